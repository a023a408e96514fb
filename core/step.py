"""A token-budget step: the sequences it runs, the tokens each feeds, and their ids
(core/scheduler.py chooses the steps)."""
from __future__ import annotations

import attrs

from .request import Sequence


@attrs.frozen
class Step:
    kind: str  # "prefill" (some sequence feeds prompt tokens) | "decode" (none does)
    seqs: list
    # tokens each sequence feeds: 1 for a decoding sequence (one that is not
    # ``prefilling``), the next chunk of its prompt for a prefilling one; a decoding one
    # with a draft: 1 + its proposed tokens
    counts: list
    # speculative decoding (core/speculative/): a Proposal per sequence (None: none), its
    # tokens fed after the sequence's last one and verified from the logits of every row
    drafts: tuple | None = None


def step_of(seqs: list[Sequence], counts: list[int]) -> Step:
    """The step feeding ``counts`` tokens to ``seqs``, its kind from theirs."""
    return Step("prefill" if any(s.prefilling for s in seqs) else "decode", seqs, counts)


def counts_needed(seq: Sequence) -> int:
    """Tokens a running sequence feeds next at most: the rest of its prompt, or one."""
    return seq.num_prefill_tokens - seq.num_computed_tokens if seq.prefilling else 1


def tokens_of(seq: Sequence) -> list[int]:
    """What a prefill of ``seq`` feeds: its prompt, plus its output after a preemption."""
    return seq.prompt_ids + seq.output_ids


def step_tokens(step: Step) -> list[int]:
    """The token ids ``step`` feeds, sequence after sequence: a prefilling sequence's next
    ``count`` tokens, a decoding one's last sampled token (then its draft's tokens)."""
    tokens = []
    for i, (s, n) in enumerate(zip(step.seqs, step.counts)):
        if s.prefilling:
            done = s.num_computed_tokens
            tokens += tokens_of(s)[done:done + n]
        else:
            tokens.append(s.output_ids[-1])
            if step.drafts is not None and step.drafts[i] is not None:
                tokens += step.drafts[i].tokens
    return tokens


def logit_rows(step: Step) -> list[int]:
    """The rows of ``step``'s token dimension whose logits it needs: each sequence's last
    row, and every row of a sequence with a draft (each verifies the token before it)."""
    rows, at = [], 0
    for i, n in enumerate(step.counts):
        drafted = step.drafts is not None and step.drafts[i] is not None
        rows += range(at, at + n) if drafted else [at + n - 1]
        at += n
    return rows
