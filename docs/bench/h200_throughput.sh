#!/usr/bin/env bash
# The mixed-traffic figures of docs/BENCHMARKS.md on one H200, in one device call:
#   bash docs/bench/h200_throughput.sh OUT_DIR
# 1) the GPU tests of the varlen kernel, the mixed steps and the graphs (SKIP_TESTS=1: not)
# and the kernel's micro-benchmark; 2) infergraft bench throughput on the LLaMA-3-8B shape
# (bf16, random weights), one run per workload in WORKLOADS ("dataset:prompt:output"),
# each a sweep over BUDGETS (max_num_batched_tokens), with the GPU's idle gaps between
# steps, and HF's continuous batching on the first HF_PROMPTS requests (HF_PROMPTS=0: no
# HF); 3) with BENCH=1, infergraft bench (batch-1 TPOT, TTFT) beside HF and the roofline.
set -u
OUT=${1:?OUT_DIR}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
ig() { python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' "$@"; }
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_varlen_attention.py \
    tests/test_mixed_steps.py tests/test_step_graph.py tests/test_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
  python3 -m infergraft.kernels.bench.varlen > "$OUT/varlen_bench.txt" 2>&1
  cat "$OUT/varlen_bench.txt"
fi
N=${NUM_PROMPTS:-1000}
BUDGETS=${BUDGETS:-2048}
HF_PROMPTS=${HF_PROMPTS:-0}
for w in ${WORKLOADS:-uniform:512:256}; do
  IFS=: read -r dataset plen olen <<< "$w"
  hf="--no-hf"; [ "$HF_PROMPTS" != 0 ] && hf="--hf-num-prompts $HF_PROMPTS"
  ig bench throughput --model llama3-8b --dataset "$dataset" --prompt-len "$plen" \
    --output-len "$olen" --num-prompts "$N" --max-batch-size "${MAX_BATCH:-256}" \
    --max-num-batched-tokens "$BUDGETS" --step-gaps $hf --out "$OUT/$dataset" \
    > "$OUT/throughput-$dataset.txt" 2>&1
  echo "== $w (budgets $BUDGETS) after $SECONDS s"
  grep -E "^ +infergraft|Output token throughput|compute floor|P50 TPOT|P99 TPOT|P99 TTFT|idle|error" \
    "$OUT/throughput-$dataset.txt"
done
if [ -n "${BENCH:-}" ]; then
  ig bench --model llama2-7b --batches 1,32 --systems infergraft,hf-eager --out "$OUT/bench" \
    > "$OUT/bench.txt" 2>&1
  tail -15 "$OUT/bench.txt"
fi
