"""The config's own keys: ``core.build``'s arguments, each checked as build would (the
error names the key, the value and what is accepted), plus plugins and checkpoint."""
from __future__ import annotations

import torch

from ..errors import ConfigError, PlanError
from ..memory import MAX_SEQ_LEN_DEFAULT
from ..preemption import MODES
from ..speculative.config import parse_speculative
from .deepspeed import dtype
from .values import boolean, positive_int, show, wrong
from .weights import checkpoint

# build()'s arguments, the config's own keys -> what each accepts (docs/config.md)
OWN_KEYS = {
    "model": "an HF model directory or alias (used when build's model argument is None)",
    "plugins": "a list of plugin names (or one name); the mapped keys' plugins follow them",
    "dtype": "float32, bfloat16 or float16, in any of DeepSpeed's spellings (dtype below)",
    "device": "\"cpu\", \"cuda\" or \"cuda:N\" (default: cuda if present)",
    "max_seq_len": f"an integer >= 1: tokens per sequence, prompt + output (default: "
                   f"{MAX_SEQ_LEN_DEFAULT})",
    "max_batch_size": "an integer >= 1: sequences at once",
    "tokenizer": "a tokenizer object (from Python only; a file's model loads its own)",
    "kernels": "\"auto\" (Triton on CUDA), \"triton\" or \"torch\"",
    "progress": "true or false: a progress bar while weights load",
    "device_memory": "bytes or a size such as \"80GiB\": the budget weights + K/V must fit",
    "cuda_graphs": "true, false or null: decode under CUDA graphs",
    "prefill_graphs": "true, false or null: a fresh prompt's prefill under CUDA graphs",
    "step_graphs": "true, false or null: every other step under CUDA graphs",
    "async_steps": "true, false or null: a step launched before the last one's tokens "
                   "are read (null: off)",
    "max_num_batched_tokens": "an integer >= 1: tokens one step carries at most",
    "max_prefill_tokens": "the old name of max_num_batched_tokens (deprecated)",
    "checkpoint": "where the weights are (checkpoint below)",
    "preemption": "\"auto\" (the cheaper of the two), \"swap\" or \"recompute\": how a "
                  "sequence makes room when the cache runs short",
    "revision": "a branch, tag or commit: the snapshot of a hub id model (org/name) in the "
                "Hugging Face cache (default: main)",
    "speculative": "an object such as {\"method\": \"ngram\", \"k\": 4} or {\"method\": "
                   "\"draft\", \"model\": DIR, \"k\": 4}: speculative decoding (null: off)",
}
_KERNELS = ("auto", "triton", "torch")


def _own(check):
    return lambda r, key, value: r.claim(key, check(key, value), key, value)


def _plugins(r, key, value):
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise wrong(key, value, "a list of plugin names, e.g. [\"paged\", \"int8\"]")
    r.plugins.extend(items)


def _device(key, value):
    if not isinstance(value, (str, torch.device)):
        raise wrong(key, value, OWN_KEYS["device"])
    return value


def _tokenizer(key, value):
    if not all(callable(getattr(value, m, None)) for m in ("encode", "decode")):
        raise wrong(key, value, OWN_KEYS["tokenizer"])
    return value


def _kernels(key, value):
    if value not in _KERNELS:
        raise wrong(key, value, ", ".join(f'"{k}"' for k in _KERNELS))
    return value


def _preemption(key, value):
    if value not in MODES:
        raise wrong(key, value, OWN_KEYS["preemption"])
    return value


def _revision(key, value):
    if not isinstance(value, str) or not value.strip():
        raise wrong(key, value, OWN_KEYS["revision"])
    return value


def _speculative(r, key, value):
    """Checked as build checks it (the method registered, every value), kept as given."""
    try:
        parse_speculative(value, r.pm.proposers())
    except PlanError as e:
        raise ConfigError(f"config key {key}={show(value)} is not valid: {e}") from None
    r.claim(key, value, key)


def _memory(key, value):
    if isinstance(value, bool) or not isinstance(value, (str, int)) or \
            isinstance(value, int) and value < 1:
        raise wrong(key, value, OWN_KEYS["device_memory"])
    return value


OWN_HANDLERS = {
    "model": lambda r, key, value: r.claim("model", value, key), "plugins": _plugins,
    "dtype": dtype, "device": _own(_device), "tokenizer": _own(_tokenizer),
    "kernels": _own(_kernels), "progress": _own(boolean), "device_memory": _own(_memory),
    **{k: _own(positive_int) for k in ("max_seq_len", "max_batch_size",
                                       "max_num_batched_tokens", "max_prefill_tokens")},
    **{k: _own(lambda key, v: boolean(key, v, none=True))
       for k in ("cuda_graphs", "prefill_graphs", "step_graphs", "async_steps")},
    "checkpoint": checkpoint, "preemption": _own(_preemption), "revision": _own(_revision),
    "speculative": _speculative,
}
# the keys passed on as they are (dtype, plugins and checkpoint are decided from several)
PASSED = ("model", "device", "max_seq_len", "max_batch_size", "tokenizer", "kernels",
          "progress", "device_memory", "cuda_graphs", "prefill_graphs", "step_graphs",
          "max_num_batched_tokens", "max_prefill_tokens", "preemption", "revision",
          "speculative", "async_steps")
