"""The CuTe forward's host side: the column-major bounds its element mask reads."""

from __future__ import annotations

import torch

from flashmask import masks
from flashmask.kernels import tiles
from flashmask.kernels.cute_kernels import launch


def _bounds(seqlen=300, batch=2):
    mask = masks.example("share_question", seqlen, batch_size=batch)
    return tiles.column_bounds(mask.startend_row_indices, mask.causal, seqlen, seqlen, batch, "cpu")


def test_each_column_holds_its_four_bounds_and_the_padding_hides_every_row():
    bounds = _bounds()
    out = launch.column_major_bounds(bounds, seqlen_q=300, columns=384)
    assert out.shape == (2, 1, 384, 4) and out.dtype == torch.int32 and out.is_contiguous()
    assert torch.equal(out[:, :, :300], bounds.transpose(2, 3))
    # Past Sk: rows [0, Sq) hidden by the lower interval, the upper one empty.
    pad = torch.tensor([0, 300, 0, 0], dtype=torch.int32).expand(2, 1, 84, 4)
    assert torch.equal(out[:, :, 300:], pad)


def test_a_16_byte_column_starts_every_16_bytes():
    out = launch.column_major_bounds(_bounds(), seqlen_q=300, columns=384)
    assert out.stride() == (384 * 4, 384 * 4, 4, 1)


def test_it_is_built_once_per_bounds_tensor_and_rebuilt_after_an_edit():
    bounds = _bounds()
    first = launch.column_major_bounds(bounds, 300, 384)
    assert launch.column_major_bounds(bounds, 300, 384) is first
    assert launch.column_major_bounds(bounds, 300, 448) is not first  # another tile width
    bounds[0, 0, 0, 5] = 7  # in place: the cached copy is stale
    again = launch.column_major_bounds(bounds, 300, 384)
    assert again is not first and again[0, 0, 5, 0] == 7
    assert launch.column_major_bounds(bounds.clone(), 300, 384) is not again
