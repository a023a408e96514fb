"""``init_inference``: DeepSpeed's entry point, building our engine.

    engine = core.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.half,
                                 replace_with_kernel_inject=True)
    out = engine.generate(**tokenizer(texts, return_tensors="pt", padding=True),
                          max_new_tokens=20)

The keys are DeepSpeed's inference config keys or ``core.build``'s own arguments, mapped
by ``core.config`` (docs/config.md has the table); the page for migrating scripts is
docs/from-deepspeed.md."""
from __future__ import annotations

import warnings

from ..build import build
from .hf_engine import InferenceEngine


def init_inference(model, config=None, **kwargs) -> InferenceEngine:
    """Build an engine for ``model`` (an HF ``PreTrainedModel``, a local directory with
    config.json and safetensors, or the alias "smollm2-135m") from ``config`` (a dict, or
    the path of a JSON file) and keyword arguments, as ``deepspeed.init_inference`` does:
    the keyword arguments are merged over the config, and a key both set to different
    values is an error (ConfigError; spellings of one value, "fp16" and torch.half, agree).
    Returns an ``InferenceEngine``: ``core.Engine`` plus HF's ``generate(input_ids, ...)``
    and ``engine(input_ids).logits``."""
    from ..config import load_config
    from ..errors import ConfigError

    options = dict(load_config({} if config is None else config))
    conflicting = sorted(k for k in options.keys() & kwargs.keys()
                         if not _same(k, options[k], kwargs[k]))
    if conflicting:
        shown = "; ".join(f"{k}: config {options[k]!r}, keyword {kwargs[k]!r}"
                          for k in conflicting)
        raise ConfigError(f"conflicting value(s) in config and keyword arguments ({shown}); "
                          "set each key in one place, or to the same value in both "
                          "(as deepspeed.init_inference)")
    return InferenceEngine.adopt(build(model, config={**options, **kwargs}))


def _same(key: str, a, b) -> bool:
    """Whether ``key`` set to ``a`` and to ``b`` asks for the same thing: equal values, or
    spellings that resolve alike ("fp16" and torch.half)."""
    try:
        if bool(a == b):
            return True
    except Exception:  # values whose == is not a truth value (tensors, say)
        return a is b
    from ..config import resolve_config
    from ..errors import InfergraftError

    try:
        with warnings.catch_warnings():  # (the build warns, once, for the merged config)
            warnings.simplefilter("ignore")
            return resolve_config({key: a}) == resolve_config({key: b})
    except InfergraftError:  # a wrong value: the conflict is reported, then the value
        return False
