"""Split-KV tile choices for a decode step, timed beside SDPA on one CUDA GPU.

For caches of 8K, 32K and 128K keys at batch 1, 8 and 32 (one query, 32 query / 8 key/value
heads, head dim 128, bf16, causal) it times SDPA (``enable_gqa``, before and after the
configurations, as a drift check) and flashmask's split-KV forward under each
:class:`~flashmask.kernels.config.DecodeConfig` (``kernels.forward`` with ``decode=``), plus,
on the 128K cache, a sliding window of 4,096 keys with 4 sink tokens under each (``sw_*``;
``sw_api`` through ``flashmask_attention``). Times are
median device microseconds of :func:`flashmask.bench_decode.time_call` (L2 flushed, host
launch work hidden). ``default`` is :func:`~flashmask.kernels.config.device_decode_config` on
this GPU.

    PYTHONPATH=src python benchmarks/decode_configs.py --out decode_configs
    python benchmarks/decode_configs.py --render decode_configs.json   # the table again

writes ``PREFIX.json`` (one object per cell: ``sk``, ``b``, times by name; ``sw_<name>`` the
sliding window) and ``PREFIX.md`` (the same as a table, each time over SDPA's best).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

# (keys per tile, pipeline stages, warps, programs per multiprocessor)
CANDIDATES = (
    (128, 3, 8, 1),
    (128, 2, 8, 1),
    (128, 3, 4, 1),
    (128, 2, 8, 2),
    (128, 2, 4, 2),
    (64, 3, 4, 4),
    (64, 2, 4, 4),
    (32, 3, 4, 4),
    (32, 3, 4, 8),
    (128, 3, 8, 2),
    (128, 3, 8, 4),
)
HEADS_Q, HEADS_K, HEAD_DIM = 32, 8, 128


def measure() -> tuple[dict, list[dict]]:
    """``(meta, cells)``: the GPU and versions, and one dict of times (us) per cache and batch."""
    import torch

    from flashmask.bench_decode import time_call
    from flashmask.kernels.config import DecodeConfig, device_decode_config

    def us(fn) -> float:
        return 1e3 * time_call(fn, 15).gpu_ms

    device = torch.device("cuda")
    configs = {"default": device_decode_config(HEAD_DIM, device)}
    for block_n, stages, warps, per_sm in CANDIDATES:
        configs[f"n{block_n}s{stages}w{warps}p{per_sm}"] = DecodeConfig(
            block_n=block_n, stages=stages, warps=warps, programs_per_sm=per_sm
        )
    cells = []
    for sk in (8192, 32768, 131072):
        for b in (1, 8, 32):
            cell = _measure_cell(sk, b, configs, us)
            print(
                json.dumps(
                    {key: round(x, 1) if isinstance(x, float) else x for key, x in cell.items()}
                )
            )
            cells.append(cell)
            torch.cuda.empty_cache()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "default": asdict(configs["default"]),
    }
    return meta, cells


def _measure_cell(sk: int, b: int, configs: dict, us) -> dict:
    """One cache length and batch: SDPA, each configuration, and at 128K the sliding window."""
    import torch
    import torch.nn.functional as F

    from flashmask import flashmask_attention, kernels, masks

    device = torch.device("cuda")
    q = torch.randn(b, 1, HEADS_Q, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(b, sk, HEADS_K, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = HEAD_DIM**-0.5

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    window = masks.sliding_window(sk, 4096, sink_tokens=4).last_rows(1).to(device)
    sri = window.startend_row_indices.expand(b, -1, -1, -1).contiguous()
    cell: dict = {"sk": sk, "b": b, "sdpa": us(sdpa)}
    if sk == 131072:  # the public call, default tiles
        cell["sw_api"] = us(lambda: flashmask_attention(q, k, v, sri, causal=True))
    for name, cfg in configs.items():
        cell[name] = us(lambda cfg=cfg: kernels.forward(q, k, v, None, True, scale, decode=cfg))
        if sk == 131072:
            cell["sw_" + name] = us(
                lambda cfg=cfg: kernels.forward(q, k, v, sri, True, scale, decode=cfg)
            )
    cell["sdpa2"] = us(sdpa)
    return cell


def render(meta: dict, cells: list[dict]) -> str:
    """A markdown table: per cell SDPA's best time (us), then each configuration's time over it."""
    names = list(
        dict.fromkeys(k for c in cells for k in c if k not in ("sk", "b", "sdpa", "sdpa2"))
    )
    lines = [
        f"# Split-KV tiles beside SDPA ({meta.get('gpu', '?')}, torch {meta.get('torch', '?')})",
        "",
        f"`default`: {meta.get('default', '?')}. Cells: time / SDPA's best time (below 1: faster"
        " than SDPA); `sw_*`: sliding window 4,096 + 4 sinks on the 128K cache, over SDPA's"
        " causal time on it.",
        "",
        "| Sk | B | SDPA us | " + " | ".join(names) + " |",
        "|---:|---:|---:|" + "---:|" * len(names),
    ]
    for cell in cells:
        base = min(cell["sdpa"], cell.get("sdpa2", cell["sdpa"]))
        ratios = [f"{cell[n] / base:.3f}" if isinstance(cell.get(n), float) else "—" for n in names]
        lines.append(f"| {cell['sk']} | {cell['b']} | {base:.1f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_configs", help="prefix of the .json and .md")
    parser.add_argument("--render", type=Path, help="only render an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        data = json.loads(args.render.read_text())
        print(render(data["meta"], data["cells"]), end="")
        return
    import torch

    if not torch.cuda.is_available():
        parser.error("timing the split-KV tiles needs a CUDA GPU (--render works anywhere)")
    meta, cells = measure()
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    Path(f"{args.out}.md").write_text(render(meta, cells))


if __name__ == "__main__":
    main()
