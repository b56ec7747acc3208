"""Regenerate the mask pictures: ``docs/gallery/NAME.png``, the gallery in ``docs/masks.md``
and the README's mask table and tile picture.

Run from anywhere (needs matplotlib)::

    python docs/make_gallery.py

The gallery's pictures come from the ``flashmask show`` command: the PNGs from
``flashmask show NAME --seqlen 64 --png docs/gallery/NAME.png`` and the text pictures from
``flashmask show NAME --seqlen 32``. The README's tile picture draws one small packed-document
mask with its tile classes (:meth:`flashmask.FlashMask.classify_tiles`). Only the text between
``<!-- BEGIN/END generated: ... -->`` markers is replaced; everything else is left alone.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from flashmask import masks
from flashmask.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MASKS_PAGE = ROOT / "docs" / "masks.md"
GALLERY = ROOT / "docs" / "gallery"
NAMES = (*masks.MASK_TYPES, "hash_sparse")
PNG_SEQLEN, TEXT_SEQLEN, COLUMNS = 64, 32, 3

PURPOSE = {
    "full": "no mask: every query sees every key (encoders)",
    "causal": "decoder-only language models",
    "sliding_window": "causal local attention: each query sees itself and the *w* keys before it",
    "causal_document": "documents packed into one sequence, causal inside each (SFT packing)",
    "document": "packed documents, bidirectional inside each",
    "share_question": "a question shared by answers that do not see each other (DPO, reward)",
    "global_sliding_window": "bidirectional local window plus global tokens (Longformer, BigBird)",
    "causal_blockwise": "in-context examples, each causal on its own; the last block sees them all",
    "prefix_lm_document": "packed documents, each a bidirectional prefix then causal tokens",
    "prefix_lm_causal": "one bidirectional prefix, then causal tokens (prefix LM)",
    "qk_sparse": "causal attention with spans whose queries and keys do not interact",
    "random_eviction": "causal attention with KV-cache eviction, drawn at random per head",
    "hash_sparse": "causal attention inside hash buckets (Reformer LSH), tokens sorted by bucket",
}


def show(*argv: str) -> str:
    """Stdout of ``flashmask show ARGV``."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main(["show", *argv])
    if status != 0:
        raise SystemExit(f"flashmask show {' '.join(argv)} failed with status {status}")
    return buffer.getvalue()


def form(name: str) -> str:
    mask = masks.example(name, TEXT_SEQLEN)
    return f"causal, C={mask.bounds}" if mask.causal else f"non-causal, C={mask.bounds}"


def mask_table() -> str:
    lines = ["| name | form | what it is for |", "|---|---|---|"]
    lines += [f"| `{name}` | {form(name)} | {PURPOSE[name]} |" for name in NAMES]
    return "\n".join(lines)


def png_gallery() -> str:
    GALLERY.mkdir(parents=True, exist_ok=True)
    cells = []
    for name in NAMES:
        path = GALLERY / f"{name}.png"
        show(name, "--seqlen", str(PNG_SEQLEN), "--png", str(path))
        cells.append(f'<img src="gallery/{name}.png" alt="{name}" width="300">')
    rows = [cells[i : i + COLUMNS] for i in range(0, len(cells), COLUMNS)]
    lines = ["| " + " | ".join([""] * COLUMNS) + " |", "|" + "---|" * COLUMNS]
    lines += ["| " + " | ".join(row + [""] * (COLUMNS - len(row))) + " |" for row in rows]
    return "\n".join(lines)


def text_gallery() -> str:
    """The text pictures side by side, ``COLUMNS`` per row, each headed by its name and form."""
    blocks = []
    for name in NAMES:
        picture = show(name, "--seqlen", str(TEXT_SEQLEN)).splitlines()[:TEXT_SEQLEN]
        blocks.append([name, f"({form(name)})", *picture])
    width = TEXT_SEQLEN + 4
    out = []
    for i in range(0, len(blocks), COLUMNS):
        group = blocks[i : i + COLUMNS]
        for lines in zip(*group, strict=True):
            out.append("".join(line.ljust(width) for line in lines).rstrip())
        out.append("")
    return "```text\n" + "\n".join(out).rstrip() + "\n```"


# The README's picture: three packed documents (4, 12 and 8 tokens) in 4x4 tiles.
TILE_DOCS, TILE = (4, 12, 8), 4
TILE_SYMBOLS = {0: ".", 1: "P", 2: "F"}  # TileClass.SKIP, PARTIAL, FULL


def tile_picture() -> str:
    """The causal-document mask of :data:`TILE_DOCS` drawn per element with tile borders, and
    beside each row of tiles its classes: ``.`` skipped, ``P`` partial, ``F`` full."""
    mask = masks.causal_document(list(TILE_DOCS), seqlen=sum(TILE_DOCS))
    rows = mask.to_string().splitlines()
    classes = mask.classify_tiles(TILE, TILE)[0, 0].tolist()
    n = len(rows)
    rule = "+".join(["-" * TILE] * (n // TILE))
    out = []
    for r, row in enumerate(rows):
        if r and r % TILE == 0:
            out.append(rule)
        cells = "|".join(row[i : i + TILE] for i in range(0, n, TILE))
        if r % TILE == 1:
            cells += "      " + " ".join(TILE_SYMBOLS[c] for c in classes[r // TILE])
        out.append(cells)
    return "```text\n" + "\n".join(out) + "\n```"


def replace_section(text: str, key: str, body: str, where: str = "README.md") -> str:
    pattern = re.compile(
        rf"(<!-- BEGIN generated: {key} -->\n).*?(<!-- END generated: {key} -->)", re.DOTALL
    )
    if not pattern.search(text):
        raise SystemExit(f"{where} has no '{key}' markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main_gallery() -> None:
    text = README.read_text()
    text = replace_section(text, "mask table", mask_table())
    text = replace_section(text, "tile picture", tile_picture())
    README.write_text(text)
    page = MASKS_PAGE.read_text()
    page = replace_section(page, "png gallery", png_gallery(), "docs/masks.md")
    page = replace_section(page, "text gallery", text_gallery(), "docs/masks.md")
    MASKS_PAGE.write_text(page)
    print(f"updated README.md, docs/masks.md and {len(NAMES)} PNGs in docs/gallery/")


if __name__ == "__main__":
    main_gallery()
