"""FlashMask's GPU kernels and their launchers.

:func:`forward` and :func:`backward` take validated inputs in the public layout
(``[B, S, H, D]``) and the raw ``startend_row_indices``; the mask is prepared once per mask
tensor (:func:`prepare_cached`: normalised bounds, tile classes and lists, O(N) + O(tiles)) and
reused by every layer and the backward. The package is laid out by role (``docs/design.md``):

* :mod:`.hardware`, :mod:`.config` — what the GPU offers, tile configurations per head dim;
* :mod:`.routing` — which kernel family runs a call (one threshold table);
* :mod:`.preparation`, :mod:`.mask_prep`, :mod:`.tiles` — mask preparation, its Triton kernels
  and its pure-PyTorch reference;
* :mod:`.forward_launcher`, :mod:`.backward_launcher`, :mod:`.query_chunks` — the launchers;
  :mod:`.launch`, :mod:`.tensors` — what they share (cached launches, layouts, descriptors);
* :mod:`.triton_kernels`, :mod:`.gluon_kernels` — the kernel families.

On a CPU-only machine the Triton kernels run through Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI tests them; the public API routes only CUDA tensors
here.
"""

from flashmask.kernels.backward_launcher import backward
from flashmask.kernels.config import (
    TileConfig,
    compact_tile_config,
    shrink_tile_config,
    tile_config,
)
from flashmask.kernels.forward_launcher import forward
from flashmask.kernels.hardware import device_shared_memory, device_supported, supports
from flashmask.kernels.preparation import clear_prepared, prepare, prepare_cached

__all__ = [
    "TileConfig",
    "backward",
    "clear_prepared",
    "compact_tile_config",
    "device_shared_memory",
    "device_supported",
    "forward",
    "prepare",
    "prepare_cached",
    "shrink_tile_config",
    "supports",
    "tile_config",
]
