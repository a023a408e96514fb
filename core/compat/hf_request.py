"""HF ``generate``'s keyword arguments resolved for our engine (``compat/hf_engine.py``):
which it takes and what each becomes, HF's defaults, the rows of a padded batch, and
refusals naming what cannot be honoured."""
from __future__ import annotations

import attrs
import torch

from ..engine import Engine
from ..errors import InvalidRequestError
from ..request import SamplingParams

#: HF ``generate`` options taken, with what each becomes here
GENERATE_OPTIONS = {
    "attention_mask": "which tokens of a row are its prompt (1) and which padding (0)",
    "max_new_tokens": "tokens generated per row at most",
    "max_length": "prompt (padded length) + new tokens at most; max_new_tokens wins",
    "do_sample": "False (HF's default): greedy; True: sample",
    "temperature": "sampling temperature (do_sample only; default 1.0)",
    "top_k": "sample among the k likeliest (do_sample only; HF's default 50; 0: off)",
    "top_p": "nucleus sampling (do_sample only; default 1.0: off)",
    "min_p": "drop tokens below min_p * the likeliest's probability (do_sample only)",
    "repetition_penalty": "HF's repetition penalty over prompt + output (greedy too)",
    "eos_token_id": "an id or a list of ids that end a row (default: the model's)",
    "pad_token_id": "fills rows that ended early (default: the model's, else its EOS)",
    "num_return_sequences": "samples per row (do_sample only, as HF)",
    "generation_config": "an HF GenerationConfig: its set fields, under the keywords",
    "use_cache": "accepted and ignored: the engine always keeps a K/V cache",
    "bos_token_id": "accepted and ignored: a prompt is never empty",
}
#: HF options taken only at their default value (what they default to)
DEFAULT_ONLY = {"num_beams": 1, "return_dict_in_generate": False, "output_scores": False,
                "output_logits": False, "output_attentions": False,
                "output_hidden_states": False, "min_new_tokens": 0, "min_length": 0}
HF_DEFAULT_NEW_TOKENS = 20  # HF's default max_length, counted as new tokens (transformers 5)
HF_DEFAULT_TOP_K = 50


@attrs.frozen
class HFRequest:
    """One HF ``generate`` call, resolved: the rows' prompts and how to run them."""
    rows: list  # each input row's token ids, its padding removed
    params: SamplingParams
    n: int  # num_return_sequences
    eos: frozenset | None  # the caller's eos_token_id where it differs from the engine's
    pad: int



def hf_request(engine: Engine, ids: torch.Tensor, options: dict) -> HFRequest:
    """HF ``generate``'s options on ``engine`` for ``ids`` [B, T], resolved as HF resolves
    them (its defaults; sampling options only with ``do_sample``); InvalidRequestError
    naming any option it cannot honour."""
    opts = _options(options)
    # 1) eos and pad as HF: the caller's, else the model's; pad falls back to the first eos
    eos_list = _id_list(opts.get("eos_token_id"), "eos_token_id")
    custom_eos = None
    if eos_list is None:
        eos_list = list(engine.spec.eos_token_ids) or sorted(engine.eos_token_ids)
    elif frozenset(eos_list) != engine.eos_token_ids:
        custom_eos = frozenset(eos_list)
    pad = opts.get("pad_token_id")
    if pad is None:
        pad = engine.spec.pad_token_id
    if pad is None:
        pad = eos_list[0] if eos_list else 0
    if not isinstance(pad, int) or isinstance(pad, bool):
        raise InvalidRequestError(f"pad_token_id must be an integer token id, got {pad!r}")
    # 2) the prompts: HF infers the mask from pad where none is given and pad is no eos
    mask = opts.get("attention_mask")
    if mask is None and pad not in eos_list and bool((ids == pad).any()):
        mask = ids != pad
    rows = prompt_rows(ids, check_mask(mask, ids))
    # 3) lengths: max_new_tokens, else max_length (total, padded), else HF's 20 new ones
    new, total = opts.get("max_new_tokens"), opts.get("max_length")
    if new is None and total is not None:
        if not isinstance(total, int) or isinstance(total, bool) or total <= ids.shape[1]:
            raise InvalidRequestError(f"max_length={total!r} leaves no room after input_ids "
                                      f"of length {ids.shape[1]}; raise it, or set "
                                      "max_new_tokens")
        new = total - ids.shape[1]
    if new is None:
        new = max(1, min(HF_DEFAULT_NEW_TOKENS, engine.plan.max_seq_len - ids.shape[1]))
    # 4) sampling: greedy unless do_sample; HF's defaults for the rest
    return HFRequest(rows=rows, params=_sampling(opts, new, custom_eos is not None),
                     n=_samples(opts), eos=custom_eos, pad=pad)


def _options(options: dict) -> dict:
    """The keywords over a generation_config's set fields; unknown ones refused."""
    opts = dict(options)
    config = opts.pop("generation_config", None)
    if config is not None:
        if not callable(getattr(config, "to_diff_dict", None)):
            raise InvalidRequestError(f"generation_config must be a transformers "
                                      f"GenerationConfig, got {type(config).__name__}")
        fields = {k: v for k, v in config.to_diff_dict().items()
                  if not k.startswith("_") and k != "transformers_version"}
        opts = {**fields, **opts}
    unknown = sorted(k for k in opts if k not in GENERATE_OPTIONS and k not in DEFAULT_ONLY)
    off_default = sorted(f"{k}={opts[k]!r}" for k in opts if k in DEFAULT_ONLY
                         and opts[k] not in (None, DEFAULT_ONLY[k]))
    if unknown or off_default:
        named = ", ".join(unknown + off_default)
        raise InvalidRequestError(
            f"HF generate option(s) {named} are not supported (beam search, scores and "
            f"minimum lengths have no counterpart here); accepted: input_ids, "
            f"{', '.join(GENERATE_OPTIONS)}, and at their defaults "
            f"{', '.join(f'{k}={v!r}' for k, v in DEFAULT_ONLY.items())}")
    return opts


def _sampling(opts: dict, max_new_tokens, ignore_eos: bool) -> SamplingParams:
    sample = opts.get("do_sample")
    sample = False if sample is None else sample
    if not isinstance(sample, bool):
        raise InvalidRequestError(f"do_sample must be True or False, got {sample!r}")
    kw = dict(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
              repetition_penalty=_or(opts.get("repetition_penalty"), 1.0))
    if sample:
        temperature = _or(opts.get("temperature"), 1.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
                or not temperature > 0:
            raise InvalidRequestError(f"temperature must be a number > 0 with do_sample=True "
                                      f"(got {temperature!r}); for greedy set do_sample=False")
        top_k = _or(opts.get("top_k"), HF_DEFAULT_TOP_K)
        top_p = _or(opts.get("top_p"), 1.0)
        # seeded from torch's generator, so torch.manual_seed makes a run repeatable
        kw.update(temperature=temperature, top_k=None if top_k == 0 else top_k,
                  top_p=None if top_p == 1 else top_p, min_p=_or(opts.get("min_p"), 0.0),
                  seed=int(torch.randint(0, 2 ** 62, (1,)).item()))
    return SamplingParams(**kw)


def _samples(opts: dict) -> int:
    n = _or(opts.get("num_return_sequences"), 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequestError(f"num_return_sequences must be an integer >= 1, got {n!r}")
    if n > 1 and not opts.get("do_sample"):
        raise InvalidRequestError(f"num_return_sequences={n} needs do_sample=True: greedy "
                                  "decoding without beam search gives one sequence per row "
                                  "(as HF)")
    return n


def _or(value, default):
    return default if value is None else value


def _id_list(value, name: str):
    """An id, a list of ids or a tensor of them as a list (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = value if isinstance(value, (list, tuple)) else [value]
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError(f"{name} must be a token id or a list of them, got {value!r}")
    return list(ids)


def check_ids(tensor, name: str, allow_negative: bool = False) -> torch.Tensor:
    """``tensor`` if it is a [B, T] integer tensor with B, T >= 1."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"{name} must be a torch tensor of token ids [batch, length] "
                                  f"(e.g. tokenizer(texts, return_tensors='pt')), got "
                                  f"{type(tensor).__name__}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidRequestError(f"{name} must hold integer token ids (torch.long), got "
                                  f"{tensor.dtype}")
    if tensor.dim() != 2 or 0 in tensor.shape:
        hint = f"; for one prompt use {name}[None]" if tensor.dim() == 1 else ""
        raise InvalidRequestError(f"{name} must be 2-d [batch, length] with both >= 1, got "
                                  f"shape {list(tensor.shape)}{hint}")
    if not allow_negative and bool((tensor < 0).any()):
        raise InvalidRequestError(f"{name} holds negative token ids")
    return tensor


def check_mask(mask, ids: torch.Tensor) -> torch.Tensor:
    """The attention mask as a bool tensor on the CPU (all ones where None)."""
    if mask is None:
        return torch.ones(ids.shape, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        got = f"shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else repr(mask)
        raise InvalidRequestError(f"attention_mask must be a tensor of 0 and 1 with input_ids' "
                                  f"shape {list(ids.shape)}, got {got}")
    mask = mask.cpu()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidRequestError("attention_mask must hold only 0 (padding) and 1 (token)")
    mask = mask.bool()
    empty = [b for b in range(mask.shape[0]) if not bool(mask[b].any())]
    if empty:
        raise InvalidRequestError(f"attention_mask rows {empty} are all zeros: a row needs at "
                                  "least one token to generate from")
    return mask


def prompt_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's tokens where the mask is 1 (HF's positions count only those too)."""
    ids = ids.cpu()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def cut_at_eos(tokens: list[int], eos: frozenset | None) -> list[int]:
    """``tokens`` up to and with the first of ``eos`` (None: the engine stopped them)."""
    if eos is not None:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[:i + 1]
    return list(tokens)
