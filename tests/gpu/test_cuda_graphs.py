"""Calls a CUDA graph captures, replayed with new masks, equal to eager calls.

Skipped without a CUDA GPU (marker ``gpu``). A call whose mask is a CUDA tensor does no host
synchronisation, so ``torch.cuda.graph`` captures it (the mask's preparation included: nothing
prepared before the capture is reused in it) and each replay reads whatever mask was copied
into the captured mask tensor:

* a training step's forward and backward (causal_document at 2K, the Triton kernels, and at
  8K, the Gluon kernels on Hopper) and a decode step (split-KV) replayed with three new masks of
  the same shape, bitwise equal to eager calls (``deterministic=True``);
* replays under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising call raises);
* ``torch.compile(mode="reduce-overhead")`` (CUDA graphs trees) and ``fullgraph=True``: new
  masks neither recompile nor change results.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashmask import flashmask_attention, kernels, masks
from flashmask.kernels import routing
from tests.gpu.conftest import CASE_PROPERTY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _document_masks(seqlen: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` causal_document index tensors ``[1, 1, seqlen, 1]`` of different packings."""
    gen = torch.Generator().manual_seed(seed)
    return [
        masks.example("causal_document", seqlen, generator=gen).startend_row_indices.cuda()
        for _ in range(count)
    ]


@contextlib.contextmanager
def _no_host_sync():
    """Raise on any synchronising CUDA call inside the block."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _capture(step, warmups: int = 3) -> torch.cuda.CUDAGraph:
    """``step``'s graph, after ``warmups`` calls on a side stream (compiling its kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("seqlen, deterministic", ((2048, True), (8192, False)))
def test_training_step_replays_new_masks_equal_to_eager(
    seqlen: int, deterministic: bool, record_property
) -> None:
    """Forward + backward of a causal_document call captured once; each replay with a new
    packing copied into the captured mask tensor equals an eager call with that packing:
    bitwise with ``deterministic=True``, within the atomics' summation order otherwise (the
    Gluon backward at 8K on Hopper)."""
    batch, heads, d = 1, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(seqlen)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (randn(batch, seqlen, heads, d).requires_grad_() for _ in range(3))
    dout = randn(batch, seqlen, heads, d)
    first, *others = _document_masks(seqlen, 4, seed=seqlen)
    static_mask = first.clone()
    outputs: dict[str, torch.Tensor] = {}

    def step():
        out = flashmask_attention(q, k, v, static_mask, causal=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        outputs.update(out=out, dq=grads[0], dk=grads[1], dv=grads[2])

    graph = _capture(step)
    config = kernels.tile_config(d, has_mask=True)
    gluon = routing.use_gluon_backward(q, k, v, dout, deterministic, True, True, config)
    case = f"train-causal_document-{seqlen}-det{int(deterministic)}"
    record = {
        "kind": "cuda_graph",
        "case": case,
        "kernels": f"bwd={'gluon' if gluon else 'triton'}",
    }
    record_property(CASE_PROPERTY, record)
    for sri in others:
        static_mask.copy_(sri)
        with _no_host_sync():
            graph.replay()
        out = flashmask_attention(q, k, v, sri, causal=True, deterministic=deterministic)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        for name, eager in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            if deterministic:
                assert torch.equal(outputs[name], eager), f"{name} of the replay != eager"
            else:
                torch.testing.assert_close(outputs[name], eager, msg=f"{name} of the replay")


def test_decode_step_replays_new_masks_equal_to_eager(record_property) -> None:
    """A split-KV decode step (1 query, 32:8 heads, a 16K cache under per-sequence document
    masks of 4 sequences) captured once, replayed with new masks."""
    batch, sk, hq, hk, d = 4, 16384, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    cpu = torch.Generator().manual_seed(2)

    def draw() -> torch.Tensor:
        mask = masks.example("causal_document", sk, batch_size=batch, generator=cpu)
        return mask.last_rows(1).startend_row_indices.cuda()

    static_mask = draw()
    result: dict[str, torch.Tensor] = {}

    def step():
        result["out"] = flashmask_attention(q, k, v, static_mask, causal=True)

    graph = _capture(step)
    record_property(CASE_PROPERTY, {"kind": "cuda_graph", "case": "decode-causal_document-16k"})
    for _ in range(3):
        sri = draw()
        static_mask.copy_(sri)
        with _no_host_sync():
            graph.replay()
        with _no_host_sync():  # a prepared or new mask: the eager call never waits either
            eager = flashmask_attention(q, k, v, sri, causal=True)
        assert torch.equal(result["out"], eager)


@pytest.mark.parametrize("mode", ("reduce-overhead", "fullgraph"))
def test_compiled_calls_take_new_masks_without_recompiling(mode: str, record_property) -> None:
    """A compiled attention call and its compiled backward, called with four packings, compile
    once and equal eager calls (``reduce-overhead`` replays them as CUDA graphs; ``fullgraph``
    allows no graph break)."""
    import torch._dynamo

    torch._dynamo.reset()
    seqlen, heads, d = 2048, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (
        torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def attend(q, k, v, sri):
        return flashmask_attention(q, k, v, sri, causal=True, deterministic=True)

    options = {"mode": "reduce-overhead"} if mode == "reduce-overhead" else {"fullgraph": True}
    compiled = torch.compile(attend, **options)
    record_property(CASE_PROPERTY, {"kind": "compile", "case": f"compile-{mode}"})
    with torch._dynamo.config.patch(error_on_recompile=True):
        for sri in _document_masks(seqlen, 4, seed=4):
            out = compiled(q, k, v, sri)
            # Copies: a CUDA graph's outputs are overwritten by its next replay.
            got = [
                out.detach().clone(),
                *(g.clone() for g in torch.autograd.grad(out, (q, k, v), dout)),
            ]
            eager = attend(q, k, v, sri)
            want = [eager.detach(), *torch.autograd.grad(eager, (q, k, v), dout)]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                torch.testing.assert_close(a, b, msg=f"{name} differs")
