#!/usr/bin/env bash
# The mixed-traffic figures of docs/BENCHMARKS.md on one H200, in one device call:
#   bash docs/bench/h200_throughput.sh OUT_DIR
# 1) the GPU tests of the mixed steps and the graphs (SKIP_TESTS=1: not; KERNEL_TESTS=1:
# the varlen kernel's tests and micro-benchmark too); 2) infergraft bench throughput on the
# LLaMA-3-8B shape (bf16, random weights), the RUNS of docs/bench/throughput_runs.py in one
# process (each with the GPU's idle gaps between steps); 3) with BENCH=1, infergraft bench
# on the LLaMA-2-7B shape (batch 1: TPOT, TTFT) beside HF eager and the copy roofline.
set -u
OUT=${1:?OUT_DIR}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
ig() { python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' "$@"; }
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_mixed_steps.py tests/test_gpu.py \
    ${KERNEL_TESTS:+tests/kernel_tests/test_varlen_attention.py} -k "${TESTS_K:-cuda or gpu}" \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
if [ -n "${KERNEL_TESTS:-}" ]; then
  python3 -m infergraft.core.tools.kernel_bench.varlen > "$OUT/varlen_bench.txt" 2>&1
  tail -12 "$OUT/varlen_bench.txt"
fi
# RUNS: docs/bench/throughput_runs.py's dataset:prompt:output:prompts:budgets[:hf[:eager]];
# the default: the mixed-traffic issue's workloads at 2048-token steps, HF beside uniform,
# the budget sweep, and the eager mixed steps (INFERGRAFT_STEP_GRAPHS=0) for comparison
python3 docs/bench/throughput_runs.py "$OUT" "${DEADLINE:-420}" \
  ${RUNS:-fixed:512:256:1000:2048 uniform:512:256:1000:2048:48 sharegpt-like:161:338:1000:2048 uniform:512:256:1000:1024,4096,8192 uniform:512:256:1000:2048:0:1} \
  > "$OUT/throughput.txt" 2>&1
grep -E "^==|^ +infergraft|Output token throughput|P50 TPOT|P99 TPOT|idle|error|failed" \
  "$OUT/throughput.txt"
if [ -n "${BENCH:-}" ]; then
  ig bench --model llama2-7b --batches 1 --systems infergraft,hf-eager --out "$OUT/bench" \
    > "$OUT/bench.txt" 2>&1
  tail -15 "$OUT/bench.txt"
fi
