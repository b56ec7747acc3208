"""What the GPU (or the interpreter) offers the kernels: compute capability, shared memory per
block, and which inputs the kernels take at all."""

from __future__ import annotations

import functools
import os

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _shared_memory_of(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


@functools.cache
def _multiprocessors_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Under the interpreter (no GPU): a stand-in SM count, so the split-KV kernels still split.
INTERPRETER_MULTIPROCESSORS = 4


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H100/H200); a small stand-in off CUDA
    (the interpreter), where it only decides how many programs a launch splits into."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return _multiprocessors_of(cuda_index(device))


def device_shared_memory(device: torch.device) -> int | None:
    """Shared memory per block (bytes) a kernel may opt into on ``device``; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    return _shared_memory_of(cuda_index(device))


def cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


# Triton compiles the kernels' fp16/bf16 tensor-core dots and asynchronous copies for compute
# capability 8.0 (Ampere) and newer; older GPUs (V100, T4) run the reference instead.
MIN_CAPABILITY = (8, 0)


@functools.cache
def capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_supported(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: a CUDA GPU of compute capability >= 8.0, or any
    device under Triton's interpreter."""
    if device.type == "cuda":
        return capability_of(cuda_index(device)) >= MIN_CAPABILITY
    return interpreting()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: fp16/bf16, head dims ``D`` (of q and k) and
    ``Dv`` (of v, equal or not: multi-head latent attention runs the Triton kernels) each a
    multiple of 8 in ``[16, 256]``, on a GPU of compute capability >= 8.0.

    Other inputs (float32/float64, other head dims, older GPUs) run the exact reference instead.
    """
    return (
        q.dtype in KERNEL_DTYPES
        and all(x % 8 == 0 and 16 <= x <= MAX_HEAD_DIM for x in (q.shape[-1], v.shape[-1]))
        and device_supported(q.device)
    )


# TMA (the tensor memory accelerator) arrived with Hopper.
TMA_CAPABILITY = (9, 0)


def gpu_capability(q: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of ``q``'s GPU, or ``None`` off the GPU or under the interpreter."""
    if q.device.type != "cuda" or interpreting():
        return None
    return capability_of(cuda_index(q.device))
