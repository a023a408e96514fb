"""LongRoPE's per-sequence choice of table (core/long_rope.py) in the scheduler, the runner's
rows and the decode look-ahead, against the fake block cache of test_scheduler.py (no
model): a short sequence reaching the boundary is recomputed first, as one long prefill."""
import types

import torch
from test_scheduler import apply, make, seq

from infergraft.core.long_rope import LongRopeSwitch
from infergraft.core.runner.lookahead import DecodeLookahead

B = 8  # the boundary: original_max_position_embeddings


def test_only_rows_of_long_sequences_below_the_boundary_are_marked():
    switch = LongRopeSwitch(B)
    long, short, decoding = seq(12), seq(5), seq(3)
    long.num_prefill_tokens, short.num_prefill_tokens = 12, 5  # admitted, nothing fed yet
    decoding.num_prefill_tokens = decoding.num_computed_tokens = 9  # a long one, decoding
    rows = switch.long_rows([short, long, decoding], [5, 6, 1], "cpu")
    assert rows.tolist() == [False] * 5 + [True] * 6 + [False]
    long.num_computed_tokens = 6  # its next chunk starts below the boundary: still marked
    assert switch.long_rows([long], [6], "cpu").tolist() == [True] * 6
    long.num_computed_tokens = 8  # at the boundary: its position says it
    assert switch.long_rows([long, short], [4, 5], "cpu") is None


def test_a_short_sequence_reaching_the_boundary_is_prefilled_again_as_a_long_one():
    sched, cache = make(max_num_batched_tokens=16)
    sched.long_rope = LongRopeSwitch(B)
    a, other = seq(6, max_new_tokens=10), seq(2, max_new_tokens=10)
    for s in (a, other):
        sched.add(s)
    apply(sched, cache, sched.schedule())  # both prompts; a's token 6 sampled
    apply(sched, cache, sched.schedule())  # a feeds position 6, samples its 2nd token
    assert a.num_computed_tokens == 7 and sched.schedule_ahead() is not None
    apply(sched, cache, sched.schedule())  # position 7: a's next row would be 8 = B
    assert sched.long_rope.stale(a) and sched.schedule_ahead() is None
    step = sched.schedule()
    # a's 6 + 3 tokens again, at the front; the other keeps decoding beside it
    assert [(s, n) for s, n in zip(step.seqs, step.counts)] == [(other, 1), (a, 9)]
    assert step.kind == "prefill" and a.num_prefill_tokens == 9 > B
    assert sched.long_rope.recomputes == 1 and sched.num_preemptions == 0
    apply(sched, cache, step)
    assert not sched.long_rope.stale(a) and cache.length(a.id) == 9


def test_the_decode_look_ahead_stops_short_of_the_boundary():
    sched, cache = make()
    sched.long_rope = LongRopeSwitch(B)
    a = seq(6, max_new_tokens=10)
    sched.add(a)
    apply(sched, cache, sched.schedule())
    engine = types.SimpleNamespace(scheduler=sched, cache=cache, speculation=None)
    look = DecodeLookahead(engine)
    assert look._can_look_ahead([a])  # in flight: position 6; next: 7
    a.num_computed_tokens = 7  # in flight: position 7; next: 8, the boundary
    assert not look._can_look_ahead([a])
    sched.long_rope = None
    assert look._can_look_ahead([a])


def test_the_rows_read_the_long_table_past_the_boundary_or_where_marked():
    from infergraft.core.rope import table_rows

    positions = torch.tensor([0, 7, 8, 20, 3])
    assert table_rows(positions, B).tolist() == [0, 7, 16, 28, 3]
    marked = torch.tensor([False, False, False, False, True])
    assert table_rows(positions, B, marked).tolist() == [0, 7, 16, 28, 11]
