"""Where a speculative verify step's host time goes, apart from the model's forward, on
the CPU: a tiny random LLaMA (core/testing/models.py) with the paged cache, its decode
and mixed-step graph inputs filled as on CUDA (``use_graphs=False``: the same static
buffers, no replay) and the next step scheduled ahead as on one CUDA device; the same
requests (prompts that repeat a phrase, so n-gram drafts are kept) on a plain engine
(greedy: the decode look-ahead) and on one with ``{"method": "ngram", "k": K}``.

Each ``engine.step`` is timed whole and in parts (perf_counter around the engine's,
runner's and speculator's methods; a part's time includes the parts indented under it).
"host apart from the model" is the whole step less the model's forward: on a GPU the
forward is a graph replay the host only launches, and this is what the host adds to it
(plain steps: the look-ahead launches the next step first, so there it runs beside the
GPU's forward; a verify step's does not). The cost fit and ``AdaptiveK``'s pauses are
bypassed (every decode step proposes), so both trees verify the same drafts.

    python docs/bench/speculative_host.py [--batch 1] [--k 4] [--new-tokens 160]
        [--prompt-tokens 72] [--rounds 5] [--before REF] [--async-steps] [--profile]

``--async-steps``: both engines built with ``async_steps=True`` (as on one CUDA device:
plain steps and, where the tree has them, verify steps launched before the last is read;
"host apart from the model" is then the host's work a step, which runs beside the GPU's
forward rather than after it). ``--before REF``: also measures the tree of git ``REF`` (``git archive`` into a scratch
folder, imported in a subprocess), rounds alternating between the two; the table then
has both. ``--profile``: cProfile's top functions over the verify steps instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

# (label, depth): a part's time includes those under it at a greater depth
PARTS = [("whole step", 0), ("host apart from the model", 1), ("schedule", 1),
         ("extend (drafts)", 1), ("propose", 2), ("forward (runner)", 1),
         ("graph inputs", 2), ("model", 2), ("split", 1), ("sample", 1), ("accept", 1),
         ("verify", 2), ("roll back", 2), ("append", 1), ("look-ahead (launch, read)", 1),
         ("observe (cost fit)", 1)]
KINDS = ("decode", "verify")


def repeating(n: int, length: int, seed: int) -> list[int]:
    """A random phrase of ``n`` tokens repeated to ``length`` tokens."""
    from infergraft.core.testing.models import random_prompt
    return (random_prompt(n, 256, seed) * (length // n + 1))[:length]


class Clock:
    """Seconds each part took in the step being timed (wrapped methods add to it)."""

    def __init__(self):
        self.now: dict = defaultdict(float)
        self.kind = "decode"

    def wrap(self, owner, name: str, label: str) -> None:
        """``owner.name`` timed under ``label`` (skipped where this tree has no such
        method: the table leaves that part blank)."""
        fn = getattr(owner, name, None)
        if fn is None:
            return
        now, perf = self.now, time.perf_counter

        def timed(*args, **kw):
            t = perf()
            try:
                return fn(*args, **kw)
            finally:
                now[label] += perf() - t
        setattr(owner, name, timed)


def instrument(engine, clock: Clock) -> None:
    from infergraft.core.speculative import adaptive, speculator as spec_module

    for name in ("schedule", "resume", "schedule_ahead"):
        clock.wrap(engine.scheduler, name, "schedule")
    clock.wrap(engine.runner, "forward", "forward (runner)")
    for name in ("prepare_step_into", "prepare_decode_into"):
        clock.wrap(engine.cache, name, "graph inputs")
    clock.wrap(engine.runner.model, "forward", "model")
    clock.wrap(engine, "_sample", "sample")
    clock.wrap(engine, "_append", "append")
    clock.wrap(engine.lookahead, "advance", "look-ahead (launch, read)")
    spec = engine.speculation
    if spec is None:
        return
    # every greedy request proposes at every decode step: no cost rule, no pause (a pause
    # under the look-ahead ended differently before f4dfb2a: the same steps in both trees)
    spec.cost.share = lambda *args, **kw: 0.0
    adaptive.MISSES_BEFORE_PAUSE = 1 << 30
    extend = spec.extend
    ahead = getattr(spec, "ahead", None)  # verify steps launched ahead (this tree has it)
    if ahead is not None:  # every drafted request launched ahead: no timing decides
        ahead.cost.gambles = lambda whole: True
        clock.wrap(ahead, "settle", "accept")

    def extend_and_classify(step, **kw):  # (ahead=: a step launched ahead's)
        out = extend(step, **kw)
        clock.kind = "verify" if out.drafts is not None else \
            "prefill" if out.kind == "prefill" else "decode"
        return out
    spec.extend = extend_and_classify
    clock.wrap(spec, "extend", "extend (drafts)")
    clock.wrap(spec.drafter, "propose", "propose")
    clock.wrap(spec, "split", "split")
    clock.wrap(spec, "accept", "accept")
    clock.wrap(spec, "_roll_back", "roll back")
    clock.wrap(spec, "observe", "observe (cost fit)")
    for name in ("verify_request", "verify_drafts"):  # the module's, as accept calls it
        clock.wrap(spec_module, name, "verify")


def build(speculative, args):
    """An engine of the tiny model on the CPU, its graph inputs as on CUDA."""
    import torch

    from infergraft import core
    from infergraft.core.runner.cuda_graph import CudaGraphRunner
    from infergraft.core.runner.step_graph import StepGraphRunner
    from infergraft.core.speculative.config import draft_rows
    from infergraft.core.testing.models import random_model, tiny_llama_config

    torch.set_num_threads(1)
    length = -(-(args.prompt_tokens + args.new_tokens + 8) // 64) * 64
    hf = random_model(tiny_llama_config(max_position_embeddings=length), seed=5, scale=5.0)
    engine = core.build(hf, plugins=["paged"], block_size=16, max_seq_len=length,
                        max_batch_size=args.batch, dtype="float32", device="cpu",
                        max_num_batched_tokens=512, prefix_caching=False,
                        speculative=speculative, **args.build)
    net = engine.runner.model
    engine.decode_graphs = CudaGraphRunner(net, engine.cache, args.batch, use_graphs=False)
    engine.decode_graphs.capture()
    extra = draft_rows(engine.speculation and engine.speculation.config, args.batch)
    engine.runner.step_graphs = StepGraphRunner(net, engine.cache, 512, args.batch,
                                                use_graphs=False, extra_rows=extra)
    engine.runner.step_graphs.capture()
    engine.schedule_ahead = True  # as on one CUDA device
    return engine


def one_round(engine, clock: Clock, args, profile=None) -> tuple[dict, list]:
    """The batch's requests to the end: kind -> {part: [seconds a step]}, their tokens."""
    import torch

    from infergraft.core.request import SamplingParams

    seqs = [engine.add_request(repeating(6 + i, args.prompt_tokens, 10 + i),
                               SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
            for i in range(args.batch)]
    steps = {kind: defaultdict(list) for kind in (*KINDS, "prefill")}
    with torch.inference_mode():
        while engine.has_unfinished():
            clock.now.clear()
            clock.kind = "decode"
            prefilling = any(s.prefilling for s in engine.scheduler.running) or \
                engine.scheduler.waiting
            if profile is not None:
                profile.enable()
            t = time.perf_counter()
            engine.step()
            whole = time.perf_counter() - t
            if profile is not None:
                profile.disable()
            kind = "prefill" if prefilling else clock.kind
            clock.now["whole step"] = whole
            clock.now["host apart from the model"] = whole - clock.now.get("model", 0.0)
            for label, _ in PARTS:
                steps[kind][label].append(clock.now.get(label, 0.0))
    return steps, [s.output_ids for s in seqs]


def measure(args) -> dict:
    """One tree's figures: {"plain"/"ngram": kind -> {part: mean us a step}, ...}."""
    import cProfile

    plain = build(None, args)
    spec = build({"method": "ngram", "k": args.k}, args)
    clocks = {"plain": Clock(), "ngram": Clock()}
    instrument(plain, clocks["plain"])
    instrument(spec, clocks["ngram"])
    profile = cProfile.Profile() if args.profile else None
    out = {"rounds": []}
    for r in range(args.rounds + 1):  # the first: warm-up
        got = {}
        for name, engine in (("plain", plain), ("ngram", spec)):
            steps, tokens = one_round(engine, clocks[name], args,
                                      profile if name == "ngram" and r else None)
            got[name] = {kind: {label: 1e6 * sum(v) / len(v) for label, v in parts.items()}
                         | {"steps": len(parts["whole step"])}
                         for kind, parts in steps.items() if parts}
            got[name + "_tokens"] = tokens
        got["same_tokens"] = got.pop("plain_tokens") == got.pop("ngram_tokens")
        stats = spec.stats()
        got["accepted_length"] = 1 + stats["spec_decode_num_accepted_tokens"] / \
            max(1, stats["spec_decode_num_drafts"])
        if r:
            out["rounds"].append(got)
    if profile is not None:
        import pstats
        pstats.Stats(profile).sort_stats("tottime").print_stats(35)
    return out


def best(rounds: list, engine: str, kind: str) -> dict | None:
    """The round whose steps of ``kind`` took least (the least disturbed by other work)."""
    have = [r[engine][kind] for r in rounds if kind in r[engine]]
    return min(have, key=lambda parts: parts["whole step"]) if have else None


def table(results: dict) -> str:
    """Markdown: us a step by part, plain decode and verify steps, per tree."""
    cols = []  # (header, parts)
    for tree, res in results.items():
        for engine, kind in (("plain", "decode"), ("ngram", "verify")):
            parts = best(res["rounds"], engine, kind)
            if parts is not None:
                cols.append((f"{tree}: {'plain decode' if engine == 'plain' else 'verify'}"
                             f" ({parts['steps']})", parts))
    lines = ["| part (us a step) | " + " | ".join(h for h, _ in cols) + " |",
             "| --- |" + " ---: |" * len(cols)]
    for label, depth in PARTS:
        cells = [f"{p[label]:.0f}" if p.get(label) else "" for _, p in cols]
        if any(cells):
            name = "&nbsp;&nbsp;" * depth + (f"**{label}**" if depth < 2 and label in (
                "whole step", "host apart from the model") else label)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: dict) -> str:
    out = []
    for tree, res in results.items():
        r = res["rounds"]
        steps = {name: sum(k.get("steps", 0) for k in r[-1][name].values())
                 for name in ("plain", "ngram")}
        out.append(f"{tree}: accepted length {r[-1]['accepted_length']:.2f}, same tokens as "
                   f"plain in every round: {all(x['same_tokens'] for x in r)}; engine steps "
                   f"a round: plain {steps['plain']}, ngram {steps['ngram']}")
    return "\n".join(out)


def scratch_tree(ref: str, root: str) -> str:
    """``ref``'s tree as an importable ``infergraft`` under ``root`` (its sys.path entry)."""
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True, cwd=os.path.dirname(__file__)).stdout.strip()
    dest = os.path.join(root, "infergraft")
    os.makedirs(dest)
    archive = subprocess.run(["git", "archive", ref, "core", "plugins", "policies", "kernels"],
                             capture_output=True, check=True, cwd=repo).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return root


def in_subprocess(args, path: str | None) -> dict:
    env = dict(os.environ)
    if path is not None:  # before the editable install's finder
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--json", "--rounds", "1", "--batch", str(args.batch),
           "--k", str(args.k), "--new-tokens", str(args.new_tokens), "--prompt-tokens",
           str(args.prompt_tokens)] + (["--async-steps"] if args.async_steps else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--prompt-tokens", type=int, default=72)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="a git ref measured too, rounds alternating")
    parser.add_argument("--async-steps", action="store_true",
                        help="both engines with async_steps=True (a tree that has them: "
                             "verify steps launched ahead where it has those)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.build = {"async_steps": True} if args.async_steps else {}
    if args.json:
        print(json.dumps(measure(args)))
        return
    if args.before is None:
        results = {"this tree": measure(args)}
    else:
        with tempfile.TemporaryDirectory() as root:
            path = scratch_tree(args.before, root)
            results = {f"before ({args.before})": {"rounds": []}, "after": {"rounds": []}}
            for _ in range(args.rounds):  # alternating: a load that comes and goes is shared
                for tree, p in zip(results, (path, None)):
                    results[tree]["rounds"] += in_subprocess(args, p)["rounds"]
    print(summary(results))
    print(table(results))


if __name__ == "__main__":
    main()
