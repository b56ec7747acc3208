"""Can this Triton warp-specialise a Hopper kernel? An offline sm_90 compile probe, no GPU.

`tl.range(warp_specialize=True)` leaves our Triton loops unpartitioned on sm_90 with Triton 3.6
(benchmarks/NOTES.md, change 12). This compiles a minimal Gluon kernel built the way an FA3-style
backward would be: one producer warp issuing TMA loads into a ring of shared-memory buffers
guarded by mbarriers, and a 4-warp consumer running `warpgroup_mma` on them (a 128 x 128 GEMM
tile over K). It reports whether the PTX reallocates registers between the partitions
(`setmaxnreg`) and whether the SASS has HGMMA and TMA loads (UTMALDG).

Usage: ``python benchmarks/gluon_probe.py`` (seconds on a CPU). Nothing runs on a GPU: whether
the kernel computes the right product is for a GPU session to check.
"""

from cubin import compile_gluon_sm90, inspect_cubin
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, k_tiles, BK: gl.constexpr):
    nbuf: gl.constexpr = a_bufs.type.shape[0]
    for i in range(k_tiles):
        s = i % nbuf
        ph = (i // nbuf) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            a_desc, [gl.program_id(0) * 128, i * BK], ready.index(s), a_bufs.index(s)
        )
        tma.async_copy_global_to_shared(b_desc, [i * BK, 0], ready.index(s), b_bufs.index(s))


@gluon.jit
def consumer(a_bufs, b_bufs, ready, empty, k_tiles, c_ptr, BN: gl.constexpr):
    nbuf: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16]
    )
    acc = gl.zeros([128, BN], gl.float32, acc_layout)
    for i in range(k_tiles):
        s = i % nbuf
        ph = (i // nbuf) & 1
        mbarrier.wait(ready.index(s), ph)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
    rows = gl.arange(0, 128, gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, gl.SliceLayout(0, acc_layout))
    ptrs = c_ptr + (gl.program_id(0) * 128 + rows)[:, None] * BN + cols[None, :]
    gl.store(ptrs, acc)


@gluon.jit
def ws_gemm(a_desc, b_desc, c_ptr, k_tiles, BK: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    a_shape: gl.constexpr = a_desc.block_type.shape
    b_shape: gl.constexpr = b_desc.block_type.shape
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NBUF, a_shape[0], a_shape[1]], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NBUF, b_shape[0], b_shape[1]], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (consumer, (a_bufs, b_bufs, ready, empty, k_tiles, c_ptr, BN)),
            (producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, k_tiles, BK)),
        ],
        [1],
        [24],
    )


BK, BN, NBUF = 64, 128, 3
a_layout = gl.NVMMASharedLayout.get_default_for([128, BK], gl.bfloat16)
b_layout = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
sig = {
    "a_desc": f"tensordesc<bf16[128, {BK}],{a_layout!r}>",
    "b_desc": f"tensordesc<bf16[{BK}, {BN}],{b_layout!r}>",
    "c_ptr": "*fp32",
    "k_tiles": "i32",
}
c = compile_gluon_sm90(ws_gemm, sig, {"BK": BK, "BN": BN, "NBUF": NBUF}, {"num_warps": 4})
dump = inspect_cubin(c, ("HGMMA", "UTMALDG"))
print(
    "setmaxnreg in PTX:",
    c.asm["ptx"].count("setmaxnreg"),
    "| HGMMA in SASS:",
    dump["HGMMA"],
    "| UTMALDG:",
    dump["UTMALDG"],
    "| warps:",
    c.metadata.num_warps,
)
