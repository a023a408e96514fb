"""Where a model comes from: an HF model in memory, a local directory, a hub id in the
local Hugging Face cache (loading/hub.py), or a demo alias.

Weights are only ever read from safetensors files or in-memory tensors (never pickle).
"""
from __future__ import annotations

import inspect
import json
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import attrs
import torch

from ..errors import InfergraftError
from .checkpoint import describe_checkpoint
from .hub import cached_snapshot, is_hub_id, not_cached_advice

ALIASES = ("smollm2-135m",)


@attrs.frozen
class ModelSource:
    name: str
    config: Any
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Optional[Any] = None
    dtype: Optional[torch.dtype] = None  # the dtype the weights are stored in
    #: a GPTQ / AWQ ``gptq.PrequantFormat``: the projections arrive quantised (loading/gptq.py)
    prequantized: Optional[Any] = None


class ModelSourceError(InfergraftError, ValueError):
    """The ``model`` argument names nothing we can load."""


def resolve_source(model, tokenizer=None, checkpoint=None, revision=None) -> ModelSource:
    """``checkpoint`` (loading/checkpoint.py): the weights come from its safetensors files;
    ``model`` then gives only the config (an HF model, e.g. on the meta device, a config
    object or a directory with config.json), or is None where the checkpoint has one.
    A config with a GPTQ / AWQ ``quantization_config``: its projections stream in already
    quantised (loading/gptq.py). ``revision``: the snapshot of a hub id ``model``."""
    from .gptq import with_prequantized

    if revision is not None and (checkpoint is not None or
                                 not isinstance(model, (str, os.PathLike))):
        raise ModelSourceError(
            f"revision={revision!r} picks a snapshot of a hub id in the Hugging Face cache "
            f"(core.build(\"org/name\", revision=...)); it does not apply to "
            f"{'checkpoint=' if checkpoint is not None else type(model).__name__ + ' models'}")
    return with_prequantized(_resolve(model, tokenizer, checkpoint, revision))


def _resolve(model, tokenizer, checkpoint, revision=None) -> ModelSource:
    from transformers import PreTrainedModel

    if tokenizer is not None and not all(callable(getattr(tokenizer, m, None))
                                         for m in ("encode", "decode")):
        raise ModelSourceError(f"tokenizer must be a tokenizer object (with encode and decode, "
                               f"e.g. AutoTokenizer.from_pretrained(dir)) or None, got {tokenizer!r}")
    if checkpoint is not None:
        return _from_checkpoint(model, describe_checkpoint(checkpoint), tokenizer)

    if isinstance(model, PreTrainedModel):
        params = next(model.parameters(), None)
        return ModelSource(
            name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
            config=model.config, tensors=lambda: iter(model.state_dict().items()),
            tokenizer=tokenizer, dtype=params.dtype if params is not None else None)
    if isinstance(model, (str, os.PathLike)):
        path = model_directory(model, revision)
        # an alias or a hub id names the model; a directory is named by its path
        return _from_directory(path, tokenizer,
                               name=None if path == Path(model).expanduser() else str(model))
    raise ModelSourceError(
        f"cannot load model {model!r}: pass a transformers PreTrainedModel, {LOADABLE}")


LOADABLE = ("a local directory with config.json and *.safetensors, a hub id (org/name) "
            f"already in the Hugging Face cache, or one of the aliases {', '.join(ALIASES)}")


def model_directory(model, revision: Optional[str] = None) -> Path:
    """The local directory that ``model`` (a name or path) names: a demo alias (its
    converted copy), a directory, or a hub id's snapshot in the Hugging Face cache at
    ``revision`` (default: main). ModelSourceError, saying what would load, otherwise."""
    name, path = str(model), Path(model).expanduser()
    if revision is not None and not (isinstance(revision, str) and revision.strip()):
        raise ModelSourceError(f"revision must be a branch, tag or commit of the hub id's "
                               f"repository (a non-empty string), got {revision!r}")
    if revision is not None and (name in ALIASES or path.is_dir() or not is_hub_id(name)):
        raise ModelSourceError(f"revision={revision!r} picks a snapshot of a hub id (org/name) "
                               f"in the Hugging Face cache; {name!r} is not one")
    if name in ALIASES:
        from .demo import ensure_demo_model

        return Path(ensure_demo_model(name))
    if path.is_dir():
        return path
    if not is_hub_id(name):
        raise ModelSourceError(f"cannot load model {name!r}: it is not a local directory; "
                               f"pass {LOADABLE}")
    snapshot, why = cached_snapshot(name, revision)
    if snapshot is None:
        raise ModelSourceError(f"cannot load model {name!r}: it is not a local directory, and "
                               f"{why}. {not_cached_advice(name)}")
    return snapshot


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelSourceError(f"{index} is not a safetensors index (a JSON object with a "
                                   f"'weight_map' of key -> shard file): {e!r}") from None
        bad = [s for s in shards if not str(s).endswith(".safetensors")]
        missing = [s for s in shards if not (path / s).is_file()]
        if bad:
            raise ModelSourceError(f"{index} names shards that are not safetensors (pickle "
                                   f"checkpoints are refused; convert them): {', '.join(bad)}")
        if missing:
            raise ModelSourceError(f"{index} names missing shards: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are refused; convert them to " \
               "safetensors)" if pickles else ""
        raise ModelSourceError(f"no *.safetensors weights in {path}{hint}")
    return files


# What AutoConfig raises for a config.json it refuses: its own ValueErrors and OSErrors, the
# TypeError / KeyError / AttributeError / ZeroDivisionError of fields it trips over (a
# list as model_type, an unknown torch_dtype, zero attention heads), and the strict
# dataclass errors of huggingface_hub's field validators (a string for an int).
try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # a huggingface_hub without strict dataclasses validates nothing
    StrictDataclassError = ValueError
_CONFIG_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError,
                  StrictDataclassError)
_CONFIG_SHAPE = 'an HF config.json is a JSON object such as {"model_type": "llama", ...}'


def _one_line(e: BaseException) -> str:
    """``e``'s message on one line (transformers and huggingface_hub span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def read_config(path: Path):
    """The HF config in ``path``/config.json; ModelSourceError, in one line naming the file
    and what is wrong, if it is absent, not a JSON object, or refused by transformers."""
    from transformers import CONFIG_MAPPING, AutoConfig

    file = path / "config.json"
    if not file.exists():
        raise ModelSourceError(f"{path} has no config.json; it is not an HF model directory")
    # 1) The JSON ourselves: for a file that is not an object, AutoConfig's own message is
    # "argument of type 'int' is not iterable".
    what = f"{file} cannot be read as an HF config"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError: ValueErrors
        raise ModelSourceError(f"{what}: it is not JSON text ({_one_line(e)}); "
                               f"{_CONFIG_SHAPE}") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(data), "a number")
        shown = "null" if data is None else f"{kind} ({json.dumps(data)[:40]})"
        raise ModelSourceError(f"{what}: it holds {shown}, not a JSON object; {_CONFIG_SHAPE}")
    # 2) transformers: trust_remote_code=False, since with None a config naming its own
    # code (auto_map) asks on stdin whether to run it; infergraft never does.
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except _CONFIG_ERRORS as e:
        model_type = data.get("model_type")
        if "model_type" not in data:
            why = "it has no model_type (e.g. \"model_type\": \"llama\")"
        elif not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            why = (f"model_type {model_type!r} is not a model type transformers knows "
                   f"(e.g. 'llama', 'mistral', 'gpt2'; a newer model may need a newer "
                   f"transformers)")
            if isinstance(data.get("auto_map"), dict):
                why += "; its auto_map names the model's own code, which infergraft never runs"
        elif isinstance(e, ZeroDivisionError):  # transformers' validators divide by sizes
            why = (f"transformers divided by zero validating it ({_one_line(e)}): a size such "
                   "as num_attention_heads is 0; sizes must be integers >= 1")
        else:
            why = _one_line(e)
        raise ModelSourceError(f"{what}: {why}") from None
    # 3) What transformers keeps unchecked but policy selection iterates over.
    archs = getattr(config, "architectures", None)
    if archs is not None and not (isinstance(archs, (list, tuple))
                                  and all(isinstance(a, str) for a in archs)):
        raise ModelSourceError(f"{what}: architectures must be a list of class names (e.g. "
                               f"[\"LlamaForCausalLM\"]) or absent, got {archs!r}")
    return config


def stored_dtype(config) -> Optional[torch.dtype]:
    """The dtype the config says the weights are stored in; None where it says none.

    transformers 5 reads config.json's ``torch_dtype`` into ``config.dtype`` and keeps
    ``torch_dtype`` as a property that prints a deprecation warning: so ``dtype`` first,
    then ``torch_dtype`` only where it is a plain attribute (transformers 4 configs,
    stand-ins), looked up statically so that the property never runs."""
    stored = getattr(config, "dtype", None)
    if stored is None:
        stored = inspect.getattr_static(config, "torch_dtype", None)
        if isinstance(stored, property):
            stored = None
    if isinstance(stored, str):
        stored = getattr(torch, stored.removeprefix("torch."), None)
    return stored if isinstance(stored, torch.dtype) else None


def spec_of(model, policy: Optional[str] = None, revision: Optional[str] = None):
    """(name, ModelSpec, HF config) from a local model directory, a cached hub id or a
    demo alias, reading only its config.json (no weights): what ``infergraft plan`` needs."""
    from ..plugin_manager import get_plugin_manager
    from ..selection import choose_policy

    name = str(model)
    config = read_config(model_directory(name, revision))
    return name, choose_policy(get_plugin_manager(), config, policy).describe(config), config


def _from_directory(path: Path, tokenizer=None, name: str | None = None) -> ModelSource:
    path = Path(path)
    config = read_config(path)
    tensors = partial(_read_safetensors, safetensors_files(path))

    if tokenizer is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    stored = stored_dtype(config)
    return ModelSource(name=name or str(path), config=config, tensors=tensors,
                       tokenizer=tokenizer, dtype=stored)


def _from_checkpoint(model, ckpt, tokenizer=None) -> ModelSource:
    """The config from ``model`` (or the checkpoint's directory), the tensors from ``ckpt``."""
    from transformers import PretrainedConfig, PreTrainedModel

    where, dtype = ckpt.directory, None
    if isinstance(model, PreTrainedModel):
        config, name = model.config, getattr(model.config, "_name_or_path", "") or ckpt.origin
        params = next(model.parameters(), None)  # on the meta device too: the dtype built in
        dtype = params.dtype if params is not None else None
    elif isinstance(model, PretrainedConfig):
        config, name = model, ckpt.origin
    elif isinstance(model, (str, os.PathLike)) and Path(model).expanduser().is_dir():
        where = Path(model).expanduser()
        config, name = read_config(where), str(model)
    elif model is None and where is not None and (where / "config.json").is_file():
        config, name = read_config(where), ckpt.origin
    else:
        own = where is not None and (where / "config.json").is_file()
        raise ModelSourceError(
            f"checkpoint {ckpt.origin!r} gives the weights; the model's config comes from the "
            f"model argument (an HF model, e.g. built on the meta device, a config, or a "
            f"directory with config.json), got {model!r}, "
            + (f"not a model directory; leave it out (None): the checkpoint's "
               f"{where / 'config.json'} serves" if own
               else "and the checkpoint's directory has no config.json"))
    if tokenizer is None and where is not None and any(
            (where / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    return ModelSource(name=name, config=config, tensors=partial(_read_safetensors, ckpt.files),
                       tokenizer=tokenizer, dtype=dtype or stored_dtype(config))


def _read_safetensors(files):
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        except SafetensorError as e:  # truncated or not safetensors at all
            raise ModelSourceError(f"{f} is not a readable safetensors file: {e}") from None
