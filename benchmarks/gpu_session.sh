#!/usr/bin/env bash
# One device call, several measurement steps: each step runs under its own time limit and writes
# its files to $OUT, so a step that overruns loses only itself. Run from the repository root:
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh check-quick bench-hd128 tune-dq
#
# Steps:
#   check-quick   gpu_check.py --quick as two processes (masks, shapes), merged (~230 s cold)
#   check-full    the same without --quick (all head dims)
#   bench-hd128   flashmask bench, 8K and 32K, hd128, 12 masks (~290 s cold: STEP_TIMEOUT=330)
#   bench-hd128-8k the same at 8K only (~150 s)
#   bench-hd128-fc the same, full and causal only (~60 s)
#   gluon-dq-before-dk gluon_backward.py timing dK's product after dQ's (DQ_BEFORE_DK=1,
#                 FlashAttention-3/4's order) against the shipped order at 8K and 32K on six
#                 masks; its GPU check: GLUON_BWD=DQ_BEFORE_DK=1 ... check-dq-tma
#   bwd-timeline  bwd_timeline.py: where the Gluon backward's items spend their time (phase
#                 stamps, gluon_bwd.TIMELINE), per item and persistent, 8K on four masks and 32K
#                 on two
#   gluon-early-kv gluon_backward.py at 8K and 32K: the persistent backward with its K/V
#                 released before the drain (gluon_bwd.EARLY_KV_RELEASE) against the persistent
#                 form and the shipped one; then bwd_timeline.py of both persistent forms; its
#                 check: GLUON_BWD=PERSISTENT=1,MAX_PROGRAMS=3,EARLY_KV_RELEASE=1 check-gluon-bwd
#   dq-first-store gluon_backward.py at 8K and 32K: gluon_bwd.DQ_FIRST_STORE (dQ tiles stored by
#                 their first writer, no zeroed accumulator) against the shipped backward, then
#                 dq_first_store_stress.py (20 calls per case against the shipped dQ); its
#                 check: GLUON_BWD=DQ_FIRST_STORE=1 check-gluon-bwd; dq-first-store-repeat the
#                 A/B again with a copy of the shipped form as a variant (the run's noise) and
#                 form 2 (the claim before the hand-over), then form 2's stress run
#   cached-launch cached_launch.py: kernels.launch's cached launches against Triton's launch path
#                 (bitwise results, host time per call) at 8K, hd128 with 16 and 4 key/value
#                 heads on five masks, then hd64 and hd256 on two
#   launch-costs  launch_costs.py (the host cost of a launch's pieces and of every launch of an
#                 8K sliding_window forward + backward in each launch setting), then
#                 cached_launch.py at 8K hd128 on four masks: Triton's path, cached, cached with
#                 raw addresses (launch.RAW_POINTERS), flex in the same rounds
#   gluon-dkdv-tma gluon_backward.py at hd128 and hd64, 8K and 32K: dK/dV through shared memory
#                 and TMA stores (DKDV_TMA=1) against the stores from registers; its GPU check:
#                 GLUON_BWD=DKDV_TMA=1 ... check-dq-tma
#   gluon-dkdv-tma-hd256 gluon_backward.py at hd256, 8K and 32K: gluon_bwd256.DKDV_TMA=1 (the
#                 prepared TMA dK/dV stores) against the shipped stores from registers;
#                 check-dkdv-tma-hd256: the quick check with it on (gpu_check --gluon-bwd256)
#   gluon-dkdv-tma-precise full and causal at 32K, hd128 and hd64, 1 s per measurement: the
#                 shipped DKDV_TMA against DKDV_TMA=0
#   gluon-dkdv-tma-long causal, qk_sparse, prefix_lm_causal at 32K hd128, 1 s per measurement:
#                 DKDV_TMA against DKDV_TMA=0
#   gluon-dk-first-hd64 gluon_backward.py at head dim 64, 8K and 32K: the shipped order (dQ's
#                 product before dK's) against dK first (DQ_BEFORE_DK=0)
#   dq-zeroing    dq_zeroing.py: change 31 (the delta kernel zeroing dQ's accumulator) against a
#                 separate zeroing launch, alternating, 8K and 32K, 16 and 4 key/value heads
#   host-gqa      host_overhead.py --kernels at 8K with 4 key/value heads: host vs GPU time and
#                 the GPU time per kernel of sliding_window and share_question
#   bench-hd128-gqa-sw flashmask bench at 8K, 4 key/value heads, the three sliding-window-like
#                 masks only (FlashMask and flex)
#   bench-hd128-dense flashmask bench, full and causal at 8K, 32K and 128K, hd128, with at
#                 least 10 timed calls per measurement (~250 s)
#   bench-hd256   flashmask bench, 32K, hd256 (~140 s); bench-hd256-8k the same at 8K (~85 s)
#   bench-hd256-128k flashmask bench, 128K, hd256, six masks; bench-hd256-128k-b the other six
#   bench-hd64    flashmask bench, 8K and 32K, hd64, 12 masks (~290 s cold: STEP_TIMEOUT=330);
#                 bench-hd64-32k the same at 32K only, bench-hd64-8k at 8K only (~150 s)
#   program-order program_order.py: the kernels' programs longest lists first
#                 (kernels.program_order) against the grid's order, 12 masks at 8K and 32K,
#                 16 heads and 16:4 grouped-query heads (bitwise checks and times)
#   order-cost    order_cost.py: a new mask's lists alone, with both launch orders in one launch
#                 and in two (GPU time, host queued ahead), six masks at 8K and 32K, 16 and 4
#                 key/value heads
#   program-order-masks program-order on the ten masks with a mask (full and causal keep the
#                 grid's order)
#   bench-hd128-gqa flashmask bench, 8K and 32K, hd128, 12 masks, 16 query heads sharing 4
#                 key/value heads (grouped-query attention; ~290 s cold)
#   tune-dq       tune.py --set dq at 8K for hd128 and hd256 (dQ-pass variants)
#   tma-check     tma_check.py at 8K for hd64 and hd128
#   gluon-forward gluon_forward.py: the warp-specialised Gluon forward against the Triton one
#   gluon-backward gluon_backward.py: the Gluon backward (dK/dV/dQ in one pass) against Triton's
#   bench-hd128-re32k flashmask bench, 32K, hd128, random_eviction only
#   bench-hd128-nomask flashmask bench, 8K and 32K, hd128, full and causal only
#   gluon-forward-tiles gluon_forward.py with 128x128 and 128x64 tiles, 2 and 3 K/V buffers
#   gluon-hd256   gluon_forward.py at head dim 256 (128x64 tiles, two slots)
#   gluon-hd64    gluon_forward.py and gluon_backward.py at head dim 64
#   check-full-gluon gpu_check.py (all head dims) with every eligible case on the Gluon kernels
#                 (STEP_TIMEOUT=450: ~350 s cold)
#   bench-hd128-128k-a / -b flashmask bench at 128K, hd128, six masks each (with 5 timed calls
#                 per measurement up to ~400 s each: one step per device call)
#   gluon-backward-re gluon_backward.py at 32K on random_eviction (a mask per head group)
#   check-gluon   gpu_check.py --quick (both parts) with every eligible case on the Gluon forward
#                 and every eligible deterministic=False one on the Gluon backward
#                 (--gluon-everywhere: the check's 1K masks are below the library's 4K-32K limits;
#                 --variant fwd_gluon=1 up to head dim 256: the forward at hd64 and hd256 too)
#   check-gluon-q2 check-gluon-programs with gluon_fwd.Q_BUFFERS=2 and two K/V slots
#   gluon-q-buffers gluon-versions of the library against itself with Q_BUFFERS=2 (two slots)
#                 and with two slots alone (BASELINE=FILE)
#   check-gluon-programs check-gluon with gluon_fwd.MAX_PROGRAMS=3 (the persistent forward's
#                 programs each loop over many of a case's query tiles)
#   gluon-forward-masks gluon_forward.py on all 12 masks at 8K and 32K (routing data)
#   check-mixed   check-gluon's cases with the Triton forward before the Gluon backward (the
#                 route masked hd64 calls from 8K keys take)
#   gluon-backward-dq-bound gluon_backward.py on full, causal and document, then the same timed with
#                 the dQ atomics compiled out (--no-dq-writes: what the dQ writes cost at most)
#   gluon-backward-variants gluon_backward.py timing dQ through the red.global writer (DQ_TMA=0),
#                 three Q/dO slots with one dQ buffer, and both, against the default (TMA)
#   gluon-row-terms gluon_backward.py timing the producer-staged lse/delta rows
#                 (ROW_TERMS_SMEM=1) against the default at 8K and 32K on six masks; its GPU
#                 check: GLUON_BWD=ROW_TERMS_SMEM=1 ... check-dq-tma
#   gluon-row-terms-modes gluon_backward.py timing ROW_TERMS_SMEM's forms (1: lse read after
#                 the scores are issued; 2: the lse staged ready to use and read before; 3: as 2
#                 with delta read once the scores are in) at hd128, and 2 and 3 at hd256 and hd64
#   gluon-routing gluon_backward.py on all 12 masks at hd64 8K (the default row-term form against
#                 forms 0 and 2) and at hd128 4K: the data for the Gluon backward's masked limits
#   gluon-query-chunks gluon_backward.py on full attention split into query chunks
#                 (kernels.query_chunks) against one launch (QUERY_CHUNK_BYTES=0): hd128 at 64K and
#                 128K, hd256 at 32K and 128K; then flashmask bench on full at 128K, hd128
#   gluon-chunks-add gluon_backward.py on full attention at 64K and 128K with the chunks' dK/dV
#                 added in the kernel (gluon_bwd.CHUNKS_ADD_IN_KERNEL=1), also split at 64K
#   gluon-o-tma   gluon_forward.py --o-tma-ab at hd128 and hd64, 8K and 32K, five masks: the
#                 forward's O through TMA stores (gluon_fwd.O_TMA) against the stores from
#                 registers; check-o-tma: the quick check with every eligible case on the Gluon
#                 kernels and O_TMA on
#   check-dq-tma  check-gluon's cases with gluon_bwd.DQ_TMA as given (GLUON_BWD=..., default
#                 DQ_TMA=0: the red.global writer, e.g. GLUON_BWD=NUM_BUFFERS=3,DQ_BUFFERS=1)
#   ncu-backward  Nsight Compute on one 32K full backward call, ours (the Gluon kernel) and SDPA's
#                 (cuDNN's flash_bprop): speed of light, compute and memory workload, warp
#                 stalls, occupancy (profile_backward.py; ncu needs the Firecracker runtime)
#   ncu-backward-128k Nsight Compute's memory sections on the hd128 backward: full at 32K and
#                 128K, causal at 128K (is the 128K full backward waiting on HBM?)
#   ncu-backward-sparse Nsight Compute on the hd128 backward: sliding_window at 8K and 32K and
#                 causal at 32K (SM active cycles, warp states, occupancy, memory), then the
#                 per-instruction stall samples of 8K sliding_window (gzipped CSV)
#   ncu-forward-o-tma Nsight Compute on the hd128 Gluon forward, full attention at 8K, O stored
#                 from registers (O_TMA=0) and through TMA (O_TMA=1): why full lost 1.6-3.3%
#                 with the TMA stores (twentieth session)
#   ncu-backward-source Nsight Compute's warp-state sampling per SASS instruction on one 32K full
#                 hd128 backward call (ours): ncu_backward_source.ncu-rep and its source page as CSV
#                 (ncu_backward_source.log)
#   tune-launch-hd256 tune.py --set launch at 8K, hd256: the Triton forward with TMA loads (never
#                 measured at hd256) and other tiles, against the shipped pointer-loaded 128x64
#   tune-dq-hd256 tune.py --set dq at 8K, hd256 only: the Triton backward's one-grid forms (dQ pass
#                 at 8 warps, with/without TMA; dK/dV 32x64) against the shipped two launches
#   gluon-hd256-bwd gluon_backward.py --head-dim 256: the head-dim-256 Gluon backward against the
#                 Triton hd256 backward at 8K and 32K, and with the red.global dQ writer
#   gluon-late-dq gluon_backward.py with the dQ hand-off after the next tile's products are
#                 issued (LATE_DQ_HANDOFF=1, 2) at hd128, and at hd64 with row-term form 2
#   gluon-late-dq-precise the default (LATE_DQ_HANDOFF=2) against 0 and 1 on full and causal
#                 at 8K and 32K, with do_bench over 1 s; gluon-chunks-add-128k CHUNKS_ADD_IN_KERNEL
#                 at 128K full with its error against the Triton backward
#   check-gluon-bwd the quick check's Gluon cases with GLUON_BWD=NAME=V[,...] set on gluon_bwd
#   gluon-bwd-persistent gluon_backward.py with the dynamic persistent backward
#                 (gluon_bwd.PERSISTENT=1) against one program per item: 12 masks at 8K, five
#                 at 32K (dK/dV bitwise); check-gluon-bwd-persistent: the quick check's Gluon
#                 cases with it on three programs (so that each loops over many items);
#                 gluon-bwd-persistent-hd64: the A/B at head dim 64, 12 masks at 8K
#   program-overhead program_overhead.py at 8K and 32K: each forward's and backward's fixed
#                 cost per program and cost per tile, fitted over sliding windows of 128-8K keys
#   gluon-forward-8k gluon_forward.py on all 12 masks at 8K (Gluon against Triton forward)
#   gluon-forward-routing gluon_forward.py on all 12 masks at 8K and 16K, hd128 (routing data
#                 for GLUON_FWD_MIN_MASKED_SEQLEN with the shipped O_TMA)
#   gluon-16k     both Gluon comparison scripts at 16K (the routing limit for masks, chosen
#                 between the 8K and 32K measurements but never measured itself) on sparse masks
#   gluon-hd64-short gluon_forward.py at head dim 64 on full and causal at 2K and 8K
#   host-overhead host_overhead.py at 8K, hd128: host enqueue time against GPU time per call
#                 (FlashMask with its mask prepared per call and cached, flex), on five masks;
#                 host-profile: the same on sliding_window with a cProfile of calls that prepare
#                 their mask, as the bench times them;
#                 kernel-times: the same with each kernel's GPU time per call (five 8K masks);
#                 host-breakdown: the same with the host time inside named library functions;
#                 host-routes: the same with the Gluon forward's masked limit at 8K and 32K;
#   eager-check   eager_check.py: flashmask_attention's autograd.Function path against the
#                 custom ops on the GPU kernels (bitwise), and the host time of each
#   gluon-forward-short gluon_forward.py on all 12 masks, hd128 at 4K-16K, hd64 at 4K-32K (the
#                 masked routing limit's data)
#   gluon-versions gluon_forward_versions.py: BASELINE=FILE (a gluon_fwd.py) against the
#                 library's Gluon forward or CANDIDATES=a.py,b.py, 12 masks at 8K and 32K
#   host-costs    host_costs.py: each phase of a Triton launch's host time, per kernel, and the
#                 library's Python layers alone (stand-in kernels), cached 8K calls
# STEP_TIMEOUT (seconds) bounds each step: default 280, and 380 for the GPU checks (the ninth
# session's quick check needed ~330 s cold after it gained the hd256 fp16 and Sq != Sk cases).
#
# COMPILE_CACHE=DIR (a folder the device call carries, e.g. an ignored .tcache/): each call starts
# on a bare machine and compiling costs ~200 s of the session's 30 minutes. With it set, the
# Triton and Inductor caches are unpacked from DIR/compile_cache.tgz first and packed into
# $OUT/compile_cache.tgz at the end for the next call to carry: the Triton cache without its
# intermediate forms (a kernel loads from its cubin and metadata; the LLVM IR alone made the
# ninth session's unpruned pack 44 MiB). A pack over the device's 15 MiB per file comes back in
# up to three 14 MiB parts ($OUT/compile_cache.tgz.part0, ...: copy them all into DIR; the next
# call unpacks DIR/compile_cache.tgz or, without it, the parts), and is dropped above 42 MiB.
set -uo pipefail
: "${OUT:?set OUT to the folder that receives the results}"
export PYTHONPATH=src
limit=${STEP_TIMEOUT:-280}
check_limit=${STEP_TIMEOUT:-380}
if [ -n "${COMPILE_CACHE:-}" ]; then
    export TRITON_CACHE_DIR=/tmp/fm_cache/triton TORCHINDUCTOR_CACHE_DIR=/tmp/fm_cache/inductor
    mkdir -p /tmp/fm_cache
    if [ -f "$COMPILE_CACHE/compile_cache.tgz" ]; then
        tar -xzf "$COMPILE_CACHE/compile_cache.tgz" -C /tmp/fm_cache &&
            echo "== compile cache: unpacked $(du -sh /tmp/fm_cache | cut -f1)"
    elif [ -f "$COMPILE_CACHE/compile_cache.tgz.part0" ]; then
        cat "$COMPILE_CACHE"/compile_cache.tgz.part* | tar -xz -C /tmp/fm_cache &&
            echo "== compile cache: unpacked $(du -sh /tmp/fm_cache | cut -f1) from parts"
    fi
    pack_cache() {
        local pack=$OUT/compile_cache.tgz size
        tar -czf "$pack" -C /tmp/fm_cache --exclude='*.llir' --exclude='*.ptx' \
            --exclude='*.ttgir' --exclude='*.ttir' --exclude='*.source' --exclude='*.glir' . \
            2>/dev/null
        size=$(stat -c %s "$pack")
        echo "== compile cache: packed $((size / 1048576)) MiB"
        if [ "$size" -ge 44040192 ]; then
            rm -f "$pack"
        elif [ "$size" -ge 15728640 ]; then
            split -b 14m -d -a 1 "$pack" "$pack.part" && rm -f "$pack" &&
                echo "== compile cache: in $(ls "$pack".part* | wc -l) parts"
        fi
    }
    trap pack_cache EXIT
fi

run_step() {
    local name=$1
    shift
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - start)) s"
    grep -v -i warn "$OUT/$name.log" | tail -n 8
}

check() {
    local flags=$1 tag=$2  # gpu_check.py options, split into words on purpose
    # Two processes compile in parallel; wait for exactly these two (a pattern match on the
    # process table would also match this shell's own command line).
    timeout "$check_limit" python benchmarks/gpu_check.py $flags --part masks --out "$OUT/$tag-masks.json" \
        >"$OUT/$tag-masks.log" 2>&1 &
    local masks=$!
    timeout "$check_limit" python benchmarks/gpu_check.py $flags --part shapes \
        --out "$OUT/$tag-shapes.json" >"$OUT/$tag-shapes.log" 2>&1 &
    local shapes=$!
    wait "$masks" "$shapes"
    # A part that ran out of time wrote no JSON: say so instead of a merge traceback.
    for part in masks shapes; do
        [ -f "$OUT/$tag-$part.json" ] || echo "== $tag: the $part part did not finish (see its log)"
    done
    # The device returns at most 8 files: keep the merged JSON (it holds every case) and the
    # logs, drop the parts once merged.
    python benchmarks/gpu_check.py --merge "$OUT/$tag-masks.json" "$OUT/$tag-shapes.json" \
        --out "$OUT/$tag.json" | tail -n 14 &&
        rm -f "$OUT/$tag-masks.json" "$OUT/$tag-shapes.json"
    grep -h FAIL "$OUT/$tag-masks.log" "$OUT/$tag-shapes.log" | head -n 5 | cut -c1-400
}

versions() {
    local baseline=$1 candidates=$2 start=$SECONDS group
    # The kernels compile first in three processes at once (one mask group each, one short run
    # of every form), so that the timed process, alone on the GPU, finds them in the cache.
    for group in full,causal,sliding_window,causal_document \
        document,share_question,global_sliding_window,causal_blockwise \
        prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction; do
        timeout "$limit" python benchmarks/gluon_forward_versions.py --baseline "$baseline" \
            --candidates "$candidates" --masks "$group" --rep-ms 1 >/dev/null 2>&1 &
    done
    wait
    echo "== gluon-versions: compiled in $((SECONDS - start)) s"
    run_step gluon_forward_versions python benchmarks/gluon_forward_versions.py \
        --baseline "$baseline" --candidates "$candidates"
}

for step in "$@"; do
    case $step in
    check-quick) check --quick gpu_check_quick ;;
    check-full) check "" gpu_check_full ;;
    bench-hd128)
        run_step bench_hd128 python -m flashmask bench --seqlens 8192,32768 --head-dims 128 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128"
        ;;
    bench-hd128-fc)
        run_step bench_hd128_fc python -m flashmask bench --seqlens 8192,32768 --head-dims 128 \
            --masks full,causal --rep-ms 100 --out "$OUT/bench_hd128_fc"
        ;;
    bench-hd128-8k)
        run_step bench_hd128_8k python -m flashmask bench --seqlens 8192 --head-dims 128 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128_8k"
        ;;
    gluon-dq-before-dk)
        run_step gluon_backward_dq_before_dk python benchmarks/gluon_backward.py \
            --seqlens 8192,32768 --variant DQ_BEFORE_DK=1
        ;;
    bwd-timeline)
        # Compile first, one process per kernel form at once (stamps and none, both program
        # forms), so that the timed run finds them in the cache.
        for masks in full sliding_window; do
            timeout "$limit" python benchmarks/bwd_timeline.py --seqlens 8192 --masks $masks \
                --variant PERSISTENT=1 --rep-ms 1 >/dev/null 2>&1 &
        done
        wait
        run_step bwd_timeline python benchmarks/bwd_timeline.py --seqlens 8192 \
            --masks sliding_window,share_question,causal_document,full --variant PERSISTENT=1 \
            --rep-ms 50 --out "$OUT/bwd_timeline_8k.json"
        run_step bwd_timeline_32k python benchmarks/bwd_timeline.py --seqlens 32768 \
            --masks sliding_window,full --variant PERSISTENT=1 --rep-ms 50 \
            --out "$OUT/bwd_timeline_32k.json"
        ;;
    gluon-early-kv)
        # gluon_bwd.EARLY_KV_RELEASE against the persistent form it changes and the shipped
        # one, then the phase stamps of both persistent forms.
        run_step gluon_backward_early_kv python benchmarks/gluon_backward.py \
            --seqlens 8192,32768 --variant PERSISTENT=1 \
            --variant PERSISTENT=1,EARLY_KV_RELEASE=1
        run_step bwd_timeline_early_kv python benchmarks/bwd_timeline.py --seqlens 8192 \
            --masks sliding_window,share_question,causal_document --variant PERSISTENT=1 \
            --variant PERSISTENT=1,EARLY_KV_RELEASE=1 --rep-ms 50 \
            --out "$OUT/bwd_timeline_early_kv.json"
        ;;
    dq-first-store)
        # gluon_bwd.DQ_FIRST_STORE (no zeroed dQ accumulator: each tile's first writer stores it)
        # against the shipped backward, then repeated calls checked for lost updates.
        run_step gluon_backward_first_store python benchmarks/gluon_backward.py \
            --seqlens 8192,32768 --variant DQ_FIRST_STORE=1
        run_step dq_first_store_stress python benchmarks/dq_first_store_stress.py \
            --seqlens 8192,32768 --repeats 20
        ;;
    dq-first-store-repeat)
        # The same A/B again with a copy of the shipped form (DQ_FIRST_STORE=0: the run's own
        # noise) and form 2 as further variants, then form 2's stress run.
        run_step gluon_backward_first_store_b python benchmarks/gluon_backward.py \
            --seqlens 8192,32768 --variant DQ_FIRST_STORE=1 --variant DQ_FIRST_STORE=0 \
            --variant DQ_FIRST_STORE=2
        run_step dq_first_store_stress_2 python benchmarks/dq_first_store_stress.py \
            --seqlens 8192,32768 --repeats 20 --form 2
        ;;
    cached-launch)
        run_step cached_launch python benchmarks/cached_launch.py --head-dims 128 --kv-heads 16,4
        run_step cached_launch_hd64_hd256 python benchmarks/cached_launch.py --head-dims 64,256 \
            --kv-heads 16 --masks sliding_window,causal
        ;;
    launch-costs)
        run_step launch_costs python benchmarks/launch_costs.py --masks sliding_window,full
        run_step cached_launch_raw python benchmarks/cached_launch.py --head-dims 128 \
            --kv-heads 16 --masks sliding_window,share_question,causal_document,full
        ;;
    gluon-dkdv-tma)
        run_step gluon_backward_dkdv_tma python benchmarks/gluon_backward.py \
            --seqlens 8192,32768 --variant DKDV_TMA=1
        run_step gluon_backward_dkdv_tma_hd64 python benchmarks/gluon_backward.py --head-dim 64 \
            --seqlens 8192,32768 --variant DKDV_TMA=1
        ;;
    gluon-dkdv-tma-hd256)
        run_step gluon_backward_dkdv_tma_hd256 python benchmarks/gluon_backward.py \
            --head-dim 256 --seqlens 8192,32768 --variant DKDV_TMA=1
        ;;
    gluon-dkdv-tma-precise)
        # Full and causal at 32K (lists of 256-512 tiles: the epilogue amortised), 1 s per
        # measurement: the shipped TMA stores against the stores from registers.
        for d in 128 64; do
            run_step "gluon_backward_dkdv_tma_precise_hd$d" python benchmarks/gluon_backward.py \
                --head-dim "$d" --seqlens 32768 --masks full,causal --rep-ms 1000 \
                --variant DKDV_TMA=0
        done
        ;;
    gluon-dkdv-tma-long)
        # The long-list masks whose bench entries moved -0.5..-2.5% with DKDV_TMA (s19), 1 s
        # per measurement, hd128 32K.
        run_step gluon_backward_dkdv_tma_long python benchmarks/gluon_backward.py \
            --seqlens 32768 --masks causal,qk_sparse,prefix_lm_causal --rep-ms 1000 \
            --variant DKDV_TMA=0
        ;;
    gluon-dk-first-hd64)
        run_step gluon_backward_dk_first_hd64 python benchmarks/gluon_backward.py --head-dim 64 \
            --seqlens 8192,32768 --variant DQ_BEFORE_DK=0
        ;;
    dq-zeroing)
        run_step dq_zeroing python benchmarks/dq_zeroing.py --seqlens 8192,32768 --kv-heads 16,4
        ;;
    host-gqa)
        run_step host_gqa python benchmarks/host_overhead.py --seqlens 8192 --kv-heads 4 \
            --masks sliding_window,share_question --kernels
        ;;
    bench-hd128-gqa-sw)
        run_step bench_hd128_gqa_sw python -m flashmask bench --seqlens 8192 --head-dims 128 \
            --kv-heads 4 --masks sliding_window,share_question,global_sliding_window \
            --impls flashmask,flex --rep-ms 100 --out "$OUT/bench_hd128_gqa_sw"
        ;;
    bench-hd256)
        run_step bench_hd256_32k python -m flashmask bench --seqlens 32768 --head-dims 256 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd256_32k"
        ;;
    bench-hd64)
        run_step bench_hd64 python -m flashmask bench --seqlens 8192,32768 --head-dims 64 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd64"
        ;;
    bench-hd64-32k)
        run_step bench_hd64_32k python -m flashmask bench --seqlens 32768 --head-dims 64 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd64_32k"
        ;;
    bench-hd64-8k)
        run_step bench_hd64_8k python -m flashmask bench --seqlens 8192 --head-dims 64 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd64_8k"
        ;;
    program-order)
        run_step program_order python benchmarks/program_order.py --seqlens 8192,32768 \
            --kv-heads 16,4
        ;;
    order-cost)
        run_step order_cost python benchmarks/order_cost.py --seqlens 8192,32768 --masks \
            sliding_window,causal_document,share_question,global_sliding_window,qk_sparse,random_eviction
        run_step order_cost_gqa python benchmarks/order_cost.py --seqlens 8192,32768 --kv-heads 4 \
            --masks sliding_window,global_sliding_window,share_question
        ;;
    program-order-masks)
        run_step program_order python benchmarks/program_order.py --seqlens 8192,32768 \
            --kv-heads 16,4 --masks sliding_window,causal_document,document,share_question,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction
        ;;
    bench-hd128-gqa)
        run_step bench_hd128_gqa python -m flashmask bench --seqlens 8192,32768 --head-dims 128 \
            --kv-heads 4 --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128_gqa"
        ;;
    bench-hd256-128k)
        run_step bench_hd256_128k python -m flashmask bench --seqlens 131072 --head-dims 256 \
            --masks full,causal,causal_document,document,share_question,sliding_window \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd256_128k"
        ;;
    bench-hd256-128k-b)
        run_step bench_hd256_128k_b python -m flashmask bench --seqlens 131072 --head-dims 256 \
            --masks global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd256_128k_b"
        ;;
    bench-hd256-8k)
        run_step bench_hd256_8k python -m flashmask bench --seqlens 8192 --head-dims 256 \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd256_8k"
        ;;
    tune-dq)
        run_step tune_dq python benchmarks/tune.py --set dq --seqlen 8192 --head-dims 128,256 \
            --masks full,causal,causal_document,share_question --rounds 2 --rep-ms 50
        ;;
    tma-check)
        run_step tma_check python benchmarks/tma_check.py --head-dims 64,128 \
            --masks full,causal,causal_document
        ;;
    gluon-forward)
        run_step gluon_forward python benchmarks/gluon_forward.py --seqlens 8192,32768
        ;;
    gluon-backward)
        run_step gluon_backward python benchmarks/gluon_backward.py --seqlens 8192,32768
        ;;
    bench-hd128-re32k)
        run_step bench_hd128_re32k python -m flashmask bench --seqlens 32768 --head-dims 128 \
            --masks random_eviction --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128_re32k"
        ;;
    bench-hd128-dense)
        # Full and causal against SDPA at 8K, 32K and 128K with at least 10 timed calls per
        # measurement (at 100 ms a 32K call is timed 3 times, a 128K call once).
        run_step bench_hd128_dense python -m flashmask bench --seqlens 8192,32768,131072 \
            --head-dims 128 --masks full,causal --rep-ms 100 --min-repeats 10 \
            --dense-limit-gb 0.5 --out "$OUT/bench_hd128_dense"
        ;;
    check-full-gluon)
        check "--gluon-everywhere --variant fwd_gluon=1 --variant-max-head-dim 256" \
            gpu_check_full_gluon
        ;;
    check-gluon)
        check "--quick --gluon-everywhere --variant fwd_gluon=1 --variant-max-head-dim 256" \
            gpu_check_gluon
        ;;
    check-gluon-programs)
        # check-gluon with the persistent Gluon forward on at most 3 programs, so that each
        # loops over many query tiles (the check's cases have fewer tiles than the SMs).
        check "--quick --gluon-everywhere --variant fwd_gluon=1 --variant-max-head-dim 256 \
            --gluon-fwd MAX_PROGRAMS=3" gpu_check_gluon_programs3
        ;;
    check-gluon-q2)
        # check-gluon with the prepared two-Q-buffer forward (gluon_fwd.Q_BUFFERS=2 beside two
        # K/V slots), on three programs so that each loops.
        check "--quick --gluon-everywhere --variant fwd_gluon=1 --variant-max-head-dim 256 \
            --gluon-fwd MAX_PROGRAMS=3,Q_BUFFERS=2 --gluon-fwd-slots 2" gpu_check_gluon_q2
        ;;
    gluon-q-buffers)
        # BASELINE=FILE (the shipped gluon_fwd.py): the library's forward against itself with
        # two Q buffers and two K/V slots, and with three slots, 12 masks at 8K and 32K.
        versions "${BASELINE:?set BASELINE}" "library,library@Q_BUFFERS=2+slots=2,library@slots=2"
        ;;
    check-mixed)
        check "--quick --gluon-everywhere --variant fwd_gluon=0 --variant-max-head-dim 256" \
            gpu_check_mixed
        ;;
    gluon-backward-dq-bound)
        run_step gluon_backward_dq python benchmarks/gluon_backward.py --masks full,causal,document
        run_step gluon_backward_no_dq python benchmarks/gluon_backward.py --no-dq-writes \
            --masks full,causal,document
        ;;
    gluon-backward-variants)
        run_step gluon_backward_variants python benchmarks/gluon_backward.py \
            --variant DQ_TMA=0 --variant NUM_BUFFERS=3,DQ_BUFFERS=1 \
            --variant DQ_TMA=0,NUM_BUFFERS=3,DQ_BUFFERS=1 \
            --masks full,causal,document,causal_document,share_question,sliding_window
        ;;
    gluon-row-terms)
        run_step gluon_backward_row_terms python benchmarks/gluon_backward.py \
            --variant ROW_TERMS_SMEM=1 \
            --masks full,causal,document,causal_document,share_question,sliding_window
        ;;
    gluon-row-terms-modes)
        run_step gluon_backward_row_terms_modes python benchmarks/gluon_backward.py \
            --variant ROW_TERMS_SMEM=1 --variant ROW_TERMS_SMEM=2 --variant ROW_TERMS_SMEM=3 \
            --masks full,causal,document,causal_document,share_question,sliding_window
        run_step gluon_backward_row_terms_hd256 python benchmarks/gluon_backward.py --head-dim 256 \
            --variant ROW_TERMS_SMEM=2 --variant ROW_TERMS_SMEM=3 \
            --masks full,causal,document,causal_document,share_question,sliding_window
        run_step gluon_backward_row_terms_hd64 python benchmarks/gluon_backward.py --head-dim 64 \
            --variant ROW_TERMS_SMEM=2 --variant ROW_TERMS_SMEM=3 \
            --masks full,causal,document,share_question,sliding_window
        ;;
    gluon-routing)
        all=full,causal,sliding_window,causal_document,document,share_question
        all=$all,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal
        all=$all,qk_sparse,random_eviction
        run_step gluon_backward_hd64_8k python benchmarks/gluon_backward.py --head-dim 64 \
            --seqlens 8192 --masks "$all" --variant ROW_TERMS_SMEM=0 --variant ROW_TERMS_SMEM=2
        run_step gluon_backward_hd128_4k python benchmarks/gluon_backward.py --seqlens 4096 \
            --masks "$all"
        ;;
    gluon-query-chunks)
        run_step gluon_backward_chunks_hd128 python benchmarks/gluon_backward.py \
            --seqlens 65536,131072 --masks full --variant QUERY_CHUNK_BYTES=0
        run_step gluon_backward_chunks_hd256 python benchmarks/gluon_backward.py --head-dim 256 \
            --seqlens 32768,131072 --masks full --variant QUERY_CHUNK_BYTES=0
        run_step bench_hd128_128k_full python -m flashmask bench --seqlens 131072 \
            --head-dims 128 --masks full --rep-ms 100 --dense-limit-gb 0.5 \
            --out "$OUT/bench_hd128_128k_full"
        ;;
    gluon-late-dq)
        # The dQ hand-off after the next tile's score products are issued: LATE_DQ_HANDOFF=1
        # (the dQ stored after the tile's products, published after the next tile's issue), 2
        # (the Q/dO slot released there too); at hd64 also row-term form 2 and both.
        run_step gluon_backward_late_dq python benchmarks/gluon_backward.py \
            --variant LATE_DQ_HANDOFF=1 --variant LATE_DQ_HANDOFF=2 \
            --masks full,causal,document,causal_document,share_question,sliding_window
        run_step gluon_backward_late_dq_hd64 python benchmarks/gluon_backward.py --head-dim 64 \
            --variant LATE_DQ_HANDOFF=2 --variant ROW_TERMS_SMEM=2 \
            --variant ROW_TERMS_SMEM=2,LATE_DQ_HANDOFF=2 \
            --masks full,causal,document,share_question,sliding_window
        ;;
    gluon-late-dq-precise)
        # Full and causal with ten times the timing window: the forms' differences there are
        # within a 100 ms window's noise.
        run_step gluon_backward_late_dq_precise python benchmarks/gluon_backward.py \
            --rep-ms 1000 --masks full,causal --variant LATE_DQ_HANDOFF=0 \
            --variant LATE_DQ_HANDOFF=1
        ;;
    gluon-chunks-add-128k)
        # The in-kernel accumulation at 128K with its dK/dV error against the Triton backward
        # (fused multiply-adds make it differ from the launcher's sums in the last bit).
        run_step gluon_backward_chunks_add_128k python benchmarks/gluon_backward.py \
            --seqlens 131072 --masks full --variant CHUNKS_ADD_IN_KERNEL=1
        ;;
    gluon-bwd-persistent)
        run_step gluon_backward_persistent python benchmarks/gluon_backward.py --seqlens 8192 \
            --masks full,causal,sliding_window,causal_document,document,share_question,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction \
            --variant PERSISTENT=1
        run_step gluon_backward_persistent_32k python benchmarks/gluon_backward.py \
            --seqlens 32768 --masks full,causal,sliding_window,share_question,document \
            --variant PERSISTENT=1
        ;;
    gluon-bwd-persistent-hd64)
        # The same at head dim 64 (items half as long per tile; shared memory has room for a
        # second K/V pair there, which this form does not use yet).
        run_step gluon_backward_persistent_hd64 python benchmarks/gluon_backward.py \
            --head-dim 64 --seqlens 8192 \
            --masks full,causal,sliding_window,causal_document,document,share_question,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction \
            --variant PERSISTENT=1
        ;;
    check-gluon-bwd-persistent)
        check "--quick --gluon-everywhere --gluon-bwd PERSISTENT=1,MAX_PROGRAMS=3" \
            gpu_check_gluon_bwd_persistent
        ;;
    check-gluon-bwd)
        # The quick GPU check's Gluon backward cases with GLUON_BWD's constants set.
        check "--quick --gluon-everywhere --gluon-bwd ${GLUON_BWD:?set GLUON_BWD}" \
            gpu_check_gluon_bwd
        ;;
    gluon-chunks-add)
        # The prepared in-kernel accumulation of the query chunks' dK/dV (same fp32 additions in
        # the same order: dK/dV bitwise equal to the launcher's sums), and the split at 64K.
        run_step gluon_backward_chunks_add python benchmarks/gluon_backward.py \
            --seqlens 65536,131072 --masks full --variant CHUNKS_ADD_IN_KERNEL=1 \
            --variant QUERY_SPLIT_FROM_BYTES=0,CHUNKS_ADD_IN_KERNEL=1
        ;;
    check-dq-tma)
        check "--quick --gluon-everywhere --gluon-bwd ${GLUON_BWD:-DQ_TMA=0}" gpu_check_dq_tma
        ;;
    check-dkdv-tma-hd256)
        check "--quick --gluon-everywhere --gluon-bwd256 DKDV_TMA=1" gpu_check_dkdv_tma_hd256
        ;;
    gluon-o-tma)
        run_step gluon_forward_o_tma python benchmarks/gluon_forward.py --seqlens 8192,32768 \
            --masks full,causal,sliding_window,share_question,document --o-tma-ab
        run_step gluon_forward_o_tma_hd64 python benchmarks/gluon_forward.py --head-dim 64 \
            --seqlens 8192,32768 --masks full,causal,sliding_window,share_question,document \
            --o-tma-ab
        ;;
    check-o-tma)
        check "--quick --gluon-everywhere --gluon-fwd-o-tma 1" gpu_check_o_tma
        ;;
    ncu-backward)
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        for impl in flashmask sdpa; do
            kernel=gluon_bwd_kernel
            [ "$impl" = sdpa ] && kernel=flash_bprop
            run_step "ncu_backward_$impl" "$ncu" --clock-control none -k "regex:$kernel" -s 1 -c 1 \
                --section SpeedOfLight --section ComputeWorkloadAnalysis \
                --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
                --section LaunchStats python benchmarks/profile_backward.py --impl "$impl"
        done
        ;;
    ncu-backward-128k)
        # Full attention's backward at 128K runs 8% below its 32K rate while causal does not:
        # memory throughput and L2 hit rates of the hd128 kernel at 32K and 128K (full) and 128K
        # (causal), to test whether a head's Q/dO and dQ (32 MB at 32K, 128 MB at 128K, against a
        # 50 MB L2) leave it waiting on HBM.
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        for case in "full 32768" "full 131072" "causal 131072"; do
            read -r mask len <<<"$case"
            run_step "ncu_backward_${mask}_$len" "$ncu" --clock-control none \
                -k regex:gluon_bwd_kernel -s 1 -c 1 --section SpeedOfLight \
                --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Chart \
                python benchmarks/profile_backward.py --impl flashmask --mask "$mask" --seqlen "$len"
        done
        ;;
    ncu-backward-sparse)
        # Why the sparse 8K backward runs at ~60% of the causal 32K rate per listed tile: the
        # hd128 kernel's SM active against elapsed cycles, warp states, occupancy and memory on
        # sliding_window at 8K (lists of ~10 tiles) and 32K (~34) and causal at 32K; then the
        # per-instruction stall samples of the 8K call (source page as CSV).
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        for case in "sliding_window 8192" "sliding_window 32768" "causal 32768"; do
            read -r mask len <<<"$case"
            run_step "ncu_backward_${mask}_$len" "$ncu" --clock-control none \
                -k regex:gluon_bwd_kernel -s 1 -c 1 --section SpeedOfLight \
                --section WarpStateStats --section Occupancy --section LaunchStats \
                --section MemoryWorkloadAnalysis --section SchedulerStats \
                python benchmarks/profile_backward.py --impl flashmask --mask "$mask" --seqlen "$len"
        done
        run_step ncu_backward_source_sw8k_run "$ncu" --clock-control none \
            -k regex:gluon_bwd_kernel -s 1 -c 1 --section WarpStateStats --section SourceCounters \
            --import-source yes -f -o "$OUT/ncu_backward_source_sw8k" \
            python benchmarks/profile_backward.py --impl flashmask --mask sliding_window --seqlen 8192
        run_step ncu_backward_source_sw8k "$ncu" -i "$OUT/ncu_backward_source_sw8k.ncu-rep" \
            --page source --csv --print-source sass
        rm -f "$OUT/ncu_backward_source_sw8k.ncu-rep"
        gzip -f "$OUT/ncu_backward_source_sw8k.log"
        ;;
    ncu-forward-o-tma)
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        for form in 0 1; do
            run_step "ncu_forward_full_8k_o_tma$form" "$ncu" --clock-control none \
                -k regex:gluon_fwd_kernel -s 0 -c 1 --section SpeedOfLight \
                --section WarpStateStats --section Occupancy --section LaunchStats \
                --section MemoryWorkloadAnalysis --section SchedulerStats \
                python benchmarks/profile_backward.py --impl flashmask --mask full --seqlen 8192 \
                --gluon-fwd-o-tma "$form"
        done
        ;;
    ncu-backward-source)
        # Where the library hd128 backward's stall cycles sit, per SASS instruction (warp-state
        # sampling with the source counters): the report, and its source page as CSV.
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        # NCU_GLUON_BWD=ROW_TERMS_SMEM=1 profiles a candidate setting instead (files tagged _variant).
        tag=ncu_backward_source${NCU_GLUON_BWD:+_variant}
        run_step "${tag}_run" "$ncu" --clock-control none -k regex:gluon_bwd_kernel \
            -s 1 -c 1 --section WarpStateStats --section SourceCounters --import-source yes \
            -f -o "$OUT/$tag" python benchmarks/profile_backward.py --impl flashmask \
            --gluon-bwd "${NCU_GLUON_BWD:-}"
        run_step "$tag" "$ncu" -i "$OUT/$tag.ncu-rep" --page source --csv --print-source sass
        ;;
    tune-launch-hd256)
        run_step tune_launch_hd256 python benchmarks/tune.py --set launch --seqlen 8192 \
            --head-dims 256 --masks full,causal,causal_document,share_question --rounds 2 --rep-ms 50
        ;;
    tune-dq-hd256)
        run_step tune_dq_hd256 python benchmarks/tune.py --set dq --seqlen 8192 --head-dims 256 \
            --masks full,causal,causal_document,share_question --rounds 2 --rep-ms 50
        ;;
    gluon-hd256-bwd)
        run_step gluon_backward_hd256 python benchmarks/gluon_backward.py --head-dim 256 \
            --variant DQ_TMA=0
        ;;
    host-overhead)
        run_step host_overhead python benchmarks/host_overhead.py --seqlens 8192 \
            --masks full,sliding_window,share_question,causal_document,document
        ;;
    host-routes)
        # 8K host and GPU time with the masked Gluon-forward limit at 8K (shipped since the
        # twenty-third session) and at 32K (the Triton forward at 8K), in one run.
        run_step host_routes python benchmarks/host_overhead.py --seqlens 8192 \
            --masks sliding_window,share_question,causal_document,document \
            --fwd-masked-limits 8192,32768
        ;;
    host-routes-breakdown)
        # Where the 8K host time goes on each forward route (host-routes measured the Gluon
        # route's mask preparation 0.1-0.2 ms dearer per call, twenty-fourth session).
        run_step host_routes_breakdown python benchmarks/host_overhead.py --seqlens 8192 \
            --masks sliding_window,share_question --fwd-masked-limits 8192,32768 --breakdown
        ;;
    kernel-times)
        # Where each 8K call's GPU time goes, kernel by kernel (FlashMask with its mask prepared
        # in the call, as the bench times it, and flex), on the masks furthest from 1.5x flex.
        run_step kernel_times python benchmarks/host_overhead.py --seqlens 8192 --kernels \
            --masks sliding_window,qk_sparse,prefix_lm_causal,causal_blockwise,full
        ;;
    host-breakdown)
        run_step host_breakdown python benchmarks/host_overhead.py --seqlens 8192 \
            --masks sliding_window,share_question,full --breakdown
        ;;
    eager-check)
        run_step eager_check python benchmarks/eager_check.py
        ;;
    host-costs)
        run_step host_costs python benchmarks/host_costs.py --seqlens 8192 \
            --masks sliding_window,full
        ;;
    host-profile)
        run_step host_profile python benchmarks/host_overhead.py --seqlens 8192 \
            --masks sliding_window --profile
        ;;
    gluon-forward-8k)
        # The Gluon forward against the Triton forward on all 12 masks at 8K (routed to the
        # Triton one there with a mask since the seventh session's measurement).
        all=full,causal,sliding_window,causal_document,document,share_question
        all=$all,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal
        all=$all,qk_sparse,random_eviction
        run_step gluon_forward_8k python benchmarks/gluon_forward.py --seqlens 8192 --masks "$all"
        ;;
    gluon-16k)
        run_step gluon_forward_16k python benchmarks/gluon_forward.py --seqlens 16384 \
            --masks sliding_window,share_question,global_sliding_window,causal_document,prefix_lm_document
        run_step gluon_backward_16k python benchmarks/gluon_backward.py --seqlens 16384 \
            --masks sliding_window,share_question,global_sliding_window,causal_document,prefix_lm_document
        ;;
    gluon-hd64-short)
        run_step gluon_forward_hd64_short python benchmarks/gluon_forward.py --head-dim 64 \
            --masks full,causal --seqlens 2048,8192
        ;;
    gluon-forward-tiles)
        run_step gluon_forward_tiles python benchmarks/gluon_forward.py --seqlens 8192,32768 \
            --block-n 128,64 --buffers 2,3
        ;;
    program-overhead)
        run_step program_overhead python benchmarks/program_overhead.py --seqlen 8192
        run_step program_overhead_32k python benchmarks/program_overhead.py --seqlen 32768 \
            --windows 255,1023,2047,4095,8191
        ;;
    gluon-forward-routing)
        all=full,causal,sliding_window,causal_document,document,share_question
        all=$all,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal
        all=$all,qk_sparse,random_eviction
        run_step gluon_forward_routing python benchmarks/gluon_forward.py --seqlens 8192,16384 \
            --masks "$all"
        ;;
    gluon-forward-masks)
        run_step gluon_forward_masks python benchmarks/gluon_forward.py --seqlens 8192,32768 \
            --masks full,causal,sliding_window,causal_document,document,share_question,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction
        ;;
    gluon-hd256)
        run_step gluon_forward_hd256 python benchmarks/gluon_forward.py --head-dim 256
        ;;
    gluon-hd64)
        run_step gluon_forward_hd64 python benchmarks/gluon_forward.py --head-dim 64
        run_step gluon_backward_hd64 python benchmarks/gluon_backward.py --head-dim 64
        ;;
    bench-hd128-128k-a)
        # At least 5 timed calls per measurement (--min-repeats' default) since the twelfth
        # session: ~2x the time of a single one at 128K.
        limit=${STEP_TIMEOUT:-500} run_step bench_hd128_128k_a python -m flashmask bench \
            --seqlens 131072 --head-dims 128 \
            --masks full,causal,causal_document,document,share_question,sliding_window \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128_128k_a"
        ;;
    bench-hd128-128k-b)
        limit=${STEP_TIMEOUT:-500} run_step bench_hd128_128k_b python -m flashmask bench \
            --seqlens 131072 --head-dims 128 \
            --masks global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal,qk_sparse,random_eviction \
            --rep-ms 100 --dense-limit-gb 0.5 --out "$OUT/bench_hd128_128k_b"
        ;;
    gluon-backward-re)
        run_step gluon_backward_re python benchmarks/gluon_backward.py --seqlens 32768 \
            --masks random_eviction,causal_document
        ;;
    bench-hd128-nomask)
        run_step bench_hd128_nomask python -m flashmask bench --seqlens 8192,32768 \
            --head-dims 128 --masks full,causal --rep-ms 100 --dense-limit-gb 0.5 \
            --out "$OUT/bench_hd128_nomask"
        ;;
    gluon-forward-short)
        # The Gluon forward against the Triton one on all 12 masks below the masked routing
        # limit (kernels.GLUON_FWD_MIN_MASKED_SEQLEN): hd128 at 4K-16K, hd64 at 4K-32K.
        all=full,causal,sliding_window,causal_document,document,share_question
        all=$all,global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal
        all=$all,qk_sparse,random_eviction
        run_step gluon_forward_short python benchmarks/gluon_forward.py \
            --seqlens 4096,8192,16384 --masks "$all"
        run_step gluon_forward_short_hd64 python benchmarks/gluon_forward.py --head-dim 64 \
            --seqlens 4096,8192,16384,32768 --masks "$all"
        ;;
    gluon-versions)
        # BASELINE=FILE [CANDIDATES=a.py,b.py]: gluon_forward_versions.py.
        versions "${BASELINE:?set BASELINE}" "${CANDIDATES:-}"
        ;;
    *)
        echo "unknown step: $step" >&2
        exit 2
        ;;
    esac
done
