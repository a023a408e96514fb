"""Where a model comes from: an HF model in memory, a local directory, or a demo alias.

Weights are only ever read from safetensors files or in-memory tensors (never pickle).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import attrs
import torch

from ..errors import InfergraftError

ALIASES = ("smollm2-135m",)


@attrs.frozen
class ModelSource:
    name: str
    config: Any
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    tokenizer: Optional[Any] = None
    dtype: Optional[torch.dtype] = None  # the dtype the weights are stored in


class ModelSourceError(InfergraftError, ValueError):
    """The ``model`` argument names nothing we can load."""


def resolve_source(model, tokenizer=None) -> ModelSource:
    from transformers import PreTrainedModel

    if tokenizer is not None and not all(callable(getattr(tokenizer, m, None))
                                         for m in ("encode", "decode")):
        raise ModelSourceError(f"tokenizer must be a tokenizer object (with encode and decode, "
                               f"e.g. AutoTokenizer.from_pretrained(dir)) or None, got {tokenizer!r}")

    if isinstance(model, PreTrainedModel):
        params = next(model.parameters(), None)
        return ModelSource(
            name=getattr(model.config, "_name_or_path", "") or type(model).__name__,
            config=model.config, tensors=lambda: iter(model.state_dict().items()),
            tokenizer=tokenizer, dtype=params.dtype if params is not None else None)
    if isinstance(model, (str, os.PathLike)):
        if str(model) in ALIASES:
            from .demo import ensure_demo_model

            return _from_directory(ensure_demo_model(str(model)), tokenizer, name=str(model))
        path = Path(model).expanduser()
        if path.is_dir():
            return _from_directory(path, tokenizer)
    raise ModelSourceError(
        f"cannot load model {model!r}: pass a transformers PreTrainedModel, a local directory "
        f"with config.json and *.safetensors, or one of the aliases {', '.join(ALIASES)}")


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


def read_config(path: Path):
    """The HF config in ``path``/config.json; ModelSourceError if absent or unreadable."""
    from transformers import AutoConfig

    if not (path / "config.json").exists():
        raise ModelSourceError(f"{path} has no config.json; it is not an HF model directory")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelSourceError(f"{path / 'config.json'} cannot be read as an HF config: "
                               f"{e}") from None


def spec_of(model, policy: Optional[str] = None):
    """(name, ModelSpec, HF config) from a local model directory or a demo alias,
    reading only its config.json (no weights): what ``infergraft plan`` needs."""
    from ..plugin_manager import get_plugin_manager
    from ..selection import choose_policy

    name = str(model)
    if name in ALIASES:
        from .demo import ensure_demo_model

        path = ensure_demo_model(name)
    else:
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise ModelSourceError(f"cannot plan {name!r}: give a local model directory with a "
                                   f"config.json, or one of the aliases {', '.join(ALIASES)}")
    config = read_config(path)
    return name, choose_policy(get_plugin_manager(), config, policy).describe(config), config


def _from_directory(path: Path, tokenizer=None, name: str | None = None) -> ModelSource:
    path = Path(path)
    config = read_config(path)
    files = safetensors_files(path)

    def tensors():
        from safetensors import SafetensorError, safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for key in st.keys():
                        yield key, st.get_tensor(key)
            except SafetensorError as e:  # truncated or not safetensors at all
                raise ModelSourceError(f"{f} is not a readable safetensors file: {e}") from None

    if tokenizer is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return ModelSource(name=name or str(path), config=config, tensors=tensors,
                       tokenizer=tokenizer, dtype=stored)
