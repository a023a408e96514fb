"""The scheduler alone, against a fake block cache (no model, no kernels): admission
order, token-budget steps (decode tokens and prompt chunks together, short prompts fused,
long ones split), who goes first after being left out, pausing and
preemption when the cache runs short, abort, and the errors. The hypothesis state
machine over the same fake is in test_scheduler_machine.py."""
import pytest

from infergraft.core.cache import CacheFullError
from infergraft.core.request import SamplingParams, Sequence, Status
from infergraft.core.scheduler import Scheduler, SchedulerError, step_tokens


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class FakeCache:
    """The KVCache methods the scheduler calls, over ``num_blocks`` blocks of
    ``block_size`` tokens (the paged cache's accounting): ``allocate`` reserves a
    prompt's blocks, ``prepare`` (the runner's call) grows a sequence block by block.
    ``fast_blocks``: blocks one step may touch (the offload cache's fast pool)."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_seq_len: int = 64,
                 fast_blocks: int | None = None):
        self.num_blocks, self.block_size, self.max_seq_len = num_blocks, block_size, max_seq_len
        self.fast_blocks = fast_blocks
        self.blocks: dict[int, int] = {}  # seq id -> blocks held
        self.len: dict[int, int] = {}  # seq id -> tokens written

    @property
    def num_free(self) -> int:
        return self.num_blocks - sum(self.blocks.values())

    def can_allocate(self, num_tokens):
        return num_tokens <= self.max_seq_len and \
            blocks_for(num_tokens, self.block_size) <= self.num_free

    def allocate(self, seq_id, num_tokens):
        assert seq_id not in self.blocks, f"sequence {seq_id} allocated twice"
        if not self.can_allocate(num_tokens):
            raise CacheFullError(f"no room for {num_tokens} tokens")
        self.blocks[seq_id], self.len[seq_id] = blocks_for(num_tokens, self.block_size), 0

    def free(self, seq_id):
        del self.blocks[seq_id], self.len[seq_id]  # KeyError: freed twice or never held

    def length(self, seq_id):
        return self.len[seq_id]

    def _grow(self, seq_ids, counts) -> list[int]:
        assert len(set(seq_ids)) == len(seq_ids), f"a sequence twice in one step: {seq_ids}"
        return [max(0, blocks_for(self.len[s] + n, self.block_size) - self.blocks[s])
                for s, n in zip(seq_ids, counts)]

    def can_append(self, seq_ids, counts):
        grow = sum(self._grow(seq_ids, counts))
        touched = grow + sum(self.blocks[s] for s in seq_ids)
        return all(self.len[s] + n <= self.max_seq_len for s, n in zip(seq_ids, counts)) \
            and grow <= self.num_free and (self.fast_blocks is None or touched <= self.fast_blocks)

    def prepare(self, seq_ids, counts):
        if not self.can_append(seq_ids, counts):
            raise CacheFullError(f"step {seq_ids} x {counts} does not fit: {self.stats()}")
        for s, n, grow in zip(seq_ids, counts, self._grow(seq_ids, counts)):
            self.blocks[s] += grow
            self.len[s] += n

    def stats(self):
        used = sum(self.blocks.values())
        return {"bytes": 0, "sequences": len(self.blocks), "tokens": sum(self.len.values()),
                "blocks_total": self.num_blocks, "blocks_free": self.num_blocks - used,
                "blocks_used": used}


def token(seq: Sequence) -> int:
    """The token the fake model samples (from the sequence id and the output length)."""
    return 10_000 + 100 * seq.id + len(seq.output_ids)


def apply(sched: Scheduler, cache: FakeCache, step) -> list[Sequence]:
    """Do what the engine does with a Step: the cache places its tokens, each sequence
    counts them, one whose prefill is now all fed samples a token, and one at its
    ``max_new_tokens`` finishes. Returns the sequences that got a token."""
    cache.prepare([s.id for s in step.seqs], step.counts)
    for s, n in zip(step.seqs, step.counts):
        s.num_computed_tokens += n
    sampled = [s for s in step.seqs if not s.prefilling]
    for s in sampled:
        s.output_ids.append(token(s))
        if len(s.output_ids) >= s.params.max_new_tokens:
            sched.finish(s, "length")
    return sampled


def seq(prompt_len: int, max_new_tokens: int = 8) -> Sequence:
    s = Sequence([], SamplingParams(max_new_tokens=max_new_tokens))
    s.prompt_ids = [100 * s.id + i for i in range(prompt_len)]
    return s


def make(num_blocks=64, block_size=4, max_batch_size=4, max_num_batched_tokens=64, **kw):
    cache = FakeCache(num_blocks, block_size, **kw)
    return Scheduler(cache, max_batch_size, max_num_batched_tokens), cache


def run(sched, cache):
    """One step: (kind, [(seq, count), ...]), applied."""
    step = sched.schedule()
    fed = list(zip(step.seqs, step.counts))
    apply(sched, cache, step)
    return step.kind, fed


def test_admission_is_first_come_first_served():
    sched, cache = make(num_blocks=6, max_batch_size=2)
    d, c, big, b, a = seq(2), seq(4), seq(24), seq(4), seq(4)  # ids: not the order
    for s in (a, b, c, big, d):
        sched.add(s)
    assert run(sched, cache) == ("prefill", [(a, 4), (b, 4)])  # the batch holds two
    assert list(sched.waiting) == [c, big, d] and sched.running == [a, b]
    sched.finish(a, "stop")
    assert run(sched, cache) == ("prefill", [(b, 1), (c, 4)])  # one slot: c
    sched.finish(b, "stop")
    # big needs 6 blocks, 5 are free: d, which would fit, does not overtake it
    assert run(sched, cache) == ("decode", [(c, 1)]) and list(sched.waiting) == [big, d]


def test_a_step_carries_decode_tokens_and_prompt_chunks_up_to_the_budget():
    sched, cache = make(max_num_batched_tokens=8)
    short = seq(3)
    sched.add(short)
    run(sched, cache)
    long, late = seq(20), seq(3)
    sched.add(long)
    # the decode token counts against the budget: the long prompt takes the other 7
    assert run(sched, cache) == ("prefill", [(short, 1), (long, 7)])
    sched.add(late)
    assert run(sched, cache) == ("prefill", [(short, 1), (long, 7)])
    assert not long.output_ids and long.num_computed_tokens == 14 and list(sched.waiting) == [late]
    step = sched.schedule()  # long's last 6 tokens leave 1: late's first chunk
    assert (step.kind, step.seqs, step.counts) == ("prefill", [short, long, late], [1, 6, 1])
    assert step_tokens(step) == [short.output_ids[-1], *long.prompt_ids[14:], late.prompt_ids[0]]
    apply(sched, cache, step)
    assert len(short.output_ids) == 4 and len(long.output_ids) == 1 and not late.output_ids
    assert run(sched, cache) == ("prefill", [(short, 1), (long, 1), (late, 2)])
    assert run(sched, cache) == ("decode", [(short, 1), (long, 1), (late, 1)])


def test_short_prompts_are_fused_into_one_step():
    sched, cache = make(max_batch_size=4, max_num_batched_tokens=16)
    a, b, c, d = seq(5), seq(5), seq(5), seq(5)
    for s in (a, b, c, d):
        sched.add(s)
    assert run(sched, cache) == ("prefill", [(a, 5), (b, 5), (c, 5), (d, 1)])
    assert run(sched, cache) == ("prefill", [(a, 1), (b, 1), (c, 1), (d, 4)])


def test_sequences_left_out_for_the_budget_go_first_next_step():
    sched, cache = make(max_batch_size=3, max_num_batched_tokens=2)
    a, b, c = seq(1), seq(1), seq(1)
    for s in (a, b, c):
        sched.add(s)
    assert run(sched, cache) == ("prefill", [(a, 1), (b, 1)])
    assert run(sched, cache) == ("decode", [(a, 1), (b, 1)])  # c waits: no budget left
    assert list(sched.waiting) == [c]
    sched.waiting.clear()  # c joins as a fork would: its cache already filled
    cache.allocate(c.id, 1)
    cache.len[c.id] = c.num_prefill_tokens = c.num_computed_tokens = 1
    c.output_ids.append(token(c))
    sched.adopt(c)
    # three decoding, two tokens a step: each one left out goes first next time
    assert [run(sched, cache) for _ in range(4)] == [
        ("decode", [(a, 1), (b, 1)]), ("decode", [(c, 1), (a, 1)]),
        ("decode", [(b, 1), (c, 1)]), ("decode", [(a, 1), (b, 1)])]
    assert sched.num_paused == 0  # left out for the budget, not for the cache


def test_a_chunk_the_cache_cannot_take_beside_the_decode_tokens_goes_first_next_step():
    sched, cache = make(block_size=4, max_num_batched_tokens=4, fast_blocks=4)
    short, long = seq(3), seq(12)  # short: 1 block; long: 3, reserved whole
    sched.add(short)
    run(sched, cache)
    sched.add(long)
    # the step after the first cannot touch short's new block and long's three at once:
    # whichever ran longest ago goes first, so chunk steps and decode steps alternate
    steps = [run(sched, cache) for _ in range(7)]
    assert steps == [("prefill", [(short, 1), (long, 3)])] + \
        [("decode", [(short, 1)]), ("prefill", [(long, 4)])] * 2 + \
        [("decode", [(short, 1)]), ("prefill", [(long, 1)])]
    assert len(long.output_ids) == 1 and len(short.output_ids) == 5 and sched.num_paused == 4
    assert sched.num_preemptions == 0


def test_decode_pauses_what_the_cache_cannot_extend():
    sched, cache = make(num_blocks=3, block_size=4)
    a, b = seq(4), seq(4)  # a block each; one block left for the two tokens after them
    for s in (a, b):
        sched.add(s)
    run(sched, cache)
    assert run(sched, cache) == ("decode", [(a, 1)])  # the oldest first, b sits out
    assert (sched.num_paused, sched.num_preemptions) == (1, 0) and sched.running == [a, b]
    assert run(sched, cache) == ("decode", [(a, 1)]) and sched.num_paused == 2


def test_when_none_fits_the_newest_is_preempted_keeping_its_tokens():
    sched, cache = make(num_blocks=3, block_size=4, max_batch_size=2)
    b, a, c = seq(4, max_new_tokens=2), seq(7), seq(4)  # ids: not the admission order
    sched.add(a)
    run(sched, cache)
    for s in (b, c):
        sched.add(s)
    run(sched, cache)  # a's token rides in b's prefill: a at 8 tokens (2 blocks), b at 4
    b_out = list(b.output_ids)
    assert run(sched, cache) == ("decode", [(a, 1)])  # each needed a 4th block: b goes
    assert sched.num_preemptions == 1 and sched.running == [a] and list(sched.waiting) == [b, c]
    assert (b.status, b.output_ids, b.num_computed_tokens, b.id in cache.blocks) == \
        (Status.WAITING, b_out, 0, False)
    sched.finish(a, "stop")
    step = sched.schedule()  # b prefilled again: its prompt and the token it had sampled
    assert (step.seqs, step.counts) == ([b, c], [5, 4])
    assert step_tokens(step) == b.prompt_ids + b_out + c.prompt_ids
    apply(sched, cache, step)
    assert b.finished and b.output_ids[:1] == b_out and len(b.output_ids) == 2
    assert sched.running == [c] and sched.num_paused == 0


def test_abort_of_waiting_and_running_sequences():
    sched, cache = make(max_batch_size=1)
    a, b, c = seq(4), seq(4), seq(4)
    for s in (a, b, c):
        sched.add(s)
    run(sched, cache)
    sched.abort([b, a])  # waiting, running
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort") and a.finished and b.finished
    assert sched.running == [] and list(sched.waiting) == [c] and not cache.blocks
    assert run(sched, cache) == ("prefill", [(c, 4)])
    sched.finish(c, "stop")
    sched.abort([c])  # already finished: unchanged
    assert c.finish_reason == "stop" and not sched.has_work() and sched.schedule() is None


def test_errors_when_nothing_running_can_fit():
    sched, cache = make(num_blocks=2, block_size=4)
    sched.add(seq(9))  # 3 blocks of 2: never fits
    with pytest.raises(SchedulerError, match="cannot take a 9-token sequence even with "
                                             "nothing running.*'blocks_free': 2"):
        sched.schedule()
    sched, cache = make(num_blocks=4, block_size=4)
    a = seq(8)
    sched.add(a)
    run(sched, cache)
    sched.add(seq(9))  # does not fit beside a: waits, no error
    assert run(sched, cache) == ("decode", [(a, 1)])
    sched, cache = make(num_blocks=1, block_size=4)
    only = seq(4)
    sched.add(only)
    run(sched, cache)
    with pytest.raises(SchedulerError, match="cannot extend its only sequence"):
        sched.schedule()


def test_a_lone_prompt_whose_step_the_cache_refuses_is_an_error():
    sched, cache = make(num_blocks=16, block_size=4, fast_blocks=2)  # a backend bug:
    sched.add(seq(12))  # room for its 3 blocks, but a step may touch only 2
    with pytest.raises(SchedulerError):
        sched.schedule()
