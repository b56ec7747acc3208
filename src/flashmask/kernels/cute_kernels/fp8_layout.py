"""How the CuTe FP8 forward hands P from the ``S = Q K^T`` accumulator to ``O += P V``, in plain
Python (no ``cutlass`` needed: the launcher's pre-pass and the CPU tests use it too).

An 8-bit ``wgmma`` takes both operands K-major and 32 k indices per instruction; the k indices
of ``P V`` are keys. Per thread (``t = lane % 4``, ``g = lane // 4``; rows ``16 * warp + g`` and
``+ 8``), the PTX ISA's fragments of a 32-key block differ:

* the fp32 accumulator of ``S`` (``wgmma`` D fragment, 8 columns per row per 32 keys): value
  ``4 j + 2 i + c`` is row ``g + 8 i``, key ``8 j + 2 t + c`` (``j``: column group 0..3 of the
  block, ``c``: pair member);
* the 8-bit A fragment of ``P V`` (register A, ``.m64nNk32``): byte ``s`` of its 16 (four 32-bit
  registers) is row ``g + 8 ((s // 4) % 2)``, k index ``4 t + s % 4 + 16 (s // 8)``.

Both give each thread 8 keys of each of its two rows, but not the same 8: thread ``t = 1``
holds keys ``2, 3, 10, 11, 18, 19, 26, 27`` of S and must supply k indices ``4..7, 20..23``.
Instead of moving bytes between threads, each thread fills its A fragment with its own
accumulator values, pair by pair (each ``cvt`` of two fp32 values to an ``e4m3x2`` half-register
is one pair; two pairs make a register, no byte shuffles): A register ``r`` of k-block ``kb`` (bytes
``4 r .. 4 r + 3``) takes accumulator values ``4 j + 2 i + (0, 1)`` of column groups
``j = 4 kb + 2 (r // 2), + 1`` and row half ``i = r % 2``, and the launcher stores V^T with its
keys permuted to match: k index ``kappa`` of each 16-key group holds key
``KEY_ORDER[kappa]``. P V sums over keys, so a reordering applied both to P's columns (how the
fragment is read) and to V^T's rows is exact.

Worked example, thread ``t = 1``, row ``g``, first k-block: A bytes ``s = 0, 1, 2, 3`` (k
indices 4, 5, 6, 7) take accumulator values 0, 1, 4, 5 (keys 2, 3, 10, 11); bytes 8..11 (k
indices 20..23) take values 8, 9, 12, 13 (keys 18, 19, 26, 27). So V^T's k index 4 must hold
key 2, 5 key 3, 6 key 10, 7 key 11, 20 key 18 ...: ``KEY_ORDER[4:8] == (2, 3, 10, 11)``, and
k indices 16..31 repeat the first 16 shifted by 16 (the mapping has period 16).
"""

from __future__ import annotations

# The permutation's period in keys: key tiles (and V^T's padded length) are multiples of it.
KEY_GROUP = 16


def key_of_index(kappa: int) -> int:
    """The key (within its 16-key group) that V^T's k index ``kappa`` (0..15) holds.

    ``kappa = 4 t + q`` is byte ``q`` of thread ``t``'s first A register, which the kernel fills
    with accumulator values ``(0, 1, 4, 5)[q]`` of the column groups ``j = q // 2``: key
    ``8 (q // 2) + 2 t + q % 2``."""
    if not 0 <= kappa < KEY_GROUP:
        raise ValueError(f"kappa must be in [0, {KEY_GROUP}), got {kappa}")
    t, q = divmod(kappa, 4)
    return 8 * (q // 2) + 2 * t + q % 2


# V^T's k index -> key, within each 16-key group:
# (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15).
KEY_ORDER: tuple[int, ...] = tuple(key_of_index(kappa) for kappa in range(KEY_GROUP))


def permuted_keys(num_keys: int) -> list[int]:
    """For each k index of a V^T of ``num_keys`` keys (a multiple of :data:`KEY_GROUP`), the key
    it holds: ``16 (p // 16) + KEY_ORDER[p % 16]``."""
    if num_keys % KEY_GROUP:
        raise ValueError(f"num_keys must be a multiple of {KEY_GROUP}, got {num_keys}")
    return [p - p % KEY_GROUP + KEY_ORDER[p % KEY_GROUP] for p in range(num_keys)]


def fragment_layout(block_n: int) -> tuple[tuple, tuple]:
    """``(shape, stride)`` of the 8-bit A fragment of ``P [64, block_n]`` in registers, compact:
    byte ``s`` (0..15) of 32-key k-block ``kb`` at offset ``s + 16 kb``; modes
    ``((4, 2, 2), M = 1, kb)`` as the MMA atom's value mode ``(q, i, h)``: k index ``4 t + q +
    16 h`` of row half ``i``."""
    if block_n % 32:
        raise ValueError(f"block_n must be a multiple of 32, got {block_n}")
    return ((4, 2, 2), 1, block_n // 32), ((1, 4, 8), 0, 16)


def accumulator_split(block_n: int) -> tuple[tuple, tuple]:
    """``(shape, stride)`` of the score accumulator ``((2, 2, block_n / 8), 1, 1)`` (compact:
    value ``c + 2 i + 4 j``) with its column-group mode ``j`` split as ``(q1, h, kb)``, ``j =
    q1 + 2 h + 4 kb``: the same registers, in modes that :func:`scatter_layout` maps."""
    if block_n % 32:
        raise ValueError(f"block_n must be a multiple of 32, got {block_n}")
    return ((2, 2, (2, 2, block_n // 32)), 1, 1), ((1, 2, (4, 8, 16)), 0, 0)


def scatter_layout(block_n: int) -> tuple[tuple, tuple]:
    """``(shape, stride)`` that sends accumulator value ``(c, i, (q1, h, kb))`` (the modes of
    :func:`accumulator_split`) to its byte of the A fragment (:func:`fragment_layout`):
    ``s = q + 4 i + 8 h`` with ``q = c + 2 q1``, at offset ``c + 2 q1 + 4 i + 8 h + 16 kb``.
    Pair members ``c`` stay adjacent: each ``cvt`` of two fp32 values fills one half of a
    32-bit register, and column groups ``j = 4 kb + 2 h + q1`` fill the halves in turn."""
    if block_n % 32:
        raise ValueError(f"block_n must be a multiple of 32, got {block_n}")
    return ((2, 2, (2, 2, block_n // 32)), 1, 1), ((1, 4, (2, 8, 16)), 0, 0)
