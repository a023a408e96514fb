#!/usr/bin/env bash
# Issue 43's owed GPU call: the quantised MMA kernels and INFERGRAFT_QUANT_MMA, written and
# compiled for sm_90 without a device (core/tools/kernel_bench/cubin.py), in one command of
# under 9 minutes (each part has its own timeout, so a slow one cannot eat the rest):
#   bash docs/bench/gpu_quant_next.sh OUT_DIR [tests] [sweep] [bench]
# tests: the CUDA cases of the MMA kernels' tests (int4_mma, fp8_mma's e4m3 and int8 rows,
#   assembly on and off), the launchers' and fused GEMMs' mma routes, and the switch through
#   the engine under the decode CUDA graphs (tests/test_quant_mma.py, gpu);
# sweep: docs/bench/quant_mma_sweep.py --quick (each LLaMA-2-7B GEMM at 1 / 16 / 32 rows:
#   bf16 cuBLAS, the shipped path, the MMA kernel, each against its bytes' roofline);
# bench: infergraft bench on the LLaMA-2-7B shape, batches 1 and 32, 32 new tokens (as the
#   BENCHMARKS quant row), beside HF eager, with int8, int4 and fp8 weights,
#   INFERGRAFT_QUANT_MMA=0 then =1 (BENCH_MODEL, BENCH_ARGS: another model, more flags; a
#   CPU dry run: BENCH_MODEL=tiny BENCH_ARGS="--device cpu --batches 1,2").
# Writes at most 8 files into OUT_DIR: summary.txt, tests.txt, sweep.txt, bench_{off,on}.txt
# and .json. Timeouts (seconds): TESTS_TIMEOUT, SWEEP_TIMEOUT, BENCH_TIMEOUT (each run), all
# cut to what DEADLINE (530 s from the start) leaves, so the call ends inside 9 minutes.
set -u
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-tests sweep bench}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
start=$SECONDS
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
# a part's timeout: its own, or what is left of the deadline if less (at least 10 s)
budget() { local left=$(( ${DEADLINE:-530} - (SECONDS - start) )); [ "$left" -lt 10 ] && left=10
           [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
# the infergraft command (an array, not a function: timeout runs it)
IG=(python3 -c 'import sys; from infergraft.core.cli import main; sys.exit(main())')
note() { echo "$*" | tee -a "$SUMMARY"; }
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "commit ${INFERGRAFT_COMMIT:-unknown}"
} 2>&1 | tee "$SUMMARY"
if has tests; then
  # 8 workers: most of the time is Triton compiling the tests' many kernel variants
  # (TEST_WORKERS=0: none, as on a small CPU host)
  xdist=""; [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null \
    && xdist="-n ${TEST_WORKERS:-8}"
  timeout "$(budget "${TESTS_TIMEOUT:-120}")" python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider $xdist \
    tests/kernel_tests/test_int4_mma.py tests/kernel_tests/test_fp8_mma.py \
    tests/kernel_tests/test_quant_mma_paths.py tests/kernel_tests/test_mma_asm.py \
    tests/test_quant_mma.py -k "cuda or gpu or asm or emulator" > "$OUT/tests.txt" 2>&1
  note "tests rc $? ($((SECONDS - start)) s)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -12 | tee -a "$SUMMARY"
fi
if has sweep; then
  timeout "$(budget "${SWEEP_TIMEOUT:-90}")" python3 docs/bench/quant_mma_sweep.py --quick \
    > "$OUT/sweep.txt" 2>&1
  note "sweep rc $? ($((SECONDS - start)) s)"
  grep -vE "^    " "$OUT/sweep.txt" | grep -E "M=|layer|TB/s|Error" | tail -45 | tee -a "$SUMMARY"
fi
if has bench; then
  for arm in off on; do
    flag=0; [ "$arm" = on ] && flag=1
    INFERGRAFT_QUANT_MMA=$flag timeout "$(budget "${BENCH_TIMEOUT:-150}")" "${IG[@]}" bench \
      --model "${BENCH_MODEL:-llama2-7b}" \
      --batches 1,32 --systems infergraft,hf-eager --compare-plugins int8,int4,fp8 \
      --new-tokens 32 ${BENCH_ARGS:-} --out "/tmp/quant_bench_$arm" > "$OUT/bench_$arm.txt" 2>&1
    note "bench INFERGRAFT_QUANT_MMA=$flag rc $? ($((SECONDS - start)) s)"
    cp "/tmp/quant_bench_$arm/results.json" "$OUT/bench_$arm.json" 2>/dev/null
    grep -E "^\||^## |Error|error:" "$OUT/bench_$arm.txt" | tail -24 | tee -a "$SUMMARY"
  done
fi
note "total $((SECONDS - start)) s"
