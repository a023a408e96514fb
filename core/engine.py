"""Engine: requests in, completions out. The scheduler says what a step runs, the model
runner runs it (eager or a graph replay), the sampler picks tokens, and ``_append``
applies stop conditions; ``step()`` is one such round (docs/architecture.md: "How a
request flows").

Threads may share one engine: each public entry holds ``Engine.lock`` for one step (not
a whole ``generate`` call), so the callers' requests run together in one batch and each
gets exactly what it gets alone; a caller returns once its own requests have finished."""
from __future__ import annotations

import time
from typing import Union

import attrs
import torch

from .distributed.failure import across_ranks
from .errors import InvalidRequestError
from .appending import append_token
from .fair_lock import FairRLock
from .forks import fork_samples
from .logits_processor import Vocabulary
from .prompt import as_batch, check_request, encode_prompt
from .request import SEED_LIMIT, Completion, SamplingParams, Sequence, completion_of, sampling_params
from .runner.async_steps import AsyncSteps
from .runner.constraints import RowConstraints
from .runner.lookahead import DecodeLookahead
from .runner.model_runner import ModelRunner
from .runner.sampler import sample_each
from .scheduler import DEFAULT_BATCHED_TOKENS, Scheduler, step_tokens
from .streaming import RequestStream, abort_requests, raise_failed

Prompt = Union[str, list]


def _runner_attribute(name: str, doc: str) -> property:
    """The engine's name for one of its model runner's graph runners (read and set)."""
    return property(lambda self: getattr(self.runner, name),
                    lambda self, value: setattr(self.runner, name, value), doc=doc)


class Engine:
    def __init__(self, model, cache, tokenizer, plan, spec, max_num_batched_tokens=None):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.plan, self.spec = plan, spec
        self.device = torch.device(plan.device)
        self.scheduler = Scheduler(cache, plan.max_batch_size, max_num_batched_tokens=(
            max_num_batched_tokens or DEFAULT_BATCHED_TOKENS))
        eos = set(spec.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._forks: dict[int, list[Sequence]] = {}  # parent id -> samples forked at its prefill
        self._stepping: list[Sequence] = []  # the running step's sequences
        # schedule the next step while the GPU runs this one (build(): on one CUDA device)
        self.schedule_ahead, self._ahead = False, None  # scheduler.schedule_ahead's step
        self.runner = ModelRunner(model, cache, self.device, plan.parallel.micro_batches)
        self.lookahead = DecodeLookahead(self)  # greedy graph decode, one step ahead
        self.async_steps = AsyncSteps(self)  # any greedy step: the next launched, then read
        # speculative.speculator.Speculator: proposed tokens verified in a step (build())
        self.speculation = None
        # requests' logits processors (structured output); build() gives its plugins'
        self.constraints = RowConstraints(Vocabulary(spec.vocab_size, self.eos_token_ids,
                                                     tokenizer, self.device.type), self.device)
        # a grammar compiling holds its request, not the batch (ranks: every one schedules alike)
        self.scheduler.ready = lambda seq: self.ranks is not None or self.constraints.ready(seq)
        self.scheduler.wait_ready = self.constraints.wait_ready
        # distributed.collectives.TensorParallelGroup or distributed.stages.PipelineStage:
        # every rank takes the tokens sampled where the logits are
        self.ranks = None
        # held for one step (or one add / abort / logits call) at a time: FIFO between
        # threads, so a caller stepping in a loop cannot starve one waiting to add its request
        self.lock = FairRLock()

    decode_graphs = _runner_attribute(
        "decode_graphs", "runner.cuda_graph.CudaGraphRunner (set by build() on CUDA) or None.")
    prefill_graphs = _runner_attribute(
        "prefill_graphs", "runner.prefill_graph.PrefillGraphRunner (build(), CUDA) or None.")

    # -- requests ----------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt (text, token ids) as token ids; InvalidRequestError if it is not one."""
        return encode_prompt(prompt, self.tokenizer, self.spec.vocab_size)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Validate and queue one request; a bad one raises and nothing else changes."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a core.SamplingParams (or None), got "
                                      f"{type(params).__name__}: e.g. SamplingParams(**{params!r})"
                                      if isinstance(params, dict) else
                                      f"params must be a core.SamplingParams, got {params!r}")
        ids = self.encode(prompt)
        self._check(ids, params)
        seq = Sequence(ids, params)
        if params.constrained:  # a bad processor argument refuses it here
            self.constraints.start(seq)
        with self.lock:
            self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def abort(self, seqs_or_ids, reason: str = "abort") -> list[Sequence]:
        """Drop requests (a ``Sequence``, its ``id``, or a list of them) now: their cache is
        freed, they finish with ``reason`` (unforked samples of ``n`` with their prompt);
        finished or unknown ones stay as they are. Returns the sequences it finished."""
        with self.lock:
            return abort_requests(self, seqs_or_ids, reason)

    # -- stepping ----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one scheduler step; returns the sequences that got a token."""
        with self.lock:
            self._stepping = []  # (a scheduler that raises has run no sequence)
            if self.lookahead.inflight is not None:  # a greedy decode step already launched
                self._stepping = list(self.lookahead.inflight[0])
                return self._ahead_step(len(self._stepping), self.lookahead.advance)
            if self.async_steps.inflight is not None:  # a step launched before the last read
                self._stepping = self.async_steps.stepping()
                return self._guarded(self.async_steps.advance)
            ahead, self._ahead = self._ahead, None
            step = None if ahead is None else self.scheduler.resume(ahead)
            step = step or self.scheduler.schedule()
            if step is None:
                return []
            if self.speculation is not None:  # drafts after decoding requests' tokens
                step = self.speculation.extend(step)
            tokens = step_tokens(step)
            replay = self.runner.replays_decode(step)
            self._stepping = list(step.seqs)  # (+ samples forked in this step)
            if replay and self.lookahead.eligible(step.seqs) and (
                    not self.async_steps.takes(step) or self.lookahead.keeps_up(step.seqs)):
                return self._ahead_step(len(step.seqs),
                                        lambda: self.lookahead.run(step.seqs, tokens))
            if self.async_steps.takes(step):
                return self._guarded(lambda: self.async_steps.run(step, tokens, replay))
            return self._guarded(lambda: self._step_body(step, tokens, replay))

    def _ahead_step(self, rows: int, run_step):
        """A look-ahead decode step, timed for speculation's cost fit: back to back, its
        call lasts one step of the pipeline (what a plain token costs while drafts pause)."""
        start = time.perf_counter()
        done = self._guarded(run_step)
        if self.speculation is not None:
            self.speculation.cost.observe(rows, time.perf_counter() - start, False)
        return done

    def _guarded(self, run_step):
        try:
            return run_step()
        # K/V written, not every token appended (an OOM, Ctrl-C, a sampler error): the
        # step's sequences are recomputed; a step launched ahead writes only slots freed here.
        except BaseException as e:
            self.lookahead.inflight = self.async_steps.inflight = self._ahead = None
            for s in self._stepping:
                if s in self.scheduler.running:
                    self.scheduler.preempt(s, failed=True)
            raise across_ranks(e, self.ranks)  # tp / pp: RankFailedError, on every rank

    def _step_body(self, step, tokens, replay) -> list[Sequence]:
        seqs, start = step.seqs, time.perf_counter()
        logits = self.runner.forward(step, tokens, replay)
        for s, n in zip(seqs, step.counts):
            s.num_computed_tokens += n
        verify = None
        if step.drafts is not None:  # (lengths move when drafts are verified: no look ahead)
            seqs, logits, verify = self.speculation.split(step, logits)
        elif self.schedule_ahead:  # while the GPU runs this step (the sampling waits for it)
            self._ahead = self.scheduler.schedule_ahead()
        if step.kind == "prefill":
            ready = [i for i, s in enumerate(seqs) if not s.prefilling]  # whole prompt fed
            if len(ready) < len(seqs):  # a chunk: no token yet
                seqs = [seqs[i] for i in ready]
                logits = None if logits is None else logits[ready]
        new = self._sample(logits, seqs) if seqs else []
        forked = self._fork_samples(seqs, logits) if self._forks and step.kind == "prefill" else []
        now = time.perf_counter()
        for seq, tok in zip(seqs, new):
            self._append(seq, tok, now)
        for seq, tok in forked:
            self._append(seq, tok, now)
        drafted = self.speculation.accept(verify, now) if verify is not None else []
        if self.speculation is not None:  # what its steps cost decides who proposes
            self.speculation.observe(step, time.perf_counter() - start)
        return seqs + [s for s, _ in forked] + drafted

    def _fork_samples(self, seqs, logits) -> list[tuple[Sequence, int]]:
        return fork_samples(self, seqs, logits)  # (n > 1: forks.py)

    def _sample(self, logits, seqs) -> list[int]:
        """One token per sequence; -1 where sampling failed (NaN logits, say): the step has
        written every sequence's K/V, so the others must still get their tokens."""
        # (logits None: a pipeline stage before the last; the last one samples)
        new = [-1] * len(seqs)
        if logits is not None:
            failed = self.constraints.mask(logits, seqs)  # constrained rows, one launch
            new = sample_each(logits, seqs)
            for row in failed:
                new[row] = -1
        return new if self.ranks is None else self.ranks.broadcast_sampled(new, self.device)

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        append_token(self, seq, token, now)  # (stop conditions, constraints: appending.py)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.metrics.finished = now
        if self.tokenizer is not None and not seq.params.stop:
            seq.text = self._decode(seq.output_ids)
        self.scheduler.finish(seq, reason)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _run(self, seqs: list[Sequence]) -> None:
        try:  # step until ours have finished (other callers' steps count too)
            while True:
                with self.lock:  # per step: other callers add, step and abort in between
                    if all(s.finished for s in seqs):
                        return
                    self.step()
        except BaseException:  # drop this call's requests (forks included), not others'
            self.abort(seqs)
            raise

    # -- public API --------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k=None, top_p=None, seed=None, stop=None, n: int = 1,
                 **sampling) -> list[Completion]:
        """Complete one prompt or a list of them (strings or token-id lists), in order.
        ``sampling``: any other SamplingParams field (``json_schema=``, ``regex=``,
        ``min_p=``, ``logprobs=``, ...).

        ``n`` samples per prompt come back prompt by prompt (``len(prompts) * n``
        completions); sample ``i`` uses ``seed + i``. The samples of a prompt share its
        prefill: the cache forks the prompt's K/V (full blocks shared on paged caches)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")
        params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, stop=stop, **sampling)
        if seed is not None and seed + n - 1 >= SEED_LIMIT:  # sample i takes seed + i
            raise InvalidRequestError(f"seed + n - 1 must stay below 2**63 (sample i uses seed "
                                      f"+ i), got seed={seed}, n={n}")
        batch = [self.encode(p) for p in as_batch(prompts)]
        for ids in batch:  # validate everything before queueing anything
            self._check(ids, params)
        seqs = []
        with self.lock:  # a step between a prompt and its forks would prefill it unforked
            for ids in batch:
                parent = self.add_request(ids, params)
                children = [Sequence(list(ids), params if seed is None else
                                     attrs.evolve(params, seed=seed + i)) for i in range(1, n)]
                if children:
                    self._forks[parent.id] = children
                seqs += [parent, *children]
        self._run(seqs)
        done = [self._completion(s) for s in seqs]
        raise_failed(seqs, done)  # carries ``done``: the others' completions are not lost
        return done

    def stream(self, prompt: Prompt, max_new_tokens: int = 16, temperature: float = 0.0,
               top_k=None, top_p=None, seed=None, stop=None, **sampling) -> RequestStream:
        """Text deltas (lists of new token ids when there is no tokenizer), as they come;
        the returned stream's ``request`` holds the request's finish reason and metrics.
        ``sampling``: any other SamplingParams field, as ``generate`` takes them."""
        params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, stop=stop, **sampling)
        ids = self.encode(prompt)
        self._check(ids, params)  # bad input raises here, not at the first next()
        return RequestStream(self, ids, params)

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """Logits for every position of ``token_ids``: [len, vocab] float32."""
        ids = self.encode(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)
        if len(ids) > self.plan.max_seq_len:
            raise InvalidRequestError(f"{len(ids)} tokens exceed "
                                      f"max_seq_len={self.plan.max_seq_len}")
        with self.lock:  # a sequence beside the running requests', for one forward
            return self.runner.logits_of(ids, self.ranks, self.spec.vocab_size)

    def stats(self) -> dict:
        with self.lock:  # the scheduler's and the cache's counters, speculation's
            extra = {} if self.speculation is None else self.speculation.stats()
            return {**self.scheduler.stats(), **extra}

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        check_request(ids, params, self.plan.max_seq_len, self.spec, self.tokenizer)

    def _completion(self, seq: Sequence) -> Completion:
        return completion_of(seq, with_text=self.tokenizer is not None)
