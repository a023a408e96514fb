"""``quantize_model``: a LLaMA-family model quantised to 4 bits and written as an HF
GPTQ checkpoint (what ``infergraft quantize`` runs).

``method="gptq"`` calibrates (``sequential.gptq_model`` on ``calibration`` windows of
Python's own docs); ``method="rtn"`` rounds each group to nearest, for comparison. Both
write the same format (``checkpoint``), which ``core.build(out)`` loads through the GPTQ
loader (``core/loading/gptq.py``) into the ``int4`` quantiser's kernels.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import attrs
import torch

from infergraft.kernels.int4_linear import GROUP_SIZES  # the int4 kernels' groups

from ..errors import QuantizeError
from .calibration import SOURCE, calibration_ids
from .checkpoint import check_out, quantized_tensors, write_checkpoint
from .gptq import DAMP
from .pack import PROJECTIONS, quantization_config, rtn_int4

METHODS = ("gptq", "rtn")
BITS = (4,)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")  # a config without architectures: its model_type
DEFAULT_TOKENS = 8192  # 32 sequences of SEQ_LEN
SEQ_LEN = 256
MIN_ZERO = 1  # GPTQ v1 stores zero - 1 (pack.py)


@attrs.frozen
class QuantizeResult:
    """What ``quantize_model`` wrote."""

    out: Path
    method: str
    group_size: int
    projections: int  # decoder projections quantised
    calibration_tokens: int  # 0 for rtn
    seconds: float
    act_order: bool = False  # GPTQ's columns by their inputs' energy (desc_act)


def check_settings(method: str, bits: int, group_size: int, calibration_tokens: int) -> None:
    """A QuantizeError naming the setting and what is accepted."""
    if method not in METHODS:
        raise QuantizeError(f"method={method!r} is not accepted; choose one of "
                            f"{', '.join(METHODS)}")
    if isinstance(bits, bool) or bits not in BITS:
        raise QuantizeError(f"bits={bits!r} is not accepted: infergraft writes 4-bit "
                            "checkpoints only (bits 4)")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise QuantizeError(f"group_size={group_size!r} is not accepted; choose one of "
                            f"{', '.join(map(str, GROUP_SIZES))} (the int4 kernels' groups)")
    if method == "gptq" and (isinstance(calibration_tokens, bool) or
                             not isinstance(calibration_tokens, int) or
                             calibration_tokens < SEQ_LEN):
        raise QuantizeError(f"calibration_tokens={calibration_tokens!r} is not accepted: "
                            f"give at least one sequence of {SEQ_LEN} tokens")


def check_architecture(config) -> None:
    archs = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    if (archs and all(a in ARCHITECTURES for a in archs)) or \
            (not archs and model_type in MODEL_TYPES):
        return
    raise QuantizeError(f"cannot quantise {', '.join(archs) or f'model_type {model_type!r}'}: "
                        f"the quantize tool handles {', '.join(ARCHITECTURES)} (model_type "
                        f"{' or '.join(MODEL_TYPES)}) only")


def source_dir(model) -> Optional[Path]:
    """The directory ``model`` names (an alias: the demo cache; a hub id: its snapshot in
    the Hugging Face cache), else None."""
    from ..loading.source import model_directory

    if isinstance(model, (str, os.PathLike)):
        return model_directory(model)
    return None


def hf_model(source):
    """A float32 HF model of ``source``'s config holding its weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32).eval()
    state = {k: t.float() if t.is_floating_point() else t for k, t in source.tensors()}
    result = hf.load_state_dict(state, strict=False)
    held = hf.state_dict()
    loaded = {held[k].data_ptr() for k in state if k in held}
    missing = [k for k in result.missing_keys if held[k].data_ptr() not in loaded]  # not tied
    unexpected = [k for k in result.unexpected_keys if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise QuantizeError(f"the checkpoint does not fit {type(hf).__name__}: missing "
                            f"{missing[:5]}, unexpected {unexpected[:5]}")
    return hf


def calibration_batch(source, tokens: int, seed: int, calibration) -> torch.Tensor:
    """The calibration ids [n, S]: ``calibration`` as given, else windows of the
    calibration text (``calibration.SOURCE``) through the model's tokenizer."""
    vocab = source.config.vocab_size
    if calibration is not None:
        ids = torch.as_tensor(calibration)
        if ids.dim() != 2 or ids.dtype != torch.int64 or not ids.numel() or \
                int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise QuantizeError(f"calibration must be int64 token ids [sequences, length] "
                                f"within the vocabulary (0..{vocab - 1}), got {tuple(ids.shape)} "
                                f"{ids.dtype}")
        return ids
    if source.tokenizer is None:
        raise QuantizeError("GPTQ calibrates on text, and the model has no tokenizer "
                            "(tokenizer.json / tokenizer_config.json in its directory): pass "
                            "tokenizer= or calibration= token ids, or use method 'rtn'")
    try:
        return calibration_ids(source.tokenizer, tokens, SEQ_LEN, seed, vocab)
    except ValueError as e:
        raise QuantizeError(str(e)) from None


def written_config(method: str, group_size: int, tokens: int, seed: int, act_order: bool,
                   own_text: bool) -> dict:
    """config.json's ``quantization_config``; ``meta`` records how it was made."""
    qc = quantization_config("gptq", group_size, sym=False, v1=True)
    meta = {"quantizer": ["infergraft"], "method": method}
    if method == "gptq":
        # act-order with static groups: g_idx stays arange(K) // group_size
        qc.update(desc_act=act_order, static_groups=act_order, damp_percent=DAMP,
                  true_sequential=True)
        meta.update(calibration_tokens=tokens, seed=seed if own_text else None,
                    calibration=SOURCE if own_text else "token ids given")
    return {**qc, "meta": meta}


def quantize_model(model, out, *, method: str = "gptq", bits: int = 4, group_size: int = 128,
                   calibration_tokens: int = DEFAULT_TOKENS, seed: int = 0, calibration=None,
                   act_order: bool | None = None, tokenizer=None,
                   progress: bool = False) -> QuantizeResult:
    """Quantise every decoder projection (q, k, v, o, gate, up, down) of ``model`` to 4
    bits in groups of ``group_size`` input columns and write an HF GPTQ checkpoint to the
    directory ``out`` (which must not exist or be empty); ``core.build(out)`` loads it.

    ``model``: a local HF safetensors directory, the ``smollm2-135m`` alias or a
    transformers model in memory (with ``tokenizer=`` for calibration and to save one).
    ``method``: "gptq" (calibrated: ``calibration_tokens`` tokens of Python's own docs,
    windows of 256 drawn with ``seed``, or ``calibration``: int64 ids [n, S] of your own)
    or "rtn" (round to nearest, no calibration). ``act_order`` (GPTQ; None: on for GPTQ, the
    robust default): the columns in descending order of their inputs' energy, each group's
    grid fixed before any column is (static groups: the groups stay contiguous, config.json
    says desc_act and static_groups). Embeddings, norms and the LM head are written unchanged. Settings, the
    model and ``out`` are checked first: QuantizeError (ModelSourceError for a model that
    cannot be read)."""
    start = time.perf_counter()
    from ..loading.source import resolve_source

    check_settings(method, bits, group_size, calibration_tokens)
    if act_order and method != "gptq":
        raise QuantizeError("act_order is a GPTQ setting; method 'rtn' has no column order")
    # act-order by default: without it the demo model's int4-g128 perplexity ratio is 1.19,
    # past the 1.10 bound act-order holds over every calibration seed tried
    act_order = method == "gptq" if act_order is None else act_order
    out = check_out(out)
    source = resolve_source(model, tokenizer)
    if source.prequantized is not None:
        raise QuantizeError(f"{source.name} is already quantised ({source.prequantized.label}); "
                            "give the dense model")
    check_architecture(source.config)
    if method == "rtn":
        tokens = 0

        def codes_of(module, weight):
            return rtn_int4(weight, group_size, min_zero=MIN_ZERO)
    else:
        from .sequential import gptq_model

        ids = calibration_batch(source, calibration_tokens, seed, calibration)
        tokens = ids.numel()
        codes = gptq_model(hf_model(source), ids, group_size, MIN_ZERO, act_order,
                           progress=progress)

        def codes_of(module, weight):
            return codes[module]
    tensors, packed = quantized_tensors(source.tensors(), codes_of, group_size)
    expected = len(PROJECTIONS) * source.config.num_hidden_layers
    if packed != expected:
        raise QuantizeError(f"found {packed} decoder projections in the checkpoint, expected "
                            f"{expected} ({', '.join(PROJECTIONS)} in each of "
                            f"{source.config.num_hidden_layers} layers)")
    where = source_dir(model)
    config = json.loads((where / "config.json").read_text()) if where is not None else \
        source.config.to_dict()
    config["quantization_config"] = written_config(method, group_size, tokens, seed,
                                                   act_order, calibration is None)
    write_checkpoint(out, tensors, config, where, source.tokenizer if where is None else None)
    return QuantizeResult(out, method, group_size, packed, tokens, time.perf_counter() - start,
                          act_order)
