"""``--config FILE`` on generate, chat, plan, bench and serve: the file's keys (ours and
DeepSpeed's, mapped by core/config) with the flags given on the command line over them.

A flag counts as given when it is not None, so every flag that can come from a config
defaults to None and the command fills its own default afterwards."""
from __future__ import annotations

import argparse
import json
import os

HELP = ("a JSON config: core.build's keyword arguments and plugin options, or DeepSpeed's "
        "inference keys (ds_config.json; docs/config.md lists what each becomes); flags "
        "given on the command line win over it")


REVISION_HELP = ("a branch, tag or commit: which snapshot of a hub id model (org/name) to "
                 "load from the Hugging Face cache (default: main)")


def add_config_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None, help=HELP)


SPECULATIVE_HELP = ("speculative decoding: a JSON object such as '{\"method\": \"ngram\", "
                    "\"k\": 4}' (prompt lookup) or '{\"method\": \"draft\", \"model\": DIR, "
                    "\"k\": 4}' (a smaller model of the same tokenizer), or a method name; "
                    "docs/config.md lists the keys")


def add_speculative_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", metavar="JSON", type=speculative_flag, default=None,
                   help=SPECULATIVE_HELP)


def speculative_flag(text: str):
    """``--speculative``'s value: a JSON object, or a bare method name ("ngram")."""
    if not text.strip().startswith("{"):
        return text.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at column {e.colno}): give an "
                                         f"object such as '{{\"method\": \"ngram\", \"k\": "
                                         f"4}}' or a method name") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def given(**flags) -> dict:
    """The flags that were given (not None)."""
    return {k: v for k, v in flags.items() if v is not None}


def build_options(config, model, default_model: str, **flags) -> tuple[object, dict]:
    """(the model, ``core.build``'s keyword arguments): ``config``'s keys (a path or None)
    resolved, then the given ``flags`` over them (``plugins``: the config's, then the
    flags'). The model: ``model`` if given, else the config's ``model``, else
    ``default_model``. Errors and warnings come now, before anything loads."""
    overrides = given(**flags)
    if config is None:
        return model or default_model, overrides
    from ..config import resolve_config

    options = resolve_config(config, overrides)
    from_config = options.pop("model", None) or checkpoint_model(options)
    return model or from_config or default_model, options


def checkpoint_model(options: dict) -> str | None:
    """The directory of the config's checkpoint where it holds a config.json: the model
    when none is named (as DeepSpeed's checkpoint is), so that ``{"checkpoint": DIR}``
    alone is a model. None without one (the build then says what is missing)."""
    ckpt = options.get("checkpoint")
    directory = getattr(ckpt, "directory", None)
    if directory is not None and (directory / "config.json").is_file():
        return str(directory)
    return None


def bench_config(args) -> dict | None:
    """A bench's ``--config`` resolved once (its warnings now, not per build): our
    engine's build options. The bench's own flags (model, device, batch, lengths) win over
    it; the config's dtype is ``--dtype``'s default, so that HF runs in it too."""
    if args.config is None:
        return None
    from ..config import resolve_config
    from ..selection import resolve_dtype

    options = resolve_config(args.config)
    options.pop("model", None)  # --model names the bench's weights (a shape or a checkpoint)
    if args.dtype is None and options.get("dtype") is not None:
        args.dtype = resolve_dtype(options["dtype"], None)
    return options


PLAN_DEFAULTS = dict(model="smollm2-135m", max_batch_size=8, tensor_parallel=1,
                     pipeline_parallel=1, micro_batches=1, kv_dtype="auto", weights="auto",
                     ring_size=2, cache="contiguous")


def plan_config(args) -> None:
    """``infergraft plan``'s flags with a ``--config`` under them (the flags given win),
    then plan's defaults: the config's model (or its checkpoint's directory), dtype, K/V
    and weight quantisers (int4's group size), sizes, budget, tensor-parallel size and
    pipeline stages (one rank's plan) and offload-weights planner."""
    if args.config is not None:
        from ..config import resolve_config

        options = resolve_config(args.config)
        plugins = options.pop("plugins", [])
        world = int(os.environ.get("WORLD_SIZE", 1))
        if "pp" in plugins:  # pp's options; its stages: the world's, as the planner's
            tp = options.get("tensor_parallel", 1)
            stages = options.get("stages") or world // tp
        else:
            tp, stages = options.get("tp_size") or (world if "tp" in plugins else None), None
        from_config = dict(
            model=options.get("model") or checkpoint_model(options), dtype=options.get("dtype"),
            kv_dtype=next((q for q in ("int8", "fp8") if f"kv-{q}" in plugins), None),
            weights=next((q for q in ("int8", "int4", "fp8") if q in plugins), None),
            group_size=options.get("group_size"),
            max_seq_len=options.get("max_seq_len"), max_batch_size=options.get("max_batch_size"),
            revision=options.get("revision"),
            max_num_batched_tokens=options.get("max_num_batched_tokens"),
            device_memory=options.get("device_memory"), tensor_parallel=tp,
            pipeline_parallel=stages, micro_batches=options.get("micro_batches"),
            offload_weights=True if "offload-weights" in plugins else None,
            cache="paged" if "paged" in plugins else None,
            resident_layers=options.get("resident_layers"), ring_size=options.get("ring_size"),
            block_size=options.get("block_size"),
            gpu_memory_utilization=options.get("gpu_memory_utilization"))
        for flag, value in from_config.items():
            if getattr(args, flag, None) in (None, False) and value is not None:
                setattr(args, flag, str(value) if flag == "dtype" else value)
    for flag, value in PLAN_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
