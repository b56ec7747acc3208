"""Summarise Nsight Compute's per-instruction warp-state samples (the source page as CSV, as
``gpu_session.sh ncu-backward-source`` writes it; plain or gzipped).

Prints the samples by stall reason, by opcode and the instructions with the most samples,
optionally only for an address range (e.g. a kernel's consumer loop, read off the SASS)::

    python benchmarks/ncu_source_summary.py \\
        benchmarks/results/ncu_backward_source_row_terms_s11.csv.gz --range b6c00:b8b70 --top 20

Addresses are compared on their low 20 bits (the CSV's are absolute, which differ per run).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the CSV's instruction table (its first line names the kernel)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or SAMPLES not in rows[1]:
        raise SystemExit(f"{path}: not an ncu source page CSV (no {SAMPLES!r} column)")
    return rows[1], rows[2:]


def _count(value: str) -> int:
    return int(value) if value.isdigit() else 0


def _opcode(source: str) -> str:
    """``@!P0 BRA 0x...`` -> ``BRA``; ``HGMMA.64x64x16.F32 ...`` -> ``HGMMA``."""
    words = source.split()
    word = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def summarise(path: Path, address_range: tuple[int, int] | None, top: int) -> None:
    header, rows = read_rows(path)
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_count(r[col[SAMPLES]]) for r in rows)
    if address_range is not None:
        lo, hi = address_range
        rows = [r for r in rows if lo <= int(r[0], 16) & 0xFFFFF <= hi]
    picked = sum(_count(r[col[SAMPLES]]) for r in rows)
    print(f"{path.name}: {picked} of {total} samples ({100 * picked / max(total, 1):.1f}%)")
    by_reason = collections.Counter()
    by_opcode = collections.Counter()
    for r in rows:
        by_opcode[_opcode(r[1])] += _count(r[col[SAMPLES]])
        for reason in reasons:
            by_reason[reason[len("stall_") :]] += _count(r[col[reason]])
    for title, counter in (("stall reason", by_reason), ("opcode", by_opcode)):
        print(f"by {title}:")
        for name, n in counter.most_common(12):
            print(f"  {name:20s} {n:9d} {100 * n / max(picked, 1):5.1f}%")
    print(f"top {top} instructions:")
    for r in sorted(rows, key=lambda r: -_count(r[col[SAMPLES]]))[:top]:
        n = _count(r[col[SAMPLES]])
        main = max(reasons, key=lambda reason: _count(r[col[reason]]))
        print(
            f"  {int(r[0], 16) & 0xFFFFF:05x} {n:8d} {100 * n / max(picked, 1):5.1f}% "
            f"{main[len('stall_') :]:14s} {r[1].strip()[:70]}"
        )


def _address_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo, 16), int(hi, 16)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI in hex, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--range", type=_address_range, default=None, help="LO:HI, hex")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    summarise(args.csv, args.range, args.top)


if __name__ == "__main__":
    main()
