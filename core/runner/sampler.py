"""Token selection: greedy, temperature, top-k, top-p, min-p, penalties, logprobs, with
per-request seeded generators.

A row's logits go through, in vLLM's order: the repetition penalty (HF's
``RepetitionPenaltyLogitsProcessor`` over prompt + output ids), the frequency and presence
penalties (OpenAI's, over output ids), the temperature, top-k, top-p and min-p (HF's
``MinPLogitsWarper``). Greedy rows take the argmax of the penalised logits. Logprobs are
the log-softmax after penalties and temperature (core/request.py says why).

Greedy rows without penalties, min_p or logprobs (most of a greedy batch) take the batch
argmax computed on the device and cost nothing else; the others are copied to the host
together in one copy and processed there, where their generators live. Rows under a
constraint (a JSON schema, a grammar: ``runner/constraints.py``) come here masked already,
so their argmax and their draws see only the tokens the constraint allows.
"""
from __future__ import annotations

import torch

from ..request import TokenLogprob


def filter_logits(logits: torch.Tensor, temperature: float, top_k, top_p,
                  min_p: float = 0.0) -> torch.Tensor:
    """logits: [V] float32 -> scaled and masked logits (masked entries are -inf)."""
    return truncate(logits / temperature, top_k, top_p, min_p)


def truncate(logits: torch.Tensor, top_k, top_p, min_p: float = 0.0) -> torch.Tensor:
    """logits: [V] float32, already scaled -> top-k, top-p, then min-p masked (-inf)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p  # keeps the smallest set reaching top_p (at least one)
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if min_p > 0:
        # the most likely token always stays (its prob >= min_p * itself)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def penalise(logits: torch.Tensor, params, prompt_set: torch.Tensor,
             output_ids: list[int]) -> torch.Tensor:
    """logits: [V] float32 -> the repetition, frequency and presence penalties applied.

    ``prompt_set``: the prompt's distinct ids [U]; ``output_ids``: the tokens generated so
    far. Returns ``logits`` itself when no penalty is set."""
    rep, freq, pres = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    out = torch.tensor(output_ids, dtype=torch.long)  # [N]
    if rep != 1:
        # HF: a seen token's logit divided by the penalty when positive, multiplied when
        # negative (both push it down for a penalty > 1), once however often it was seen
        seen = torch.cat([prompt_set, out])
        score = logits[seen]
        logits = logits.index_put((seen,), torch.where(score < 0, score * rep, score / rep))
    if (freq != 0 or pres != 0) and len(output_ids):
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)  # [V]
        logits = logits - (counts * freq + (counts > 0).to(logits.dtype) * pres)
    return logits


def sample_each(logits: torch.Tensor, seqs) -> list[int]:
    """``sample``, but a row that fails (NaN logits, say) gets -1 and its sequence's
    ``error`` says why, instead of costing the other rows their tokens."""
    states = [None if s.generator is None else s.generator.get_state() for s in seqs]
    try:
        return sample(logits, seqs)
    except Exception:  # rows before the failing one drew already: draw again from there
        # (their logprobs, recorded already, are replaced: _record keys them by position)
        for s, state in zip(seqs, states):
            if state is not None:
                s.generator.set_state(state)
        return [_sample_row(logits[i:i + 1], s) for i, s in enumerate(seqs)]


def _sample_row(row: torch.Tensor, seq) -> int:
    try:
        return sample(row, [seq])[0]
    except Exception as e:
        seq.error = failure(e)
        return -1


def failure(e: Exception) -> str:
    """A sequence's ``error`` where its row's sampling raised ``e``."""
    return f"sampling failed: {type(e).__name__}: {e}"


def nan_error(rows: list[int]) -> ValueError:
    """What sampling rows of NaN logits raises (argmax would return the NaN's index)."""
    return ValueError(f"NaN logits in row(s) {rows}: the model's output overflowed")


def sample(logits: torch.Tensor, seqs) -> list[int]:
    """logits: [B, V] float32, one row per sequence -> one token id per sequence. A row
    holding NaN raises (argmax would return the NaN's index as a token)."""
    # [2, B] -> host in one copy (one sync a step, as before the NaN check)
    out, nan = torch.stack([logits.argmax(-1), torch.isnan(logits).any(-1).long()]).tolist()
    nan_rows = [row for row, bad in enumerate(nan) if bad]
    if nan_rows:
        raise nan_error(nan_rows)
    rows = [row for row, seq in enumerate(seqs)
            if not seq.params.greedy or seq.params.needs_logits_processing]
    if not rows:  # an all-greedy batch: the argmax is every token
        return out
    host = logits[rows].cpu() if len(rows) < len(seqs) else logits.cpu()  # [R, V], one copy
    for i, row in enumerate(rows):
        out[row] = _draw(host[i], seqs[row], out[row])
    return out


def _draw(logits: torch.Tensor, seq, argmax: int) -> int:
    """logits: [V] float32 on the host -> this sequence's token (``argmax``: the raw
    logits' argmax, the token of a greedy row without penalties)."""
    p = seq.params
    scaled, masked = process(logits, seq)
    if masked is None:  # greedy
        token = int(scaled.argmax()) if _penalised(p) else argmax
    else:
        token = int(torch.multinomial(masked.softmax(-1), 1, generator=seq.generator))
    if p.logprobs is not None:
        _record(seq, token, scaled.log_softmax(-1), p.logprobs)
    return token


def process(logits: torch.Tensor, seq, output_ids=None):
    """logits: [V] float32 on the host -> (the logits of the distribution a token is drawn
    from, after the penalties and the temperature: what logprobs report; those logits
    truncated by top-k, top-p and min-p, or None for a greedy row, whose token is the first
    one's argmax). ``output_ids``: the output the penalties see (default: ``seq``'s; a
    speculative token's row sees the proposed tokens before it too)."""
    p = seq.params
    if _penalised(p):
        out = seq.output_ids if output_ids is None else output_ids
        logits = penalise(logits, p, seq.prompt_id_set(), out)
    if p.greedy:  # the distribution before truncation: temperature 1 for greedy rows
        return logits, None
    scaled = logits / p.temperature
    return scaled, truncate(scaled, p.top_k, p.top_p, p.min_p)


def _penalised(p) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _record(seq, token: int, logprobs: torch.Tensor, k: int) -> None:
    """Append ``token``'s TokenLogprob to ``seq.logprobs`` (logprobs: [V] float32)."""
    place_logprob(seq, logprob_entry(token, logprobs, k))


def logprob_entry(token: int, logprobs: torch.Tensor, k: int) -> TokenLogprob:
    """``token``'s TokenLogprob and the ``k`` most likely tokens' (logprobs: [V] float32)."""
    top = ()
    if k:
        values, ids = torch.topk(logprobs, k)  # sorted, most likely first
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def place_logprob(seq, entry: TokenLogprob) -> None:
    """``entry`` as the logprob of output position len(output_ids): a step retried after a
    failure (or recomputed after an interrupt between sampling and appending) replaces its
    own."""
    del seq.logprobs[len(seq.output_ids):]
    seq.logprobs.append(entry)
