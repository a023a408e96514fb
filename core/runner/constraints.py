"""The logits processors of a step's rows (core/logits_processor.py, the contract).

``RowConstraints`` starts a request's ``ConstraintState``s when the engine adds it (each
processor its request names: a bad argument or an unknown name refuses the request before
it is queued), and each step:

1. ``mask``: fills one host bitmask [R, words] for the R constrained rows of the step's
   logits (R = 0: nothing at all happens) and masks them in one kernel launch
   (``kernels/token_bitmask.py``; the host work overlaps the device's forward pass, which
   runs ahead of the sampler). A row whose processor raises, or allows no token, is
   sampled as -1: its request ends with ``finish_reason="error"``, the others go on.
2. ``advance``: each state takes the row's sampled token; a refused token ends the request
   ("error"), a complete constraint finishes it ("stop").
3. ``forced``: the tokens a request's constraint forces next (jump-forward), which the
   engine appends and feeds in the request's next step.
"""
from __future__ import annotations

import functools
import time

import torch

from ..errors import InvalidRequestError
from ..logits_processor import Vocabulary, bitmask_words


def _timed(method):
    """Adds the method's wall time to ``self.host_seconds``."""
    @functools.wraps(method)
    def timed(self, *args):
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.host_seconds += time.perf_counter() - t0
    return timed


class RowConstraints:
    def __init__(self, vocab: Vocabulary, device, processors=None):
        self.vocab, self.device = vocab, torch.device(device)
        self._processors = processors  # a Registry (core.build's); None: the process-wide
        self._host = None  # [rows, words] int32 bitmask, pinned on CUDA, grown as needed
        self._op = None
        # host time on constraints: masks filled and applied (on the CPU the op runs here),
        # tokens accepted, forced tokens found
        self.host_seconds = 0.0

    @property
    def processors(self):
        if self._processors is None:
            from ..plugin_manager import get_plugin_manager  # (an engine not from build())
            self._processors = get_plugin_manager().logits_processors()
        return self._processors

    @processors.setter
    def processors(self, registry) -> None:  # core.build: its plugins' registry
        self._processors = registry

    def start(self, seq) -> None:
        """``seq.constraints``: a new state per processor its params name."""
        states = []
        for name, arg in seq.params.processors:
            if name not in self.processors:
                raise InvalidRequestError(
                    f"unknown logits processor {name!r}; registered: "
                    f"{', '.join(self.processors.names()) or '(none)'}")
            states.append(self.processors.get(name).start(arg, self.vocab))
        seq.constraints = states

    @_timed
    def mask(self, logits: torch.Tensor, seqs) -> list[int]:
        """Mask the constrained rows of ``logits`` [B, V] in place; returns the rows that
        failed (``seq.error`` says why), to be sampled as -1."""
        rows = [i for i, s in enumerate(seqs) if s.params.constrained]
        if not rows:
            return []
        bitmask = self._bitmask(len(rows))  # [R, words], all ones
        failed = []
        for j, i in enumerate(rows):
            try:
                self._fill(seqs[i], bitmask, j)
            except Exception as e:  # this request fails, not the batch
                seqs[i].error = f"its logits processor failed: {type(e).__name__}: {e}"
                bitmask[j] = -1  # any token: the row is sampled, then dropped
                failed.append(i)
        index = torch.tensor(rows, dtype=torch.long)
        self.op(logits, bitmask.to(self.device, non_blocking=True), index.to(self.device))
        return failed

    def _fill(self, seq, bitmask, j: int) -> None:
        if seq.constraints is None:  # a sample of n, forked from a validated request
            self.start(seq)
        first, *others = seq.constraints
        first.fill_bitmask(bitmask, j)
        for state in others:  # several processors: the tokens all of them allow
            row = torch.full_like(bitmask[j:j + 1], -1)
            state.fill_bitmask(row, 0)
            bitmask[j] &= row[0]
        if not bitmask[j].any():
            raise ValueError("its constraint allows no token here")

    @_timed
    def advance(self, seq, token: int) -> str | None:
        """Each of ``seq``'s states takes ``token``: "error" if one refuses it (seq.error
        says why), "stop" if a constraint is complete, else None."""
        try:
            if seq.constraints is None:  # (a rank that does not sample)
                self.start(seq)
            for state in seq.constraints:
                if not state.accept(token):
                    seq.error = f"token {token} is not allowed by its constraint"
                    return "error"
            return "stop" if self.complete(seq) else None
        except Exception as e:
            seq.error = f"its logits processor failed: {type(e).__name__}: {e}"
            return "error"

    @staticmethod
    def complete(seq) -> bool:
        """A constraint of ``seq`` allows nothing but a stop token now."""
        return any(s.is_complete() for s in seq.constraints or ())

    @_timed
    def forced(self, seq, limit: int) -> list[int]:
        """The tokens ``seq``'s constraint forces next (at most ``limit``), already taken
        by its state; [] without jump-forward (off, logprobs asked, several processors)."""
        p, states = seq.params, seq.constraints
        if not p.jump_forward or p.logprobs is not None or len(states or ()) != 1:
            return []
        try:
            return states[0].take_forced(limit)
        except Exception:  # nothing forced; the next mask will say what is wrong
            return []

    @property
    def op(self):
        if self._op is None:
            from infergraft.kernels.dispatch import get_op, resolve_backend
            self._op = get_op("apply_token_bitmask", resolve_backend(self.device))
        return self._op

    def _bitmask(self, rows: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < rows:
            grown = max(rows, 8, 2 * (0 if self._host is None else self._host.shape[0]))
            self._host = torch.empty((grown, bitmask_words(self.vocab.size)),
                                     dtype=torch.int32, pin_memory=self.device.type == "cuda")
        out = self._host[:rows]
        out.fill_(-1)
        return out
