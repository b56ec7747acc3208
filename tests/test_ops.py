"""The ``torch.library`` custom ops: opcheck, and ``torch.compile(fullgraph=True)`` through
``flashmask_attention`` without graph breaks or recompiles on new mask values."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import flashmask
from flashmask import FlashMask, ops


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code and recompile counters must not leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tensors(seed, *shapes, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(s, generator=g, dtype=dtype).requires_grad_(requires_grad) for s in shapes
    )


def qkv(seed, seqlen=10, dtype=torch.float32, requires_grad=False):
    """q [2, S, 4, 8], k and v [2, S, 2, 8] (GQA), v with head dim 6."""
    shapes = [(2, seqlen, 4, 8), (2, seqlen, 2, 8), (2, seqlen, 2, 6)]
    return tensors(seed, *shapes, dtype=dtype, requires_grad=requires_grad)


def indices(seed, seqlen=10, bounds=2, heads=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, seqlen + 1, (2, heads, seqlen, bounds), generator=g, dtype=torch.int32)


# ---------------------------------------------------------------------------- opcheck
OPCHECK_CASES = [
    (torch.float32, None, False),
    (torch.float64, None, True),
    (torch.float32, (1, 2), True),
    (torch.float64, (2, 2), False),
    (torch.float32, (1, 4), False),
]
OPCHECK_IDS = ["fp32-no-mask", "fp64-causal", "fp32-causal-C2", "fp64-C2-Hm2", "fp32-C4"]


@pytest.mark.parametrize(("dtype", "mask", "causal"), OPCHECK_CASES, ids=OPCHECK_IDS)
def test_opcheck_attention_forward(dtype, mask, causal):
    """Schema, fake (meta) kernel, autograd registration and AOT dispatch (static and dynamic)."""
    q, k, v = qkv(0, seqlen=6, dtype=dtype, requires_grad=True)
    sri = None if mask is None else indices(1, 6, bounds=mask[1], heads=mask[0])
    torch.library.opcheck(ops.attention_forward, (q, k, v, sri, causal, 0.4, False))


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize(("dtype", "mask", "causal"), OPCHECK_CASES, ids=OPCHECK_IDS)
def test_opcheck_attention_backward(dtype, mask, causal, with_dlse):
    q, k, v = qkv(2, seqlen=6, dtype=dtype)
    sri = None if mask is None else indices(3, 6, bounds=mask[1], heads=mask[0])
    out, lse = ops.attention_forward(q, k, v, sri, causal, 0.4, False)
    dout, dlse = tensors(4, out.shape, lse.shape, dtype=dtype)
    dlse = torch.where(torch.isfinite(lse), dlse.to(lse.dtype), 0.0) if with_dlse else None
    torch.library.opcheck(
        ops.attention_backward, (dout, dlse, q, k, v, out, lse, sri, causal, 0.4, False)
    )


@pytest.mark.parametrize("layout", ["contiguous", "heads-outermost"])
def test_backward_outputs_are_laid_out_like_the_inputs(layout):
    """Regression: the reference returned dk/dv as transposed views while the fake kernel promises
    ``empty_like(k)`` strides, a fake/real mismatch that compiled graphs can trip over."""
    q, k, v = qkv(5)
    if layout == "heads-outermost":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] stored as [B, H, S, D]
    out, lse = ops.attention_forward(q, k, v, None, True, 0.4, False)
    dq, dk, dv, dsinks = ops.attention_backward(
        torch.ones_like(out), None, q, k, v, out, lse, None, True, 0.4, False
    )
    assert dq.stride() == q.stride()
    assert dk.stride() == k.stride()
    assert dv.stride() == v.stride()
    assert dsinks.numel() == 0  # no sinks: an empty placeholder


@pytest.mark.parametrize("causal", [False, True], ids=["mask", "causal-mask"])
def test_opcheck_with_sinks(causal):
    """The ops with learnable sinks (``[Hq]``): schema, fake kernel, autograd (the sinks get a
    gradient) and the backward op's ``dsinks``."""
    q, k, v = qkv(6, seqlen=6, dtype=torch.float64, requires_grad=True)
    sri = indices(7, 6, bounds=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    args = (q, k, v, sri, causal, 0.4, False, 0.0, sinks)
    torch.library.opcheck(ops.attention_forward, args)
    out, lse = ops.attention_forward(*args)
    (dout,) = tensors(8, out.shape, dtype=torch.float64)
    with torch.no_grad():
        torch.library.opcheck(
            ops.attention_backward,
            (dout, None, q, k, v, out, lse, sri, causal, 0.4, False, 0.0, sinks.detach()),
        )


# ---------------------------------------------------------------------------- torch.compile
class MaskedAttention(torch.nn.Module):
    """A module whose forward builds a FlashMask from raw indices and calls the public API."""

    def forward(self, q, k, v, startend_row_indices):
        mask = FlashMask(startend_row_indices, causal=True)
        return flashmask.flashmask_attention(q, k, v, mask, return_softmax_lse=True)


def test_compiled_module_never_recompiles_for_new_mask_values():
    """5 different masks of one shape: one frame compiled, outputs and grads equal eager."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = MaskedAttention()
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    for seed in range(5):
        q, k, v = qkv(10 + seed, requires_grad=True)
        sri = indices(20 + seed, bounds=1)
        out, lse = compiled(q, k, v, sri)
        eager_out, eager_lse = module(q, k, v, sri)
        assert torch.equal(out, eager_out)
        assert torch.equal(lse, eager_lse)
        loss = out.sum() + torch.where(lse.isinf(), 0.0, lse).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
        eager_loss = eager_out.sum() + torch.where(eager_lse.isinf(), 0.0, eager_lse).sum()
        for got, want in zip(grads, torch.autograd.grad(eager_loss, (q, k, v)), strict=True):
            assert torch.equal(got, want)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v, sri: flashmask.flashmask_attention(q, k, v, sri, causal=False),
        lambda q, k, v, sri: flashmask.flashmask_attention(q, k, v, sri[..., 0], causal=True),
        lambda q, k, v, sri: flashmask.flashmask_attention(q, k, v, window_size=(2, 1)),
        lambda q, k, v, sri: flashmask.flashmask_attention(q, k, v, causal=True, softmax_scale=0.3),
        lambda q, k, v, sri: flashmask.flashmask_attention(
            q, k, v, sri, sinks=torch.zeros(q.shape[2], dtype=q.dtype)
        ),
    ],
    ids=["raw-indices", "3d-indices", "window_size", "no-mask", "sinks"],
)
def test_every_mask_path_traces_as_one_graph(call):
    q, k, v = qkv(30)
    explanation = torch._dynamo.explain(call)(q, k, v, indices(31))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_a_flashmask_argument_does_not_recompile_for_new_values():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def attend(q, k, v, mask):
        return flashmask.flashmask_attention(q, k, v, mask)

    q, k, v = qkv(40)
    for seed in range(3):
        mask = FlashMask(indices(41 + seed, bounds=4), causal=False)
        assert torch.equal(attend(q, k, v, mask), flashmask.flashmask_attention(q, k, v, mask))
    assert counter.frame_count == 1


def test_sequence_length_changes_recompile_once_then_run_dynamic():
    """Automatic dynamic shapes: static first, one dynamic recompile, then no more."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(MaskedAttention(), backend=counter, fullgraph=True)
    frames = []
    for seqlen in (8, 12, 16):
        q, k, v = qkv(50, seqlen=seqlen, requires_grad=True)
        out, _ = compiled(q, k, v, indices(51, seqlen=seqlen, bounds=1))
        out.sum().backward()
        assert q.grad.shape == q.shape
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2]


def test_torch_export_keeps_the_custom_op_and_runs_like_eager():
    """testing-anchors §6.F.25: ``torch.export`` of a module calling ``flashmask_attention``
    traces through the fake kernel into one ``flashmask::attention_forward`` node, and the
    exported program computes what eager does for new inputs and new mask values."""
    module = MaskedAttention()
    q, k, v = qkv(40)
    exported = torch.export.export(module, (q, k, v, indices(41, bounds=1)))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("flashmask.attention_forward" in t for t in targets), sorted(targets)
    q2, k2, v2 = qkv(42)
    sri = indices(43, bounds=1)
    for got, want in zip(exported.module()(q2, k2, v2, sri), module(q2, k2, v2, sri), strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------- eager autograd.Function
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("use", ["out", "lse", "both"])
def test_the_eager_function_matches_the_custom_ops_bit_for_bit(mask, use, sinks):
    """``ops.attention`` on plain CUDA tensors in eager mode runs ``_EagerAttention``: the same
    outputs and gradients (the sinks' too) as the custom ops with their registered backward,
    whichever outputs the loss uses (an unused one's gradient arrives as None in both)."""
    sri = indices(3) if mask else None
    results = []
    for call in (ops.attention_forward, ops._EagerAttention.apply):
        q, k, v = qkv(4, requires_grad=True)
        inputs = [q, k, v]
        extra = ()
        if sinks:
            inputs.append(torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True))
            extra = (0.0, inputs[-1])
        out, lse = call(q, k, v, sri, False, 0.3, False, *extra)
        (gout,) = tensors(5, out.shape)
        loss = {"out": (out * gout).sum(), "lse": lse.exp().sum()}
        loss["both"] = loss["out"] + loss["lse"]
        results.append((out, lse, *torch.autograd.grad(loss[use], inputs)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_eager_function_refuses_a_second_backward_instead_of_dropping_it():
    """With ``create_graph=True`` the gradients carry a node that raises when differentiated
    (a gradient penalty would otherwise lose its attention terms silently); the first-order
    gradients are unchanged."""
    q, k, v = qkv(6, requires_grad=True)
    out, _ = ops._EagerAttention.apply(q, k, v, None, True, 0.3, False)
    dq, dk = torch.autograd.grad(out.sum(), (q, k), create_graph=True)
    plain = torch.autograd.grad(
        ops._EagerAttention.apply(q, k, v, None, True, 0.3, False)[0].sum(), (q, k)
    )
    assert torch.equal(dq, plain[0]) and torch.equal(dk, plain[1])
    with pytest.raises(RuntimeError, match="no second derivative"):
        (dq.square().sum() + (q * 2).sum()).backward()


def test_calls_that_may_be_traced_or_intercepted_take_the_custom_ops():
    """Plain tensors in eager mode qualify for the eager function; a dispatch mode (what
    FakeTensorMode, make_fx and FlopCounterMode install), a tensor subclass or compiling do
    not."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = qkv(7)
    assert ops._plain_eager(q, k, v, None)
    with FlopCounterMode(display=False):
        assert not ops._plain_eager(q, k, v, None)
    assert not ops._plain_eager(torch.nn.Parameter(q), k, v, None)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(q):
        seen.append(ops._plain_eager(q))
        return q + 1

    traced(q)
    assert seen == [False]


# ---------------------------------------------------------------------------- the FP8 op
def fp8_args(seed, mask=True, out_dtype=torch.bfloat16, sinks=False, softcap=0.0):
    """The positional arguments of ``ops.attention_forward_fp8``: per-head quantised q, k, v
    (GQA, V's head dim 6) with their ``[B, Hk]`` descales."""
    q, k, v = qkv(seed)
    (q8, qd), (k8, kd), (v8, vd) = (
        flashmask.quantize_fp8(q, group=2), flashmask.quantize_fp8(k), flashmask.quantize_fp8(v)
    )  # fmt: skip
    sri = indices(seed + 1) if mask else None
    sink = torch.randn(4) if sinks else None
    return (q8, k8, v8, sri, False, 0.4, softcap, sink, qd, kd, vd, out_dtype)


# opcheck's schema test compares inputs before and after the call with torch.allclose, which
# float8 tensors do not implement on the CPU; the fake kernel and AOT dispatch tests run.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"mask": False, "out_dtype": torch.float32}, {"sinks": True, "softcap": 5.0}],
    ids=["mask-bf16", "no-mask-fp32", "sinks-softcap"],
)
def test_opcheck_attention_forward_fp8(kwargs):
    """The forward-only FP8 op: fake kernel (output in ``out_dtype``, lse float32) and AOT
    dispatch with static and dynamic shapes."""
    args = fp8_args(50, **kwargs)
    torch.library.opcheck(ops.attention_forward_fp8, args, test_utils=FP8_OPCHECKS)
    out, lse = ops.attention_forward_fp8(*args)
    assert out.dtype == args[-1] and lse.dtype == torch.float32


def test_fp8_calls_trace_as_one_graph_and_never_recompile_for_new_values():
    """``torch.compile(fullgraph=True)`` through an FP8 ``flashmask_attention``: one frame for
    new inputs, descales and mask values, equal to eager."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def attend(q, k, v, sri, qd, kd, vd):
        return flashmask.flashmask_attention(q, k, v, sri, q_descale=qd, k_descale=kd, v_descale=vd)

    for seed in (60, 62):
        q8, k8, v8, sri, _, _, _, _, qd, kd, vd, _ = fp8_args(seed)
        eager = flashmask.flashmask_attention(
            q8, k8, v8, sri, q_descale=qd, k_descale=kd, v_descale=vd
        )
        assert torch.equal(attend(q8, k8, v8, sri, qd, kd, vd), eager)
    assert counter.frame_count == 1
