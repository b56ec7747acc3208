"""One builder per FlashMask mask type (placeholder, filled in by the masks work)."""
