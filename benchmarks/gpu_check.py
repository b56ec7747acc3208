"""GPU correctness matrix for the kernels (Triton and, on Hopper, Gluon; one call on the H200).

* every builder's mask x head dims x dtypes x GQA, plus random masks of every (causal, C) form at
  ragged Sq != Sk shapes: out, lse, dq, dk, dv against a float32 reference, judged by DESIGN §4's
  rule (error <= 2x the error of PyTorch's own low-precision eager attention + 2x rounding noise);
* bit-exactness of skipping: ``deterministic=True`` results equal the same kernels with every tile
  treated as partial, for every builder;
* reproducibility: deterministic backward repeated gives identical bits, also against a run whose
  mask preparation was not cached (``kernels.prepare_cached``);
* on some cases, the default config equals two backward launches with every load masked
  through pointers (``TileConfig.fused_backward`` / ``even_fast_path`` / ``fwd_tma``), bitwise.

``--variant fwd_tma=0,fwd_m=128`` checks candidate defaults: the overrides replace fields of
``tile_config``'s answer for head dims up to 128 (``--variant-max-head-dim``), to check a
configuration before shipping it.

Writes ``$OUT/gpu_check.json`` (or ``--out``) and prints a summary table.
Usage: ``PYTHONPATH=src python benchmarks/gpu_check.py [--quick]``; to halve the wall time (the
run is compile-bound), run ``--part masks`` and ``--part shapes`` as two processes with their own
``--out`` and combine them with ``--merge A.json B.json --out gpu_check.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import replace

import torch
from bench_cases import add_o_tma_option, apply_o_tma_option

from flashmask import kernels, masks
from flashmask.kernels import routing
from flashmask.mask import FlashMask
from flashmask.reference import reference_backward, reference_forward

ABS_FLOOR = 1e-5
FORMS = [(True, 1), (True, 2), (False, 2), (False, 4)]


def random_indices(b, hm, sq, sk, causal, c, gen):
    """Random int32 indices including out-of-range values and empty/reversed intervals."""
    x = torch.randint(-2, sq + 3, (b, hm, sk, c), generator=gen, dtype=torch.int32)
    if c == 4 and not causal:
        x = x.sort(-1).values[..., [2, 3, 0, 1]]  # UT above LT in most columns
    return x


def lowp_attention(q, k, v, dense, scale):
    """PyTorch eager attention in the input dtype with a dense mask; fully masked rows -> 0."""
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(g, 2).transpose(1, 2)
    vh = v.repeat_interleave(g, 2).transpose(1, 2)
    s = (qh * scale) @ kh.transpose(-1, -2)
    any_visible = dense.any(-1, keepdim=True)
    s = s.masked_fill(~dense, float("-inf")).masked_fill(~any_visible, 0.0)
    p = (torch.softmax(s.float(), -1) * any_visible).to(q.dtype)
    return (p @ vh).transpose(1, 2)


def residue_bound(grad_name, q, k, v, do, scale):
    """The largest |dq| or |dk| allowed where the exact gradient is 0 (every query row sees at
    most one key, so its softmax is constant): ``dS = P * (dP - delta)`` with
    ``delta = rowsum(dO * O)`` leaves a few fp32 ulps of the terms' size (the CPU suite's rule,
    ``tests/kernels``: ``_assert_cancellation_residue``)."""
    d = q.shape[-1]
    terms = (do.float().abs() * v.float().abs().amax()).sum(-1).amax().item()
    operand = max(q.abs().amax().item(), k.abs().amax().item())
    summed = q.shape[1] * q.shape[2] // k.shape[2] if grad_name == "dk" else 1
    return 4 * d * torch.finfo(torch.float32).eps * terms * operand * abs(scale) * summed


def check_case(name, q, k, v, sri, causal, deterministic=True):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5
    mask = FlashMask(sri, causal) if sri is not None else None
    iv = mask.intervals(sq) if mask is not None else None
    out, lse = kernels.forward(q, k, v, sri, causal, scale)
    do = torch.randn_like(out)
    # deterministic=False exercises an atomic dQ path: on Hopper at hd64/128/256 the Gluon
    # backward (without a mask, with one from routing.GLUON_BWD_MIN_MASKED_SEQLEN's keys, or
    # under --gluon-everywhere), else the Triton kernels' fp32-atomic dQ (atomic_dq).
    cfg = replace(kernels.tile_config(d), atomic_dq=not deterministic)
    dq, dk, dv = kernels.backward(
        do, None, q, k, v, out, lse, sri, causal, scale, deterministic, config=cfg
    )
    ro, rl = reference_forward(q.float(), k.float(), v.float(), iv, causal, scale)
    rq, rk, rv = reference_backward(
        do.float(), None, q.float(), k.float(), v.float(), ro, rl, iv, causal, scale
    )
    # Low-precision eager attention with the dense mask: the error budget.
    if mask is not None:
        dense = mask.to_dense(sq).repeat_interleave(hq // mask.num_heads, 1)
    else:
        rows = torch.arange(sq, device=q.device).view(-1, 1)
        cols = torch.arange(sk, device=q.device).view(1, -1)
        dense = (
            (cols <= rows + sk - sq)
            if causal
            else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        )
        dense = dense.expand(b, hq, sq, sk)
    ql, kl, vl = (x.detach().clone().requires_grad_() for x in (q, k, v))
    lo = lowp_attention(ql, kl, vl, dense, scale)
    lo.backward(do)
    res = {
        "case": name,
        "shape": [b, sq, sk, hq, hk, d],
        "dtype": str(q.dtype).split(".")[-1],
        "kernels": _kernel_paths(q, k, v, do, sri, scale, deterministic, cfg),
    }
    ok = True
    noise_scale = 2 * (torch.finfo(q.dtype).eps)
    pairs = [
        ("out", out, ro, lo),
        ("dq", dq, rq, ql.grad),
        ("dk", dk, rk, kl.grad),
        ("dv", dv, rv, vl.grad),
    ]
    # Exact dq = dk = 0 when no query row sees two keys (e.g. Sk = 1).
    exact_zero = bool((dense.sum(-1) <= 1).all())
    for tname, a, hi, low in pairs:
        if not torch.isfinite(a).all():
            res[tname] = "NaN/inf"
            ok = False
            continue
        if exact_zero and tname in ("dq", "dk"):
            worst, bound = a.float().abs().max().item(), residue_bound(tname, q, k, v, do, scale)
            res[tname] = {"exact_zero": True, "max_abs": worst, "residue_bound": bound}
            ok &= worst <= bound
            continue
        err = (a.float() - hi).abs().max().item()
        err_lo = (low.float() - hi).abs().max().item()
        noise = noise_scale * hi.abs().max().item()
        rtol = 2.0 if (tname != "dq" or deterministic) else 3.0
        ratio = err / max(err_lo + noise, 1e-12)
        res[tname] = {"err": err, "err_lowp": err_lo, "ratio": ratio}
        # Absolute floor: with Sk = 1 the exact dq and dk are 0 and every implementation returns
        # rounding noise of order 1e-6, which the relative rule would call a failure.
        ok &= err <= rtol * err_lo + 2 * noise or err < ABS_FLOOR
    finite = torch.isfinite(rl)
    lse_err = (lse - rl)[finite].abs().max().item() if finite.any() else 0.0
    res["lse_err"] = lse_err
    ok &= bool((lse[~finite] == float("-inf")).all()) and lse_err < 1e-2
    res["pass"] = bool(ok)
    return res


def _kernel_paths(q, k, v, do, sri, scale, deterministic, bwd_config) -> str:
    """Which forward and backward kernels the case ran (``gluon`` or ``triton``), by the
    launchers' own routing rules, so a check of the Gluon paths shows that it reached them."""
    fwd_config = kernels.tile_config(q.shape[-1], has_mask=sri is not None)
    masked = sri is not None
    fwd = routing.use_gluon_forward(q, k, v, scale, masked, fwd_config)
    bwd = routing.use_gluon_backward(q, k, v, do, deterministic, True, masked, bwd_config)
    return f"fwd={'gluon' if fwd else 'triton'} bwd={'gluon' if bwd else 'triton'}"


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def bit_exact_case(name, q, k, v, sri, causal, scale=None, launch_check=False):
    """Skipping == dense mode and repeat == repeat, bitwise; with ``launch_check`` also the
    default config == two backward launches with every load masked (more compiles, so only on
    some cases)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o1, l1 = kernels.forward(q, k, v, sri, causal, scale)
    o2, l2 = kernels.forward(q, k, v, sri, causal, scale, skip_tiles=False)
    do = torch.randn_like(o1)
    g1 = kernels.backward(do, None, q, k, v, o1, l1, sri, causal, scale, True)
    g2 = kernels.backward(do, None, q, k, v, o1, l1, sri, causal, scale, True, skip_tiles=False)
    g3 = kernels.backward(do, None, q, k, v, o1, l1, sri, causal, scale, True)
    # The repeat above reused the mask's cached preparation; prepare it afresh once more.
    kernels.clear_prepared()
    o5, l5 = kernels.forward(q, k, v, sri, causal, scale)
    g5 = kernels.backward(do, None, q, k, v, o5, l5, sri, causal, scale, True)
    launch_equal = True
    if launch_check:
        # The Triton forward on both sides: where the default is the Gluon forward (no mask,
        # hd128), comparing it with itself would prove nothing about the launch and loads.
        base = replace(kernels.tile_config(q.shape[-1], has_mask=sri is not None), fwd_gluon=False)
        plain = replace(base, fused_backward=False, even_fast_path=False, fwd_tma=False)
        o3, l3 = kernels.forward(q, k, v, sri, causal, scale, config=base)
        o4, l4 = kernels.forward(q, k, v, sri, causal, scale, config=plain)
        g4 = kernels.backward(do, None, q, k, v, o1, l1, sri, causal, scale, True, config=plain)
        launch_equal = _bitwise_equal((o3, l3, *g1), (o4, l4, *g4))
    return {
        "case": name,
        "scale": scale,
        "skip_equals_dense": _bitwise_equal((o1, l1, *g1), (o2, l2, *g2)),
        "deterministic_repeat": _bitwise_equal(g1, g3),
        "cached_equals_fresh_preparation": _bitwise_equal((o1, l1, *g1), (o5, l5, *g5)),
        "launch_and_loads_equal": launch_equal if launch_check else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--part",
        default="all",
        choices=("all", "masks", "shapes"),
        help="masks: every builder's mask; shapes: random masks over ragged shapes (two parts "
        "can run as two processes at once, their compiles in parallel; then --merge)",
    )
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine the parts' files")
    parser.add_argument(
        "--variant",
        default="",
        help="TileConfig overrides, e.g. fwd_tma=0,bwd_warps=8 (head dims up to "
        "--variant-max-head-dim)",
    )
    parser.add_argument("--variant-max-head-dim", type=int, default=128)
    parser.add_argument(
        "--gluon-everywhere",
        action="store_true",
        help="lift the library's length limits for masked inputs (8K-32K keys), so every case the "
        "Gluon kernels take at their default head dim (128) runs them: the forward, and the "
        "backward with deterministic=False (add --variant fwd_gluon=1 for the forward at hd64)",
    )
    parser.add_argument(
        "--gluon-bwd",
        default="",
        help="gluon_bwd launch constants for the run, e.g. DQ_TMA=0 or NUM_BUFFERS=3,DQ_BUFFERS=1 "
        "(candidate settings measured by gluon_backward.py --variant, checked here)",
    )
    parser.add_argument(
        "--gluon-bwd256",
        default="",
        help="gluon_bwd256 launch constants for the run, e.g. DKDV_TMA=1 (as --gluon-bwd)",
    )
    parser.add_argument(
        "--gluon-fwd",
        default="",
        help="gluon_fwd launch constants for the run, e.g. MAX_PROGRAMS=3 (as --gluon-bwd)",
    )
    parser.add_argument(
        "--gluon-fwd-slots",
        type=int,
        choices=(2, 3),
        default=None,
        help="the Gluon forward's K/V slots up to head dim 128 (routing.GLUON_FWD_SLOTS; 2 with "
        "--gluon-fwd Q_BUFFERS=2)",
    )
    add_o_tma_option(parser, "the run")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    args = parser.parse_args()
    if args.merge:
        parts = []
        for path in args.merge:
            with open(path) as f:
                parts.append(json.load(f))
        results = [r for p in parts for r in p["results"]]
        exact = [e for p in parts for e in p["bit_exact"]]
        seconds = max(p["summary"]["seconds"] for p in parts)
        env = {key: parts[0]["summary"][key] for key in ENV_KEYS}
        variant = parts[0]["summary"].get("variant", "")
        return report(args.out, results, exact, seconds, env, variant)
    if args.variant:
        _override_defaults(args.variant, args.variant_max_head_dim)
    if args.gluon_everywhere:
        routing.GLUON_FWD_MIN_MASKED_SEQLEN = 0
        routing.GLUON_BWD_MIN_MASKED_SEQLEN = {}
    if args.gluon_fwd:
        _apply_gluon_fwd_option(parser, args.gluon_fwd)
    if args.gluon_fwd_slots is not None:
        routing.GLUON_FWD_SLOTS = args.gluon_fwd_slots
    if args.gluon_bwd or args.gluon_bwd256:
        from gluon_backward import apply_gluon_bwd_option

        from flashmask.kernels.gluon_kernels import backward as gluon_bwd
        from flashmask.kernels.gluon_kernels import backward_hd256 as gluon_bwd256

        for text, module, option in (
            (args.gluon_bwd, gluon_bwd, "--gluon-bwd"),
            (args.gluon_bwd256, gluon_bwd256, "--gluon-bwd256"),
        ):
            if text:
                apply_gluon_bwd_option(parser, text, module, option)
    o_tma_label = apply_o_tma_option(args.gluon_fwd_o_tma)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0 if args.part != "shapes" else 1)
    torch.manual_seed(0)
    results, exact = [], []
    t0 = time.time()

    def inputs(b, sq, sk, hq, hk, d, dtype):
        return (
            torch.randn(b, sq, hq, d, device=dev, dtype=dtype),
            torch.randn(b, sk, hk, d, device=dev, dtype=dtype),
            torch.randn(b, sk, hk, d, device=dev, dtype=dtype),
        )

    names = [*masks.MASK_TYPES, "hash_sparse"] if args.part != "shapes" else []
    seqlen = 1024
    head_dims = [64, 128, 256] if args.quick else [32, 64, 96, 128, 192, 256]
    for name in names:
        for d in head_dims:
            for dtype in (torch.bfloat16, torch.float16):
                if dtype == torch.float16 and d not in (128, 256):
                    continue
                for hq, hk in ((8, 8), (8, 2)):
                    hm = hk if name == "random_eviction" else 1
                    if name in ("full", "causal"):
                        sri, causal = None, name == "causal"
                    else:
                        m = masks.example(name, seqlen, batch_size=2, num_heads=hm, generator=gen)
                        sri, causal = m.startend_row_indices.to(dev), m.causal
                    q, k, v = inputs(2, seqlen, seqlen, hq, hk, d, dtype)
                    det = hk != 2  # both backward paths get covered
                    case = f"{name}/D{d}/H{hq}:{hk}/det={det}"
                    try:
                        r = check_case(case, q, k, v, sri, causal, det)
                    except Exception as exc:  # a kernel that fails to launch is a failed case
                        r = {"case": case, "error": f"{type(exc).__name__}: {exc}"[:300]}
                        r["pass"] = False
                    results.append(r)
                    if not r["pass"]:
                        print("FAIL", json.dumps(r), flush=True)
        print(f"{name}: {len(results)} cases, {time.time() - t0:.0f} s", flush=True)
        q, k, v = inputs(2, seqlen, seqlen, 8, 2, 128, torch.bfloat16)
        if name in ("full", "causal"):
            sri, causal = None, name == "causal"
        else:
            m = masks.example(
                name,
                seqlen,
                batch_size=2,
                num_heads=2 if name == "random_eviction" else 1,
                generator=gen,
            )
            sri, causal = m.startend_row_indices.to(dev), m.causal
        launch_check = name in ("full", "causal", "document", "prefix_lm_causal")
        exact.append(bit_exact_case(name, q, k, v, sri, causal, launch_check=launch_check))
        if name in ("causal", "document", "prefix_lm_causal"):
            # A negative scale takes the forward's scale-before-max path.
            exact.append(bit_exact_case(f"{name}/scale=-0.05", q, k, v, sri, causal, -0.05))
    shapes = [
        (1, 1),
        (113, 203),
        (128, 217),
        (239, 1),
        (799, 3),
        (1023, 1024),
        (1024, 1023),
        (2048, 1999),
        # Multiples of 128 with Sq != Sk: the Gluon backward's shapes (and its causal offset).
        (256, 384),
        (384, 256),
    ]
    for causal, c in FORMS if args.part != "masks" else ():
        for sq, sk in shapes:
            for hq, hk, hm in ((4, 4, 4), (8, 1, 1)):
                dims = (128,) if args.quick else (64, 128)
                if sq % 128 == 0 and sk % 128 == 0:  # the Gluon hd256 backward's shapes too
                    dims += (256,)
                for d in dims:
                    sri = random_indices(2, hm, sq, sk, causal, c, gen).to(dev)
                    q, k, v = inputs(2, sq, sk, hq, hk, d, torch.bfloat16)
                    name = f"random/causal={causal}/C={c}/{sq}x{sk}/H{hq}:{hk}:{hm}/D{d}"
                    results.append(check_case(name, q, k, v, sri, causal, deterministic=hk == 4))
        sri = random_indices(2, 1, 1024, 1024, causal, c, gen).to(dev)
        q, k, v = inputs(2, 1024, 1024, 8, 2, 128, torch.bfloat16)
        exact.append(
            bit_exact_case(f"random/causal={causal}/C={c}", q, k, v, sri, causal, launch_check=True)
        )

    # No mask with Sq != Sk at multiples of 128: the Gluon forward and backward, causal offset
    # included (the masks part runs them at Sq = Sk only).
    for sq, sk in ((256, 384), (384, 256)) if args.part != "masks" else ():
        for causal, d in itertools.product((False, True), (128, 256)):
            for hq, hk in ((4, 4), (8, 2)):
                q, k, v = inputs(2, sq, sk, hq, hk, d, torch.bfloat16)
                name = f"no-mask/causal={causal}/{sq}x{sk}/H{hq}:{hk}/D{d}"
                results.append(check_case(name, q, k, v, None, causal, deterministic=hk == 4))

    # More (batch x head) programs than one grid axis may hold (65535): the grid keeps heads and
    # batch on separate axes, so this must run and be right.
    if args.part != "masks":
        q, k, v = inputs(4100, 16, 16, 16, 16, 64, torch.bfloat16)
        sri = random_indices(4100, 1, 16, 16, True, 1, gen).to(dev)
        results.append(check_case("large-grid/B4100xH16", q, k, v, sri, True))
    flags = [
        args.gluon_everywhere and "gluon-everywhere",
        args.gluon_bwd,
        args.gluon_bwd256 and f"gluon_bwd256 {args.gluon_bwd256}",
        args.gluon_fwd and f"gluon_fwd {args.gluon_fwd}",
        args.gluon_fwd_slots and f"gluon_fwd slots {args.gluon_fwd_slots}",
        o_tma_label,
    ]
    variant = " ".join(filter(None, [args.variant, *flags]))
    return report(args.out, results, exact, time.time() - t0, variant=variant)


GLUON_FWD_CONSTANTS = ("PERSISTENT", "MAX_PROGRAMS", "Q_BUFFERS")


def _apply_gluon_fwd_option(parser: argparse.ArgumentParser, text: str) -> None:
    """``--gluon-fwd NAME=INT[,...]``: set ``gluon_fwd``'s launch constants (names from
    :data:`GLUON_FWD_CONSTANTS`) for the run; bad text is the parser's error."""
    from flashmask.kernels.gluon_kernels import forward as gluon_fwd

    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in GLUON_FWD_CONSTANTS or not value.isdigit():
            parser.error(
                f"--gluon-fwd: expected NAME=INT[,NAME=INT...] with NAME in "
                f"{GLUON_FWD_CONSTANTS}, got {item!r}"
            )
        setattr(gluon_fwd, name, int(value))


def _override_defaults(spec: str, max_head_dim: int) -> None:
    """Make ``kernels.tile_config`` answer with ``spec``'s fields replaced (head dims up to
    ``max_head_dim``); booleans are written 0/1."""
    fields = {f.name: f for f in dataclasses.fields(kernels.TileConfig)}
    overrides = {}
    for item in spec.split(","):
        key, value = item.split("=")
        if key not in fields:
            raise SystemExit(f"--variant: TileConfig has no field {key!r}")
        is_bool = fields[key].type in (bool, "bool")
        overrides[key] = bool(int(value)) if is_bool else int(value)
    original = kernels.tile_config

    def tile_config(head_dim, **kwargs):
        cfg = original(head_dim, **kwargs)
        return replace(cfg, **overrides) if head_dim <= max_head_dim else cfg

    kernels.tile_config = tile_config


ENV_KEYS = ("date", "gpu", "torch", "triton", "python")


def report(
    out: str,
    results: list[dict],
    exact: list[dict],
    seconds: float,
    env: dict | None = None,
    variant: str = "",
) -> int:
    """Write the JSON (summary, cases, bit-exactness checks), print failures; exit status."""
    failed = [r for r in results if not r["pass"]]
    checks = (
        "skip_equals_dense",
        "deterministic_repeat",
        "launch_and_loads_equal",
        "cached_equals_fresh_preparation",
    )
    not_exact = [e for e in exact if not all(e.get(c) is not False for c in checks)]
    worst = {
        t: max((r[t].get("ratio", 0.0) for r in results if isinstance(r.get(t), dict)), default=0.0)
        for t in ("out", "dq", "dk", "dv")
    }
    env = env or {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
    }
    summary = {
        **env,
        "variant": variant,
        "cases": len(results),
        "failed": len(failed),
        "worst_error_ratio_vs_lowp": worst,
        # How many cases ran each forward/backward kernel pair (see _kernel_paths).
        "kernel_paths": dict(
            sorted(collections.Counter(r.get("kernels", "?") for r in results).items())
        ),
        "bit_exact_cases": len(exact),
        "bit_exact_failed": len(not_exact),
        "seconds": seconds,
    }
    with open(out, "w") as f:
        json.dump({"summary": summary, "results": results, "bit_exact": exact}, f, indent=1)
    print(json.dumps(summary, indent=1))
    for r in failed[:20]:
        print("FAIL", json.dumps(r))
    for e in not_exact[:20]:
        print("NOT EXACT", json.dumps(e))
    return 0 if not failed and not not_exact else 1


if __name__ == "__main__":
    sys.exit(main())
