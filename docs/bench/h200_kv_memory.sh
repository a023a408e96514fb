#!/usr/bin/env bash
# The KV-memory figures of docs/BENCHMARKS.md (issue 24) on one H200, in one device call
# of at most 9 minutes:
#   bash docs/bench/h200_kv_memory.sh OUT_DIR [prefix] [uniform] [sharegpt] [oversubscribed]
# infergraft bench throughput on the LLaMA-3-8B shape (bf16, random weights), 1000 requests
# at once (NUM_PROMPTS), each part under OUT_DIR/<part>/throughput.json:
# prefix: one 1024-token system prompt + a 64-256-token question each, 128 out, prefix
#   caching on (the default) vs prefix_caching=false; HF's continuous batching on the first
#   HF_PROMPTS (16; 0: none) requests beside them; prefix512: the same at max_batch_size 512
#   (the pool the cached prefix saves takes twice the sequences), without HF
# uniform: 512 / 256 (prompts 128-896, outputs 64-448): on vs off at a 0% hit rate
# sharegpt: sharegpt-like (lognormal) at max_seq_len 8192, 2048, then 8192 again (the
#   order's drift, seen before as 1-4%, shows as the two 8192 runs' difference)
# preemption: PREEMPT_PROMPTS (300) uniform 512 / 256 requests in BLOCKS blocks, preemption
#   auto, then recompute, then swap
# oversubscribed: uniform 512 / 256 with a pool of BLOCKS (3072) blocks, a quarter of what
#   the batch wants (256 x (512 + 256) / 16 = 12288), preemption PREEMPTION (auto); 8
#   requests rerun alone after it (--check-alone); COMPARE=preemption=recompute adds a run
# Estimates, from docs/BENCHMARKS.md's ~8,000 out tok/s on uniform 512 / 256 (32 s a run)
# and HF's ~224 tok/s: start 30 s (install, imports, the HF model, the matmul rate); the
# first engine build ~60 s (Triton compiles), each later one ~15 s (graph captures);
# prefix 170 s (on ~20 s: 160 new prompt tokens a request; off ~55 s: 1.18M prompt tokens;
# HF 16 requests with its own warm-up ~25 s), uniform 95 s (2 x 33), sharegpt 115 s
# (2 x 42: 338k output tokens), oversubscribed 85 s (~57 s at ~4,500 tok/s, alone 8 x
# ~1.5 s): ~495 s. A part whose estimate would end past DEADLINE (520 s from the start) is
# skipped, and the whole is cut at LIMIT (540 s): what finished stays under OUT_DIR.
set -u
OUT=${1:?OUT_DIR}
shift
PARTS=${*:-prefix uniform sharegpt oversubscribed}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export INFERGRAFT_COMMIT=${INFERGRAFT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
N=${NUM_PROMPTS:-1000}
PREEMPTION=${PREEMPTION-auto}  # PREEMPTION= : the build's default, no --preemption
COMMON="--model ${MODEL:-llama3-8b} --num-prompts $N"
HF_N=${HF_PROMPTS:-16}
if [ "$HF_N" = 0 ]; then HF=--no-hf; else HF="--hf-num-prompts $HF_N"; fi
# part|estimate (s)|flags
RUNS=(
  "prefix|170|--dataset prefix --prompt-len 1024 --output-len 128 $HF --compare-options prefix_caching=false"
  "prefix512|120|--dataset prefix --prompt-len 1024 --output-len 128 --max-batch-size 512 --no-hf --compare-options prefix_caching=false"
  "uniform|95|--dataset uniform --prompt-len 512 --output-len 256 --no-hf --compare-options prefix_caching=false"
  "sharegpt|150|--dataset sharegpt-like --max-seq-len 8192 --no-hf --compare-options max_seq_len=2048,max_seq_len=8192"
  "preemption|110|--dataset uniform --prompt-len 512 --output-len 256 --no-hf --num-prompts ${PREEMPT_PROMPTS:-300} --num-blocks ${BLOCKS:-3072} --preemption auto --compare-options preemption=recompute,preemption=swap"
  "oversubscribed|85|--dataset uniform --prompt-len 512 --output-len 256 --no-hf --num-blocks ${BLOCKS:-3072} --check-alone ${CHECK_ALONE:-8}${PREEMPTION:+ --preemption $PREEMPTION}${COMPARE:+ --compare-options $COMPARE}"
)
SELECTED=()
for run in "${RUNS[@]}"; do
  case " $PARTS " in *" ${run%%|*} "*) SELECTED+=("$run");; esac
done
# one process: the HF model (16 GB of random weights) made once, every part's engines
# built on it, one alive at a time
timeout "${LIMIT:-540}" python3 - "$OUT" "$SECONDS" "${DEADLINE:-520}" "$COMMON" \
  "${SELECTED[@]}" <<'EOF' 2>&1 | tee "$OUT/kv_memory.txt" | grep -E \
  "^==|^ +infergraft|Output token throughput|/ infergraft|P50 TTFT \(ms\)|Prefix cache|Preemptions|K/V blocks|full length|as alone|error|failed|Traceback"
import functools
import json
import sys
import time

import torch

from infergraft.core.tools import bench_cli, bench_throughput as bt
from infergraft.core.tools.bench_variants import free_device

out, started, deadline, common, *runs = sys.argv[1:]
t0 = time.time() - float(started)
hf_model = functools.lru_cache(bench_cli.load_hf)


def load_models(name, device, dtype, *sizes, **kw):
    hf = hf_model(name, device, dtype)
    return hf, bt.build_engine(hf, device, dtype, *sizes, **kw)


bt.load_models = load_models
for run in runs:
    part, estimate, flags = run.split("|")
    at = time.time() - t0
    if at + float(estimate) > float(deadline):
        print(f"== skipped {part}: at {at:.0f} s its ~{estimate} s would end past {deadline} s")
        continue
    print(f"== {part} at {at:.0f} s: {flags}", flush=True)
    try:
        rc = bt.main(common.split() + flags.split() + ["--out", f"{out}/{part}"])
    except (Exception, SystemExit) as e:  # the next part still gets its chance
        rc = f"{type(e).__name__}: {e}"
    try:
        data = json.load(open(f"{out}/{part}/throughput.json"))
    except OSError:
        data = {"runs": {}, "variants": []}
    free_device()  # what HF's cache left too: the next part's pool is sized to what is free
    print(f"== {part} done at {time.time() - t0:.0f} s, rc {rc}; "
          f"{torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0:.1f} "
          "GiB left allocated")
    for name, s in [*data["runs"].items(), *((v["name"], v) for v in data["variants"])]:
        kv, vs = s.get("kv") or {}, s.get("vs_base") or {}
        print(f"==   {name}: {s.get('output_throughput', 0):.0f} out tok/s, TTFT P50 "
              f"{(s.get('ttft_ms') or {}).get('p50') or 0:.0f} ms, vs base {vs}, kv {kv}, "
              f"full length {s.get('full_length')}, alone {s.get('alone')}, "
              f"device {s.get('device')}", flush=True)
EOF
