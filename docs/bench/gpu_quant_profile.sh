#!/usr/bin/env bash
# Issue 43's first step, profile before changing kernels (one GPU call):
#   bash docs/bench/gpu_quant_profile.sh OUT_DIR [int4] [profile] [ncu]
# int4: docs/bench/quant_mma_sweep.py, the tensor-core int4 and fp8 kernels beside the shipped paths;
# profile: docs/bench/quant_profile.py, the per-kernel GPU time of a decode step of the
# LLaMA-2-7B shape at batches 1 and 32 for bf16, int8, int4 and fp8 weights (one process);
# ncu: Nsight Compute on the first layers' kernels of one batch-1 decode step of each build
# (a process each), the speed of light, warp stalls and instruction mix as CSV.
set -u
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-int4 profile ncu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
if has int4; then
  timeout "${INT4_TIMEOUT:-240}" python3 docs/bench/quant_mma_sweep.py > "$OUT/quant_mma.txt" 2>&1
  echo "quant_mma_sweep rc $?"; grep -vE "^    " "$OUT/quant_mma.txt" | tail -60
fi
if has profile; then
  timeout "${PROFILE_TIMEOUT:-330}" python3 docs/bench/quant_profile.py --batches "${PROFILE_BATCHES:-1,32}" \
    > "$OUT/profile.txt" 2>&1
  grep -E "^\[|sum of kernel" "$OUT/profile.txt"
fi
if has ncu; then
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,launch__registers_per_thread,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warp_latency_issue_stalled_math_pipe_throttle,smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__average_warp_latency_issue_stalled_mio_throttle,smsp__average_warp_latency_issue_stalled_lg_throttle,smsp__average_warp_latency_issue_stalled_not_selected,smsp__average_warp_latency_issue_stalled_selected,smsp__average_warp_latency_issue_stalled_dispatch_stall,smsp__average_warp_latency_issue_stalled_no_instruction
  for build in ${NCU_BUILDS:-int4 fp8 int8 bf16}; do
    b=$build; [ "$b" = bf16 ] && b=""
    timeout "${NCU_TIMEOUT:-100}" ncu --clock-control none --nvtx --nvtx-include "${build}_b1/" \
      --launch-count "${NCU_KERNELS:-24}" --metrics "$METRICS" --csv --page raw \
      python3 docs/bench/quant_profile.py --ncu --batches 1 --new-tokens 8 --builds "$b" \
      > "$OUT/ncu_$build.csv" 2> "$OUT/ncu_$build.err"
    echo "ncu $build: rc $? $(grep -c '^"' "$OUT/ncu_$build.csv") rows"
  done
fi
