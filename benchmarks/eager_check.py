"""``flashmask_attention``'s eager path on the GPU: the ``autograd.Function`` that plain CUDA
tensors take (``ops._EagerAttention``) against the custom ops with their registered backward,
on the GPU kernels, and the host time per forward + backward of each.

With ``deterministic=True`` both paths must agree bit for bit (the same kernels, the same
order); without it dK/dV too (the Gluon backward's dQ alone is summed by atomics, so it is
compared within 1e-2 of its largest element). Losses over ``out``, over ``lse`` alone (the
gradient of ``out`` arrives as None) and over both. Both paths also against the launchers
called directly on inputs that need no gradient (each pass then prepares its own lists, where
a forward that a backward follows prepares both), by the same rule. Usage (H200):
``PYTHONPATH=src python benchmarks/eager_check.py``; exits 1 on a mismatch.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
from bench_cases import mask_case

from flashmask import kernels, ops
from flashmask.attention import flashmask_attention


def grads(path, q, k, v, sri, causal, deterministic, use, gout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = path(q, k, v, sri, causal, q.shape[-1] ** -0.5, deterministic)
    # Rows that see no key have lse -inf (and zero gradients): left out of the lse loss.
    loss = {"out": (out.float() * gout).sum(), "lse": torch.where(lse.isfinite(), lse, 0).sum()}
    loss["both"] = loss["out"] + loss["lse"]
    return (out, lse, *torch.autograd.grad(loss[use], (q, k, v)))


def agree(part: str, x: torch.Tensor, y: torch.Tensor, deterministic: bool) -> bool:
    """Bit for bit, except the non-deterministic dQ (atomics): within 1e-2 of its largest
    element."""
    if deterministic or part != "dq":
        return torch.equal(x, y)
    scale = y.float().abs().max().clamp_min(1e-6)
    return bool(((x.float() - y.float()).abs().max() / scale) < 1e-2)


def host_us(path, q, k, v, sri, causal, do, repeats: int = 50) -> float:
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    total = 0.0
    for i in range(repeats + 5):
        t0 = time.perf_counter()
        out, _ = path(q, k, v, sri, causal, q.shape[-1] ** -0.5, False)
        torch.autograd.grad(out, (q, k, v), do)
        if i >= 5:
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total * 1e6 / repeats


def main() -> int:
    failures = 0
    eager = ops._EagerAttention.apply
    custom = ops.attention_forward
    for s in (2048, 8192):
        batch, heads, d = max(1, 32768 // s), 16, 128
        for name in ("full", "causal", "sliding_window", "document"):
            mask, sri, causal = mask_case(name, s, batch)
            q, k, v, do = (
                torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(4)
            )
            gout = do.float()
            # The public function takes the eager path here.
            taken = []
            original = ops._EagerAttention.apply
            ops._EagerAttention.apply = lambda *a: taken.append(1) or original(*a)
            try:
                flashmask_attention(q, k, v, mask.to("cuda") if mask is not None else None,
                                    causal=causal)  # fmt: skip
            finally:
                del ops._EagerAttention.apply  # back to autograd.Function's own
            if not taken:
                print(f"FAIL {s} {name}: flashmask_attention did not take the eager path")
                failures += 1
            for deterministic in (True, False):
                for use in ("out", "lse", "both"):
                    a = grads(eager, q, k, v, sri, causal, deterministic, use, gout)
                    b = grads(custom, q, k, v, sri, causal, deterministic, use, gout)
                    names = ("out", "lse", "dq", "dk", "dv")
                    for label, x, y in zip(names, a, b, strict=True):
                        if not agree(label, x, y, deterministic):
                            print(f"FAIL {s} {name} det={deterministic} loss={use}: {label}")
                            failures += 1
            # Against the launchers called directly on inputs that need no gradient, each pass
            # preparing its own lists (the eager path prepares the backward's in the forward).
            scale = d**-0.5
            for det, (path, label) in itertools.product(
                (True, False), ((eager, "eager function"), (custom, "custom ops"))
            ):
                kernels.clear_prepared()
                a = grads(path, q, k, v, sri, causal, det, "out", gout)
                kernels.clear_prepared()
                out, lse = kernels.forward(q, k, v, sri, causal, scale, deterministic=det)
                dout = gout.to(q.dtype)
                b = (out, lse, *kernels.backward(dout, None, q, k, v, out, lse, sri, causal,
                                                 scale, det))  # fmt: skip
                for part, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b, strict=True):
                    if not agree(part, x, y, det):
                        print(f"FAIL {s} {name} det={det} {label} vs separate preparation: {part}")
                        failures += 1
            e_us = host_us(eager, q, k, v, sri, causal, do)
            c_us = host_us(custom, q, k, v, sri, causal, do)
            print(
                f"{s} {name:16} agree; host us per fwd+bwd: eager function {e_us:.0f}, "
                f"custom ops {c_us:.0f}"
            )
    print("eager check:", "FAILED" if failures else "passed", f"({failures} mismatches)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
