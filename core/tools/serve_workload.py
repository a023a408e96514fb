"""What ``infergraft bench serve`` sends and what it measures: the prompts, their arrival
times, one request's timings read off its stream, and a run's summary.

Prompts are lists of random token ids (seeded; never the ids 0..9, which most vocabularies
give to special tokens such as BOS, EOS and padding), sent as the completions API's
``prompt`` so that every prompt is exactly as long as asked on any tokenizer; each asks for
``max_tokens`` = its output length with ``ignore_eos``, so outputs are exact too.

The workloads (``--prompt-len`` P, ``--output-len`` O):
- ``fixed``: every prompt P tokens, every output O.
- ``uniform``: prompt lengths uniform over [P/4, 7P/4], outputs over [O/4, 7O/4]: the
  same means as ``fixed``, spread.
- ``sharegpt-like``: lognormal lengths with the means of ShareGPT's conversations as the
  vLLM paper gives them (161 prompt, 338 output tokens: the defaults of P and O) and a
  ShareGPT-like long tail (log-space sigma 1.0 for prompts, 0.8 for outputs: coefficients
  of variation ~1.3 and ~0.95), clipped to [4, 4x mean] (at the defaults a prompt and its
  output fit 2048 positions, as vLLM's ShareGPT filter keeps them). The lognormal's
  location is solved so that the clipped mean is the asked mean.
- ``prefix``: one shared system prompt of P tokens (default 1024) before each request's own
  question of 64..256 tokens (uniform): what a prefix cache can reuse.
"""
from __future__ import annotations

import json
import math
import random

import attrs

from ..metrics import percentiles

DATASETS = ("fixed", "uniform", "sharegpt-like", "prefix")
DEFAULT_LENS = {"fixed": (256, 128), "uniform": (256, 128), "sharegpt-like": (161, 338),
                "prefix": (1024, 128)}  # dataset -> (prompt len, output len)
FIRST_ID = 10  # ids below it are left to special tokens
SHAREGPT_SIGMA = (1.0, 0.8)  # prompt, output (log space)
SHAREGPT_CLIP = 4.0  # x the mean
PREFIX_QUESTION = (64, 256)
SLO_METRICS = ("ttft", "tpot", "e2el")


@attrs.frozen
class Request:
    prompt: tuple[int, ...]
    output_len: int


def make_requests(dataset: str, n: int, prompt_len: int, output_len: int, vocab_size: int,
                  seed: int | str = 0) -> list[Request]:
    """``n`` requests of ``dataset`` (one of DATASETS), token ids in [FIRST_ID, vocab_size);
    the same ``seed`` (an int or a string) draws the same requests."""
    rng = random.Random(seed)

    def ids(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_ID, vocab_size) for _ in range(k))

    if dataset == "fixed":
        lens = [(prompt_len, output_len)] * n
    elif dataset == "uniform":
        lens = [(_uniform(rng, prompt_len), _uniform(rng, output_len)) for _ in range(n)]
    elif dataset == "sharegpt-like":
        draw = [_clipped_lognormal(mean, sigma) for mean, sigma in
                zip((prompt_len, output_len), SHAREGPT_SIGMA)]
        lens = [(draw[0](rng), draw[1](rng)) for _ in range(n)]
    elif dataset == "prefix":
        shared = ids(prompt_len)
        return [Request(shared + ids(rng.randint(*PREFIX_QUESTION)), output_len)
                for _ in range(n)]
    else:
        raise ValueError(f"unknown dataset {dataset!r}: one of {', '.join(DATASETS)}")
    return [Request(ids(p), o) for p, o in lens]


def _uniform(rng: random.Random, mean: int) -> int:
    lo = max(1, round(mean / 4))
    return rng.randint(lo, 2 * mean - lo)  # [L/4, 7L/4]: mean L


def _clipped_lognormal(mean: int, sigma: float):
    """A draw of round(clip(X, lo, hi)), X lognormal(mu, sigma), whose mean is ``mean``."""
    lo, hi = min(4, mean), SHAREGPT_CLIP * mean

    def clipped_mean(mu: float) -> float:  # E[clip(X, lo, hi)], in closed form
        def cdf(x):
            return 0.5 * (1 + math.erf(x / math.sqrt(2)))
        a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
        inside = math.exp(mu + sigma ** 2 / 2) * (cdf(b - sigma) - cdf(a - sigma))
        return lo * cdf(a) + inside + hi * (1 - cdf(b))

    # the clipped mean grows with mu: bisect for the one that gives ``mean``
    left, right = math.log(mean) - 10.0, math.log(mean) + 10.0
    for _ in range(100):
        mid = (left + right) / 2
        left, right = (mid, right) if clipped_mean(mid) < mean else (left, mid)
    mu = (left + right) / 2
    return lambda rng: int(round(min(hi, max(lo, rng.lognormvariate(mu, sigma)))))


def send_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: the first at 0, then gaps drawn
    from a gamma distribution of shape ``burstiness`` and mean 1/``rate`` (shape 1: a
    Poisson process; below 1 burstier, above 1 more regular; the variance is
    1/(rate^2 burstiness)). ``rate`` inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@attrs.define
class Record:
    """One request as the client saw it: times in seconds from when it was sent."""
    prompt_len: int
    output_len: int  # asked
    ttft: float | None = None  # to the first chunk with text (or token ids)
    itl: list = attrs.field(factory=list)  # between such chunks
    e2el: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None  # the server's usage.completion_tokens
    error: str | None = None
    _last: float = attrs.field(default=0.0, init=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2el is not None

    @property
    def output_tokens(self) -> int:
        """The server's count when it sent usage, else one a chunk with text."""
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (tokens - 1); None for a request of one token."""
        n = self.output_tokens
        if not self.ok or n < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (n - 1)

    def on_event(self, event: dict, t: float) -> None:
        """One SSE ``data:`` payload of a completions (or chat) stream, ``t`` s after sending."""
        if "error" in event:  # vLLM-style servers report a failure mid-stream this way
            err = event["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens", self.usage_tokens)
        for choice in event.get("choices") or ():
            # a chunk with text, or with token ids (a server whose model has no tokenizer)
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text or choice.get("token_ids"):
                if self.ttft is None:
                    self.ttft = t
                else:
                    self.itl.append(t - self._last)
                self._last, self.chunks = t, self.chunks + 1

    def finish(self, t: float) -> None:
        if self.error is None and self.output_tokens == 0:
            self.error = "the stream ended without any text or usage"
        if self.error is None:
            self.e2el = t


def parse_sse_line(line: str):
    """One line of a server-sent event stream: its ``data:`` payload as a dict, the string
    "[DONE]" at the end, None for lines that carry none (blank, ``:`` comments, ``event:``).
    ValueError if the payload is not JSON."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"a stream chunk is not JSON ({e}): {data[:200]!r}") from None


def is_good(r: Record, slos: dict[str, float]) -> bool:
    """Whether ``r`` met every SLO (ms) in ``slos`` (keys from SLO_METRICS); a one-token
    request has no TPOT and meets any TPOT SLO."""
    if not r.ok:
        return False
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(got[k] is None or got[k] * 1e3 <= ms for k, ms in slos.items())


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = [v * 1e3 for v in values]
    return {"mean": sum(ms) / len(ms), **percentiles(ms, (50, 90, 99))}


def summarise(records: list[Record], duration: float, slos: dict[str, float] | None = None,
              ) -> dict:
    """A run's figures: counts, throughputs (per second of ``duration``), latency mean and
    P50/P90/P99 in ms (nearest rank), goodput when ``slos`` are given."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = sum(is_good(r, slos) for r in done) if slos else None
    return {
        "completed": len(done), "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": duration, "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "good_requests": good, "goodput": None if good is None else good / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in done for x in r.itl]),
        "e2el_ms": _stats_ms([r.e2el for r in done]),
    }
