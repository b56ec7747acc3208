"""Small forward+backward cases for ``compute-sanitizer`` (memcheck / racecheck / initcheck).

Covers every (causal, C) form, ragged lengths, GQA, both backward paths, and extreme index
values (INT32_MIN, INT32_MAX, negative, > Sq) that must never cause an out-of-bounds access.
Usage: ``compute-sanitizer --tool memcheck python benchmarks/sanitize_cases.py``
"""

from __future__ import annotations

import torch

from flashmask import kernels

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for causal, c in ((True, 1), (True, 2), (False, 2), (False, 4)):
        # Ragged shapes, and one that divides every tile (the unmasked-load paths).
        shapes = (
            (1, 1, 1, 1, 64),
            (37, 203, 4, 2, 128),
            (130, 67, 2, 1, 256),
            (128, 256, 4, 2, 128),
        )
        for sq, sk, hq, hk, d in shapes:
            extremes = torch.tensor([INT32_MIN, INT32_MAX, -1, 0, sq, sq + 1], dtype=torch.int32)
            pick = torch.randint(0, len(extremes), (1, 1, sk, c), generator=gen)
            sri = extremes[pick].to(dev)
            q = torch.randn(1, sq, hq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, sk, hk, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, sk, hk, d, device=dev, dtype=torch.bfloat16)
            out, lse = kernels.forward(q, k, v, sri, causal, d**-0.5)
            do = torch.randn_like(out)
            for det in (True, False):
                grads = kernels.backward(do, None, q, k, v, out, lse, sri, causal, d**-0.5, det)
                if not all(torch.isfinite(g).all() for g in grads):
                    raise RuntimeError(f"non-finite gradient: causal={causal} C={c} {sq}x{sk}")
            if not torch.isfinite(out).all():
                raise RuntimeError(f"non-finite output: causal={causal} C={c} {sq}x{sk}")
            cases += 1
    # No interval mask: the larger forward tiles of full and causal attention.
    for causal in (True, False):
        q = torch.randn(1, 256, 4, 128, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 256, 2, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out, lse = kernels.forward(q, k, v, None, causal, 128**-0.5)
        grads = kernels.backward(torch.randn_like(out), None, q, k, v, out, lse, None, causal,
                                 128**-0.5, True)  # fmt: skip
        if not all(torch.isfinite(g).all() for g in (out, *grads)):
            raise RuntimeError(f"non-finite result without a mask: causal={causal}")
        cases += 1
    torch.cuda.synchronize()
    print(f"sanitize_cases: {cases} cases ran")


if __name__ == "__main__":
    main()
