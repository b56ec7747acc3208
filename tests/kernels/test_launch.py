"""``kernels.launch.launch_kernel``: the same launch as ``kernel[grid](...)``, with Triton's
binding skipped for calls whose arguments specialise as an earlier call's.

The cached launch itself needs a GPU (the ``gpu``-marked test below compares a forward +
backward through it bitwise with one through Triton's path); here Triton's path is a stand-in
that records what it was given, and the key is checked against Triton's own specialisation
function."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from flashmask.kernels import launch

LAYOUT_DEFAULTS = {"swizzle_byte_width": 128, "element_bitwidth": 16, "rank": 2}


def _tritons_specialisation(arg):
    """What Triton's binder records for ``arg`` as a specialised, alignment-checked parameter."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def _arguments() -> list:
    """Arguments of every kind the library passes, with the values Triton tells apart."""
    base = torch.zeros(4096, dtype=torch.float32)
    tensors = [
        base.view(dtype)[offset : offset + 256]
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32)
        for offset in (0, 1, 4, 8, 64)
    ]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31, 2**32, -(2**31), -(2**31) - 1]
    descriptors = [
        TensorDescriptor.from_tensor(base.view(dtype).view(64, -1), block)
        for dtype in (torch.bfloat16, torch.float16)
        for block in ([64, 64], [64, 128], [128, 64])
    ]
    return [*tensors, *ints, 0.0, 1.0, 0.5, -2.0, True, False, None, *descriptors]


def test_equal_keys_mean_equal_triton_specialisations():
    """Two arguments with one key specialise alike to Triton: a cached kernel compiled for one
    is the kernel Triton's path would pick for the other."""
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        if launch._arg_key(a) == launch._arg_key(b):
            assert _tritons_specialisation(a) == _tritons_specialisation(b), (a, b)


def test_keys_hit_across_calls_that_differ_only_in_addresses_and_float_values():
    """The cache is useful: new aligned tensors of a dtype, other float values and new
    descriptors over other tensors of the same dtype and block shape share a key."""
    x, y = torch.zeros(64, 128, dtype=torch.bfloat16), torch.ones(128, 128, dtype=torch.bfloat16)
    assert launch._arg_key(x) == launch._arg_key(y)
    assert launch._arg_key(0.125) == launch._arg_key(0.5)
    dx, dy = TensorDescriptor.from_tensor(x, [64, 64]), TensorDescriptor.from_tensor(y, [64, 64])
    assert launch._arg_key(dx) == launch._arg_key(dy)
    # Told apart: dtype, alignment, the int 1 (a constant to Triton) and the bool True.
    assert launch._arg_key(x) != launch._arg_key(x.float())
    assert launch._arg_key(x) != launch._arg_key(x.view(-1)[1:])
    assert launch._arg_key(1) != launch._arg_key(True)


def test_gluon_descriptors_are_keyed_by_their_layout():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    layouts = [
        gl.NVMMASharedLayout(**LAYOUT_DEFAULTS),
        gl.NVMMASharedLayout(**{**LAYOUT_DEFAULTS, "swizzle_byte_width": 64}),
    ]
    a, b = (GluonDescriptor.from_tensor(x, [64, 128], layout) for layout in layouts)
    assert launch._arg_key(a) != launch._arg_key(b)
    assert _tritons_specialisation(a) != _tritons_specialisation(b)
    again = GluonDescriptor.from_tensor(x.clone(), [64, 128], layouts[0])
    assert launch._arg_key(again) == launch._arg_key(a)


def _kernel_source(x_ptr, n, scale, flag, BLOCK: tl.constexpr, EXTRA: tl.constexpr = 7):
    pass


class _Compiled:
    """A compiled kernel's launcher, recording its calls."""

    function = "function-handle"
    packed_metadata = ("packed",)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def stand_in(monkeypatch):
    """A compiled-mode ``JITFunction`` whose Triton path records its calls and returns one
    compiled kernel; device 3, stream 77; an empty cache."""
    kernel = JITFunction(_kernel_source)
    compiled = _Compiled()
    paths = []

    def run(*args, grid, warmup, **kwargs):
        paths.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(kernel, "run", run)
    triton = launch._triton()
    monkeypatch.setattr(triton, "current_device", lambda: 3)
    monkeypatch.setattr(triton, "current_stream", lambda device: 77 if device == 3 else None)
    monkeypatch.setattr(launch, "_PLANS", {})
    return types.SimpleNamespace(kernel=kernel, compiled=compiled, paths=paths)


def test_a_repeated_call_launches_the_compiled_kernel_with_the_parameters_in_order(stand_in):
    x = torch.zeros(256, dtype=torch.bfloat16)
    launch.launch_kernel(stand_in.kernel, (5, 2), x, 64, 0.5, True, BLOCK=32, num_warps=4)
    assert stand_in.paths == [((5, 2), (x, 64, 0.5, True), {"BLOCK": 32, "num_warps": 4})]
    y = torch.ones(512, dtype=torch.bfloat16)
    launch.launch_kernel(stand_in.kernel, (9,), y, 64, 0.25, True, BLOCK=32, num_warps=4)
    assert len(stand_in.paths) == 1  # no second binding
    # grid padded to three, stream, handle, metadata, no launch metadata or hooks, then every
    # parameter in the kernel's order: the constexprs and EXTRA's default too, no options.
    assert stand_in.compiled.calls == [
        (9, 1, 1, 77, "function-handle", ("packed",), None, None, None, y, 64, 0.25, True, 32, 7)
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"x": torch.zeros(256, dtype=torch.float16)},  # another dtype
        {"x": torch.zeros(257, dtype=torch.bfloat16)[1:]},  # misaligned
        {"n": 65},  # another int value
        {"n": True},  # a bool where an int was
        {"flag": 1},  # an int where a bool was
        {"BLOCK": 64},  # another constexpr
        {"num_warps": 8},  # another launch option
        {"EXTRA": 7},  # the default given by keyword: another form of call
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_call_that_may_specialise_differently_takes_tritons_path(stand_in, change):
    call = {"x": torch.zeros(256, dtype=torch.bfloat16), "n": 64, "flag": True}
    options = {"BLOCK": 32, "num_warps": 4}
    launch.launch_kernel(stand_in.kernel, (1,), call["x"], call["n"], 0.5, call["flag"], **options)
    call.update({k: v for k, v in change.items() if k in call})
    options.update({k: v for k, v in change.items() if k not in call})
    launch.launch_kernel(stand_in.kernel, (1,), call["x"], call["n"], 0.5, call["flag"], **options)
    assert len(stand_in.paths) == 2 and not stand_in.compiled.calls


def test_hooks_switch_off_and_changed_globals_take_tritons_path(stand_in, monkeypatch):
    from triton import knobs

    x = torch.zeros(256, dtype=torch.bfloat16)

    def call():
        launch.launch_kernel(stand_in.kernel, (1,), x, 64, 0.5, True, BLOCK=32)

    call()
    hook = knobs.runtime.launch_enter_hook  # an empty chain of hooks
    hook.add(print)
    try:
        call()  # a profiler's hook: Triton's path calls it
    finally:
        hook.remove(print)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda metadata: None)
    call()  # a hook set as a function, as older Triton took it
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    namespace = {"SCALE": 2}
    monkeypatch.setattr(stand_in.kernel, "used_global_vals", {("SCALE", 0): (1, namespace)})
    call()  # Triton's path raises for a global changed since compiling
    assert len(stand_in.paths) == 4 and not stand_in.compiled.calls
    namespace["SCALE"] = 1
    call()
    assert len(stand_in.paths) == 4 and len(stand_in.compiled.calls) == 1


def test_unkeyable_arguments_and_interpreted_kernels_take_tritons_path(stand_in):
    launch.launch_kernel(stand_in.kernel, (1,), [1], 64, 0.5, True, BLOCK=32)
    launch.launch_kernel(stand_in.kernel, (1,), [1], 64, 0.5, True, BLOCK=32)
    assert len(stand_in.paths) == 2 and not launch._PLANS
    seen = []

    class Interpreted:  # not a JITFunction, as under Triton's interpreter
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, args, kwargs))

    for _ in range(2):
        launch.launch_kernel(Interpreted(), (2, 3), 1, BLOCK=4)
    assert seen == [((2, 3), (1,), {"BLOCK": 4})] * 2


def test_the_cache_starts_over_when_full(stand_in, monkeypatch):
    monkeypatch.setattr(launch, "MAX_ENTRIES", 2)
    x = torch.zeros(256, dtype=torch.bfloat16)
    for n in (1, 2, 3):
        launch.launch_kernel(stand_in.kernel, (1,), x, n + 16, 0.5, True, BLOCK=32)
    assert len(launch._PLANS) == 1
    launch.launch_kernel(stand_in.kernel, (1,), x, 19, 0.5, True, BLOCK=32)
    assert len(stand_in.paths) == 3 and len(stand_in.compiled.calls) == 1
    launch.clear()
    launch.launch_kernel(stand_in.kernel, (1,), x, 19, 0.5, True, BLOCK=32)
    assert len(stand_in.paths) == 4 and len(launch._PLANS) == 1


def test_a_launch_that_returns_no_compiled_kernel_is_not_cached(stand_in, monkeypatch):
    monkeypatch.setattr(stand_in.kernel, "run", lambda *a, grid, warmup, **kw: None)
    x = torch.zeros(256, dtype=torch.bfloat16)
    for _ in range(2):
        launch.launch_kernel(stand_in.kernel, (1,), x, 16, 0.5, True, BLOCK=32)
    assert not launch._PLANS and not stand_in.compiled.calls


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False])
def test_on_a_gpu_cached_launches_give_tritons_results_without_its_binding(
    monkeypatch, deterministic
):
    """A forward + backward with every launch cached equals one through Triton's path (bitwise,
    except the atomics-summed dQ of the non-deterministic backward), and once warm no launch of
    it takes Triton's path."""
    from flashmask import flashmask_attention, masks
    from flashmask.kernels import clear_prepared

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(2, 1024, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        for heads in (8, 2, 2, 8)
    )
    mask = masks.sliding_window(1024, 200, batch_size=2, device="cuda")

    def forward_backward():
        clear_prepared()
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flashmask_attention(qg, kg, vg, mask, causal=mask.causal, deterministic=deterministic)
        return (out, *torch.autograd.grad(out, (qg, kg, vg), do))

    with monkeypatch.context() as through_triton:  # every launch through kernel[grid](...)
        through_triton.setattr(launch, "_runtime_state", lambda kernel, triton: None)
        want = forward_backward()
    forward_backward()
    triton_path = []
    run = JITFunction.run
    monkeypatch.setattr(
        JITFunction, "run", lambda self, *a, **kw: triton_path.append(self) or run(self, *a, **kw)
    )
    got = forward_backward()
    assert not triton_path
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        if deterministic or name != "dq":
            assert torch.equal(x, y), name
        else:  # summed by atomics in any order
            assert (x.float() - y.float()).abs().max() <= 1e-2 * y.float().abs().max(), name
