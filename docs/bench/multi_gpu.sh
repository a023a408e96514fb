#!/usr/bin/env bash
# The multi-GPU runs issue 29 owes, one part per device call (each at most 9 minutes):
#   bash docs/bench/multi_gpu.sh OUT_DIR x2              # on nvidia-h200-x2
#   bash docs/bench/multi_gpu.sh OUT_DIR x4-bench        # on nvidia-h200-x4
#   bash docs/bench/multi_gpu.sh OUT_DIR x4-throughput   # on nvidia-h200-x4
# Every run is `infergraft bench [throughput] --tensor-parallel N --pipeline-parallel M`
# under torchrun (core/tools/bench_parallel.py): rank 0 times the model on one GPU first
# (unless --no-single), then every rank its share, timed in lockstep; JSON under OUT_DIR.
# x2: LLaMA-2-7B shape bf16 (random weights), batch-1 and batch-32 TPOT and TTFT(512) at tp 2
#   beside one GPU in the same script (target: tp 2 TPOT <= 0.6x one GPU's at batch 1),
#   OUT_DIR/x2/tp2/results.json; fp32 greedy of the same shape on tp 2 equal to one GPU's
#   (OUT_DIR/x2/greedy_fp32.json); NCCL's all-reduce at decode sizes, eager and in a graph,
#   beside a copy of the same bytes (docs/bench/allreduce_latency.py: whether a one-shot
#   all-reduce would pay; OUT_DIR/x2/allreduce.json);
#   tests/test_tensor_parallel.py::test_two_gpus_match_hf (parity with HF over NCCL) and tests/test_parallel_fused.py (tp 2's fused layer and
#   graphs with the all-reduces captured, against one GPU; OUT_DIR/x2/pytest.txt).
# x4-bench: a LLaMA-70B-shaped bf16 model (random weights, 138 GB: no single GPU, so
#   --no-single): tp 4, tp 2 x pp 2 with micro_batches 4, pp 4 (PP4_MICRO=K: pp 4 with
#   micro_batches K); batch-1 and batch-32 TPOT, TTFT(512); OUT_DIR/x4/<config>/results.json.
# x4-throughput: the same three on N_PROMPTS (256) uniform requests of 512 + 128 tokens at
#   once; OUT_DIR/x4t/<config>/throughput.json.
# CONFIGS="tp4 pp4" runs only those of the three. Estimates, unmeasured (no multi-GPU
# machine has run this yet): x2 ~300 s (each 7B build ~60 s with Triton compiles and graph
# captures; the fp32 check builds 27 GB twice), x4-bench ~150 s a config (random weights
# made on each GPU, 20-40 layers a rank), x4-throughput ~150 s a config. Each run gets what
# is left of BUDGET (540 s from the start; a run with under 60 s left is skipped), so a
# part ends inside one device call; what finished stays under OUT_DIR (at most 7 files a
# part: the device tool returns 8).
set -u
OUT=${1:?OUT_DIR}
PART=${2:?part: x2, x4-bench or x4-throughput}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
# NVLink multicast off (device/KINDS.md: it can take the host's shared GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
need=$([ "$PART" = x2 ] && echo 2 || echo 4)
have=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$have" -lt "$need" ]; then
  echo "part $PART needs $need GPUs; this machine has $have"; exit 2
fi
RUN="python3 -m torch.distributed.run --standalone"
left() {  # seconds of BUDGET left; non-zero status (skip the run) under 60
  LEFT=$(( ${BUDGET:-540} - SECONDS ))
  [ "$LEFT" -ge 60 ] || { echo "== skipped $1 at ${SECONDS} s: ${LEFT} s left"; return 1; }
}

# name|ranks|flags: the three 70B placements
PLACEMENTS=(
  "tp4|4|--tensor-parallel 4"
  "tp2-pp2-mb4|4|--tensor-parallel 2 --pipeline-parallel 2 --micro-batches 4"
  "pp4|4|--pipeline-parallel 4${PP4_MICRO:+ --micro-batches $PP4_MICRO}"
)

placements() {  # $1: bench or throughput; each selected placement in turn, within BUDGET
  for p in "${PLACEMENTS[@]}"; do
    IFS="|" read -r name ranks flags <<<"$p"
    case " ${CONFIGS:-tp4 tp2-pp2-mb4 pp4} " in *" $name "*) ;; *) continue;; esac
    left "$name" || continue
    echo "== $1 $name at ${SECONDS} s: $flags"
    if [ "$1" = bench ]; then
      timeout "$LEFT" $RUN --nproc-per-node "$ranks" -m infergraft.core.cli bench \
        --model llama2-70b --batches 1,32 --no-single $flags --out "$OUT/x4/$name"
    else
      timeout "$LEFT" $RUN --nproc-per-node "$ranks" -m infergraft.core.cli bench throughput \
        --model llama2-70b --dataset uniform --num-prompts "${N_PROMPTS:-256}" \
        --prompt-len 512 --output-len 128 --no-single $flags --out "$OUT/x4t/$name"
    fi
    echo "== $name done at ${SECONDS} s, rc $?"
  done
}

two_gpus() {
    left "tp 2 beside one GPU" && echo "== tp 2 beside one GPU at ${SECONDS} s" &&
    timeout "$LEFT" $RUN --nproc-per-node 2 -m infergraft.core.cli bench --model llama2-7b \
      --batches 1,32 --tensor-parallel 2 --out "$OUT/x2/tp2"
    echo "== fp32 greedy, tp 2 against one GPU at ${SECONDS} s"
    cat >/tmp/greedy_fp32.py <<'EOF'
"""One rank: greedy tokens of the LLaMA-2-7B shape in float32 on tp 2; rank 0 first alone."""
import json
import sys

import torch

from infergraft import core
from infergraft.core.tools.bench import random_prompts
from infergraft.core.tools.bench_parallel import first_on_rank0, join_group, random_weights
from infergraft.core.tools.bench_variants import free_device

rank, device = join_group("cuda")
prompts = random_prompts(4, 64, 32000, seed=1)
kw = dict(dtype=torch.float32, device=device, max_seq_len=256, max_batch_size=4)


def tokens(plugins):
    engine = core.build(random_weights("llama2-7b", device, torch.float32), plugins=plugins, **kw)
    return [c.token_ids for c in engine.generate(prompts, max_new_tokens=48)]


def alone():
    got = tokens(["paged"])
    free_device()
    return got


one = first_on_rank0(rank, alone)
tp2 = tokens(["paged", "tp"])
if rank == 0:
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(one, tp2)]
    json.dump({"equal": one == tp2, "first_difference": first, "one_gpu": one, "tp2": tp2},
              open(sys.argv[1], "w"), indent=1)
    print(f"fp32 greedy tp 2 == one GPU: {one == tp2} (first difference per prompt: {first})")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
EOF
    left "the all-reduce latency" && echo "== all-reduce latency at ${SECONDS} s" &&
    timeout "$LEFT" $RUN --nproc-per-node 2 docs/bench/allreduce_latency.py \
      "$OUT/x2/allreduce.json"
    left "the fp32 greedy check" && timeout "$LEFT" $RUN --nproc-per-node 2 /tmp/greedy_fp32.py \
      "$OUT/x2/greedy_fp32.json"
    left "test_two_gpus_match_hf" || return
    echo "== pytest test_two_gpus_match_hf at ${SECONDS} s"
    timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider \
      "tests/test_tensor_parallel.py::test_two_gpus_match_hf" tests/test_parallel_fused.py \
      >"$OUT/x2/pytest.txt" 2>&1
    echo "== pytest rc $? at ${SECONDS} s"; tail -3 "$OUT/x2/pytest.txt"
}

case "$PART" in
  x2) mkdir -p "$OUT/x2"; two_gpus 2>&1 | tee "$OUT/x2.txt" ;;
  x4-bench) placements bench 2>&1 | tee "$OUT/x4_bench.txt" ;;
  x4-throughput) placements throughput 2>&1 | tee "$OUT/x4_throughput.txt" ;;
  *) echo "unknown part $PART: x2, x4-bench or x4-throughput"; exit 2 ;;
esac
