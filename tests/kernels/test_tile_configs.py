"""Tile configurations (``flashmask.kernels.tile_config`` and friends) and the launchers' fallback
when a kernel needs more shared memory than the GPU has.

The H200-tuned tiles need up to 224 KB of shared memory per block; an A100 offers 163 KB and
consumer Ampere/Ada GPUs 99 KB. The launchers must pick tiles that fit, and if a launch still runs
out of shared memory (a GPU or Triton version we did not compile for), shrink the tiles and retry
instead of failing — but never silently change a configuration the caller passed explicitly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from triton.runtime.errors import OutOfResources

from flashmask import kernels
from flashmask.kernels import TileConfig, config, hardware, tensors
from flashmask.kernels.triton_kernels import backward as attention_bwd
from flashmask.kernels.triton_kernels import forward as attention_fwd

INTERPRETER_WARNING = "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KB = 1024


@pytest.fixture
def not_interpreting(monkeypatch):
    """``tile_config`` as on a GPU (under the interpreter it always returns 16x16 tiles)."""
    monkeypatch.setattr(hardware, "interpreting", lambda: False)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_gpus_with_less_shared_memory_than_hopper_get_compact_tiles(not_interpreting, head_dim):
    for shared in (99 * KB, 163 * KB):  # consumer Ampere/Ada, A100
        for has_mask in (True, False):
            cfg = kernels.tile_config(head_dim, has_mask=has_mask, shared_memory=shared)
            assert cfg == kernels.compact_tile_config(head_dim)
    hopper = kernels.tile_config(head_dim, shared_memory=227 * KB)
    assert hopper == kernels.tile_config(head_dim)  # unknown shared memory: the H200 tiles
    assert hopper != kernels.compact_tile_config(head_dim)


def test_without_a_mask_hopper_forward_tiles_are_larger_where_no_tma(not_interpreting):
    """Without a mask the forward takes taller tiles (128 query rows: nothing to skip but the
    causal triangle) except at head dim 128, where the 64x64 TMA-loaded tiles measured faster."""
    for head_dim, expected in ((64, (128, 64)), (96, (128, 128)), (128, (64, 64))):
        masked = kernels.tile_config(head_dim, has_mask=True)
        unmasked = kernels.tile_config(head_dim, has_mask=False)
        assert (unmasked.fwd_m, unmasked.fwd_n) == expected
        assert (masked.fwd_m, masked.fwd_n) == (64, 64)
        # The backward does not depend on the mask's presence.
        assert (unmasked.bwd_m, unmasked.bwd_n, unmasked.dq_m, unmasked.dq_n) == (
            masked.bwd_m,
            masked.bwd_n,
            masked.dq_m,
            masked.dq_n,
        )


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_hopper_forward_uses_tma_only_where_measured_faster_and_safe(not_interpreting, head_dim):
    """TMA loads in the forward at head dim 128 (faster on the H200 with and without a mask,
    checked there); never on square 4-D tiles (miscompiled by Triton 3.6), at hd256 (slower), at
    head dims not yet checked on a GPU, or in compact tiles."""
    for has_mask in (True, False):
        cfg = kernels.tile_config(head_dim, has_mask=has_mask)
        assert cfg.fwd_tma == (head_dim == 128)
        block_d = tensors.padded_head_dim(head_dim)
        if cfg.fwd_tma:
            assert tensors.tma_tiles_safe(cfg.fwd_m, cfg.fwd_n, block_d)
    assert not kernels.compact_tile_config(head_dim).fwd_tma


def test_shrinking_drops_stages_first_then_halves_tiles_down_to_16():
    cfg = TileConfig(128, 64, 8, 3, 64, 64, 8, 2, 64, 32, 4, 2)
    steps = []
    while cfg is not None:
        steps.append(cfg)
        cfg = kernels.shrink_tile_config(cfg)
    stages = [(c.fwd_stages, c.bwd_stages, c.dq_stages) for c in steps]
    assert stages[:3] == [(3, 2, 2), (2, 1, 1), (1, 1, 1)]
    tiles = [(c.fwd_m, c.fwd_n, c.bwd_m, c.bwd_n, c.dq_m, c.dq_n) for c in steps[2:]]
    assert tiles == [
        (128, 64, 64, 64, 64, 32),
        (64, 32, 32, 32, 32, 16),
        (32, 16, 16, 16, 16, 16),
        (16, 16, 16, 16, 16, 16),
    ]
    assert all(c.fwd_warps == c.bwd_warps == c.dq_warps == 4 for c in steps[3:])


class SharedMemoryLimit:
    """Stands in for a Triton kernel on a GPU that cannot fit tiles above 16 or more than one
    pipeline stage: launching such a configuration raises ``OutOfResources`` as Triton does,
    anything smaller runs the real kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.refused = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            blocks = [v for k, v in kwargs.items() if k.endswith(("BLOCK_M", "BLOCK_N"))]
            stages = [v for k, v in kwargs.items() if k.endswith("STAGES")]
            if max(blocks) > 16 or max(stages) > 1:
                self.refused += 1
                raise OutOfResources(300 * KB, 99 * KB, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def limited_gpu(monkeypatch):
    """Every attention kernel behind a ``SharedMemoryLimit``, the default tiles too large for it
    (32x32, two stages), and an empty memory of fitted configurations."""
    limits = {}
    for module, name in (
        (attention_fwd, "flashmask_fwd_kernel"),
        (attention_bwd, "flashmask_bwd_fused_kernel"),
        (attention_bwd, "flashmask_bwd_dkdv_kernel"),
        (attention_bwd, "flashmask_bwd_dq_kernel"),
    ):
        limits[name] = SharedMemoryLimit(getattr(module, name))
        monkeypatch.setattr(module, name, limits[name])
    too_large = TileConfig(32, 32, 4, 2, 32, 32, 4, 2, 32, 32, 4, 2)
    monkeypatch.setattr(config, "tile_config", lambda *a, **k: too_large)
    monkeypatch.setattr(config, "_FITTED", {})
    return limits


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, 40, 2, 32, generator=gen).to(DEVICE, torch.float16) for _ in range(4)
    )
    sri = torch.randint(0, 41, (1, 1, 40, 1), generator=gen, dtype=torch.int32).to(DEVICE)
    return q, k, v, dout, sri


def _forward_backward(config=None):
    q, k, v, dout, sri = _inputs()
    out, lse = kernels.forward(q, k, v, sri, True, 0.2, config=config)
    grads = kernels.backward(dout, None, q, k, v, out, lse, sri, True, 0.2, True, config=config)
    return out, lse, *grads


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
def test_default_tiles_shrink_until_they_fit_and_are_remembered(limited_gpu):
    results = _forward_backward()
    # Refused: 32x32 with two stages, then 32x32 with one; 16x16 with one stage ran.
    assert limited_gpu["flashmask_fwd_kernel"].refused == 2
    fitted = TileConfig(16, 16, 4, 1, 16, 16, 4, 1, 16, 16, 4, 1)
    assert list(config._FITTED.values()) == [fitted]
    # The same bits as asking for the fitted tiles directly.
    expected = _forward_backward(config=fitted)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results, expected, strict=True):
        assert torch.equal(a, b), name
    # Later calls start from the fitted tiles: nothing more is refused.
    refused = {name: limit.refused for name, limit in limited_gpu.items()}
    _forward_backward()
    assert {name: limit.refused for name, limit in limited_gpu.items()} == refused


@pytest.mark.filterwarnings(INTERPRETER_WARNING)
def test_an_explicit_config_is_never_changed(limited_gpu):
    with pytest.raises(OutOfResources):
        _forward_backward(config=TileConfig(32, 32, 4, 1, 32, 32, 4, 1, 32, 32, 4, 1))
    assert config._FITTED == {}


@pytest.mark.parametrize(
    ("capability", "supported"),
    [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)],
)
def test_gpus_older_than_ampere_run_the_reference(monkeypatch, capability, supported):
    """Compute capability < 8.0 (V100, T4): the kernels are not used (the exact reference runs)
    rather than failing inside Triton's compiler."""
    monkeypatch.setattr(hardware, "capability_of", lambda index: capability)
    assert kernels.device_supported(torch.device("cuda", 0)) is supported
