"""Requests as the engine sees them: sampling parameters, sequences, completions.

Log-probabilities (``SamplingParams.logprobs``) are those of the distribution a token is
drawn from after the penalties and the temperature (vLLM's "processed" logprobs; greedy:
the penalised logits at temperature 1), before the top-k / top-p / min-p truncation, so
every token, the sampled one included, has a finite log-probability; without truncation
it is exactly the distribution the token was drawn from."""
from __future__ import annotations

import enum
import itertools
import math
from typing import Optional

import attrs
import torch

from ._moved import moved_names
from .errors import InvalidRequestError
from .logits_processor import named_processors
from .metrics import RequestMetrics
from .structured.constraint import PROCESSOR, check_constraint, choices, schema_text


#: temperatures below this sample greedily (as vLLM): logits / T would overflow float32
GREEDY_BELOW = 1e-5
SEED_LIMIT = 2 ** 63  # seeds are in [0, SEED_LIMIT): what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's top_logprobs limit)


def _number(x, kinds) -> bool:
    return isinstance(x, kinds) and not isinstance(x, bool)  # True is not 1 token


def _check_params(p: "SamplingParams") -> None:
    if not _number(p.max_new_tokens, int) or p.max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {p.max_new_tokens!r}")
    if not _finite(p.temperature) or p.temperature < 0:
        raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), "
                                  f"got {p.temperature!r}")
    if p.top_k is not None and (not _number(p.top_k, int) or p.top_k < 1):
        raise InvalidRequestError(f"top_k must be None or an integer >= 1, got {p.top_k!r}")
    if p.top_p is not None and (not _number(p.top_p, (int, float)) or not 0 < p.top_p <= 1):
        raise InvalidRequestError(f"top_p must be None or in (0, 1], got {p.top_p!r}")
    if p.seed is not None and (not _number(p.seed, int) or not 0 <= p.seed < SEED_LIMIT):
        raise InvalidRequestError(f"seed must be None or an integer in [0, 2**63), got {p.seed!r}")
    if any(not isinstance(s, str) or not s for s in p.stop):
        raise InvalidRequestError(f"stop must be a non-empty string or a list of them, got {p.stop!r}")
    if p.logprobs is not None and (not _number(p.logprobs, int)
                                   or not 0 <= p.logprobs <= MAX_LOGPROBS):
        raise InvalidRequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] "
                                  f"(top log-probabilities per token), got {p.logprobs!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        x = getattr(p, name)
        if not _finite(x) or not -2 <= x <= 2:
            raise InvalidRequestError(f"{name} must be a number in [-2, 2] (0 = off), got {x!r}")
    if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise InvalidRequestError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                                  f"got {p.repetition_penalty!r}")
    if not _finite(p.min_p) or not 0 <= p.min_p <= 1:
        raise InvalidRequestError(f"min_p must be a number in [0, 1] (0 = off), got {p.min_p!r}")
    if not isinstance(p.speculative, bool):
        raise InvalidRequestError(f"speculative must be True or False (False: this request "
                                  f"never proposes tokens), got {p.speculative!r}")


def _finite(x) -> bool:
    try:
        return _number(x, (int, float)) and math.isfinite(x)
    except OverflowError:  # an int past float's range
        return False


def _as_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return tuple(stop) if isinstance(stop, (list, tuple)) else (stop,)  # else: checked above


@attrs.frozen
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_stop)
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    logprobs: Optional[int] = None  # None: none; k: the sampled token's and the top k's
    presence_penalty: float = 0.0  # OpenAI: over the generated tokens, once per token seen
    frequency_penalty: float = 0.0  # OpenAI: over the generated tokens, per occurrence
    repetition_penalty: float = 1.0  # HF / vLLM: over prompt + generated tokens, a ratio
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one's
    # Structured output (core/structured/): at most one of the five below, which every
    # output then matches; json_schema: a dict, JSON text or a pydantic model class
    json_schema: Optional[str] = attrs.field(default=None, converter=schema_text)
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    grammar: Optional[str] = None  # EBNF (GBNF: "root ::= ...") or Lark ("start: ...")
    choice: Optional[tuple[str, ...]] = attrs.field(default=None, converter=choices)
    jump_forward: bool = False  # tokens a constraint forces: appended, fed in one step
    # registered logits processors (core/logits_processor.py): name -> argument
    logits_processors: tuple = attrs.field(default=(), converter=named_processors)
    # False: never proposes tokens where the engine speculates (core/speculative/)
    speculative: bool = True
    #: the structured-output fields as one checked Constraint (None: none given)
    constraint: object = attrs.field(init=False, default=None, eq=False, repr=False)
    # Greedy with no logits processing and no logprobs: its token is the batch argmax, so
    # the decode graphs' in-graph argmax and the look-ahead may choose it. Computed once
    # here: the sampler and the look-ahead read it for every row of every step.
    plain_greedy: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        _check_params(self)
        object.__setattr__(self, "constraint", check_constraint(self))
        object.__setattr__(self, "plain_greedy", self.greedy and not self.needs_logits_processing
                           and not self.constrained)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def constrained(self) -> bool:
        """A structured-output field or a logits processor: the sampler masks this row."""
        return self.constraint is not None or bool(self.logits_processors)

    @property
    def processors(self) -> tuple:
        """(name, argument) of each processor it runs (its Constraint's: ``grammar``)."""
        grammar = ((PROCESSOR, self.constraint),) if self.constraint is not None else ()
        return self.logits_processors + grammar

    @property
    def needs_logits_processing(self) -> bool:
        """Penalties, min_p or logprobs: the sampler must see this row's logits."""
        return (self.logprobs is not None or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_p != 0)


def sampling_params(**fields) -> SamplingParams:
    """SamplingParams(**fields), an unknown field named with the ones there are."""
    known = sorted(a.name for a in attrs.fields(SamplingParams) if a.init)
    if set(fields) - set(known):
        raise InvalidRequestError(f"unknown sampling parameter(s) {sorted(set(fields) - set(known))}"
                                  f"; SamplingParams takes: {', '.join(known)}")
    return SamplingParams(**fields)


@attrs.frozen
class TokenLogprob:
    """One output token's log-probability and the ``params.logprobs`` most likely tokens'
    (id, log-probability), most likely first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V in host memory, to be swapped back in
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """One request's mutable state while the engine works on it."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None  # stop, length, abort or error
        self.error: Optional[str] = None  # why, when finish_reason is "error"
        self.text = ""  # detokenised output so far (stop strings trimmed)
        # K/V the cache holds, counted up by each step (prefill chunks, then one a decode
        # step), and how many of them the current prefill feeds: set at admission to the
        # prompt (plus the output so far after a preemption), 0 while waiting
        self.num_computed_tokens = 0
        self.num_prefill_tokens = 0
        # prompt tokens whose K/V the prefix cache held at the first admission (OpenAI's
        # usage.prompt_tokens_details.cached_tokens; 0 without prefix caching)
        self.num_cached_tokens = 0
        self.num_admissions = 0
        self.metrics = RequestMetrics()
        # one per output token, appended by the sampler (None: logprobs not asked for)
        self.logprobs: Optional[list[TokenLogprob]] = None if params.logprobs is None else []
        self._prompt_set: Optional[torch.Tensor] = None  # the prompt's distinct ids, on demand
        # a ConstraintState per processor of params.processors (the engine starts them)
        self.constraints: Optional[list] = None
        # its speculative.adaptive.AdaptiveK once it speculates (the proposal length)
        self.speculation = None
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def count_admission(self, cached: int) -> None:
        """The scheduler admitted it, ``cached`` leading tokens' K/V found in the cache.
        The first admission's count stays: a recompute's re-admission finds the blocks
        this request filled itself (its prompt, its output), not ones it was served."""
        if self.num_admissions == 0:
            self.num_cached_tokens = cached
        self.num_admissions += 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def prompt_id_set(self) -> torch.Tensor:
        """The prompt's distinct token ids: [U] int64 (the repetition penalty's, each step)."""
        if self._prompt_set is None:
            self._prompt_set = torch.tensor(self.prompt_ids, dtype=torch.long).unique()
        return self._prompt_set

    @property
    def prefilling(self) -> bool:
        """Admitted, with prompt tokens not fed yet (a chunked prefill in progress)."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@attrs.frozen
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: Optional[str]
    finish_reason: str  # "stop" (EOS or a stop string), "length", "error" or "abort"
    metrics: RequestMetrics
    logprobs: Optional[list[TokenLogprob]] = None  # one per token_ids entry, if asked for
    # prompt tokens whose K/V came from the prefix cache (Sequence.num_cached_tokens)
    num_cached_tokens: int = 0


def completion_of(seq: Sequence, with_text: bool) -> Completion:
    """``seq``'s Completion (``with_text``: the engine has a tokenizer: its text)."""
    return Completion(prompt_token_ids=seq.prompt_ids, token_ids=list(seq.output_ids),
                      text=seq.text if with_text else None, finish_reason=seq.finish_reason,
                      metrics=seq.metrics,
                      logprobs=None if seq.logprobs is None else list(seq.logprobs),
                      num_cached_tokens=seq.num_cached_tokens)


__getattr__ = moved_names(__name__)  # names that moved out, for one release
