"""What a step of N constrained rows costs the host, without a model: the constraints'
side of ``structured_overhead.py`` (``RowConstraints``: masks filled, tokens accepted,
forced tokens found), on any machine, at the logits' width of a large model.

``python docs/bench/structured_host.py [--requests 256] [--steps 64] [--vocab 128256]
[--jump] [--out FILE.json]``

N requests, each under a JSON schema of its own (``structured_overhead.schema``: an
array of at least 200 bounded strings), on the demo model's tokenizer (SmolLM2, 49,152
tokens) and logits ``--vocab`` wide (LLaMA-3's 128,256 by default, as
``structured_overhead.py --model llama3-8b`` runs). Each step masks the N rows, picks a
random allowed token per row (seeded: every run walks the same outputs, whose digest it
prints), and appends it as the engine does (``advance``; with ``--jump`` the forced
tokens after it too). The bitmask op is left out (on a GPU it is one launch; on the CPU
the reference implementation would dominate): host time is the fill, the accept and the
jump-forward search. Compile: the N schemas compiled as an engine on a GPU compiles
them (``Vocabulary.device`` "cuda": in background threads), wall time to the last, once
xgrammar knows the grammars of their string lengths (as in ``structured_overhead.py``'s
rounds after the first).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_overhead import schema  # noqa: E402  (the same schemas)

from infergraft import core  # noqa: E402
from infergraft.core.logits_processor import Vocabulary, bitmask_words  # noqa: E402
from infergraft.core.runner.constraints import RowConstraints  # noqa: E402


class Request:
    """What ``RowConstraints`` reads of a request (``core.request.Sequence``'s fields)."""

    def __init__(self, params):
        self.params, self.constraints, self.error, self.output_ids = params, None, None, []


def run(args) -> dict:
    from transformers import AutoTokenizer

    from infergraft.core.loading.demo import ensure_demo_model

    tok = AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True))
    width = len(tok)  # the tokens a walk may take: the tokenizer's
    rows = RowConstraints(Vocabulary(args.vocab, frozenset({tok.eos_token_id}), tok, "cuda"),
                          "cpu")
    captured = []
    rows._op = lambda logits, bitmask, index: captured.append((bitmask, index))
    reqs = [Request(core.SamplingParams(max_new_tokens=args.steps * 4, jump_forward=args.jump,
                                        json_schema=schema(i, 0)))
            for i in range(args.requests)]
    # xgrammar keeps the grammar of each string length it compiled (40 of them here): as
    # in structured_overhead.py's rounds after the first, those are known already
    for i in range(min(40, args.requests)):
        warm = Request(core.SamplingParams(json_schema=schema(i, -1)))
        rows.start(warm)
        _ = warm.constraints[0].matcher
    t0 = time.perf_counter()
    for r in reqs:
        rows.start(r)
    for r in reqs:  # (the engine's first mask waits for these)
        _ = r.constraints[0].matcher
    compile_s = time.perf_counter() - t0
    logits = torch.empty(args.requests, 0)  # (read by the op alone, which is left out)
    gen = torch.Generator().manual_seed(0)
    digest = hashlib.sha256()
    mask_s = append_s = 0.0
    for _ in range(args.steps):
        captured.clear()
        t = time.perf_counter()
        failed = rows.mask(logits, reqs)
        mask_s += time.perf_counter() - t
        assert not failed, [reqs[i].error for i in failed]
        tokens = [0] * len(reqs)
        for bitmask, index in captured:  # a random allowed token per row
            words = bitmask[:, :bitmask_words(width)]
            bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.reshape(len(index), -1)[:, :width].bool()
            score = torch.rand(allowed.shape, generator=gen).masked_fill_(~allowed, -1)
            for i, t in zip(index.tolist(), score.argmax(1).tolist()):
                tokens[i] = t
        t = time.perf_counter()
        for r, token in zip(reqs, tokens):
            r.output_ids.append(token)
            assert rows.advance(r, token) is None, r.error
            if args.jump:  # (as the engine asks: only where jump-forward is on)
                r.output_ids += rows.forced(r, 64)
        append_s += time.perf_counter() - t
    for r in reqs:
        digest.update(json.dumps(r.output_ids).encode())
    return {"requests": args.requests, "steps": args.steps, "vocab": args.vocab,
            "jump": args.jump, "compile_s": compile_s,
            "mask_ms_per_step": mask_s / args.steps * 1e3,
            "append_ms_per_step": append_s / args.steps * 1e3,
            "host_ms_per_step": rows.host_seconds / args.steps * 1e3,
            "tokens": sum(len(r.output_ids) for r in reqs), "digest": digest.hexdigest()[:16],
            "sample": tok.decode(reqs[0].output_ids)[:80]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256, help="the logits' width")
    p.add_argument("--jump", action="store_true", help="jump-forward on")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (the walk's own sampling, not timed)
    out = run(args)
    print(f"{out['requests']} rows x {out['steps']} steps, logits {out['vocab']} wide, "
          f"jump-forward {'on' if out['jump'] else 'off'}: constraints' host time "
          f"{out['host_ms_per_step']:.2f} ms/step (mask {out['mask_ms_per_step']:.2f}, "
          f"accept and forced {out['append_ms_per_step']:.2f}); compile of the "
          f"{out['requests']} schemas {out['compile_s']:.2f} s; {out['tokens']} tokens, "
          f"digest {out['digest']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
