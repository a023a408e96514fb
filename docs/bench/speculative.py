"""Speculative decoding (core/speculative/): what n-gram drafts buy where the output quotes
the input, what a verify step costs against a decode step, and a batch's throughput with
speculation on and off, each pair in the same run on the same engine.

``python docs/bench/speculative.py [--parts tpot,verify,batch] [--model smollm2-135m]
[--device cpu] [--k 4] [--ahead both] [--new-tokens 96] [--rounds 3] [--verify-model tiny]
[--context 512] [--batch 32] [--batch-tokens 64] [--out FILE.json]``

tpot: the model (real weights) at batch 1, greedy, on an edit / summarise / code workload
whose answers quote their prompts (speculative_workload.py: three short prompts, two
longer); each prompt alternately with ``speculative=False`` and with n-gram drafts
(``{"method": "ngram", "k": K}``) on one engine (the paged cache, no prefix caching,
asynchronous steps as on one CUDA device, the CPU too), rounds alternating; ``--ahead
both`` (default) runs the drafts on two engines, verify steps launched ahead (``"ahead":
true``, core/speculative/ahead.py) and each after the last is read (false), rounds
alternating between the three (``on`` / ``off``: that one alone). Per prompt: the median
TPOT of each, their ratio, the mean accepted length (tokens a verify step gave, the
target's own included), the share of proposed tokens kept, and whether the tokens were the same (greedy: they must be);
then the workload's row: the prompts' TPOTs weighted by their answers' tokens.
Beside them, in the same run: HF transformers' ``generate`` on the same weights, plain and
with its own prompt lookup (``prompt_lookup_num_tokens=K``), its TPOT as (the time of the
whole answer - that of its first token) / (tokens - 1); and the copy roofline of a decode
step (the weights and the K/V at the answer's mean context, at the copy rate measured then).

verify: ``--verify-model`` (a random shape of ``infergraft bench``, ``llama2-7b`` on a GPU;
or a model directory or alias) holding one sequence of ``--context`` tokens; the forward
of a decode step (1 token; a decode-graph replay on CUDA) against that of a verify step of
1 + k tokens (the mixed-step path: a step-graph replay on CUDA), k = 1, 2, 4, 8: 30 timed
calls each, the k's interleaved, the sequence rolled back after each; their median and
their best (the least disturbed by other work on the machine). The ratio at k is the
bound on what any proposer can gain: a verify step must give more tokens than that.

batch: ``--batch`` requests at once (``ignore_eos``, ``--batch-tokens`` each), of two
workloads: the quoting one and an open-ended one (stories: little to look up), off and on
in alternating rounds; out tok/s (prefills included) and decoding tok/s (the tokens after
the last prompt's first, over the time after it), and on's share of off's (the median over
rounds of each round's ratio).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infergraft import core
from infergraft.core.speculative.proposer import Proposal
from infergraft.core.step import Step
from infergraft.core.tools.bench import copy_bandwidth, random_prompts, sync
from infergraft.core.tools.bench_cli import load_hf
from infergraft.core.tools.provenance import provenance
from infergraft.core.tools.roofline import step_bytes
from infergraft.core.tools.shapes import SHAPES
from speculative_workload import OPEN, WORKLOAD

KS = (0, 1, 2, 4, 8)  # proposed tokens of a verify step (0: a decode step)
WARMUP, REPEATS = 3, 30


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)


def run(engine, prompts, params) -> list:
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


@torch.inference_mode()
def hf_tpot(hf, prompt_ids, new_tokens: int, lookup: int | None, rounds: int) -> float:
    """HF ``generate``'s TPOT (seconds), greedy, its prompt lookup with ``lookup`` tokens
    (None: plain): the whole answer's time less its first token's, over the tokens after
    the first; the median of ``rounds``."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup

    def timed(n):
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

    timed(4)  # warm-up
    tpots = []
    for _ in range(rounds):
        first, _ = timed(1)
        whole, n = timed(new_tokens)
        tpots.append((whole - first) / max(1, n - 1))
    return statistics.median(tpots)


def roofline_tpot(engine, bandwidth: float, context: int) -> float:
    """Seconds a decode step of one sequence at ``context`` must take reading its bytes."""
    plan = engine.plan
    return step_bytes(engine.spec, plan.step_weight_bytes or plan.weight_bytes,
                      plan.kv_bytes_per_token, 1, context) / bandwidth


def tpot_engines(args) -> dict:
    """"ahead" / "synchronous" -> an engine speculating so (``--ahead``), warmed up."""
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.ahead]
    engines = {}
    for ahead in modes:
        engine = core.build(args.model, plugins=["paged"], device=args.device,
                            dtype=args.dtype, max_batch_size=max(args.batch, 1),
                            max_seq_len=1024, prefix_caching=False, async_steps=True,
                            speculative={"method": "ngram", "k": args.k, "ahead": ahead})
        run(engine, [chat(engine, "Hello")], core.SamplingParams(max_new_tokens=8))
        engines["ahead" if ahead else "synchronous"] = engine
    return engines


def tpot_part(args) -> list[dict]:
    engines = tpot_engines(args)
    engine = next(iter(engines.values()))  # (the plain requests': either does)
    hf = load_hf(args.model, args.device, getattr(torch, engine.plan.dtype))  # the same weights
    bandwidth = copy_bandwidth(torch.device(args.device),
                               nbytes=(1 << 30) if str(args.device).startswith("cuda") else 1 << 28)
    rows = []
    for kind in args.prompts.split(","):
        text = WORKLOAD[kind]
        prompt, got = chat(engine, text), {False: [], **{name: [] for name in engines}}
        dropped = {name: e.speculation.ahead.dropped for name, e in engines.items()
                   if e.speculation.ahead is not None}
        for _ in range(args.rounds):
            params = core.SamplingParams(max_new_tokens=args.new_tokens, speculative=False)
            got[False].append(run(engine, [prompt], params)[0])
            for name, e in engines.items():
                params = core.SamplingParams(max_new_tokens=args.new_tokens, speculative=True)
                got[name].append(run(e, [prompt], params)[0])
        extra = {f"{name}_tpot_ms": statistics.median(s.metrics.tpot for s in got[name]) * 1e3
                 for name in engines}
        extra.update({f"{name}_ratio": extra[f"{name}_tpot_ms"] * 1e-3 / statistics.median(
            s.metrics.tpot for s in got[False]) for name in engines})
        # rows of a step launched ahead that were dropped (a draft not kept whole), a round
        extra.update({"dropped_a_round": (engines["ahead"].speculation.ahead.dropped -
                                           dropped["ahead"]) / args.rounds}
                     if "ahead" in dropped else {})
        same = all(a.output_ids == b.output_ids for name in engines
                   for a, b in zip(got[False], got[name]))
        got[True] = got[next(iter(engines))]  # the first mode's figures, as before
        off, on = got[False], got[True]
        tpot = {m: statistics.median(s.metrics.tpot for s in got[m]) for m in (False, True)}
        drafts = sum(s.metrics.num_drafts for s in on)
        kept = sum(s.metrics.num_accepted_tokens for s in on)
        proposed = sum(s.metrics.num_draft_tokens for s in on)
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        n = len(on[0].output_ids)
        hf_plain = hf_tpot(hf, ids, n, None, args.rounds)
        hf_lookup = hf_tpot(hf, ids, n, args.k, args.rounds)
        roof = roofline_tpot(engine, bandwidth, len(ids) + n // 2)
        rows.append({"kind": kind, "tokens": n,
                     "plain_tpot_ms": tpot[False] * 1e3, "ngram_tpot_ms": tpot[True] * 1e3,
                     "ratio": tpot[True] / tpot[False],
                     "mean_accepted_length": 1 + kept / drafts if drafts else None,
                     "acceptance_rate": kept / proposed if proposed else None,
                     "same_tokens": same, "ngram_mode": next(iter(engines)), **extra,
                     "hf_tpot_ms": hf_plain * 1e3, "hf_prompt_lookup_tpot_ms": hf_lookup * 1e3,
                     "roofline_tpot_ms": roof * 1e3, "copy_gb_s": bandwidth / 1e9})
        r = rows[-1]
        print(f"  {kind:<10} {r['tokens']:4d} tokens  TPOT plain {r['plain_tpot_ms']:7.2f} ms  "
              f"ngram {r['ngram_tpot_ms']:7.2f} ms  ({r['ratio']:.2f}x)  accepted length "
              f"{r['mean_accepted_length'] or 0:.2f}  kept {r['acceptance_rate'] or 0:.0%}  "
              f"same tokens: {r['same_tokens']}\n" + "".join(
                  f"  {'':<10} ngram {name}: {r[name + '_tpot_ms']:7.2f} ms "
                  f"({r[name + '_ratio']:.2f}x)\n" for name in engines) +
              f"  {'':<10} {r.get('dropped_a_round', 0):.1f} requests' rows launched ahead "
              f"dropped a round\n  {'':<10} HF generate {hf_plain * 1e3:7.2f} "
              f"ms, its prompt lookup {hf_lookup * 1e3:7.2f} ms ({hf_lookup / hf_plain:.2f}x); "
              f"roofline {roof * 1e3:6.3f} ms (copy {bandwidth / 1e9:.0f} GB/s)", flush=True)
    rows.append(workload_row(rows))
    r = rows[-1]
    print(f"  {'workload':<10} {r['tokens']:4d} tokens  TPOT plain {r['plain_tpot_ms']:7.2f} ms  "
          f"ngram {r['ngram_tpot_ms']:7.2f} ms  ({r['ratio']:.2f}x)  (each prompt's TPOT "
          f"weighted by its tokens); HF {r['hf_tpot_ms']:.2f} ms, its prompt lookup "
          f"{r['hf_prompt_lookup_tpot_ms']:.2f} ms", flush=True)
    return rows


def workload_row(rows) -> dict:
    """The prompts together: each TPOT weighted by its answer's tokens (the time the whole
    workload's decoding took, over its tokens)."""
    tokens = sum(r["tokens"] for r in rows)
    keys = [k for k in rows[0] if k.endswith("_tpot_ms")]
    row = {"kind": "workload", "tokens": tokens,
           **{k: sum(r[k] * r["tokens"] for r in rows) / tokens for k in keys}}
    row["ratio"] = row["ngram_tpot_ms"] / row["plain_tpot_ms"]
    row.update({k.replace("_tpot_ms", "_ratio"): row[k] / row["plain_tpot_ms"] for k in keys
                if k.replace("_tpot_ms", "_ratio") in rows[0]})
    return row


@torch.inference_mode()
def verify_part(args) -> list[dict]:
    name, ctx = args.verify_model, args.context
    model = load_hf(name, args.device, args.dtype) if name in SHAPES else name
    # (speculative: for the mixed-step graphs' logits rows a draft of max(KS) needs)
    engine = core.build(model, plugins=["paged"], device=args.device, dtype=args.dtype,
                        max_batch_size=8, max_seq_len=ctx + 64, prefix_caching=False,
                        speculative={"method": "ngram", "k": max(KS)})
    del model
    vocab = engine.spec.vocab_size
    seq = engine.add_request(random_prompts(1, ctx, vocab)[0],
                             core.SamplingParams(max_new_tokens=32, ignore_eos=True))
    while not seq.output_ids:  # its prefill
        engine.step()
    held, runner = engine.cache.length(seq.id), engine.runner
    steps = {}
    for k in KS:
        tokens = [seq.output_ids[-1]] + random_prompts(1, k, vocab, seed=k)[0] if k else \
            [seq.output_ids[-1]]
        step = Step("decode", [seq], [1 + k], (Proposal(tuple(tokens[1:])),) if k else None)
        steps[k] = (step, tokens, runner.replays_decode(step))
    times = {k: [] for k in KS}
    for i in range(WARMUP + REPEATS):  # the k's interleaved: a load that comes and goes
        for k, (step, tokens, replay) in steps.items():  # shares itself among them
            sync(args.device)
            t0 = time.perf_counter()
            runner.forward(step, tokens, replay)
            sync(args.device)
            if i >= WARMUP:
                times[k].append(time.perf_counter() - t0)
            engine.cache.truncate(seq.id, held)
    rows = []
    for k in KS:
        ms, best = statistics.median(times[k]) * 1e3, min(times[k]) * 1e3
        rows.append({"k": k, "tokens": 1 + k, "ms": ms, "best_ms": best,
                     "ratio": ms / (statistics.median(times[0]) * 1e3),
                     "best_ratio": best / (min(times[0]) * 1e3),
                     "path": "decode graph" if steps[k][2] else
                     ("step graph" if runner.step_graphs is not None else "eager")})
        r = rows[-1]
        print(f"  {'decode' if k == 0 else f'verify k={k}':<12} {1 + k:2d} tokens  median "
              f"{ms:8.3f} ms ({r['ratio']:5.2f}x)  best {best:8.3f} ms ({r['best_ratio']:5.2f}x)"
              f"  ({r['path']})", flush=True)
    engine.abort(seq)
    return rows


def decode_rate(seqs) -> float:
    """Tokens a second while the whole batch decodes: those after the last request's first
    token (every prompt prefilled), over the time from it to the last token."""
    start = max(s.metrics.first_token for s in seqs)
    end = max(s.metrics.token_times[-1] for s in seqs)
    tokens = sum(sum(t > start for t in s.metrics.token_times) for s in seqs)
    return tokens / (end - start) if end > start else float("nan")


def batch_part(args) -> list[dict]:
    engine = core.build(args.model, plugins=["paged"], device=args.device, dtype=args.dtype,
                        max_batch_size=args.batch, max_seq_len=1024, prefix_caching=False,
                        speculative={"method": "ngram", "k": args.k})
    quoting = [chat(engine, t) for t in WORKLOAD.values()]
    stories = [chat(engine, t) for t in OPEN]
    rows = []
    for name, texts in (("quoting", quoting), ("open-ended", stories)):
        prompts = [texts[i % len(texts)] for i in range(args.batch)]
        tok_s, decode_tok_s = {False: [], True: []}, {False: [], True: []}
        accepted = []
        for r in range(args.rounds):
            for on in (False, True):
                params = core.SamplingParams(max_new_tokens=args.batch_tokens,
                                             ignore_eos=True, speculative=on)
                t0 = time.perf_counter()
                seqs = run(engine, prompts, params)
                seconds = time.perf_counter() - t0
                tok_s[on].append(sum(len(s.output_ids) for s in seqs) / seconds)
                decode_tok_s[on].append(decode_rate(seqs))
                if on:
                    m = [s.metrics for s in seqs]
                    accepted.append((sum(x.num_accepted_tokens for x in m),
                                     sum(x.num_draft_tokens for x in m)))
        share = statistics.median(a / b for a, b in zip(tok_s[True], tok_s[False]))
        decode_share = statistics.median(a / b for a, b in zip(decode_tok_s[True],
                                                                decode_tok_s[False]))
        kept, proposed = map(sum, zip(*accepted))
        rows.append({"workload": name, "batch": args.batch, "off_tok_s": statistics.median(
            tok_s[False]), "on_tok_s": statistics.median(tok_s[True]), "on_share": share,
            "off_decode_tok_s": statistics.median(decode_tok_s[False]),
            "on_decode_tok_s": statistics.median(decode_tok_s[True]),
            "on_decode_share": decode_share,
            "acceptance_rate": kept / proposed if proposed else None,
            "draft_tokens_per_request": proposed / args.rounds / args.batch})
        r = rows[-1]
        print(f"  {name:<10} batch {args.batch}: out tok/s off {r['off_tok_s']:7.1f} on "
              f"{r['on_tok_s']:7.1f} ({share:.1%} of off); decoding off "
              f"{r['off_decode_tok_s']:7.1f} on {r['on_decode_tok_s']:7.1f} ({decode_share:.1%})"
              f"  kept {r['acceptance_rate'] or 0:.0%} of {r['draft_tokens_per_request']:.1f} "
              f"proposed a request", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="tpot,verify,batch")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--ahead", choices=("both", "on", "off"), default="both",
                   help="tpot: verify steps launched ahead, each after the last, or both")
    p.add_argument("--prompts", default=",".join(WORKLOAD),
                   help=f"tpot: which of the quoting prompts ({', '.join(WORKLOAD)})")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verify-model", default=None,
                   help="default: llama2-7b on CUDA, the tiny shape on the CPU")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args(argv)
    unknown = set(args.prompts.split(",")) - set(WORKLOAD)
    if unknown:
        p.error(f"--prompts: unknown {', '.join(sorted(unknown))}; the prompts are "
                f"{', '.join(WORKLOAD)}")
    if args.verify_model is None:
        args.verify_model = "llama2-7b" if str(args.device).startswith("cuda") else "tiny"
    if args.dtype is None and str(args.device).startswith("cuda"):
        args.dtype = "bfloat16"
    parts = args.parts.split(",")
    out = {"args": vars(args), **provenance()}
    print(f"speculative decoding, {args.device} ({args.dtype or 'the model dtype'}), "
          f"k={args.k}, {out['commit']}")
    if "tpot" in parts:
        print(f"tpot: {args.model}, batch 1, {args.new_tokens} new tokens at most, median of "
              f"{args.rounds} rounds")
        out["tpot"] = tpot_part(args)
    if "verify" in parts:
        print(f"verify: {args.verify_model}, one sequence of {args.context} tokens, "
              f"{REPEATS} forwards each")
        out["verify"] = verify_part(args)
    if "batch" in parts:
        print(f"batch: {args.model}, {args.batch} requests x {args.batch_tokens} tokens, "
              f"median of {args.rounds} rounds")
        out["batch"] = batch_part(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
