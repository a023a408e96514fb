"""The logits processors of a step's rows (core/logits_processor.py, the contract).

``RowConstraints`` starts a request's ``ConstraintState``s when the engine adds it (each
processor its request names: a bad argument or an unknown name refuses the request before
it is queued), and each step:

1. ``mask``: fills one host bitmask [R, words] for the R constrained rows of the step's
   logits (R = 0: nothing at all happens) and masks them in one kernel launch
   (``kernels/token_bitmask.py``; the host work overlaps the device's forward pass, which
   runs ahead of the sampler, and nothing before it waits for the device). The rows
   whose one state has a ``batch`` (a grammar's) are filled by one call of it, across
   its threads, not row by row; other rows (a plugin's state, several processors) one
   by one, in a launch of their own. A row whose processor raises, or allows no token,
   is sampled as -1: its request ends with ``finish_reason="error"``, the others go on.
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
    """Adds the method's wall time to ``self.host_seconds`` and to its own entry of
    ``self.host_parts`` (none of the timed methods calls another)."""
    name = method.__name__

    @functools.wraps(method)
    def timed(self, *args):
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            spent = time.perf_counter() - t0
            self.host_seconds += spent
            self.host_parts[name] = self.host_parts.get(name, 0.0) + spent
    return timed


class RowConstraints:
    def __init__(self, vocab: Vocabulary, device, processors=None):
        self.vocab, self.device = vocab, torch.device(device)
        self._processors = processors  # a Registry (core.build's); None: the process-wide
        # a step's bitmasks and rows pinned on CUDA (the caching host allocator keeps them
        # until their copies are done), so their copies to the device do not wait
        self._pinned = self.device.type == "cuda"
        self._op = None
        # host time on constraints: masks filled and applied (on the CPU the op runs here),
        # tokens accepted, forced tokens found
        self.host_seconds = 0.0
        self.host_parts: dict[str, float] = {}  # the same by method: mask, advance, ...

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

    @staticmethod
    def ready(seq) -> bool:
        """Whether ``seq`` can run without its first mask waiting (the scheduler holds it
        in the queue until then: ``ConstraintState.ready``)."""
        return not seq.params.constrained or all(s.ready() for s in seq.constraints or ())

    @_timed
    def wait_ready(self, seq) -> None:
        """Nothing else can run: block until ``seq``'s states are ready."""
        for state in seq.constraints or ():
            state.wait()

    @_timed
    def mask(self, logits: torch.Tensor, seqs, rows=None) -> list[int]:
        """Mask the constrained rows of ``logits`` [B, V] in place (``rows``: those of
        them to mask, default all); returns the rows that failed (``seq.error`` says why),
        to be sampled as -1."""
        if rows is None:
            rows = [i for i, s in enumerate(seqs) if s.params.constrained]
        if not rows:
            return []
        # rows whose one state fills in a batch (``state.batch``: a grammar's, per
        # tokenizer) go together; the others (several processors, a plugin's) one by one
        groups, failed = {}, []
        for i in rows:
            seq = seqs[i]
            try:
                if seq.constraints is None:  # a sample of n, forked from a validated request
                    self.start(seq)
            except Exception as e:
                failed.append(self._failed(seq, e))
                continue
            states = seq.constraints
            batch = getattr(states[0], "batch", None) if len(states) == 1 else None
            groups.setdefault(batch, []).append(i)
        for batch, group in groups.items():
            failed += self._mask_rows(logits, [seqs[i] for i in group], group, batch)
        failed = {id(s) for s in failed}
        return [i for i in rows if id(seqs[i]) in failed]

    def _mask_rows(self, logits, seqs, rows: list[int], batch) -> list:
        """Rows ``rows`` of ``logits`` masked by their ``seqs``' states in one launch, one
        fill call if ``batch``; returns the sequences that failed."""
        # 1. their bitmask [R, words] on the host: a batch's as wide as its tokenizer
        # (the kernel masks every id past a bitmask's width), else the logits' width
        words = bitmask_words(self.vocab.size) if batch is None else batch.words
        bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=self._pinned)
        if batch is not None:
            errors = batch.fill([s.constraints[0] for s in seqs], bitmask)
        else:
            bitmask.fill_(-1)
            errors = {}
            for j, seq in enumerate(seqs):
                try:
                    self._fill(seq, bitmask, j)
                except Exception as e:
                    errors[j] = e
        # 2. a row left with no token allowed fails; a failed row allows any token (it
        # is sampled, then dropped)
        for j in (~bitmask.any(1)).nonzero().flatten().tolist():
            errors.setdefault(j, ValueError("its constraint allows no token here"))
        for j, e in errors.items():
            self._failed(seqs[j], e)
            bitmask[j] = -1
        # 3. one launch; both copies asynchronous (pinned), so nothing here waits for
        # the device's forward pass
        index = torch.tensor(rows, dtype=torch.long, pin_memory=self._pinned)
        self.op(logits, bitmask.to(self.device, non_blocking=True),
                index.to(self.device, non_blocking=True))
        return [seqs[j] for j in errors]

    @staticmethod
    def _failed(seq, error: Exception):
        """``seq`` failed in its logits processor: ``seq.error`` says how; returns it."""
        seq.error = f"its logits processor failed: {type(error).__name__}: {error}"
        return seq

    def _fill(self, seq, bitmask, j: int) -> None:
        first, *others = seq.constraints
        first.fill_bitmask(bitmask, j)
        for state in others:  # several processors: the tokens all of them allow
            row = torch.full_like(bitmask[j:j + 1], -1)
            state.fill_bitmask(row, 0)
            bitmask[j] &= row[0]

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
