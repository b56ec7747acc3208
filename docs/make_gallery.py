"""Regenerate the mask gallery: ``docs/gallery/NAME.png`` and the README's generated sections.

Run from anywhere (needs matplotlib)::

    python docs/make_gallery.py

Every picture comes from the ``flashmask show`` command: the PNGs from
``flashmask show NAME --seqlen 64 --png docs/gallery/NAME.png`` and the text pictures from
``flashmask show NAME --seqlen 32``. The README text between the ``<!-- BEGIN/END generated:
... -->`` markers is replaced; everything else in it is left alone.
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
        cells.append(f'<img src="docs/gallery/{name}.png" alt="{name}" width="300">')
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


def replace_section(text: str, key: str, body: str) -> str:
    pattern = re.compile(
        rf"(<!-- BEGIN generated: {key} -->\n).*?(<!-- END generated: {key} -->)", re.DOTALL
    )
    if not pattern.search(text):
        raise SystemExit(f"README.md has no '{key}' markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main_gallery() -> None:
    text = README.read_text()
    text = replace_section(text, "mask table", mask_table())
    text = replace_section(text, "png gallery", png_gallery())
    text = replace_section(text, "text gallery", text_gallery())
    README.write_text(text)
    print(f"updated {README.relative_to(ROOT)} and {len(NAMES)} PNGs in docs/gallery/")


if __name__ == "__main__":
    main_gallery()
