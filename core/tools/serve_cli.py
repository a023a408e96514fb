"""``infergraft serve``: the OpenAI-compatible HTTP server (core/serving/app.py) on
uvicorn, over an engine stepping in a process of its own on a GPU
(serving/engine_process.py), else (the CPU, torchrun's rank 0) an AsyncEngine on its own
thread.

SIGTERM (or Ctrl-C) stops accepting connections, lets the running requests finish (30 s
at most, then they are aborted), shuts the engine down and exits 0 (Ctrl-C: 130). Under
torchrun with ``--plugin tp`` or ``pp``, rank 0 serves and the other ranks follow its
steps; when a rank fails or dies, the requests in flight end with an error naming it, the
server stops, and every surviving rank exits 1 (or on the SIGTERM torchrun's agent sends
once a worker died) within the collective timeout (``INFERGRAFT_COLLECTIVE_TIMEOUT``,
core/distributed/failure.py). Needs the ``serve`` extra: ``pip install 'infergraft[serve]'``."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading

from ..build import build
from ..errors import InfergraftError, RankFailedError
from ..memory import MAX_SEQ_LEN_DEFAULT
from ..serving.body import DEFAULT_MAX_REQUEST_BYTES
from ..serving.tool_calls import FAMILIES as TOOL_CALL_FAMILIES
from ..units import parse_bytes
from .config_cli import (REVISION_HELP, add_config_argument, add_speculative_argument,
                         build_options)

DEFAULT_MODEL = "smollm2-135m"  # as `infergraft generate`
GRACE_S = 30  # seconds open requests get after SIGTERM before they are cancelled


class ServeSetupError(InfergraftError):
    """``infergraft serve`` cannot start (the serve extra is missing, a bad option)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Serve a model over HTTP with OpenAI's API: /v1/models, "
                     "/v1/completions, /v1/chat/completions (streaming as server-sent "
                     "events), /health, /metrics (Prometheus) and a chat page at /.")
    p.add_argument("--model", default=None,
                   help=f"HF model directory, hub id in the Hugging Face cache (org/name) or "
                        f"alias (default: the --config's model, else {DEFAULT_MODEL}); also "
                        f"the model name clients send")
    p.add_argument("--revision", default=None, help=REVISION_HELP)
    add_config_argument(p)
    p.add_argument("--plugin", action="append", help="plugin name to use (repeatable)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 (default: "
                        "$INFERGRAFT_API_KEY if set, else no key)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="sequences decoded together at most (default: the planner's)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond the batch before new ones get 503 "
                        "(default 256)")
    p.add_argument("--max-request-bytes", type=_size, default=DEFAULT_MAX_REQUEST_BYTES,
                   metavar="SIZE",
                   help="largest request body taken, e.g. 16MiB; a larger one gets 413 "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES // 2 ** 20}MiB)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"context length: prompt + completion tokens (default: "
                        f"{MAX_SEQ_LEN_DEFAULT})")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step carries at most, decode tokens and prompt chunks "
                        "together (default: the engine's)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_FAMILIES), default=None,
                   help="how chat requests with tools have the model's calls read back: "
                        "hermes (Hermes, Qwen: <tool_call>), llama3_json (LLaMA 3.x: bare "
                        "JSON), mistral ([TOOL_CALLS]); default: the one the chat template "
                        "asks for, else hermes")
    add_speculative_argument(p)
    p.add_argument("--prefill-graphs", action="store_true",
                   help="caches without mixed-step graphs (contiguous): replay a captured "
                        "graph for a prompt prefilled with nothing else running (CUDA; the "
                        "paged cache replays every step from graphs anyway)")


def _size(text: str) -> int:
    try:
        size = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def _imports():
    try:
        import uvicorn

        from ..serving.app import create_app
        from ..serving.async_engine import AsyncEngine
    except ImportError as e:
        raise ServeSetupError(f"infergraft serve needs the serve extra ({e.name} is "
                              "missing): pip install 'infergraft[serve]'") from e
    return uvicorn, create_app, AsyncEngine


def _check(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ServeSetupError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 1:
        raise ServeSetupError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ServeSetupError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")


def _on_cuda(device) -> bool:
    import torch

    return str(device).startswith("cuda") if device else torch.cuda.is_available()


def run(args) -> int:
    """The ``serve`` command."""
    _check(args)
    uvicorn, create_app, AsyncEngine = _imports()  # before the model loads: fail fast
    api_key = args.api_key or os.environ.get("INFERGRAFT_API_KEY") or None
    first = os.environ.get("RANK", "0") == "0"
    args.model, options = build_options(
        args.config, args.model, DEFAULT_MODEL, plugins=args.plugin or None,
        dtype=args.dtype, device=args.device, max_seq_len=args.max_seq_len,
        max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        revision=args.revision, speculative=args.speculative)
    if not args.prefill_graphs:  # the build's default (None) only when asked for
        options.setdefault("prefill_graphs", False)
    options["progress"] = first
    if "WORLD_SIZE" not in os.environ and _on_cuda(options.get("device")):
        # the engine in a process of its own: on a GPU the HTTP side's Python would hold
        # up the launches; on a CPU a second process contends for the same few cores
        from ..serving.engine_process import EngineProcess

        aengine = EngineProcess.launch(args.model, max_waiting=args.max_waiting, **options)
    elif first:  # built on the thread that steps it (AsyncEngine.build says why)
        aengine = AsyncEngine.build(args.model, max_waiting=args.max_waiting, **options)
    else:
        engine = build(args.model, **options)
        if engine.ranks is not None:
            # rank 0 admits and aborts requests; this rank applies the same at each step
            try:
                AsyncEngine.follow(engine)
            except RankFailedError as e:
                print(f"infergraft serve: {e}", file=sys.stderr, flush=True)
                return 1
            return 0
        aengine = AsyncEngine(engine, max_waiting=args.max_waiting)
    engine = aengine.engine
    app = create_app(aengine, args.model, api_key=api_key,
                     max_request_bytes=args.max_request_bytes,
                     tool_call_parser=args.tool_call_parser)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=GRACE_S, lifespan="on")
    server = uvicorn.Server(config)
    print(f"infergraft serve: {args.model} on http://{args.host}:{args.port} (max batch "
          f"{engine.plan.max_batch_size}, max_seq_len {engine.plan.max_seq_len}, max waiting "
          f"{args.max_waiting}, tool calls read as {app.state.tool_family.name}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it stopped on once it has shut down; under the default
    # SIGTERM action that would kill the process (exit 143) after a clean shutdown
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    stop_watching = _stop_when_failed(aengine, server)
    try:
        asyncio.run(server.serve())
    except SystemExit as e:  # uvicorn's startup failure: the engine is shut down already
        if server.started:
            raise
        raise ServeSetupError(f"the server did not start on {args.host}:{args.port} "
                              f"(uvicorn's log above says why: the port in use?)") from e
    finally:
        stop_watching.set()
        signal.signal(signal.SIGTERM, previous)
    failed = getattr(aengine, "failed", None)
    if failed:  # a rank went away: the engine cannot serve, torchrun should know
        print(f"infergraft serve: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0


def _stop_when_failed(aengine, server) -> threading.Event:
    """Stop ``server`` once the engine's loop has stopped for good (a rank failed); the
    event returned ends the watch."""
    done = threading.Event()

    def watch():
        while not done.wait(0.2):
            if getattr(aengine, "failed", None):
                server.should_exit = True
                return

    threading.Thread(target=watch, daemon=True, name="infergraft-failure-watch").start()
    return done
