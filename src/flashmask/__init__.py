"""FlashMask for PyTorch: exact attention with column-interval masks in O(N) memory."""

from flashmask import masks
from flashmask.attention import flashmask_attention
from flashmask.fp8 import hadamard_rotate, quantize_fp8
from flashmask.mask import (
    FlashMask,
    MaskNotRepresentableError,
    TileClass,
    intersect,
    to_dense,
    validate,
)
from flashmask.varlen import flashmask_varlen_attention

__all__ = [
    "FlashMask",
    "MaskNotRepresentableError",
    "TileClass",
    "flashmask_attention",
    "flashmask_varlen_attention",
    "hadamard_rotate",
    "intersect",
    "masks",
    "quantize_fp8",
    "to_dense",
    "validate",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    # The model-level API needs transformers; import it only when asked for.
    if name in ("apply_flashmask", "remove_flashmask"):
        from flashmask.integrations import policy

        return getattr(policy, name)
    raise AttributeError(f"module 'flashmask' has no attribute {name!r}")
