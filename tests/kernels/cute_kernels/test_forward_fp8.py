"""The FP8 (e4m3) CuTe forward on the CPU: its variants compile for sm_90a and fit the shared
memory, the hand-over of P from the score accumulator to the 8-bit A fragment composed with
the V^T key order is the identity (checked against the PTX ISA's fragment layouts, written
here independently of the kernel), the V^T pre-pass, and what ``launch.forward_fp8`` checks
and hands the kernel. Its results are proved on a GPU by ``tests/gpu/test_cute_fp8.py``.

Compiling every variant the launcher can ask for (3 head dims x 4 forms x skip/dense, 24)
takes about 75 s on one core; this file compiles a representative 13: every form in both modes
at head dim 128, and at 64 and 256 (their own shared-memory layouts and ring depths) the
persistent schedule skipping and the element mask on every tile (causal with a mask, dense),
and fp16 output once. All 24 compile without spilling registers at head dims 64 and 128."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import types

import pytest
import torch

# launch (imported first) sets CUTE_DSL_ARCH before cutlass is imported.
from flashmask.kernels import tiles
from flashmask.kernels.cute_kernels import fp8_layout, launch

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(
    not HAS_CUTLASS, reason="needs the flashmask[cute] extra (nvidia-cutlass-dsl)"
)

# (causal, has_mask, has_upper): full, causal, causal with a lower interval, and non-causal
# with both intervals (persistent programs by the launcher's rule).
FORMS = {
    "full": (False, False, False),
    "causal": (True, False, False),
    "causal_mask": (True, True, False),
    "mask": (False, True, True),
}
COMPILED = [
    *((128, form, dense) for form in FORMS for dense in (False, True)),
    *(
        (d, form, dense)
        for d in (64, 256)
        for form, dense in (("mask", False), ("causal_mask", True))
    ),
]
# Dynamic shared memory per block on Hopper.
SMEM_LIMIT = 227 * 1024


def _variant(head_dim: int, form: str, dense: bool):
    from flashmask.kernels.cute_kernels.forward import ForwardVariant

    causal, has_mask, has_upper = FORMS[form]
    block_n, stages = launch.fp8_tiles(head_dim, full_attention=form == "full")
    return ForwardVariant(
        head_dim=head_dim,
        block_n=block_n,
        kv_stages=stages,
        causal=causal,
        has_mask=has_mask,
        has_upper=has_upper,
        mask_full_tiles=dense,
        ordered=has_mask,  # launch orders exist only with a mask
        persistent=form == "mask",
        fp8=True,
    )


def _compile(variant, out_dtype: torch.dtype, monkeypatch) -> tuple[object, int]:
    """``(compiled kernel, its shared memory in bytes)``: ``launch.compiled_forward`` past its
    cache, with the kernel object recorded to read the storage its trace laid out."""
    from flashmask.kernels.cute_kernels import forward

    built = []

    class Recorded(forward.HopperForward):
        def __init__(self, v):
            super().__init__(v)
            built.append(self)

    monkeypatch.setattr(forward, "HopperForward", Recorded)
    compiled = launch.compiled_forward.__wrapped__(variant, out_dtype)
    return compiled, built[0].shared_storage.size_in_bytes()


@needs_cutlass
@pytest.mark.parametrize(
    ("head_dim", "form", "dense"),
    COMPILED,
    ids=[f"d{d}-{form}-{'dense' if dense else 'skip'}" for d, form, dense in COMPILED],
)
def test_fp8_variant_compiles_and_fits_shared_memory(head_dim, form, dense, monkeypatch):
    compiled, smem = _compile(_variant(head_dim, form, dense), torch.bfloat16, monkeypatch)
    assert compiled is not None
    assert smem <= SMEM_LIMIT


_FP8_VARIANT = """
import torch
from tests.kernels.cute_kernels.test_forward_fp8 import _variant
from flashmask.kernels.cute_kernels import launch
launch.compiled_forward(_variant(128, {form!r}, False), torch.bfloat16)
"""


@needs_cutlass
@pytest.mark.parametrize("form", list(FORMS))
def test_the_head_dim_128_fp8_forwards_do_not_spill(tmp_path, form: str):
    """At head dim 128 every form holds its tile loop in registers: full attention at its
    192-key tiles (a 64 x 192 fp32 score accumulator per warpgroup), the others at 128-key
    tiles, where with a mask the wider tiles spilled 36 to 104 bytes
    (``launch.FP8_FULL_ATTENTION_TILES``)."""
    from tests.kernels.cute_kernels.ptx import compiled_ptx, spill_bytes

    ptx = compiled_ptx(tmp_path / "dump", _FP8_VARIANT.format(form=form))
    assert spill_bytes(tmp_path, ptx) == 0


@needs_cutlass
def test_fp8_variant_with_float16_output_compiles(monkeypatch):
    compiled, _ = _compile(_variant(128, "causal_mask", False), torch.float16, monkeypatch)
    assert compiled is not None


def test_full_attention_fp8_calls_take_wider_key_tiles_at_head_dim_128():
    """Full attention at D = 128 takes 192-key tiles, spreading the per-tile softmax work over
    1.5x the keys; masked and causal calls, and D = 64 and 256, keep the bf16 forward's tiles
    (and lists). Every width is a whole number of 32-key k-blocks (the 8-bit ``wgmma``'s),
    hence of the V^T key order's 16-key groups."""
    for d in launch.FP8_HEAD_DIMS:
        narrow = (launch.key_tile(d), launch.FP8_KV_STAGES[d])
        assert launch.fp8_tile_shape(d, full_attention=False) == (128, launch.key_tile(d), True)
        assert launch.fp8_tiles(d, full_attention=False) == narrow
    full = {d: launch.fp8_tiles(d, full_attention=True) for d in launch.FP8_HEAD_DIMS}
    assert full == {64: (128, 8), 128: (192, 4), 256: (64, 5)}
    assert all(n % 32 == 0 for n, _ in full.values())
    with pytest.raises(ValueError, match="head_dim"):
        launch.fp8_tile_shape(192, full_attention=True)


@needs_cutlass
def test_query_tile_is_the_kernels():
    from flashmask.kernels.cute_kernels.forward import BLOCK_M

    assert launch.QUERY_TILE == BLOCK_M


# --- The P hand-over, from the PTX ISA's wgmma fragment layouts -------------------------------
# Written from the PTX ISA ("Register Fragments and Shared Memory Matrix Layouts" of wgmma), not
# from the kernel: a thread is (warp w, lane l) of the warpgroup, g = l // 4, t = l % 4.


def ptx_accumulator(warp: int, lane: int, value: int) -> tuple[int, int]:
    """(row, column) of fp32 accumulator value ``value`` of an ``m64nN`` wgmma: ``d[4 j + 2 i
    + c]`` is row ``16 w + g + 8 i``, column ``8 j + 2 t + c``."""
    j, rest = divmod(value, 4)
    i, c = divmod(rest, 2)
    return 16 * warp + lane // 4 + 8 * i, 8 * j + 2 * (lane % 4) + c


def ptx_a_fragment_8bit(warp: int, lane: int, byte: int) -> tuple[int, int]:
    """(row, k) of byte ``byte`` (0..15, ``a0..a15``, four per 32-bit register) of an 8-bit A
    register fragment of ``m64nNk32``: ``a0..a3`` row ``g``, k ``4 t .. 4 t + 3``; ``a4..a7`` row
    ``g + 8``, the same k; ``a8..a15`` as ``a0..a7`` with k + 16."""
    q = byte % 4
    i = (byte // 4) % 2
    h = byte // 8
    return 16 * warp + lane // 4 + 8 * i, 4 * (lane % 4) + q + 16 * h


def _flatten(shape, stride):
    if isinstance(shape, tuple):
        pairs = [_flatten(s, d) for s, d in zip(shape, stride, strict=True)]
        return [p for group in pairs for p in group]
    return [(shape, stride)]


def layout_offsets(spec: tuple[tuple, tuple]) -> list[int]:
    """A CuTe layout's offset of each linear (colexicographic) index, in plain Python."""
    modes = _flatten(*spec)
    offsets = []
    for index in range(math.prod(s for s, _ in modes)):
        offset = 0
        for size, step in modes:
            index, coord = divmod(index, size)
            offset += coord * step
        offsets.append(offset)
    return offsets


def test_key_order_is_a_permutation_of_each_group_of_16():
    assert sorted(fp8_layout.KEY_ORDER) == list(range(16))
    assert fp8_layout.KEY_ORDER == (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
    keys = fp8_layout.permuted_keys(64)
    assert sorted(keys) == list(range(64))
    assert keys[16:32] == [16 + k for k in fp8_layout.KEY_ORDER]
    with pytest.raises(ValueError, match="num_keys"):
        fp8_layout.permuted_keys(40)


@pytest.mark.parametrize("block_n", [64, 128, 192])
def test_the_scatter_and_the_key_order_compose_to_the_identity(block_n: int):
    """Each accumulator value of S, rounded and stored where the kernel's store puts it, is read
    by the 8-bit A fragment as P of the same row and of the key that V^T's k index holds."""
    acc = layout_offsets(fp8_layout.accumulator_split(block_n))
    scatter = layout_offsets(fp8_layout.scatter_layout(block_n))
    fragment = layout_offsets(fp8_layout.fragment_layout(block_n))
    # The split view is the accumulator itself: value e at offset e.
    assert acc == list(range(block_n // 2))
    # The fragment is compact and the scatter a bijection onto it.
    assert sorted(fragment) == list(range(block_n // 2)) == sorted(scatter)
    slot_of_offset = {offset: index for index, offset in enumerate(fragment)}
    keys = fp8_layout.permuted_keys(block_n)
    for warp, lane in itertools.product(range(4), range(32)):
        for split_index, value in enumerate(acc):
            row, key = ptx_accumulator(warp, lane, value)
            # The fragment's linear index: byte s of k-block kb at s + 16 kb.
            kb, byte = divmod(slot_of_offset[scatter[split_index]], 16)
            a_row, k = ptx_a_fragment_8bit(warp, lane, byte)
            assert a_row == row
            assert keys[32 * kb + k] == key


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("keys", "block_n"), [(128, 128), (200, 128), (200, 192), (100, 64), (64, 64)]
)
def test_p_v_through_simulated_fragments_equals_p_v(keys: int, block_n: int):
    """P V computed as the kernel's warpgroup does, from per-thread fragments (each thread's A
    bytes filled from its own accumulator values, read at the PTX ISA's k indices) against
    the pre-pass's V^T, equals P V."""
    torch.manual_seed(0)
    d = 16
    p = _fp8(torch.rand(64, keys)).float()
    v = _fp8(torch.randn(1, keys, 1, d))
    vt = launch.fp8_values_transposed(v, block_n)[0, 0].float()  # [D, keys padded]
    padded = vt.shape[1]
    p_padded = torch.zeros(64, padded)
    p_padded[:, :keys] = p
    acc = layout_offsets(fp8_layout.accumulator_split(padded))
    scatter = layout_offsets(fp8_layout.scatter_layout(padded))
    fragment = layout_offsets(fp8_layout.fragment_layout(padded))
    slot_of_offset = {offset: index for index, offset in enumerate(fragment)}
    out = torch.zeros(64, d)
    for warp, lane in itertools.product(range(4), range(32)):
        # The thread's A bytes, each from one of its accumulator values.
        a = torch.zeros(padded // 2)
        for split_index, value in enumerate(acc):
            row, col = ptx_accumulator(warp, lane, value)
            a[slot_of_offset[scatter[split_index]]] = p_padded[row, col]
        for slot in range(padded // 2):
            kb, byte = divmod(slot, 16)
            row, k = ptx_a_fragment_8bit(warp, lane, byte)
            out[row] += a[slot] * vt[:, 32 * kb + k]
    torch.testing.assert_close(out, p @ v[0, :, 0].float(), atol=1e-5, rtol=1e-5)


# --- The V^T pre-pass and the launcher -----------------------------------------------------


def test_values_transposed_permutes_keys_and_pads_with_zeros():
    torch.manual_seed(1)
    v = _fp8(torch.randn(2, 150, 3, 64))
    vt = launch.fp8_values_transposed(v, 128)
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (2, 3, 64, 256) and vt.is_contiguous()
    keys = torch.tensor(fp8_layout.permuted_keys(256))
    raw_vt, raw_v = vt.view(torch.uint8), v.view(torch.uint8)
    real = keys < 150
    assert torch.equal(raw_vt[..., real], raw_v[:, keys[real]].permute(0, 2, 3, 1))
    assert (raw_vt[..., ~real] == 0).all()


@pytest.mark.parametrize(
    ("shape", "block_n", "transposed"),
    [
        ((2, 150, 3, 64), 128, False),
        ((1, 77, 2, 128), 16, True),
        ((1, 200, 2, 128), 192, False),
        ((1, 256, 1, 256), 64, False),
    ],
)
def test_values_transposed_kernel_equals_the_copy(shape, block_n: int, transposed: bool):
    """The Triton pre-pass (here through its interpreter) writes what the strided copy does:
    keys permuted, zeros past Sk, any strides of V."""
    torch.manual_seed(2)
    v = _fp8(torch.randn(*shape))
    if transposed:  # [B, Hk, Sk, D] storage seen as [B, Sk, Hk, D]
        v = _fp8(torch.randn(shape[0], shape[2], shape[1], shape[3])).transpose(1, 2)
    by_kernel = launch.fp8_values_transposed_by_kernel(v, block_n)
    by_copy = launch.fp8_values_transposed_by_copy(v, block_n)
    assert by_kernel.dtype == torch.float8_e4m3fn and by_kernel.is_contiguous()
    assert torch.equal(by_kernel.view(torch.uint8), by_copy.view(torch.uint8))


def test_values_transposed_takes_any_strides():
    v = _fp8(torch.randn(1, 3, 64, 32)).transpose(1, 2)  # [1, 64, 3, 32], not contiguous
    expected = launch.fp8_values_transposed(v.contiguous(), 64)
    assert torch.equal(
        launch.fp8_values_transposed(v, 64).view(torch.uint8), expected.view(torch.uint8)
    )


def test_values_transposed_reads_v_anew_on_every_call():
    """V changed in place (a KV cache being filled) gives a new V^T: nothing is cached."""
    v = _fp8(torch.randn(1, 128, 1, 64))
    first = launch.fp8_values_transposed(v, 128).clone()
    v.view(torch.uint8).zero_()
    second = launch.fp8_values_transposed(v, 128)
    assert (second.view(torch.uint8) == 0).all()
    assert not torch.equal(first.view(torch.uint8), second.view(torch.uint8))


def _inputs(batch=2, sq=300, sk=260, hq=4, hk=2, d=128, masked=True, causal=False):
    """CPU stand-ins of ``forward_fp8``'s arguments: ``(args, kwargs)``."""
    q = _fp8(torch.randn(batch, sq, hq, d))
    k = _fp8(torch.randn(batch, sk, hk, d))
    v = _fp8(torch.randn(batch, sk, hk, d))
    full_attention = not masked and not causal
    tm, tn = -(-sq // 128), -(-sk // launch.fp8_tiles(d, full_attention=full_attention)[0])
    counts = torch.ones(batch, 1, tm, dtype=torch.int32)
    lists = tiles.TileLists(torch.zeros(batch, 1, tm, tn, dtype=torch.int32), counts, counts)
    bounds = torch.zeros(batch, 1, 4, sk, dtype=torch.int32) if masked else None
    order = torch.arange(batch * hq * tm, dtype=torch.int32) if masked else None
    descales = [torch.rand(batch, hk) + 0.5 for _ in range(3)]
    args = [q, k, v, bounds, lists, 1, causal, True, 0.1, True, order, *descales]
    return args, {"out_dtype": torch.bfloat16}


def _launch_args(monkeypatch, args, kwargs):
    """What ``launch.forward_fp8`` hands the compiled kernel on the CPU (a recording stand-in
    for the kernel, the tensors themselves for their DLPack views, the device check off):
    ``(variant, out dtype, args)``."""
    seen = []

    def compiled(variant, dtype):
        return lambda *a: seen.append((variant, dtype, a))

    monkeypatch.setattr(launch, "compiled_forward", compiled)
    monkeypatch.setattr(launch, "_view", lambda x, align: x)
    monkeypatch.setattr(launch, "_check_devices", lambda named, device: None)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)
    )
    out, lse = launch.forward_fp8(*args, **kwargs)
    (call,) = seen
    assert out.dtype == kwargs["out_dtype"] and out.shape == args[0].shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, args[0].shape[1])
    return call


def test_forward_fp8_hands_the_kernel_v_transposed_and_the_descales(monkeypatch):
    args, kwargs = _inputs()
    variant, out_dtype, call = _launch_args(monkeypatch, args, kwargs)
    assert variant.fp8 and variant.persistent and variant.ordered and variant.has_upper
    assert (variant.block_n, variant.kv_stages) == (128, launch.FP8_KV_STAGES[128])
    assert out_dtype == torch.bfloat16
    q, k, v = args[:3]
    assert call[0] is q and call[1] is k
    assert torch.equal(
        call[2].view(torch.uint8), launch.fp8_values_transposed(v, 128).view(torch.uint8)
    )
    assert call[14] == pytest.approx(0.1 * math.log2(math.e))
    scales = call[-1]
    q_descale, k_descale, v_descale = args[11:14]
    assert scales.shape == (2, 2, 2) and scales.is_contiguous()
    torch.testing.assert_close(scales[..., 0], q_descale * k_descale)
    torch.testing.assert_close(scales[..., 1], v_descale)


def test_forward_fp8_hands_the_kernel_the_sinks_after_the_descales(monkeypatch):
    """Sinks join the rows in the kernel (a ``sinks`` variant, float32 ``[Hq]`` after the
    descale tensor), so nothing folds them after the call."""
    args, kwargs = _inputs()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)
    variant, _, call = _launch_args(monkeypatch, args, {**kwargs, "sinks": sinks})
    assert variant.fp8 and variant.sinks
    assert call[-2].shape == (2, 2, 2)
    assert call[-1].dtype == torch.float32 and torch.equal(call[-1], sinks.float())
    variant, _, call = _launch_args(monkeypatch, args, kwargs)
    assert not variant.sinks and call[-1].shape == (2, 2, 2)


@needs_cutlass
def test_fp8_sinks_variant_compiles():
    variant = dataclasses.replace(_variant(128, "mask", False), sinks=True)
    assert launch.compiled_forward(variant, torch.bfloat16) is not None


def test_forward_fp8_runs_causal_and_unmasked_calls_one_item_per_program(monkeypatch):
    for causal, tile, padded in ((False, (192, 4), 384), (True, (128, 6), 256)):
        args, kwargs = _inputs(sk=200, masked=False, causal=causal)
        kwargs["out_dtype"] = torch.float16
        variant, out_dtype, call = _launch_args(monkeypatch, args, kwargs)
        assert not variant.persistent and not variant.has_mask and not variant.ordered
        assert out_dtype == torch.float16 and call[10] == 1
        # D = 128: full attention in 192-key tiles and 4 slots, causal in 128-key tiles; V^T
        # padded to whole tiles of its width (Sk = 200).
        assert (variant.block_n, variant.kv_stages) == tile
        assert tile == launch.fp8_tiles(128, full_attention=not causal)
        assert call[2].shape[-1] == padded
    kwargs["persistent"] = True
    variant, _, call = _launch_args(monkeypatch, args, kwargs)
    assert variant.persistent and call[10] == 4  # min(items, 4 "SMs" off CUDA)


def _bad(index_or_key, value):
    args, kwargs = _inputs()
    if isinstance(index_or_key, int):
        args[index_or_key] = value
    else:
        kwargs[index_or_key] = value
    return args, kwargs


def _strided_q() -> torch.Tensor:
    return _fp8(torch.zeros(2, 4, 300, 128)).transpose(1, 2)


BAD = [
    ("q", TypeError, lambda: _bad(0, torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16))),
    ("k", ValueError, lambda: _bad(1, _fp8(torch.zeros(2, 260, 2, 64)))),
    ("v", ValueError, lambda: _bad(2, _fp8(torch.zeros(2, 250, 2, 128)))),
    ("head dim", ValueError, lambda: _bad(0, _fp8(torch.zeros(2, 300, 4, 96)))),
    ("heads", ValueError, lambda: _bad(0, _fp8(torch.zeros(2, 300, 3, 128)))),
    ("q must be contiguous", ValueError, lambda: _bad(0, _strided_q())),
    ("mask_heads", ValueError, lambda: _bad(5, 3)),
    ("bounds", ValueError, lambda: _bad(3, torch.zeros(2, 1, 4, 100, dtype=torch.int32))),
    ("lists", ValueError, lambda: _bad(4, tiles.TileLists(*[torch.zeros(2, 1, 3, 9).int()] * 3))),
    ("order", ValueError, lambda: _bad(10, torch.zeros(5, dtype=torch.int32))),
    ("softmax_scale", ValueError, lambda: _bad(8, -0.1)),
    ("q_descale", TypeError, lambda: _bad(11, torch.ones(2, 2, dtype=torch.float64))),
    ("k_descale", ValueError, lambda: _bad(12, torch.ones(2, 4))),
    ("v_descale", TypeError, lambda: _bad(13, 1.0)),
    ("out_dtype", TypeError, lambda: _bad("out_dtype", torch.float32)),
    ("on q's CUDA device", ValueError, _inputs),  # CPU tensors: the last check
]  # fmt: skip


@pytest.mark.parametrize(("match", "error", "make"), BAD, ids=[b[0] for b in BAD])
def test_forward_fp8_rejects_bad_inputs_naming_them(match, error, make):
    args, kwargs = make()
    with pytest.raises(error, match=match):
        launch.forward_fp8(*args, **kwargs)
