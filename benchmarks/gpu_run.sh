#!/usr/bin/env bash
# Rerun the GPU checks and measurements on a CUDA machine, from the repository root:
#
#   bash benchmarks/gpu_run.sh check bench          # any steps, in the order given
#
# Steps (results go to $RESULTS, default benchmarks/results, named with today's date):
#   check       the GPU tests (tests/gpu; FLASHMASK_GPU_FULL=1 for the full matrix), their
#               summary in gpu_check_<date>.json
#   bench       flashmask bench, 8K and 32K tokens, head dim 128, the 12 masks (the README's
#               table): bench_hd128_<date>.{json,md,png}
#   bench-128k  the same at 128K, in two runs of six masks: bench_hd128_128k_{a,b}_<date>.*
#   bench-fp8   flashmask bench --dtype fp8: the FP8 forward beside the bf16 forward,
#               FlexAttention and SDPA, 8K and 32K, head dim 128, the 12 masks: fp8_<date>.*
#   features    flashmask bench with learnable sinks and the logit cap beside the plain call, 8K
#               and 32K, head dim 128, the 12 masks: features_<date>.{json,md,png}
#   mla         benchmarks/mla_backward.py: the Gluon against the Triton backward at MLA's head
#               dims (192 / 128), the 12 masks at 8K and 32K: mla_backward_<date>.{json,md}
#   decode      flashmask bench --decode: decode steps (batch 1/8/32, 8K-128K caches) and
#               chunked prefill beside SDPA and FlexAttention: decode_<date>.{json,md}
#   graphs      benchmarks/decode_graphs.py, a ~1B model's generation with and without CUDA
#               graphs: decode_graphs_<date>.{json,md}
#   e2e         benchmarks/e2e.py, training steps of a ~1B model: e2e_<date>/e2e.{json,md}
#               (MODEL=gpt_oss or deepseek_v3: that model style, into e2e_<model>_<date>/)
#   cp          benchmarks/cp_gpu.py on every GPU of the machine (torchrun): cp_gpu_<date>/
#   sass        benchmarks/sass_report.py (compiles for sm_90, needs no GPU): sass_report_<date>.*
#   cute-det    benchmarks/cute_backward.py --deterministic, the CuTe backward's deterministic
#               variant against the plain kernel (needs flashmask[cute]): cute_det_<date>.*
#   profile     benchmarks/profile_call.py on causal 8K and full 32K, our call and, where
#               fm4_torch imports, FlashMask-4's, kernel by kernel: profile_<date>.log
#
# Environment: RESULTS (output folder), DATE (the stamp, default YYYY-MM-DD), JOBS (pytest-xdist
# workers for check, default 8), MODEL (e2e's model style, default llama). src/ goes first on PYTHONPATH, so the checkout is what runs.
set -uo pipefail

results=${RESULTS:-benchmarks/results}
date=${DATE:-$(date +%F)}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
[ $# -gt 0 ] || { sed -n '2,32p' "$0"; exit 2; }
mkdir -p "$results"

bench() {  # bench NAME SEQLENS MASKS
    python -m flashmask bench --seqlens "$2" --head-dims 128 --masks "$3" --rep-ms 100 \
        --dense-limit-gb 0.5 --out "$results/$1_$date"
}

all_masks=full,causal,sliding_window,causal_document,document,share_question
more_masks=global_sliding_window,causal_blockwise,prefix_lm_document,prefix_lm_causal
more_masks=$more_masks,qk_sparse,random_eviction

failed=()
for step in "$@"; do
    echo "== $step"
    start=$SECONDS
    case $step in
    check)
        FLASHMASK_GPU_REPORT="$results/gpu_check_$date.json" \
            python -m pytest -q -p no:randomly -n "${JOBS:-8}" tests/gpu
        ;;
    bench) bench bench_hd128 8192,32768 "$all_masks,$more_masks" ;;
    bench-128k)
        bench bench_hd128_128k_a 131072 "$all_masks" &&
            bench bench_hd128_128k_b 131072 "$more_masks"
        ;;
    bench-fp8)
        python -m flashmask bench --dtype fp8 --seqlens 8192,32768 --head-dims 128 --rep-ms 100 \
            --dense-limit-gb 0.5 --out "$results/fp8_$date"
        ;;
    features)
        python -m flashmask bench --impls flashmask,flashmask_sinks,flashmask_softcap \
            --seqlens 8192,32768 --head-dims 128 --rep-ms 100 --out "$results/features_$date"
        ;;
    mla) python benchmarks/mla_backward.py --out "$results/mla_backward_$date" ;;
    decode) python -m flashmask bench --decode --out "$results/decode_$date" ;;
    graphs) python benchmarks/decode_graphs.py --out "$results/decode_graphs_$date" ;;
    e2e)
        python benchmarks/e2e.py --longest-max 262144 --step-limit-s 30 --budget-s 7200 \
            --model "${MODEL:-llama}" --out "$results/e2e${MODEL:+_$MODEL}_$date"
        ;;
    cp)
        torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" benchmarks/cp_gpu.py \
            --out "$results/cp_gpu_$date"
        ;;
    sass) python benchmarks/sass_report.py --out "$results/sass_report_$date" ;;
    cute-det)
        python benchmarks/cute_backward.py --deterministic --out "$results/cute_det_$date"
        ;;
    profile)
        impls=flashmask
        python -c "from flashmask.bench import flashmask4; exit(flashmask4() is None)" &&
            impls="flashmask fm4"
        log="$results/profile_$date.log"
        : >"$log"
        profiled=0
        for impl in $impls; do
            for case in "causal 8192" "full 32768"; do
                read -r mask seqlen <<<"$case"
                python benchmarks/profile_call.py --impl "$impl" --mask "$mask" \
                    --seqlen "$seqlen" >>"$log" || profiled=1
            done
        done
        [ "$profiled" -eq 0 ]
        ;;
    *)
        echo "unknown step: $step (see the top of $0)" >&2
        exit 2
        ;;
    esac
    rc=$?
    echo "== $step: exit status $rc, $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed+=("$step")
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}" >&2; exit 1; }
