"""A ``checkpoint`` to read weights from (``core.build``'s argument, a config's key): a
directory of safetensors files, one ``.safetensors`` file, or DeepSpeed's checkpoint
description ``{"type": "ds_model", "checkpoints": [files], "version": 1.0}`` as a JSON
file or a dict, its files relative to ``base_dir`` (else the JSON file's directory).

Only safetensors files are read: pickle checkpoints (.bin, .pt, .pth, .ckpt) are refused,
since loading one runs whatever code it carries. ``source.resolve_source`` reads them."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import attrs

from ..errors import ConfigError

PICKLE = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
CONVERT = ("pickle checkpoints are refused (loading one runs the code it carries); convert "
           "it once to safetensors, e.g. AutoModelForCausalLM.from_pretrained(dir)"
           ".save_pretrained(out) writes model.safetensors")
TYPES = ("ds_model", "bloom")  # DeepSpeed's types whose files carry HF key names
DESCRIPTION = '{"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}'


@attrs.frozen
class Checkpoint:
    """The safetensors files to read, and the directory a config.json or tokenizer may be
    in (the checkpoint's directory, or the JSON description's)."""

    files: tuple[Path, ...]
    directory: Optional[Path] = None
    origin: str = ""  # what was given, for messages and the model's name


def describe_checkpoint(value, base_dir=None, key: str = "checkpoint") -> Checkpoint:
    """``value`` (a path or a description dict) as a Checkpoint, every file checked to be an
    existing safetensors file; ConfigError naming ``key`` otherwise."""
    if isinstance(value, Checkpoint):
        return value
    if isinstance(value, dict):
        base = Path(base_dir).expanduser() if base_dir else Path.cwd()
        return _from_description(value, base, key, origin=f"{key} object")
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(f"config key {key}={value!r} is not valid; accepted: a directory of "
                          f"*.safetensors, a .safetensors file, or DeepSpeed's checkpoint JSON "
                          f"(a file or an object such as {DESCRIPTION})")
    path = Path(value).expanduser()
    if path.suffix.lower() in PICKLE:
        raise ConfigError(f"config key {key}={str(value)!r}: {CONVERT}")
    if path.is_dir():
        return Checkpoint(_directory_files(path, key), path, str(value))
    if not path.is_file():
        raise ConfigError(f"config key {key}={str(value)!r}: no such file or directory")
    if path.suffix == ".safetensors":
        return Checkpoint((path,), path.parent, str(value))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key {key}={str(value)!r} is neither safetensors nor a JSON "
                          f"checkpoint description ({e}); e.g. {DESCRIPTION}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"checkpoint description {path} is not a JSON object; e.g. "
                          f"{DESCRIPTION}")
    base = Path(base_dir).expanduser() if base_dir else path.parent
    if "weight_map" in data:  # an HF model.safetensors.index.json
        data = {"checkpoints": sorted(set(data["weight_map"].values()))}
    return _from_description(data, base, key, origin=str(value), directory=path.parent)


def _from_description(data: dict, base: Path, key: str, origin: str,
                      directory: Optional[Path] = None) -> Checkpoint:
    kind = data.get("type", "ds_model")
    if not isinstance(kind, str) or kind.lower() not in TYPES:
        raise ConfigError(f"{key} type {kind!r} is refused: its key layout is not mapped; "
                          f"accepted: {', '.join(TYPES)} (HF key names)")
    if data.get("parallelization") == "tp" or _more_than_one(data.get("tp_size", 1)):
        raise ConfigError(f"{key} {origin} is pre-sharded (parallelization / tp_size); give "
                          "the full HF safetensors weights: every rank cuts its own pieces")
    if str(data.get("dtype", "")).lower() in ("int8", "torch.int8"):
        raise ConfigError(f"{key} {origin} is pre-quantised (dtype int8); give float weights "
                          "and quantization.enabled")
    files = data.get("checkpoints")
    if isinstance(files, dict):
        raise ConfigError(f"{key} {origin} lists pre-sharded files ({', '.join(files)}); give "
                          "the full HF safetensors weights: every rank cuts its own pieces")
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"{key} {origin}: checkpoints must be a list of safetensors file "
                          f"names, got {files!r}; e.g. {DESCRIPTION}")
    base = Path(data["base_dir"]).expanduser() if data.get("base_dir") else base
    paths = [Path(f).expanduser() if Path(f).is_absolute() else base / f for f in files]
    pickles = [str(p) for p in paths if p.suffix.lower() in PICKLE]
    if pickles:
        raise ConfigError(f"{key} {origin} names {', '.join(pickles)}: {CONVERT}")
    other = [str(p) for p in paths if p.suffix != ".safetensors"]
    if other:
        raise ConfigError(f"{key} {origin} names files that are not .safetensors: "
                          f"{', '.join(other)}")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"{key} {origin} names missing files: {', '.join(missing)} (relative "
                          f"names are under {base}; base_dir sets it)")
    return Checkpoint(tuple(paths), directory or base, origin)


def _directory_files(path: Path, key: str) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return describe_checkpoint(index, key=key).files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return tuple(files)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PICKLE)
    if pickles:
        raise ConfigError(f"config key {key}={str(path)!r} holds {', '.join(pickles)}: {CONVERT}")
    raise ConfigError(f"config key {key}={str(path)!r} holds no *.safetensors files")


def _more_than_one(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 1
