"""Several ``infergraft bench throughput`` runs in one process, on one HF model built once
(a random LLaMA-3-8B shape takes a while to initialise), for one device call:

    python3 docs/bench/throughput_runs.py OUT DEADLINE_S RUN [RUN ...]

RUN is ``dataset:prompt_len:output_len:num_prompts:budgets[:hf_prompts[:eager]]`` (budgets a
comma list, hf_prompts 0 for no HF, eager 1 for INFERGRAFT_STEP_GRAPHS=0). Each run writes
OUT/<dataset>-<budgets>[-eager]/throughput.json as the command itself does; runs that would
start after DEADLINE_S seconds are skipped. STEP_GAPS=0: without ``--step-gaps``;
STEP_CENSUS=1: with ``--step-census`` (every step classed and timed, a table a run).
MAX_BATCH=N: ``--max-batch-size N`` on every run (the engine's default otherwise).
COMPARE=VARIANTS: ``--compare-options VARIANTS`` on every run, e.g. COMPARE=async_steps=true
(asynchronous steps on, then off, on the same requests: each row with its GPU idle share).
"""
import os
import sys
import time

from infergraft.core.tools import bench_cli, bench_throughput as bt

MODEL = os.environ.get("MODEL", "llama3-8b")
GAPS = ["--step-gaps"] if os.environ.get("STEP_GAPS", "1") == "1" else []
GAPS += ["--step-census"] if os.environ.get("STEP_CENSUS") == "1" else []
GAPS += ["--compare-options", os.environ["COMPARE"]] if os.environ.get("COMPARE") else []
GAPS += ["--max-batch-size", os.environ["MAX_BATCH"]] if os.environ.get("MAX_BATCH") else []
_hf = {}
LOAD_MODELS = bt.load_models


def cached_models(name, device, dtype, *sizes, **kw):
    """bench_cli.load_models with HF's model made once per name."""
    if name not in _hf:
        _hf[name] = bench_cli.load_hf(name, device, dtype)
    hf = _hf[name]
    return hf, bt.build_engine(hf, device, dtype, *sizes, **kw)


def main(out, deadline, *runs):
    bt.load_models = cached_models
    t0 = time.time()
    for run in runs:
        if time.time() - t0 > float(deadline):
            print(f"== skipped {run}: past {deadline} s", flush=True)
            continue
        dataset, plen, olen, n, budgets, *rest = run.split(":")
        hf_n, eager = (rest + ["0", "0"])[:2]
        os.environ["INFERGRAFT_STEP_GRAPHS"] = "0" if eager == "1" else "1"
        name = f"{dataset}-{budgets.replace(',', '_')}" + ("-eager" if eager == "1" else "")
        argv = ["--model", MODEL, "--dataset", dataset, "--prompt-len", plen, "--output-len",
                olen, "--num-prompts", n, "--max-num-batched-tokens", budgets,
                "--out", f"{out}/{name}"] + GAPS + (["--hf-num-prompts", hf_n] if hf_n != "0"
                                             else ["--no-hf"])
        print(f"== {name} at {time.time() - t0:.0f} s", flush=True)
        try:
            bt.main(argv)
        except Exception as e:  # the next run still gets its chance
            print(f"== {name} failed: {type(e).__name__}: {e}", flush=True)
        sys.stdout.flush()
    bt.load_models = LOAD_MODELS


if __name__ == "__main__":
    main(*sys.argv[1:])
