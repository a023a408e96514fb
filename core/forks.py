"""Samples 2..n of a prompt (``generate(..., n=...)``): forked from their parent once its
prefill is done, sharing its K/V (``cache.fork``: full blocks shared on paged caches), each
taking its first token from the parent's logits; one that cannot fork (no batch slot, no
block, a cache without forks) is queued to be prefilled on its own, like any request."""
from __future__ import annotations

from .cache import CacheFullError


def fork_samples(engine, seqs, logits) -> list:
    """``Engine._fork_samples``: (child, its first token) for each sample of ``seqs`` (the
    sequences whose prefill this step finished; ``logits``: one row each, None on a
    pipeline stage before the last) that forked."""
    out = []
    for row, parent in enumerate(seqs):
        for child in engine._forks.pop(parent.id, ()):
            try:
                if not engine.scheduler.has_room():
                    raise CacheFullError("no batch slot")
                engine.cache.fork(parent.id, child.id)
            except (CacheFullError, NotImplementedError):
                engine.scheduler.add(child)  # prefilled later, like any request
                continue
            child.num_prefill_tokens = parent.num_prefill_tokens
            child.num_computed_tokens = parent.num_computed_tokens
            # it holds the parent's K/V: their prompt's cached tokens are the same
            child.count_admission(parent.num_cached_tokens)
            engine.scheduler.adopt(child)
            engine._stepping.append(child)
            row_logits = None if logits is None else logits[row:row + 1]
            out.append((child, engine._sample(row_logits, [child])[0]))
    return out
