"""Which proposed tokens a request keeps: the target model's logits at each of its rows
of a verify step decide.

A request fed its last token and ``d`` proposed tokens gets ``d + 1`` rows of logits: row
``i`` is the target's distribution after the proposed tokens before ``i``. Greedy: the
proposed tokens are kept while each is the target's argmax; at the first that is not, the
target's argmax replaces it, and when all are kept the last row gives one more token (the
bonus). Sampled: rejection sampling (Leviathan et al. 2023, Chen et al. 2023) keeps
proposed token ``t`` with probability ``min(1, p(t) / q(t))`` (``q``: the distribution it
was drawn from; a point mass for greedy drafts and n-gram lookup: ``p(t)``) and on a
refusal draws from ``max(p - q, 0)`` normalised (a point mass: ``p`` without ``t``), so
every token is distributed exactly as the target's (``p``: after penalties, temperature,
top-k, top-p and min-p, as the sampler draws). Either way a request appends between 1 and
``d + 1`` tokens a verify step.
"""
from __future__ import annotations

import torch

from ..runner.sampler import logprob_entry, process


def accept_greedy(targets: list[int], draft) -> list[int]:
    """targets: the target's token at each of ``len(draft) + 1`` rows -> the tokens to
    append: the proposed ones it agrees with, then its own."""
    out = []
    for want, proposed in zip(targets, draft):
        out.append(want)
        if want != proposed:
            return out
    out.append(targets[len(draft)])
    return out


def rejection_sample(probs: torch.Tensor, draft, draft_probs, generator) -> list[int]:
    """probs: [d + 1, V] the target's distribution at each row (float32, rows summing to 1);
    draft: the d proposed ids; draft_probs: [d, V] the distributions they were drawn from,
    or None (point masses) -> the tokens to append, each distributed as the target's."""
    out = []
    for i, t in enumerate(draft):
        p = probs[i]
        q_t = 1.0 if draft_probs is None else float(draft_probs[i, t])
        u = float(torch.rand((), generator=generator))
        if u * q_t < float(p[t]):  # kept with probability min(1, p(t) / q(t))
            out.append(t)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[t] = 0
        else:
            residual = (p - draft_probs[i]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p <= q everywhere: only rounding refused it
            out.append(t)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out


def verify_request(logits: torch.Tensor, targets: list[int], seq, proposal):
    """One request's rows of a verify step -> (the tokens it appends, their TokenLogprobs
    or None). logits: [d + 1, V] float32 on the host (None for a plain greedy request, which
    reads ``targets``: each row's argmax, from the device)."""
    p, draft = seq.params, proposal.tokens
    if p.plain_greedy:
        return accept_greedy(targets, draft), None
    # row i after the proposed tokens before it: the penalties count those too
    rows = [process(logits[i], seq, seq.output_ids + list(draft[:i]))
            for i in range(len(draft) + 1)]
    if p.greedy:
        tokens = accept_greedy([int(scaled.argmax()) for scaled, _ in rows], draft)
    else:
        probs = torch.stack([masked.softmax(-1) for _, masked in rows])  # [d + 1, V]
        tokens = rejection_sample(probs, draft, proposal.probs, seq.generator)
    entries = None if p.logprobs is None else \
        [logprob_entry(t, rows[i][0].log_softmax(-1), p.logprobs) for i, t in enumerate(tokens)]
    return tokens, entries
