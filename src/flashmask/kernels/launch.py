"""Launching compiled Triton and Gluon kernels without Triton's per-call binding.

``kernel[grid](*args)`` spends 40-60 us of host time binding the arguments, computing their
specialisation and the cache key before Triton's C launcher runs (measured on the H200's host
under Triton 3.6; ``docs/performance.md``). A short attention call launches five to seven
kernels, so at 8K keys with a sparse mask the host, not the GPU, can set the pace.

:func:`launch_kernel` keeps, per kernel, the compiled kernel that Triton's own path chose for a
call, keyed by what Triton's specialisation reads from the arguments (or something finer): a
tensor's dtype and whether its address is 16-byte aligned, an integer's exact value, a float's
type, a tensor descriptor's dtype, block shape, layout and padding, any other argument's value,
and the launch options. A later call with the same key skips the binding and calls the compiled
kernel's launcher with the arguments in the kernel's parameter order, as Triton's path does.
Anything this cannot vouch for takes Triton's path: the interpreter, a launch hook (profilers),
a kernel with pre-run hooks, an argument type not listed above, or a changed global the kernel
read.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

# A cache of this many keys across kernels is cleared when full (shapes repeat in training, so
# a full cache means keys that do not: start over rather than keep them all).
MAX_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to launch a key's compiled kernel: the positional arguments, then the parameters
    after them in the kernel's order, ``rest`` picking each from the keyword arguments merged
    over ``defaults`` (the parameters' defaults). ``kernel`` keeps the keyed ``id`` alive."""

    kernel: Any
    compiled: Any
    defaults: dict[str, Any]
    rest: Callable[[dict], tuple]


_PLANS: dict[tuple, _Plan] = {}


class _Uncacheable(Exception):
    """An argument whose specialisation this module does not know how to key."""


# Stands for any float in a key: Triton specialises floats by type, not value.
_FLOAT = ("float",)
_MISSING = object()


def _arg_key(arg: Any) -> Any:
    """What Triton's specialisation of ``arg`` depends on (or more), as a hashable value."""
    kind = type(arg)
    if kind is int or arg is None:
        return arg  # the value decides i32/i64, divisibility by 16 and the constant 1
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is bool:
        return (bool, arg)  # not equal to the int 0 or 1 in a key (a different type to Triton)
    if kind is float:
        return _FLOAT
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):  # a host-side tensor descriptor
        return (
            kind,
            arg.base.dtype,
            tuple(arg.block_shape),
            getattr(arg, "layout", None),
            getattr(arg, "padding", None),
            getattr(arg, "round_f32_to_tf32", None),
        )
    try:
        hash(arg)
    except TypeError:
        raise _Uncacheable(kind.__name__) from None
    return (kind, arg)


def _args_key(args: tuple) -> tuple:
    """The key of the positional arguments (ints and tensors, the most common, inline)."""
    tensor = torch.Tensor
    return tuple([
        a if type(a) is int
        else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is tensor
        else _arg_key(a)
        for a in args
    ])  # fmt: skip


# Keyword values keyed by value and type alone (the constexprs and launch options the library
# passes): a bool and an int of equal value stay apart through their types.
_PLAIN_TYPES = frozenset({int, bool, str, type(None)})


def _kwargs_key(kwargs: dict) -> tuple:
    types = tuple(map(type, kwargs.values()))
    if _PLAIN_TYPES.issuperset(types):
        return tuple(kwargs.items()), types
    return tuple([(name, _arg_key(value)) for name, value in kwargs.items()]), None


@functools.cache
def _triton() -> types.SimpleNamespace:
    """What the launch path uses from Triton, resolved once (flashmask imports Triton lazily):
    ``JITFunction``, ``HookChain``, ``knobs``, and the driver's current device and stream
    functions (torch's current device and its current raw stream, as Triton's path uses)."""
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    return types.SimpleNamespace(
        JITFunction=JITFunction,
        HookChain=HookChain,
        knobs=knobs,
        current_device=lambda: driver.active.get_current_device(),
        current_stream=lambda device: driver.active.get_current_stream(device),
    )


def _hooked(hook: Any, chain: type) -> bool:
    """Whether a launch hook would do something: Triton 3.6 and 3.9 hold them as a ``chain``
    (``HookChain``), empty unless a profiler added to it (or replaced it with a function)."""
    return hook is not None and (type(hook) is not chain or bool(hook.calls))


def _runtime_state(kernel: Any, triton: types.SimpleNamespace) -> tuple | None:
    """The Triton settings a launch of ``kernel`` reads besides its arguments, or ``None`` where
    Triton's path must run: not a compiled-mode kernel (the interpreter's), pre-run hooks, or
    launch hooks set (a profiler)."""
    if not isinstance(kernel, triton.JITFunction) or kernel.pre_run_hooks:
        return None
    runtime = triton.knobs.runtime
    if (
        _hooked(runtime.launch_enter_hook, triton.HookChain)
        or _hooked(runtime.launch_exit_hook, triton.HookChain)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
    ):
        return None
    compilation = triton.knobs.compilation
    return (
        runtime.debug,
        getattr(compilation, "instrumentation_mode", None),
        getattr(compilation, "fpsan_homomorphic_casts", None),
    )


def _globals_unchanged(kernel: Any) -> bool:
    """Whether every global the kernel read when it compiled still has its value (Triton's path
    raises otherwise; a cached launch must not hide that)."""
    for (name, _), (value, namespace) in kernel.used_global_vals.items():
        if namespace.get(name, _MISSING) != value:
            return False
    return True


def _plan(kernel: Any, compiled: Any, args: tuple, kwargs: dict) -> _Plan:
    """The plan for calls with positional arguments keyed as ``args`` and these keyword names."""
    params = list(kernel.signature.parameters.items())[len(args) :]
    defaults = {}
    for name, param in params:
        if name not in kwargs:
            if param.default is inspect.Parameter.empty:
                raise _Uncacheable(f"parameter {name} not given")
            defaults[name] = param.default
    names = [name for name, _ in params]
    if not names:
        rest = lambda merged: ()  # noqa: E731
    elif len(names) == 1:
        rest = lambda merged: (merged[names[0]],)  # noqa: E731
    else:
        rest = itemgetter(*names)
    return _Plan(kernel, compiled, defaults, rest)


def launch_kernel(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` (a ``triton.jit`` or ``gluon.jit`` function) over ``grid`` (1 to 3
    program counts) with ``args``/``kwargs``, exactly as ``kernel[grid](*args, **kwargs)``
    would: the same compiled kernel, the same arguments, the current device's current stream.
    Calls whose arguments specialise as a previous call's skip Triton's binding."""
    triton = _triton()
    state = _runtime_state(kernel, triton)
    if state is None:
        kernel[grid](*args, **kwargs)
        return
    device = triton.current_device()
    try:
        key = _key(kernel, device, state, args, kwargs)
    except _Uncacheable:
        kernel[grid](*args, **kwargs)
        return
    plan = _PLANS.get(key)
    if plan is None or (kernel.used_global_vals and not _globals_unchanged(kernel)):
        compiled = kernel[grid](*args, **kwargs)
        if compiled is None:  # not compiled in this call (Triton's asynchronous compile mode)
            return
        try:
            plan = _plan(kernel, compiled, args, kwargs)
        except _Uncacheable:
            return
        if len(_PLANS) >= MAX_ENTRIES:
            _PLANS.clear()
        _PLANS[key] = plan
        return
    _run_plan(plan, grid, triton.current_stream(device), args, kwargs)


def _key(kernel: Any, device: int, state: tuple, args: tuple, kwargs: dict) -> tuple:
    """The cache key of a call of ``kernel`` on ``device`` under Triton settings ``state``
    (:func:`_runtime_state`); raises :class:`_Uncacheable` for an argument it cannot key."""
    return (id(kernel), device, state, _args_key(args), _kwargs_key(kwargs))


def _run_plan(plan: _Plan, grid: tuple[int, ...], stream: int, args: tuple, kwargs: dict) -> None:
    """Call ``plan``'s compiled launcher over ``grid`` on ``stream`` as Triton's path does: the
    grid padded to three, no launch metadata or hooks, ``args`` as given, then the remaining
    parameters in the kernel's order."""
    rest = plan.rest({**plan.defaults, **kwargs} if plan.defaults else kwargs)
    compiled, size = plan.compiled, len(grid)
    compiled.run(
        grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream,
        compiled.function, compiled.packed_metadata, None, None, None, *args, *rest,
    )  # fmt: skip


def clear() -> None:
    """Forget every cached launch (the next call of each kernel takes Triton's path)."""
    _PLANS.clear()
