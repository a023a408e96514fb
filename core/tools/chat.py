"""``infergraft chat``: a conversation with an instruct model in the terminal.

Every reply samples with the session's settings (temperature, top-k, top-p, max new
tokens; reply i of a session with ``--seed N`` uses seed N + i, so the same lines give
the same replies). A conversation that outgrows ``max_seq_len`` loses its oldest turns,
a Ctrl-C during a reply stops that reply only, and Ctrl-D or an empty line at the prompt
ends the chat (exit status 0), Ctrl-C there too (130, as Ctrl-C ends every command)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from ..errors import InfergraftError
from ..request import SEED_LIMIT, SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Chat with an instruct model. When the conversation outgrows "
                     "--max-seq-len its oldest turns are dropped (a --system message stays). "
                     "Ctrl-C during a reply stops that reply, what it said so far staying in "
                     "the conversation; an empty line or Ctrl-D at the prompt ends (exit "
                     "status 0), Ctrl-C there too (130).")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message, kept when old turns are dropped (default: the "
                        "chat template's own, if it has one)")


def run(args, make_engine: Callable) -> int:
    """The ``chat`` command: ``make_engine(args)`` builds the engine (the CLI's builder)."""
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    SamplingParams(**kw)  # bad sampling values fail before the model loads
    engine = make_engine(args)
    tok = engine.tokenizer
    if engine.ranks is not None:
        print("chat reads the terminal in one process; under torchrun use generate",
              file=sys.stderr)
        return 2
    if tok is None or not getattr(tok, "chat_template", None):
        print("this model has no chat template: use `infergraft generate --raw` for a "
              "base model", file=sys.stderr)
        return 2
    if args.max_new_tokens >= engine.plan.max_seq_len:
        print(f"--max-new-tokens {args.max_new_tokens} leaves no room for a message in "
              f"max_seq_len={engine.plan.max_seq_len}: lower it or raise --max-seq-len",
              file=sys.stderr)
        return 2
    enable_line_editing()
    print("chat with the model; an empty line, Ctrl-D or Ctrl-C ends; Ctrl-C during a "
          "reply stops it", file=sys.stderr)
    return converse(engine, kw, system=args.system)


def enable_line_editing() -> bool:
    """Arrow keys and history in ``input()``: importing ``readline`` is what hooks it
    in. Absent on Windows; and a piped stdin needs none (input() reads it plainly)."""
    if not sys.stdin.isatty():
        return False
    try:
        import readline  # noqa: F401
    except ImportError:
        return False
    return True


def converse(engine, kw: dict, system: str | None = None,
             read_line: Callable | None = None) -> int:
    """Read a line (``input`` unless ``read_line``), reply, repeat, until an empty line or
    EOF (returns 0) or Ctrl-C at the prompt (130, the shell's 128 + SIGINT)."""
    read_line = read_line or input
    history = [] if system is None else [{"role": "system", "content": system}]
    replies = 0
    while True:
        try:
            line = read_line("> ").strip()
        except EOFError:
            print()  # the shell's prompt starts on a line of its own
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        ids = fit_history(engine, history, kw["max_new_tokens"])
        if ids is None:
            history.pop()
            continue
        seed = None if kw["seed"] is None else (kw["seed"] + replies) % SEED_LIMIT
        replies += 1
        try:
            reply, finished = stream_reply(engine, ids, dict(kw, seed=seed))
        except InfergraftError as e:  # a failed reply (NaN logits, say) costs its turn only
            print(f"\ninfergraft: error: {e}", file=sys.stderr)
            history.pop()
            continue
        # An interrupted reply stays as far as it got (the user saw it); one interrupted
        # before its first word goes, with its question, so user and assistant alternate.
        if reply or finished:
            history.append({"role": "assistant", "content": reply})
        else:
            history.pop()


def stream_reply(engine, ids: list[int], kw: dict) -> tuple[str, bool]:
    """Print the reply as it comes; (its text, False if Ctrl-C stopped it)."""
    reply, deltas = "", None
    try:
        deltas = engine.stream(ids, **kw)
        for delta in deltas:
            print(delta, end="", flush=True)
            reply += delta
    except KeyboardInterrupt:
        # Ctrl-C in engine.step already freed the request; in print it has not:
        # closing the stream frees it (a no-op on a stream that has ended)
        if deltas is not None:
            deltas.close()
        print()
        print("(reply interrupted; " + ("what it said so far stays in the conversation)"
              if reply else "it had said nothing: your message is dropped too)"),
              file=sys.stderr)
        return reply, False
    print()
    return reply, True


def fit_history(engine, history: list[dict], max_new_tokens: int) -> list[int] | None:
    """The prompt's token ids for ``history`` (ending in the new user message), dropping
    the oldest user + assistant pairs (a leading system message stays) until prompt +
    ``max_new_tokens`` fit ``max_seq_len``; says so on stderr. None (history untouched)
    when the newest message does not fit even alone."""
    limit = engine.plan.max_seq_len
    head = 1 if history[0]["role"] == "system" else 0
    alone = _prompt_ids(engine, history[:head] + history[-1:])
    if len(alone) + max_new_tokens > limit:
        print(f"(that message is {len(alone)} tokens with the chat template; with "
              f"max_new_tokens={max_new_tokens} it does not fit max_seq_len={limit} even "
              "alone: type a shorter one)", file=sys.stderr)
        return None
    dropped = 0
    ids = _prompt_ids(engine, history)
    while len(ids) + max_new_tokens > limit:
        del history[head:head + 2]
        dropped += 1
        ids = _prompt_ids(engine, history)
    if dropped:
        turns = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
        print(f"(dropped {turns}: the conversation outgrew max_seq_len={limit})",
              file=sys.stderr)
    return ids


def _prompt_ids(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
    return engine.encode(text)
