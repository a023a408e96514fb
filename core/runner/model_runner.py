"""One forward step of a scheduled batch, eager or replayed from a CUDA graph.

The engine decides what runs (``scheduler.Step``: which sequences, how many tokens each,
which token ids); the runner decides how: a decode step whose batch has a captured graph
replays it (``cuda_graph``), any other step within the largest token bucket replays a
mixed-step graph (``step_graph``, caches that support it), a fresh prompt alone replays a
prefill graph on caches that only support those (``prefill_graph``), anything else runs
eagerly through ``model.DecoderModel`` after the cache places the new tokens
(``cache.prepare``); on a pipeline stage with ``micro_batches`` > 1, in groups in flight
across the stages at once (``distributed.micro_batches``).
"""
from __future__ import annotations

import torch

from ..cache import CacheFullError
from ..distributed.failure import across_ranks, collective_timeout, wait_for_device
from ..distributed.micro_batches import forward_groups
from ..errors import PlanError
from .cuda_graph import CudaGraphRunner
from .prefill_graph import PrefillGraphRunner
from ..step import logit_rows
from .step_graph import StepGraphRunner


class ModelRunner:
    def __init__(self, model, cache, device: torch.device, micro_batches: int = 1):
        self.model, self.cache, self.device = model, cache, device
        # a step's token groups in flight across pipeline stages (plan.parallel's)
        self.micro_batches = micro_batches
        self.decode_graphs: CudaGraphRunner | None = None  # set by build() on CUDA
        self.prefill_graphs: PrefillGraphRunner | None = None  # likewise
        self.step_graphs: StepGraphRunner | None = None  # likewise
        # core.long_rope.LongRopeSwitch where LongRoPE's two tables are in use (build())
        self.long_rope = None

    def replays_decode(self, step) -> bool:
        """True where ``step`` is a decode step whose batch size has a captured graph (not
        one carrying drafts: those are mixed steps)."""
        graphs = self.decode_graphs
        return step.kind == "decode" and step.drafts is None and graphs is not None \
            and graphs.bucket(len(step.seqs)) is not None

    def forward(self, step, tokens: list[int], replay: bool, feed=None):
        """The step's logits [rows we sample from, V] float32: one row per sequence of a
        decode step, the last fed row of each sequence of a prefill step, every row of a
        sequence with a draft (``step.logit_rows``; None on a pipeline stage before the
        last). ``feed``: rows of ``tokens`` whose token is on the device, the previous
        step's sampled one (async_steps.DeviceFeed: one process, no micro-batches)."""
        seqs, counts = step.seqs, step.counts
        if replay:
            return self._watched(self.decode_graphs.decode([s.id for s in seqs], tokens, feed))
        # rows a LongRoPE position does not place (graphs are captured without them)
        long_rows = None if self.long_rope is None else \
            self.long_rope.long_rows(seqs, counts, self.device)
        rows = None if step.drafts is None else logit_rows(step)  # a verify step's
        mixed = step.kind == "prefill" or rows is not None
        steps = self.step_graphs
        if steps is not None and mixed and long_rows is None \
                and steps.bucket(counts, rows) is not None:
            return self._watched(steps.run([s.id for s in seqs], counts, tokens, rows, feed))
        graphs = self.prefill_graphs
        if step.kind == "prefill" and rows is None and graphs is not None and feed is None \
                and long_rows is None and graphs.bucket(seqs, counts):
            return self._watched(graphs.prefill(seqs[0].id, tokens))  # [1, V]
        token_t = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        if feed is not None:
            feed.into(token_t)
        if self._pipelined():
            return forward_groups(self.model, self.cache, [s.id for s in seqs], counts,
                                  token_t, self.micro_batches, step.kind != "decode", long_rows)
        meta = self.cache.prepare([s.id for s in seqs], counts)
        if not mixed:
            return self.model(token_t, self.cache, meta, None)  # [B, V]
        if rows is None:
            rows = torch.tensor(counts).cumsum(0) - 1  # [B] row of each sequence's last token
        index = torch.as_tensor(rows).to(self.device)
        return self.model(token_t, self.cache, meta, index, long_rows=long_rows)  # [R, V]

    def every_row(self, seq_id, ids: list[int]):
        """Logits of every position of a sequence the cache just allocated: [len, V]
        (None on a pipeline stage before the last). LongRoPE: one forward over the whole
        sequence, as HF's (core/long_rope.py)."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)  # [len]
        long_rows = None
        if self.long_rope is not None and len(ids) > self.long_rope.boundary:
            long_rows = torch.ones(len(ids), dtype=torch.bool, device=self.device)
        if self._pipelined():  # the sequence in consecutive pieces through the stages
            return forward_groups(self.model, self.cache, [seq_id], [len(ids)], tokens,
                                  self.micro_batches, last_rows=False, long_rows=long_rows)
        meta = self.cache.prepare([seq_id], [len(ids)])
        return self.model(tokens, self.cache, meta, None, long_rows=long_rows)

    def logits_of(self, ids: list[int], ranks, vocab_size: int) -> torch.Tensor:
        """``Engine.logits``' body: ``ids`` allocated beside the running requests, the
        logits of every row on the host, [len, V] float32 (every rank's: ``ranks``), the
        cache freed again."""
        seq_id = ("logits", id(ids))
        try:
            self.cache.allocate(seq_id, len(ids))
        except CacheFullError as e:  # the running requests hold every row / block
            raise CacheFullError(f"engine.logits needs room for {len(ids)} tokens beside "
                                 f"the running requests: {e}; call it when fewer run, or "
                                 "build with a larger max_batch_size") from None
        try:
            out = self.every_row(seq_id, ids)  # [len, V]; None before the last stage
            if ranks is not None:
                out = ranks.broadcast_logits(out, (len(ids), vocab_size), self.device)
            return out.cpu()
        except Exception as e:  # tp / pp: RankFailedError, on every rank
            raise across_ranks(e, ranks)
        finally:
            self.cache.free(seq_id)

    def _watched(self, logits):
        """A replay's logits, once its collectives finished within the decode graphs'
        ``replay_timeout`` (set across ranks, where the step and prefill graphs come beside
        them). NCCL's watchdog does not see a graph's collectives: a peer gone mid-replay
        would leave this rank waiting for ever."""
        timeout = getattr(self.decode_graphs, "replay_timeout", None)
        if timeout is not None:
            event = torch.cuda.Event()
            event.record()
            wait_for_device(event, timeout)
        return logits

    def _pipelined(self) -> bool:
        """Micro-batches: a pipeline stage's eager step with ``micro_batches`` > 1."""
        return self.micro_batches > 1 and getattr(self.model, "stage", None) is not None


def decode_graphs_for(net, cache, plan, device, wanted) -> CudaGraphRunner | None:
    """Decode under CUDA graphs on the GPU (default) when the cache supports it. Where
    layers' weights stream in, each graph holds its step's copies too (``WeightStreamer``)."""
    across = graphs_across_ranks(plan)
    if wanted is None:
        wanted = device.type == "cuda" and CudaGraphRunner.supported(cache) and across is None \
            and plan.kernels != "torch"
    if not wanted:
        return None
    if across is not None:
        raise PlanError(f"cuda_graphs=True cannot run here: {across}")
    if plan.kernels == "torch":  # the reference ops read values back (padding rows' checks)
        raise PlanError("cuda_graphs=True cannot capture kernels='torch': the reference ops "
                        "synchronise with the host; use kernels='triton' or 'auto', or "
                        "cuda_graphs=False")
    if device.type != "cuda" or not CudaGraphRunner.supported(cache):
        raise PlanError(f"cuda_graphs=True needs a CUDA device and a cache backend that "
                        f"supports them (contiguous, paged); got {device} / {plan.cache_backend}")
    runner = CudaGraphRunner(net, cache, plan.max_batch_size)
    if plan.parallel.world_size > 1:
        runner.replay_timeout = collective_timeout()
    runner.capture()
    return runner


def graphs_across_ranks(plan) -> str | None:
    """Why the ranks of this plan cannot replay CUDA graphs (None: they can). Under tp
    on NCCL the graphs hold the all-reduces (and the head's gather): every rank captures
    the same buckets in the same order at build, and replays them in lockstep. A gloo
    collective cannot be captured; a pipeline stage's send / recv are left eager."""
    parallel = plan.parallel
    if parallel.world_size == 1:
        return None
    if len(parallel.stages) > 1:
        return (f"pipeline stages ({len(parallel.stages)}) run eagerly: their send / recv "
                "are not captured")
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if "nccl" not in str(backend):  # ("cpu:gloo,cuda:nccl": CUDA tensors go to NCCL)
        return (f"graphs across {parallel.world_size} ranks capture NCCL's all-reduce; this "
                f"process group runs {backend!r}")
    return None


def prefill_graphs_for(net, cache, plan, decode_graphs, wanted) -> PrefillGraphRunner | None:
    """A fresh prompt's prefill under CUDA graphs (captured per length bucket on first use)."""
    if wanted is None:
        wanted = decode_graphs is not None and PrefillGraphRunner.supported(cache)
    if not wanted:
        return None
    if decode_graphs is None or not PrefillGraphRunner.supported(cache):
        raise PlanError(f"prefill_graphs=True needs decode CUDA graphs and a cache that can "
                        f"capture a prefill (contiguous without a sliding window or int8 K/V; "
                        f"the paged cache captures mixed steps instead: step_graphs); got "
                        f"{plan.cache_backend} with kv_dtype={plan.kv_dtype}")
    return PrefillGraphRunner(net, cache, plan.max_seq_len, share_pool_with=decode_graphs)


def step_graphs_for(net, cache, plan, decode_graphs, max_tokens, wanted, extra_rows=0):
    """Mixed steps under CUDA graphs (default: with the decode graphs, where the cache can);
    ``extra_rows``: logits rows beyond one a sequence (speculative drafts' verification)."""
    from infergraft.kernels import switches  # not at import: the kernels import triton

    if wanted is None:
        wanted = decode_graphs is not None and StepGraphRunner.supported(cache) \
            and switches.value("INFERGRAFT_STEP_GRAPHS")
    if not wanted:
        return None
    if decode_graphs is None or not StepGraphRunner.supported(cache):
        raise PlanError(f"step_graphs=True needs decode CUDA graphs and a cache that can "
                        f"capture a mixed step (paged); got {plan.cache_backend}")
    runner = StepGraphRunner(net, cache, max_tokens, plan.max_batch_size,
                             share_pool_with=decode_graphs, extra_rows=extra_rows)
    runner.capture()
    return runner
