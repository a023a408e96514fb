"""Writing the quantised model: an HF GPTQ-format directory (``checkpoint_format`` "gptq",
v1) that ``core.build(dir)`` and transformers' GPTQ integration read.

``model.safetensors`` holds each decoder projection P as P.qweight / P.qzeros / P.scales /
P.g_idx (``pack.pack_gptq``) and every other tensor of the source as it was;
config.json is the source's with a ``quantization_config``; the tokenizer and generation
files are copied. The directory is written beside ``out`` and renamed into place at the
end, so a failed or interrupted run leaves no half-written checkpoint behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from ..errors import QuantizeError
from .pack import PROJECTIONS, pack_gptq

#: a decoder projection's weight key in an HF LLaMA-family checkpoint
PROJECTION_KEY = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.(?:%s))\.weight$"
                            % "|".join(PROJECTIONS))
#: files copied beside the weights: the tokenizer's, the chat template, generation defaults
COPIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
          "merges.txt", "*.model", "chat_template*", "generation_config.json")


def check_out(out) -> Path:
    """``out`` as a Path; refused where it is a file or a non-empty directory."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantizeError(f"--out {out} exists and is not an empty directory; the tool "
                            "never overwrites: remove it or choose another directory")
    return out


def projection_of(key: str) -> Optional[str]:
    """The module name of a projection's weight key ("model.layers.0.mlp.up_proj"), else
    None."""
    match = PROJECTION_KEY.match(key)
    return match.group(1) if match else None


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], codes_of: Callable,
                      group_size: int) -> tuple[dict, int]:
    """The checkpoint's tensors: each projection's weight replaced by its packed codes
    (``codes_of(module, weight)`` -> (q, zeros, scales)), the rest unchanged; a tensor
    sharing storage with one already taken (a tied lm_head in memory) is left out, as
    ``save_pretrained`` leaves it. Returns (tensors, projections packed)."""
    out, seen, packed = {}, set(), 0
    for key, t in tensors:
        module = projection_of(key)
        if module is None:
            where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.numel() and where in seen:
                continue
            seen.add(where)
            out[key] = t.contiguous()
            continue
        n, k = t.shape
        if n % 8 or k % 8:
            raise QuantizeError(f"{module} is [{n}, {k}]; the GPTQ layout packs 8 codes an "
                                "int32 along both dimensions, so both must be multiples of 8")
        q, zeros, scales = codes_of(module, t)
        out.update({f"{module}.{p}": v for p, v in
                    pack_gptq(q, zeros, scales, group_size, v1=True).items()})
        packed += 1
    return out, packed


def write_checkpoint(out: Path, tensors: dict, config: dict, source_dir: Optional[Path],
                     tokenizer=None) -> None:
    """``out``/model.safetensors + config.json + the tokenizer (copied from
    ``source_dir``, else saved from ``tokenizer``), written in a sibling directory first."""
    from safetensors.torch import save_file

    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        if source_dir is not None:
            for pattern in COPIED:
                for f in source_dir.glob(pattern):
                    if f.is_file():
                        shutil.copy2(f, partial / f.name)
        elif tokenizer is not None:
            tokenizer.save_pretrained(str(partial))
        if out.exists():
            out.rmdir()  # empty (check_out): replaced by the finished directory
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
