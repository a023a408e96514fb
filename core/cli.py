"""The ``infergraft`` command: generate, chat, plugins (and plan, bench, quantize, serve).

This module parses the arguments and dispatches; ``generate`` lives here, ``chat``,
``plugins``, ``plan``, ``bench``, ``quantize`` and ``serve`` in ``core/tools``. Bad input exits
2 with what was wrong, Ctrl-C exits 130 without a traceback, a reader gone (``| head``)
exits 141 without one. ``DESCRIPTION`` is what ``infergraft --help`` tells a user."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import signal
import sys
import threading

from .build import build
from .errors import InfergraftError, InvalidRequestError
from .memory import MAX_SEQ_LEN_DEFAULT
from .request import SamplingParams
from .tools import chat, plugins_cli, structured_cli
from .tools.config_cli import (REVISION_HELP, add_config_argument, add_speculative_argument,
                               build_options)

DEFAULT_MODEL = "smollm2-135m"
# A write to a pipe whose reader went away: the status of a process that SIGPIPE killed
# (128 + 13), as `cat` or `git log` give under `| head` and `set -o pipefail` reports.
READER_GONE = 141

DESCRIPTION = """\
infergraft runs LLMs (LLaMA, Mistral, Phi-3/4, GPT-2; more through plugins) on a CUDA GPU
or the CPU: one prompt, a chat in the terminal, or an OpenAI-compatible server. A model is
a local Hugging Face directory (config.json and *.safetensors), a hub id already in the
Hugging Face cache (org/name), or the demo alias smollm2-135m (downloaded once).

Each command has its own --help."""

EPILOG = """\
examples:
  infergraft generate "The capital of France is" --max-new-tokens 16
  infergraft chat --model HuggingFaceTB/SmolLM2-135M-Instruct
  infergraft plan ./my-model --max-seq-len 8192 --max-batch-size 16
  infergraft serve --model ./my-model --port 8000

exit status: 0 done, 2 bad input (one line says what was wrong), 130 Ctrl-C,
141 the reader of the output went away (as `| head` does)."""


def _build(args):
    """The engine; under torchrun (``--plugin tp``) only rank 0 prints."""
    first = os.environ.get("RANK", "0") == "0"
    model, options = build_options(args.config, args.model, DEFAULT_MODEL,
                                   plugins=args.plugin or None, dtype=args.dtype,
                                   device=args.device, max_seq_len=args.max_seq_len,
                                   revision=args.revision, speculative=args.speculative)
    engine = build(model, progress=first, **options)
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
    if not args.prompt.strip():  # the chat template would make it non-empty
        raise InvalidRequestError("prompt is empty: give at least one non-blank character "
                                  "(an empty or whitespace-only prompt is refused)")
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or None,
              **structured_cli.constraint_fields(args))
    SamplingParams(**kw)  # bad sampling values fail before the model loads
    engine = _build(args)
    prompt = _prompt_text(engine, args.prompt, args.raw)
    if args.stream:
        seq = _stream(engine, prompt, kw)
        n, finish, metrics = len(seq.output_ids), seq.finish_reason, seq.metrics
    else:
        done = engine.generate(prompt, **kw)[0]
        print(done.text)
        n, finish, metrics = len(done.token_ids), done.finish_reason, done.metrics
    if args.verbose:
        drafts = "" if not metrics.num_drafts else \
            (f", {metrics.mean_accepted_length:.2f} tokens per verify step, "
             f"{metrics.acceptance_rate:.0%} of proposed kept")
        print(f"[{n} tokens, finish={finish}, TTFT {(metrics.ttft or 0) * 1e3:.1f} ms, "
              f"TPOT {(metrics.tpot or 0) * 1e3:.1f} ms, "
              f"{metrics.tokens_per_s or 0:.1f} tok/s{drafts}]", file=sys.stderr)
    return 0


def _stream(engine, prompt: str, kw: dict):
    """Print one request's text as it comes; returns its finished Sequence (``-v`` needs
    its metrics and finish reason)."""
    stream, shown = engine.stream(prompt, **kw), False
    try:
        for delta in stream:
            print(delta, end="", flush=True)
            shown = True
    finally:  # Ctrl-C or a failed step: the stream frees the request; end the line
        stream.close()
        if shown or (stream.request is not None and stream.request.finished):
            print(flush=True)
    return stream.request


def cmd_chat(args) -> int:
    return chat.run(args, make_engine=_build)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"HF model directory, hub id in the Hugging Face cache (org/name) or "
                        f"alias (default: the --config's model, else {DEFAULT_MODEL})")
    p.add_argument("--revision", default=None, help=REVISION_HELP)
    add_config_argument(p)
    p.add_argument("--plugin", action="append", help="plugin name to use (repeatable)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"context length: prompt + output tokens (default: {MAX_SEQ_LEN_DEFAULT})")
    add_speculative_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K likeliest tokens only")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the likeliest tokens holding mass P only")
    p.add_argument("--seed", type=int, default=None,
                   help="makes sampling reproducible: the same seed gives the same output "
                        "(chat: reply i of the session uses SEED + i)")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infergraft", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"infergraft {version()}",
                        help="print the installed infergraft's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, title="commands")
    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print latency metrics")
    structured_cli.add_arguments(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat (instruct models)")
    _model_args(c)
    chat.add_arguments(c)
    c.set_defaults(func=cmd_chat)
    p = sub.add_parser("plugins", help="list registered plugins")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=plugins_cli.run)
    b = sub.add_parser("bench", help="decode/prefill benchmark beside HF transformers")
    from .tools.bench_cli import add_arguments, run as run_bench
    add_arguments(b)
    b.set_defaults(func=run_bench)
    # `bench serve`, `bench throughput`: optional subcommands, so that plain `bench FLAGS`
    # parses as before
    from .tools.bench_serve import add_arguments as serve_bench_arguments, run as run_serve_bench
    from .tools.bench_throughput import add_arguments as throughput_arguments, \
        run as run_throughput
    bench_sub = b.add_subparsers(dest="bench_command", metavar="{serve,throughput}")
    bs = bench_sub.add_parser(
        "serve", help="serving benchmark of an OpenAI-compatible server (as vllm bench serve)")
    serve_bench_arguments(bs)
    bs.set_defaults(func=run_serve_bench)
    bt = bench_sub.add_parser(
        "throughput", help="offline throughput of our engine beside HF's continuous "
                           "batching and the compute floor (as vllm bench throughput)")
    throughput_arguments(bt)
    bt.set_defaults(func=run_throughput)
    m = sub.add_parser("plan", help="memory plan of a model (no weights loaded)")
    from .tools.plan_cli import add_arguments as plan_arguments, run as run_plan
    plan_arguments(m)
    m.set_defaults(func=run_plan)
    q = sub.add_parser("quantize", help="write a 4-bit GPTQ checkpoint of a model (GPTQ or "
                                        "round to nearest)")
    from .tools.quantize_cli import add_arguments as quantize_arguments, run as run_quantize
    quantize_arguments(q)
    q.set_defaults(func=run_quantize)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from .tools.serve_cli import add_arguments as serve_arguments, run as run_serve
    serve_arguments(s)
    s.set_defaults(func=run_serve)
    return parser


def version() -> str:
    """The installed distribution's version (an uninstalled checkout has none)."""
    try:
        return importlib.metadata.version("infergraft")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: no package metadata)"


def main(argv=None) -> int:
    """Run one command; its exit status. A reader gone (``infergraft plugins | head -1``)
    exits 141 quietly (Python's own recipe: catch BrokenPipeError, point stdout at
    devnull); stdout is flushed in here, so that a failed write cannot wait for exit."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # a captured stdout has no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE


def _main(argv) -> int:
    args = make_parser().parse_args(argv)
    with _noting_interrupts() as interrupted:
        try:
            return args.func(args)
        except InfergraftError as e:
            if not interrupted:
                print(f"infergraft: error: {e}", file=sys.stderr)
                return 2
        # Ctrl-C in any command: the shell's convention (128 + SIGINT), not a traceback
        except KeyboardInterrupt:
            pass
        # the KeyboardInterrupt raised inside an extension (safetensors reading a
        # tensor) can come out as that extension's own error
        except Exception:
            if not interrupted:
                raise
    print("infergraft: interrupted", file=sys.stderr)
    return 130


@contextlib.contextmanager
def _noting_interrupts():
    """Yields a list that SIGINT appends to (then raising KeyboardInterrupt as Python's own
    handler does); outside the main thread, where signals cannot be handled, an empty one."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
