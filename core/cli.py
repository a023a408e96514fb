"""The ``infergraft`` command: generate, chat, plugins (and plan, bench)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .build import build
from .errors import InfergraftError
from .plugin_manager import get_plugin_manager
from .request import SamplingParams

DEFAULT_MODEL = "smollm2-135m"


def _build(args):
    """The engine; under torchrun (``--plugin tp``) only rank 0 prints."""
    first = os.environ.get("RANK", "0") == "0"
    engine = build(args.model, plugins=args.plugin or None, dtype=args.dtype,
                   device=args.device, max_seq_len=args.max_seq_len, progress=first)
    if not first:
        sys.stdout = open(os.devnull, "w")
    return engine


def _prompt_text(engine, text: str, raw: bool) -> str:
    tok = engine.tokenizer
    if raw or tok is None or not getattr(tok, "chat_template", None):
        return text
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=False)


def cmd_generate(args) -> int:
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None)
    SamplingParams(**kw)  # bad sampling values fail before the model loads
    engine = _build(args)
    prompt = _prompt_text(engine, args.prompt, args.raw)
    if args.stream:
        for delta in engine.stream(prompt, **kw):
            print(delta, end="", flush=True)
        print()
        return 0
    done = engine.generate(prompt, **kw)[0]
    print(done.text)
    if args.verbose:
        m = done.metrics
        print(f"[{len(done.token_ids)} tokens, finish={done.finish_reason}, "
              f"TTFT {m.ttft * 1e3:.1f} ms, TPOT {(m.tpot or 0) * 1e3:.1f} ms, "
              f"{m.tokens_per_s or 0:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = _build(args)
    tok = engine.tokenizer
    if engine.ranks is not None:
        print("chat reads the terminal in one process; under torchrun use generate",
              file=sys.stderr)
        return 2
    if tok is None or not getattr(tok, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    history = []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        reply = ""
        for delta in engine.stream(prompt, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p):
            print(delta, end="", flush=True)
            reply += delta
        print()
        history.append({"role": "assistant", "content": reply})
    return 0


def plugin_rows(pm=None) -> list[dict]:
    """One row per registered object (kind, name) and per plugin that registers none
    (kind "hooks", e.g. a prepare_plan-only plugin), with where it came from."""
    pm = pm or get_plugin_manager()
    rows, seen = [], set()
    for kind, reg in pm.registries().items():
        for name in reg.names():
            seen.add(reg.origin(name))
            rows.append(_row(pm, kind, name, reg.origin(name)))
    rows += [_row(pm, "hooks", p, p) for p in pm.info if p not in seen]
    return rows


def _row(pm, kind: str, name: str, plugin: str) -> dict:
    info = pm.info[plugin]
    return {"kind": kind, "name": name, "plugin": plugin, "version": info.version,
            "contract": info.contract, "origin": info.origin, "module": info.module,
            "hooks": pm.hook_names(plugin)}


def cmd_plugins(args) -> int:
    rows = plugin_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("kind", "name", "plugin", "version", "contract", "origin")
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip())
    if not rows:
        print("(no plugins registered)")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF model directory or alias (default {DEFAULT_MODEL})")
    p.add_argument("--plugin", action="append", help="plugin name to use (repeatable)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infergraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print latency metrics")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat (instruct models)")
    _model_args(c)
    c.set_defaults(func=cmd_chat)
    p = sub.add_parser("plugins", help="list registered plugins")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)
    b = sub.add_parser("bench", help="decode/prefill benchmark beside HF transformers")
    from .tools.bench_cli import add_arguments, run as run_bench
    add_arguments(b)
    b.set_defaults(func=run_bench)
    m = sub.add_parser("plan", help="memory plan of a model (no weights loaded)")
    from .tools.plan_cli import add_arguments as plan_arguments, run as run_plan
    plan_arguments(m)
    m.set_defaults(func=run_plan)
    return parser


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except InfergraftError as e:
        print(f"infergraft: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
