"""The scheduler under random add / step / finish / preempt / abort (a hypothesis state
machine), against the fake block cache of test_scheduler.py. A model of the waiting
queue and of what each sequence was fed is the reference; after every rule nothing is
dropped or duplicated, the limits hold, and the cache holds exactly the running
sequences; every step is checked as it is scheduled, every preemption as it happens."""
import collections
import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_scheduler import FakeCache, apply, seq

from infergraft.core.request import Status
from infergraft.core.scheduler import Scheduler, step_tokens

MAX_SEQ_LEN = 16
MAX_LIVE = 8  # unfinished requests at a time


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), spare=st.integers(0, 6),
                fast=st.one_of(st.none(), st.integers(0, 6)), batch=st.integers(1, 4),
                budget=st.integers(1, 12))
    def setup(self, block_size, spare, fast, batch, budget):
        # room for one sequence of MAX_SEQ_LEN at least: alone, every request fits
        full = -(-MAX_SEQ_LEN // block_size)
        fast_blocks = None if fast is None else full + fast
        self.cache = FakeCache(full + spare, block_size, MAX_SEQ_LEN, fast_blocks)
        self.sched = Scheduler(self.cache, batch, budget)
        self.added, self.finished = [], []
        self.queue = collections.deque()  # the waiting queue as it must be
        self.admitted = {}  # seq id -> admission number (a re-admission renumbers)
        self.admissions = itertools.count()
        self.fed = {}  # seq id -> prefill tokens fed since its admission
        self.in_schedule, self.preempted = False, []
        real = self.sched.preempt

        def preempt(s):  # every preemption, from the scheduler or from the engine
            if self.in_schedule:
                newest = max(self.sched.running, key=lambda r: self.admitted[r.id])
                assert s is newest, f"preempted seq {s.id}, not the newest {newest.id}"
            out = list(s.output_ids)
            real(s)
            assert self.sched.waiting[0] is s and s.output_ids == out, "tokens not kept"
            assert (s.status, s.num_computed_tokens, s.num_prefill_tokens) == (Status.WAITING, 0, 0)
            self.queue.appendleft(s)
            self.preempted.append(s)
        self.sched.preempt = preempt

    def unfinished(self):
        return [s for s in self.added if not s.finished]

    def draw_seq(self, data, seqs):
        """One of ``seqs``, drawn (and reported) by its id."""
        sid = data.draw(st.sampled_from([s.id for s in seqs]), label="seq id")
        return next(s for s in seqs if s.id == sid)

    # -- rules -------------------------------------------------------------------------
    @precondition(lambda self: len(self.unfinished()) < MAX_LIVE)
    @rule(prompt=st.integers(1, 12), new=st.integers(1, 8))
    def add(self, prompt, new):
        s = seq(prompt, max_new_tokens=min(new, MAX_SEQ_LEN - prompt))
        self.sched.add(s)
        self.added.append(s)
        self.queue.append(s)

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def step(self):
        sched, before = self.sched, list(self.sched.running)
        step = self.scheduled()
        # admitted: the front of the queue, in order (the preempted ones first)
        new = [s for s in sched.running if s not in before or s in self.preempted]
        assert new == list(self.queue)[:len(new)], "admission out of order"
        for s in new:
            self.queue.popleft()
            self.admitted[s.id], self.fed[s.id] = next(self.admissions), 0
            assert s.num_prefill_tokens == s.num_tokens and s.num_computed_tokens == 0
        self.check_step(step)
        apply(sched, self.cache, step)
        for s in step.seqs:
            if s.finished:
                self.finished.append(s)

    def scheduled(self):
        """``sched.schedule()`` with preemptions recorded (``self.preempted``): a step."""
        self.in_schedule, self.preempted = True, []
        try:
            step = self.sched.schedule()
        finally:
            self.in_schedule = False
        assert step is not None and step.seqs, "work left but nothing scheduled"
        return step

    def check_step(self, step):
        seqs, counts, sched = step.seqs, step.counts, self.sched
        assert len(seqs) == len(counts) <= sched.max_batch_size
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence twice in one step"
        assert all(any(s is r for r in sched.running) for s in seqs), "a step of idle sequences"
        chunks = [(s, n) for s, n in zip(seqs, counts) if s.prefilling]
        riders = [n for s, n in zip(seqs, counts) if not s.prefilling]
        assert riders == [1] * len(riders), f"decode counts {riders}"
        assert sum(counts) <= sched.max_num_batched_tokens, counts
        assert step.kind == ("prefill" if chunks else "decode"), (step.kind, counts)
        for s, n in chunks:  # the next chunk, where the last one ended: [fed, fed + n)
            assert s.num_computed_tokens == self.fed[s.id] and \
                1 <= n <= s.num_prefill_tokens - self.fed[s.id], (s.id, n)
            self.fed[s.id] += n
        want = []
        for s, n in zip(seqs, counts):
            fed = s.num_computed_tokens
            want += (s.prompt_ids + s.output_ids)[fed:fed + n] if s.prefilling \
                else [s.output_ids[-1]]
        assert step_tokens(step) == want

    @precondition(lambda self: any(not s.prefilling for s in self.sched.running))
    @rule(data=st.data())
    def finish(self, data):  # a stop token (max_new_tokens finishes in ``apply``)
        s = self.draw_seq(data, [s for s in self.sched.running if not s.prefilling])
        self.sched.finish(s, "stop")
        self.finished.append(s)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data):  # the engine's recovery after a step that failed
        self.sched.preempt(self.draw_seq(data, self.sched.running))

    @precondition(lambda self: self.unfinished())
    @rule(data=st.data())
    def abort(self, data):
        s = self.draw_seq(data, self.unfinished())
        if s in self.queue:
            self.queue.remove(s)
        self.sched.abort([s])
        assert s.finish_reason == "abort"
        self.finished.append(s)

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def drain(self):
        """Step until every request completes: no livelock, no starvation."""
        for _ in range(1000):
            if not self.sched.has_work():
                break
            self.step()
            self.nothing_dropped_or_duplicated()
            self.cache_holds_exactly_the_running()
        assert not self.sched.has_work() and all(s.finished for s in self.added)
        assert not self.cache.blocks

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def nothing_dropped_or_duplicated(self):
        sched = self.sched
        assert [s.id for s in sched.waiting] == [s.id for s in self.queue]
        places = [list(sched.waiting), sched.running, self.finished]
        for s in self.added:
            assert sum(1 for where in places for x in where if x is s) == 1, f"seq {s.id}"
        assert sum(map(len, places)) == len(self.added)
        for where, status in zip(places, (Status.WAITING, Status.RUNNING, Status.FINISHED)):
            assert all(s.status is status for s in where), status

    @invariant()
    def limits_and_order_hold(self):
        running = self.sched.running
        assert len(running) <= self.sched.max_batch_size
        order = [self.admitted[s.id] for s in running]
        assert order == sorted(order), "running is not in admission order"
        # one prompt is chunked at a time, and it samples only after its last chunk
        assert sum(s.prefilling for s in running) <= 1
        for s in running:
            assert s.num_computed_tokens == self.fed[s.id] or not s.prefilling
            assert len(s.output_ids) == s.num_computed_tokens - len(s.prompt_ids) + 1 \
                or s.prefilling
        assert all(len(s.output_ids) <= s.params.max_new_tokens for s in self.added)

    @invariant()
    def cache_holds_exactly_the_running(self):
        c = self.cache
        assert set(c.blocks) == {s.id for s in self.sched.running}, "leaked or missing"
        for s in self.sched.running:
            assert c.length(s.id) == s.num_computed_tokens
            assert c.blocks[s.id] * c.block_size >= s.num_prefill_tokens  # reserved whole
        assert 0 <= c.num_free <= c.num_blocks


class TestSchedulerMachine(SchedulerMachine.TestCase):
    settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
