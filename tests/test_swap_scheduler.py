"""The scheduler's side of preemption by swap: the cost model that picks swap or recompute
(core/preemption.py), and the swapped queue (core/swap_schedule.py) against the fake
cache of test_scheduler.py, by hand and under test_scheduler_machine's state machine."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_scheduler import FakeCache, apply, blocks_for, seq
from test_scheduler_machine import SchedulerMachine
from test_swap_preemption import FAST_LINK, SLOW_LINK, fill, paged

from infergraft.core.errors import PlanError
from infergraft.core.preemption import PreemptionPolicy, Rates, measured_rates, recompute_flops
from infergraft.core.request import Status
from infergraft.core.scheduler import Scheduler
from infergraft.core.testing.cache_machine import tiny_cache_spec


# -- the cost model ----------------------------------------------------------------------
def _filled(n):
    cache, s = paged(), seq(n)
    cache.allocate(s.id, n)
    fill(cache, s.id, [n])
    s.num_prefill_tokens = s.num_computed_tokens = n
    return cache, s


def test_auto_swaps_on_a_fast_link_and_recomputes_on_a_slow_one():
    cache, s = _filled(10)
    spec = cache.spec
    assert PreemptionPolicy("auto", spec, rates=FAST_LINK).choose(cache, s) == "swap"
    assert PreemptionPolicy("auto", spec, rates=SLOW_LINK).choose(cache, s) == "recompute"
    swap, recompute = PreemptionPolicy("auto", spec, rates=Rates(1e9, 1e12)).costs(cache, s)
    assert swap == 2 * cache.swap_bytes(s.id) / 1e9
    assert recompute == recompute_flops(spec, 10) / 1e12


def test_once_its_copies_ran_the_swap_cost_is_their_rate_not_the_bulk_links():
    cache, s = _filled(10)
    assert cache.swap_seconds(s.id) is None  # nothing copied yet: the link's rate serves
    cache.swap_out(s.id)
    cache.swap_in(s.id)
    n, seconds = cache._copied_bytes, cache._copied_seconds
    assert n == 2 * cache.swap_bytes(s.id) and seconds > 0  # out and back in, timed
    policy = PreemptionPolicy("auto", cache.spec, rates=FAST_LINK)
    # out and back in again, at the rate they ran: the seconds they took
    assert policy.costs(cache, s)[0] == cache.swap_seconds(s.id) == pytest.approx(seconds)
    # copies that ran at a byte per 10^6 s: a fast link no longer helps
    cache._copied_bytes, cache._copied_seconds = 1, 1e6
    assert policy.choose(cache, s) == "recompute"


def test_the_modes_and_the_fallbacks_to_recompute():
    cache, s = _filled(10)
    assert PreemptionPolicy("swap").choose(cache, s) == "swap"
    assert PreemptionPolicy("recompute").choose(cache, s) == "recompute"
    cache._host.free.clear()  # no host room
    assert PreemptionPolicy("swap").choose(cache, s) == "recompute"
    assert PreemptionPolicy("swap").choose(FakeCache(8), s) == "recompute"  # no swap at all
    with pytest.raises(PlanError, match="preemption must be one of 'auto', 'swap', 'recompute'"):
        PreemptionPolicy("sometimes")


def test_recompute_flops_count_the_window():
    spec, windowed = tiny_cache_spec(), tiny_cache_spec(sliding_window=4)
    assert recompute_flops(spec, 10) > recompute_flops(windowed, 10)
    assert recompute_flops(spec, 1) == recompute_flops(windowed, 1)


def test_rates_are_measured_once_per_device():
    rates = measured_rates("cpu", torch.float32)
    assert rates is measured_rates(torch.device("cpu"), torch.float32)
    assert rates.link_bytes_per_s > 0 and rates.flops_per_s > 0


# -- the scheduler, against a fake cache -------------------------------------------------
class FakeSwapCache(FakeCache):
    """FakeCache with swap: a swapped sequence's blocks leave the pool until it is back."""
    supports_swap = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.out = {}  # seq id -> (blocks, tokens)

    def can_swap_out(self, seq_id):
        return seq_id in self.blocks

    def swap_bytes(self, seq_id):
        return 100 * self.blocks[seq_id]

    def swap_out(self, seq_id):
        self.out[seq_id] = (self.blocks.pop(seq_id), self.len.pop(seq_id))

    def can_swap_in(self, seq_id):
        held, n = self.out[seq_id]
        return max(held, blocks_for(n + 1, self.block_size)) <= self.num_free

    def swap_in(self, seq_id):
        self.blocks[seq_id], self.len[seq_id] = self.out.pop(seq_id)

    def free_swapped(self, seq_id):
        del self.out[seq_id]


def swapping(num_blocks, max_batch_size=4, budget=64):
    cache = FakeSwapCache(num_blocks, 4)
    sched = Scheduler(cache, max_batch_size, budget)
    sched.preemption = PreemptionPolicy("swap")
    return sched, cache


def swap_one(sched, cache, *seqs):
    """Add ``seqs`` and step until one of them is swapped out."""
    for s in seqs:
        sched.add(s)
    while not sched.swapped:
        step = sched.schedule()
        apply(sched, cache, step)
    return step


def test_the_newest_is_swapped_out_and_comes_back_before_any_prompt():
    sched, cache = swapping(num_blocks=3, max_batch_size=2)
    a, b, c = seq(4, 8), seq(4, 8), seq(1)
    # b sits out while a fills its second block; then neither fits: b, the newest, goes
    assert swap_one(sched, cache, a, b).seqs == [a]
    assert sched.swapped == [b] and b.status is Status.SWAPPED and sched.running == [a]
    assert (sched.num_swapped_out, sched.num_recomputed, sched.num_preemptions) == (1, 0, 1)
    assert b.id in cache.out and b.id not in cache.blocks and sched.has_work()
    ahead = sched.schedule_ahead()  # no room for b: a's next step is scheduled ahead still
    assert ahead.seqs == [a]
    sched.add(c)
    assert sched.stats()["num_waiting"] == 2  # c, and b swapped out
    assert sched.resume(ahead).seqs == [a]  # c, arrived meanwhile, waits behind b
    sched.finish(a, "stop")
    assert sched.schedule_ahead() is None  # room for b now: schedule() swaps it in first
    step = sched.schedule()  # b is back (it ran longest ago: first), and only then c
    assert step.seqs == [b, c] and b.status is Status.RUNNING and not sched.swapped
    assert b.num_computed_tokens == 4 and step.counts == [1, 1]


def test_swapped_sequences_come_back_oldest_first_and_all_finish():
    sched, cache = swapping(num_blocks=6, max_batch_size=4, budget=8)
    seqs = [seq(3, 12) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    swapped_in_order = []
    while sched.has_work():
        before = list(sched.swapped)
        step = sched.schedule()
        back = [s for s in before if s not in sched.swapped]
        assert back == before[:len(back)], "swapped back out of order"
        swapped_in_order += back
        apply(sched, cache, step)
        assert set(cache.blocks) == {s.id for s in sched.running}
        assert set(cache.out) == {s.id for s in sched.swapped}
    assert all(len(s.output_ids) == 12 for s in seqs) and swapped_in_order
    assert sched.num_swapped_out > 0 and sched.num_recomputed == 0
    assert not cache.blocks and not cache.out


def test_steps_are_scheduled_ahead_while_a_swapped_sequence_waits_for_room():
    # as the engine steps: counts fed, the next step scheduled ahead, then tokens sampled
    sched, cache = swapping(num_blocks=6, max_batch_size=4, budget=8)
    seqs = [seq(3, 12) for _ in range(6)]
    for s in seqs:
        sched.add(s)
    ahead, ahead_while_out, admitted_while_out = None, 0, []
    while sched.has_work():
        step = (ahead and sched.resume(ahead)) or sched.schedule()
        cache.prepare([s.id for s in step.seqs], step.counts)
        for s, n in zip(step.seqs, step.counts):
            s.num_computed_tokens += n
        waiting = list(sched.waiting)
        ahead = sched.schedule_ahead()
        if sched.swapped and ahead is not None:
            ahead_while_out += 1
            admitted_while_out += [s for s in ahead.seqs if s in waiting]
        for s in step.seqs:
            if not s.prefilling:
                s.output_ids.append(10_000 + 100 * s.id + len(s.output_ids))
                if len(s.output_ids) >= s.params.max_new_tokens:
                    sched.finish(s, "length")
        assert set(cache.out) == {s.id for s in sched.swapped}
    assert all(len(s.output_ids) == 12 for s in seqs)
    assert sched.num_swapped_out > 0 and not cache.blocks and not cache.out
    assert ahead_while_out > 0, "no step was scheduled ahead while a sequence was out"
    assert not admitted_while_out, "a prompt admitted ahead while a sequence was swapped out"


def test_aborting_a_swapped_sequence_frees_its_host_copy():
    sched, cache = swapping(num_blocks=3, max_batch_size=2)
    a, b = seq(4, 8), seq(4, 8)
    swap_one(sched, cache, a, b)
    sched.abort([b])
    assert (b.status, b.finish_reason) == (Status.FINISHED, "abort")
    assert not sched.swapped and not cache.out and b.id not in sched._last_ran


class Alternating:
    """A preemption policy that swaps and recomputes by turns (where the cache can swap)."""

    def __init__(self):
        self.turn = 0

    def choose(self, cache, seq):
        self.turn += 1
        return "swap" if self.turn % 2 and cache.can_swap_out(seq.id) else "recompute"


class SwapSchedulerMachine(SchedulerMachine):
    """test_scheduler_machine's machine over a cache that swaps: a swapped sequence is in
    one place only (``swapped``, its blocks out of the pool), it is the newest running one
    when it goes, no prompt is admitted while it is out, and it comes back oldest first,
    as a readmission, with what it had computed."""

    # a pool of one sequence and a little: preemptions most steps
    @initialize(block_size=st.integers(1, 4), spare=st.integers(0, 2), batch=st.integers(2, 4),
                budget=st.integers(1, 12), alternate=st.booleans())
    def setup(self, block_size, spare, batch, budget, alternate):
        SchedulerMachine.setup(self, block_size, spare, None, batch, budget)
        c = self.cache
        self.cache = self.sched.cache = FakeSwapCache(c.num_blocks, block_size, c.max_seq_len)
        self.sched.preemption = Alternating() if alternate else PreemptionPolicy("swap")
        real = self.cache.swap_out

        def swap_out(seq_id):
            newest = max(self.sched.running, key=lambda r: self.admitted[r.id])
            assert seq_id == newest.id, f"swapped out seq {seq_id}, not the newest {newest.id}"
            real(seq_id)
        self.cache.swap_out = swap_out

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def step(self):
        sched = self.sched
        before, out = list(sched.running), list(sched.swapped)
        computed = {s.id: s.num_computed_tokens for s in out}
        step = self.scheduled()
        back = [s for s in out if s in sched.running]
        assert back == out[:len(back)], "swapped back out of order"
        new = [s for s in sched.running
               if s not in before and s not in back or s in self.preempted]
        assert new == list(self.queue)[:len(new)], "admission out of order"
        assert not (new and sched.swapped), "a prompt admitted while a sequence is swapped out"
        for s in sched.running:  # a swap in, like an admission, makes the newest
            if s in back or s in new:
                self.admitted[s.id] = next(self.admissions)
        for s in back:
            assert s.num_computed_tokens == computed[s.id]
        for s in new:
            self.queue.popleft()
            self.fed[s.id] = 0
            assert s.num_prefill_tokens == s.num_tokens and s.num_computed_tokens == 0
        self.check_step(step)
        apply(sched, self.cache, step)
        self.finished += [s for s in step.seqs if s.finished]

    @invariant()
    def nothing_dropped_or_duplicated(self):
        sched = self.sched
        assert [s.id for s in sched.waiting] == [s.id for s in self.queue]
        places = [list(sched.waiting), sched.running, sched.swapped, self.finished]
        for s in self.added:
            assert sum(1 for where in places for x in where if x is s) == 1, f"seq {s.id}"
        statuses = (Status.WAITING, Status.RUNNING, Status.SWAPPED, Status.FINISHED)
        for where, status in zip(places, statuses):
            assert all(s.status is status for s in where), status
        assert [s.id for s in sched.swapped] == sorted(s.id for s in sched.swapped)

    @invariant()
    def cache_holds_exactly_the_running(self):
        super().cache_holds_exactly_the_running()
        assert set(self.cache.out) == {s.id for s in self.sched.swapped}
        for s in self.sched.swapped:
            assert self.cache.out[s.id][1] == s.num_computed_tokens


class TestSwapSchedulerMachine(SwapSchedulerMachine.TestCase):
    settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
