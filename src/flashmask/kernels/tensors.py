"""Tensor layout helpers the launchers share: strides, padded head dims, TMA descriptors."""

from __future__ import annotations

import torch

from flashmask.kernels import hardware


def tma_usable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether TMA descriptors can describe ``tensors``: a GPU with TMA (or the interpreter),
    16-byte aligned base addresses and strides, unit stride along the head dimension."""
    device = tensors[0].device
    if device.type == "cuda":
        if hardware.capability_of(hardware.cuda_index(device)) < hardware.TMA_CAPABILITY:
            return False
    elif not hardware.interpreting():
        return False
    return all(
        x.data_ptr() % 16 == 0
        and x.stride(-1) == 1
        and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])
        for x in tensors
    )


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous at a 16-byte aligned address (what the Gluon kernels' 2-D TMA
    descriptors need): ``x`` itself when it is, else a copy."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def tma_tiles_safe(block_m: int, block_n: int, block_d: int) -> bool:
    """Whether the forward's TMA tiles ``[block_m, block_d]`` (Q) and ``[block_n, block_d]``
    (K, V) avoid the shape Triton 3.6 miscompiles on the H200: with ``block_n == block_d``
    (hd128 at 128x128 tiles, hd64 at 64x64) the TMA forward returned wrong outputs (max error
    0.2-2.8 in every such case, exact in every other; ``docs/performance.md``). Square
    tiles keep the pointer loads."""
    return block_n != block_d and block_m != block_d


def row_descriptor(x: torch.Tensor, rows: int, block_d: int):
    """A TMA descriptor over ``x [B, S, H, D]`` loading ``[1, rows, 1, block_d]`` blocks (one
    head's ``rows`` consecutive sequence positions); out-of-range elements read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, block_d])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)
