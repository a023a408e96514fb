"""Run a function on N local processes forming a torch.distributed group (gloo, CPU), and
an HF-parity worker for planners that split the model across them.

    results = run_ranks(tp_parity, 2, config, ["tp"], prompts)   # one dict per rank

Each rank is a fresh process forked from a forkserver that has imported torch and
transformers once (on NCCL, or ``start_method="spawn"``: a fresh interpreter, as torchrun
starts); it takes the caller's environment. ``fn`` must be importable (module level) and
return JSON-able data. A rank that fails fails the call with its traceback (unless
``outcomes=True``: then each rank's result, error or exit code); a hang is killed after
``timeout`` seconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

import torch


# what every rank imports first (seconds a process), imported once in the forkserver its
# ranks fork from; not infergraft, whose switches are read from the environment on import
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free when checked, drawn below the kernel's ephemeral range: bind(0) and every
    outgoing connection (a gloo rank's, a client's) take theirs from that range, so a port
    from it could be taken by another test's connection before our server binds it."""
    low = 32768  # Linux's default start of ip_local_port_range
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.SystemRandom()  # not the tests' seeded generator: workers draw apart
    for _ in range(200):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host} in 200 draws")


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo",
              outcomes: bool = False, collective_timeout: float | None = None,
              start_method: str | None = None) -> list:
    """``fn(*args)`` on each rank of a fresh group (``backend="nccl"``: one GPU a rank).

    ``outcomes``: a rank that raises or dies does not fail the call; each rank's entry is
    ``{"result": ...}``, ``{"error": "Type: message", "traceback": ...}`` or, for a process
    that died (a signal, ``os._exit``), ``{"exitcode": n}``. ``collective_timeout``: the
    group's timeout in seconds (and ``INFERGRAFT_COLLECTIVE_TIMEOUT`` in the ranks).
    ``start_method``: "forkserver" (the ranks have imported PRELOAD before joining the
    group; the default on gloo) or "spawn" (a fresh interpreter a rank, as torchrun starts
    them; the default on NCCL, whose ranks then meet CUDA in a process of their own)."""
    import torch.multiprocessing as mp

    start_method = start_method or ("spawn" if backend == "nccl" else "forkserver")
    if start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank_main, args=(world_size, free_port(), fn, args, out,
                                                   backend, outcomes, collective_timeout,
                                                   dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        if outcomes:  # join() would end the others once one rank fails
            while any(p.is_alive() for p in ctx.processes):
                if time.monotonic() > deadline:
                    _kill(ctx)
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} ran over {timeout} s")
                time.sleep(0.05)
            return [_outcome(Path(out, f"{r}.json"), p) for r, p in enumerate(ctx.processes)]
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                _kill(ctx)
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} ran over {timeout} s")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world_size)]


def _kill(ctx) -> None:
    for p in ctx.processes:
        p.kill()


def _outcome(path: Path, process) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"exitcode": process.exitcode}


def _rank_main(rank, world_size, port, fn, args, out, backend, outcomes=False,
               collective_timeout=None, environ=None):
    import datetime
    import faulthandler
    import traceback

    import torch.distributed as dist

    from infergraft.core.distributed.failure import leave_group

    faulthandler.enable()  # a rank that aborts in C++ (SIGABRT) prints where it was
    if environ is not None:  # a forkserver's child has the server's, from its start
        os.environ.clear()
        os.environ.update(environ)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    group_timeout = None
    if collective_timeout is not None:
        os.environ["INFERGRAFT_COLLECTIVE_TIMEOUT"] = str(int(collective_timeout))
        group_timeout = datetime.timedelta(seconds=collective_timeout)
    torch.set_num_threads(1)  # N ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=group_timeout)
    path = Path(out, f"{rank}.json")
    try:
        if not outcomes:
            path.write_text(json.dumps(fn(*args)))
            return
        try:
            result = {"result": fn(*args)}
        except BaseException as e:
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        path.write_text(json.dumps(result))
    finally:
        if dist.is_initialized():  # a rank whose step failed has left the group already
            leave_group()


def tp_parity_cases(cases: list[dict]) -> list[dict]:
    """``tp_parity(**case)`` for each case, in one set of ranks (one start-up)."""
    return [tp_parity(**case) for case in cases]


def tp_parity(config, plugins: list, prompts: list[list[int]], new_tokens: int = 12,
              seed: int = 0, scale: float = 25.0, device: str = "cpu",
              planner_options: dict | None = None, hf_full_forwards: bool = False,
              **build_options) -> dict:
    """On one rank: build ``plugins`` around a seeded random HF model of ``config`` (the
    same weights on every rank) and compare with HF's own forward and greedy generate
    (``hf_full_forwards``: parity.greedy_by_full_forwards, a forward over the whole
    sequence a step),
    which every rank runs whole, and with the same plugins in one process. Returns the
    errors, our, HF's and the lone engine's tokens, a sampled continuation without a
    seed (ranks must agree on it) and the plan's sizes."""
    from infergraft import core

    from .models import random_model
    from . import parity
    from .parity import hf_logits, relative_error

    hf = random_model(config, seed=seed, scale=scale)  # on the CPU: the same on every rank
    if device == "cuda":
        hf = hf.to(torch.device("cuda", torch.cuda.current_device()))
    engine = core.build(hf, plugins=plugins, dtype="float32", device=device,
                        max_batch_size=len(prompts), **build_options, **(planner_options or {}))
    errors = [relative_error(engine.logits(ids), hf_logits(hf, ids)) for ids in prompts]
    reference = parity.greedy_by_full_forwards if hf_full_forwards else parity.hf_greedy
    ours = [c.token_ids for c in engine.generate(prompts, max_new_tokens=new_tokens)]
    planners = set(core.get_plugin_manager().planners().names())
    alone = core.build(hf, plugins=[p for p in plugins if p not in planners], dtype="float32",
                       device=device, max_batch_size=len(prompts), **build_options)
    sampled = engine.generate(prompts[0], max_new_tokens=new_tokens, temperature=1.0)
    return {"errors": errors, "ours": ours,  # alone: the same plugins in this process only
            "alone": [c.token_ids for c in alone.generate(prompts, max_new_tokens=new_tokens)],
            "hf": [reference(hf, ids, new_tokens) for ids in prompts],
            "sampled": sampled[0].token_ids,
            "tensor_parallel": engine.plan.parallel.tensor_parallel,
            "stages": len(engine.plan.parallel.stages),
            "weight_bytes": engine.plan.weight_bytes,
            "alone_weight_bytes": alone.plan.weight_bytes,
            "kv_bytes_per_token": engine.plan.kv_bytes_per_token}


def build_verdicts(config, plugins: list, budgets: list) -> str:
    """On one rank: build ``plugins`` with this rank's ``device_memory`` (``budgets[rank]``)
    and say how it ended: "built", or the PlanError's message."""
    import torch.distributed as dist

    from infergraft import core

    from ..errors import PlanError
    from .models import random_model

    try:
        core.build(random_model(config), plugins=plugins, device="cpu", max_seq_len=64,
                   device_memory=budgets[dist.get_rank()])
    except PlanError as e:
        return str(e)
    return "built"


def parity_configs() -> dict:
    """The GPT-2 (tied head, learned positions) and Mistral (sliding window 4) configs the
    multi-rank parity tests run beside ``tiny_llama_config``: small enough for gloo ranks."""
    from transformers import GPT2Config, MistralConfig

    gpt2 = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                      bos_token_id=1, eos_token_id=2)
    gpt2.architectures = ["GPT2LMHeadModel"]
    mistral = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=112,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, sliding_window=4, bos_token_id=1,
                            eos_token_id=2)
    mistral.architectures = ["MistralForCausalLM"]
    return {"gpt2": gpt2, "mistral": mistral}
