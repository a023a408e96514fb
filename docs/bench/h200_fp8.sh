#!/usr/bin/env bash
# The fp8 figures of docs/BENCHMARKS.md (issue 27) on one H200:
#   bash docs/bench/h200_fp8.sh OUT_DIR [tests] [attn] [weights] [arms] [kv] [throughput]
# tests: the GPU tests of fp8 weights, kv-fp8 and their kernels; attn: one layer's decode
# attention over bf16 / int8 / e4m3 K/V at 4,032 tokens, shipped and forced plans (and K read
# transposed, INFERGRAFT_KV_LOAD_T); arms: fp8 batch 1 with INFERGRAFT_GEMV_FP8 off / on; weights: infergraft bench
# on the LLaMA-2-7B shape (batches 1 and 32, 512-token prompts) with fp8 weights beside bf16
# and HF eager; kv: batch 16 at 4,000-token prompts with kv-fp8 and kv-int8 beside bf16 K/V
# (the attention-bound case); throughput: bench throughput on the LLaMA-3-8B shape, 1000
# uniform requests of 512 / 256 tokens, fp8 (and fp8 + kv-fp8) beside bf16, HF on a slice.
set -u
# (tests/kernel_tests/* before tests/*: given after them, the kernels' conftest fixtures were
# not found on the H200)
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-tests weights kv}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
ig() { python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())' "$@"; }
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if has tests; then
  # (~9 minutes with every part's kernels compiling: give tests a call of their own)
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m "not slow" tests/kernel_tests/test_fp8_linear.py tests/kernel_tests/test_kv_write_quant.py \
    tests/kernel_tests/test_rotary_quant.py tests/kernel_tests/test_fused_scaled_rows.py \
    tests/kernel_tests/test_paged_attention.py tests/kernel_tests/test_varlen_attention.py \
    tests/test_weight_fp8.py tests/test_kv_fp8.py \
    -k "${TESTS_K:-(cuda or gpu) and (fp8 or int8 or quant or scaled_rows)}" \
    > "$OUT/gpu_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -12
fi
if has attn; then
  python3 docs/bench/kv_quant_attention.py > "$OUT/attn.txt" 2>&1
  cat "$OUT/attn.txt"
fi
if has weights; then
  ig bench --model llama2-7b --batches 1,32 --systems infergraft,hf-eager \
    --compare-plugins fp8 --out "$OUT/weights" > "$OUT/weights.txt" 2>&1
  tail -14 "$OUT/weights.txt"
fi
if has arms; then  # the switches off by default, each beside its default in this call
  ig bench --model llama2-7b --batches 1 --systems infergraft --plugins fp8 \
    --out "$OUT/fp8_tiles" > "$OUT/fp8_tiles.txt" 2>&1
  INFERGRAFT_GEMV_FP8=1 ig bench --model llama2-7b --batches 1 --systems infergraft \
    --plugins fp8 --out "$OUT/fp8_words" > "$OUT/fp8_words.txt" 2>&1
  tail -4 "$OUT/fp8_tiles.txt" "$OUT/fp8_words.txt"
fi
if has kv; then
  ig bench --model llama2-7b --batches 16 --prompt-len 4000 --new-tokens 32 \
    --systems infergraft,hf-eager --compare-plugins kv-fp8,kv-int8 --out "$OUT/kv" \
    > "$OUT/kv.txt" 2>&1
  tail -12 "$OUT/kv.txt"
fi
if has throughput; then
  ig bench throughput --model llama3-8b --dataset uniform --num-prompts 1000 \
    --prompt-len 512 --output-len 256 --hf-num-prompts "${HF_PROMPTS:-48}" \
    --compare-plugins fp8,fp8+kv-fp8 --out "$OUT/throughput" > "$OUT/throughput.txt" 2>&1
  tail -16 "$OUT/throughput.txt"
fi
