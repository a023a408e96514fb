#!/usr/bin/env bash
# Issue 43's next GPU call: INFERGRAFT_QUANT_MMA's three settings (0: the shipped paths; auto,
# the default: int4 from 16 rows on int4_mma; 1: every MMA kernel) and what decides auto's
# rule, in one command of under 9 minutes (each part has its own timeout, so a slow one
# cannot eat the rest):
#   bash docs/bench/gpu_quant_next.sh OUT_DIR [tests] [sweep] [bench]
# tests: the CUDA cases of the MMA kernels' tests (int4_mma, fp8_mma's e4m3 and int8 rows,
#   assembly on and off), the launchers' and fused GEMMs' routes at each setting, and the
#   switch at auto and 1 through the engine under the decode CUDA graphs (tests/test_quant_mma.py);
# sweep: docs/bench/quant_mma_sweep.py twice: int4's launchers at 1-32 rows (where auto's
#   MMA_MIN_ROWS should sit: 16 and 32 measured, 2-12 not yet), then --fused: the fused decode
#   layer's GEMMs on e4m3 and int8 rows, byte tiles vs WORDS (same grid), at 1 and 32 rows (what
#   the engine runs at <= 32 rows; docs/bench/quant-mma.md says why the launchers' sweep
#   disagreed with the engine there);
# bench: infergraft bench on the LLaMA-2-7B shape, batches 1 and 32, 32 new tokens (as the
#   BENCHMARKS quant row), with int8, int4 and fp8 weights beside bf16, INFERGRAFT_QUANT_MMA=0
#   (with HF eager), then auto, then 1 (BENCH_MODEL, BENCH_ARGS: another model, more flags;
#   a CPU dry run: BENCH_MODEL=tiny BENCH_ARGS="--device cpu --batches 1,2").
# Writes 7 files into OUT_DIR: summary.txt, tests.txt, sweep.txt, bench.txt (the three
# settings' output, one after another) and bench_{off,auto,on}.json. Timeouts (seconds):
# TESTS_TIMEOUT, SWEEP_TIMEOUT (each sweep), BENCH_TIMEOUT (each setting), all cut to what
# DEADLINE (530 s from the start) leaves, so the call ends inside 9 minutes.
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
  timeout "$(budget "${TESTS_TIMEOUT:-150}")" python3 -m pytest -q -rf --tb=short \
    -p no:cacheprovider $xdist \
    tests/kernel_tests/test_int4_mma.py tests/kernel_tests/test_fp8_mma.py \
    tests/kernel_tests/test_quant_mma_paths.py tests/kernel_tests/test_mma_asm.py \
    tests/test_quant_mma.py -k "cuda or gpu or asm or emulator" > "$OUT/tests.txt" 2>&1
  note "tests rc $? ($((SECONDS - start)) s)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -12 | tee -a "$SUMMARY"
fi
if has sweep; then
  timeout "$(budget "${SWEEP_TIMEOUT:-60}")" python3 docs/bench/quant_mma_sweep.py --quick \
    --formats int4 --rows 1,2,4,8,12,16,32 > "$OUT/sweep.txt" 2>&1
  note "sweep int4 rc $? ($((SECONDS - start)) s)"
  timeout "$(budget "${SWEEP_TIMEOUT:-60}")" python3 docs/bench/quant_mma_sweep.py --fused \
    --formats fp8,int8 --rows 1,32 >> "$OUT/sweep.txt" 2>&1
  note "sweep fused rc $? ($((SECONDS - start)) s)"
  grep -vE "^    " "$OUT/sweep.txt" | grep -E "M=|layer|TB/s|Error" | tail -60 | tee -a "$SUMMARY"
fi
if has bench; then
  : > "$OUT/bench.txt"
  for arm in off auto on; do
    flag=$arm systems=infergraft
    [ "$arm" = off ] && flag=0 systems=infergraft,hf-eager  # HF once: the switch is ours
    [ "$arm" = on ] && flag=1
    echo "### INFERGRAFT_QUANT_MMA=$flag" >> "$OUT/bench.txt"
    INFERGRAFT_QUANT_MMA=$flag timeout "$(budget "${BENCH_TIMEOUT:-140}")" "${IG[@]}" bench \
      --model "${BENCH_MODEL:-llama2-7b}" \
      --batches 1,32 --systems "$systems" --compare-plugins int8,int4,fp8 \
      --new-tokens 32 ${BENCH_ARGS:-} --out "/tmp/quant_bench_$arm" > "/tmp/quant_bench_$arm.txt" 2>&1
    note "bench INFERGRAFT_QUANT_MMA=$flag rc $? ($((SECONDS - start)) s)"
    cat "/tmp/quant_bench_$arm.txt" >> "$OUT/bench.txt"
    cp "/tmp/quant_bench_$arm/results.json" "$OUT/bench_$arm.json" 2>/dev/null
    grep -E "^\||^## |Error|error:" "/tmp/quant_bench_$arm.txt" | tail -24 | tee -a "$SUMMARY"
  done
fi
note "total $((SECONDS - start)) s"
