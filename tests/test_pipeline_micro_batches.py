"""Pipeline micro-batches (``plugins=["pp"], micro_batches=M``: core/distributed/
micro_batches.py): how a step is cut into groups, gloo ranks against HF's own forward and
greedy generate at M = 1, 2, 4 (prompts cut inside a sequence, sliding windows, a tied
head, 2 stages x tensor_parallel 2), and the stages really working on different groups at
once."""
import itertools
import time

import pytest
from hypothesis import given, strategies as st

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.distributed.micro_batches import split_step
from infergraft.core.errors import PlanError
from infergraft.core.testing.distributed import run_ranks, tp_parity_cases
from infergraft.core.testing.models import random_model, tiny_llama_config

# a long prompt (cut into pieces at M > 1) beside prompts of other lengths
LONG = [1, *[(7 * i) % 250 + 3 for i in range(41)]]
PROMPTS = [LONG, [1, 5, 9, 33, 7, 80, 12], [1, 200, 3], [1, 17, 17, 4, 99, 31, 8, 8, 64, 2, 5]]


# -- the split, without ranks ---------------------------------------------------------------
@given(st.lists(st.integers(1, 70), min_size=1, max_size=9), st.integers(1, 9))
def test_groups_cover_every_token_once_in_order_balanced(counts, m):
    groups = split_step(counts, m)
    total = sum(counts)
    n = min(m, total)
    assert len(groups) == n
    # the pieces, group after group, are each sequence's tokens once and in order
    fed = {i: 0 for i in range(len(counts))}
    offset = 0
    for g in groups:
        assert g.offset == offset and g.tokens > 0 and list(g.seqs) == sorted(set(g.seqs))
        for i, k, end in zip(g.seqs, g.counts, g.ends):
            assert all(fed[j] == counts[j] for j in range(i))  # earlier sequences done
            fed[i] += k
            assert end == (fed[i] == counts[i])
        offset += g.tokens
    assert fed == dict(enumerate(counts)) and offset == total
    # each group within one token (and an eighth of a group moved to a boundary) of T / n
    slack = (total // n) // 8
    assert all(abs(g.tokens - total / n) <= 1 + 2 * slack for g in groups), groups
    # each cut splits at most one sequence
    assert sum(len(g.seqs) for g in groups) <= len(counts) + n - 1
    # the rows we sample from: each sequence's last token, in the step's order
    rows = [g.offset + r for g in groups for r in g.last_rows()]
    assert rows == [t - 1 for t in itertools.accumulate(counts)]


def test_cuts_prefer_sequence_boundaries_and_cut_a_lone_prompt():
    # cuts at 20 and 40; boundaries at 20 and 41 (within an eighth of 20): no piece cut
    assert [g.counts for g in split_step([20, 21, 19], 3)] == [(20,), (21,), (19,)]
    lone = split_step([60], 3)  # one prompt: three consecutive pieces
    assert [(g.counts, g.ends, g.offset) for g in lone] == \
        [((20,), (False,), 0), ((20,), (False,), 20), ((20,), (True,), 40)]
    assert [g.last_rows() for g in lone] == [[], [], [19]]
    decode = split_step([1] * 5, 2)  # decode: B sequences in groups of about B / M
    assert [g.seqs for g in decode] == [(0, 1), (2, 3, 4)]
    assert len(split_step([1, 1], 4)) == 2  # never more groups than tokens


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_micro_batches_must_be_a_positive_integer(bad):
    planner = core.get_plugin_manager().planners().get("pp")
    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    with pytest.raises(PlanError, match=rf"micro_batches={bad!r} must be an integer >= 1"):
        planner.plan(spec, 2, micro_batches=bad)
    assert planner.plan(spec, 2, micro_batches=3).micro_batches == 3
    assert planner.plan(spec, 2).micro_batches == 1


def test_plan_cli_prints_the_micro_batches(capsys):
    import json

    assert main(["plan", "smollm2-135m", "--pipeline-parallel", "2", "--micro-batches", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["micro_batches"] == 4 and "4 micro-batches a step" in out["model"]
    assert main(["plan", "smollm2-135m", "--micro-batches", "2"]) == 2
    assert "--micro-batches 2 pipelines the stages of --pipeline-parallel" in \
        capsys.readouterr().err


# -- on ranks ---------------------------------------------------------------------------------
def _configs():
    from infergraft.core.testing.distributed import parity_configs

    gpt2, mistral = parity_configs()["gpt2"], parity_configs()["mistral"]
    return {"llama-gqa-contiguous": dict(config=tiny_llama_config(), plugins=[]),
            "llama-gqa-paged": dict(config=tiny_llama_config(), plugins=["paged"]),
            "mistral-window-paged": dict(config=mistral, plugins=["paged"]),
            "gpt2-tied": dict(config=gpt2, plugins=[])}  # tied head, learned positions


def _cases():
    cases = {f"{name}-m{m}": dict(case, plugins=["pp", *case["plugins"]], prompts=PROMPTS,
                                  new_tokens=8, planner_options={"micro_batches": m})
             for name, case in _configs().items() for m in (1, 2, 4)}
    # a step budget of 16: prompt chunks beside decode tokens in one step, cut into groups
    cases["llama-paged-chunked-m4"] = dict(cases["llama-gqa-paged-m4"],
                                           max_num_batched_tokens=16)
    return cases


def overlap_probe(micro_batches: int) -> dict:
    """On one rank: a LLaMA at pp 2 whose last stage's first group takes 0.5 s longer
    (its first layer sleeps once); every stage's events of an engine.logits call (one
    prompt in ``micro_batches`` pieces), then of a 3-token generate of two prompts."""
    engine = core.build(random_model(tiny_llama_config()), plugins=["pp"], dtype="float32",
                        device="cpu", max_seq_len=64, micro_batches=micro_batches)
    stage = engine.ranks
    if stage.last:
        layer = engine.model.layers[0]
        original = layer.forward

        def slow(*args, **kwargs):
            layer.forward = original  # once
            time.sleep(0.5)
            return original(*args, **kwargs)

        layer.forward = slow
    stage.events = []
    engine.logits(LONG[:24])
    logits_events, stage.events = stage.events, []
    engine.generate([LONG, PROMPTS[2]], max_new_tokens=3)
    return {"stage": stage.index, "logits": logits_events, "generate": stage.events}


def pipeline_cases(cases: list[dict], micro_batches: int) -> dict:
    return {"cases": tp_parity_cases(cases), "probe": overlap_probe(micro_batches)}


@pytest.fixture(scope="module")
def two_ranks():
    """Every case and the probe on the same two ranks (one start-up)."""
    cases = _cases()
    ranks = run_ranks(pipeline_cases, 2, list(cases.values()), 3, timeout=600)
    return {"cases": {name: [r["cases"][i] for r in ranks] for i, name in enumerate(cases)},
            "probe": [r["probe"] for r in ranks]}


@pytest.mark.parametrize("name", list(_cases()))
def test_two_stages_match_hf(two_ranks, name):
    r0, r1 = two_ranks["cases"][name]
    assert (r0["tensor_parallel"], r0["stages"]) == (1, 2)
    assert r0["errors"] == r1["errors"]  # every rank took the same logits
    assert max(r0["errors"]) < 1e-4, r0["errors"]
    assert r0["ours"] == r0["hf"] == r0["alone"]  # greedy tokens, whole continuations
    assert r0["ours"] == r1["ours"] and r0["sampled"] == r1["sampled"]  # ranks agree


def test_stage_0_runs_ahead_of_stage_1(two_ranks):
    """Stage 1 posts every group's receive before it computes; stage 0 sends each group
    as it is computed and waits for its sends only at the end of the step, and finishes
    computing all 3 groups while stage 1 is still on group 0 (0.5 s longer): the stages
    worked on different groups at the same time."""
    first, last = two_ranks["probe"]
    assert (first["stage"], last["stage"]) == (0, 1)
    events = lambda r: [(e, g) for e, g, _ in r["logits"]]  # noqa: E731
    assert events(first) == [*itertools.chain.from_iterable(
        (("compute", g), ("sent", g), ("computed", g)) for g in range(3)), ("sends done", 3)]
    assert events(last) == [*(("posted", g) for g in range(3)), *itertools.chain.from_iterable(
        (("compute", g), ("received", g), ("computed", g)) for g in range(3)), ("sends done", 0)]
    at = lambda r, e, g: next(t for x, k, t in r["logits"] if (x, k) == (e, g))  # noqa: E731
    assert at(first, "computed", 2) < at(last, "computed", 0)
    # generate: the prefill of 42 + 3 tokens in 3 groups, the two decode steps in 2
    assert [g for e, g, _ in first["generate"] if e == "sends done"] == [3, 2, 2]
    assert [g for e, g, _ in last["generate"] if e == "received"] == [0, 1, 2, 0, 1, 0, 1]


def test_two_stages_of_two_tensor_parallel_ranks_in_micro_batches():
    cases = [dict(config=tiny_llama_config(), plugins=["pp"], prompts=PROMPTS, new_tokens=8,
                  planner_options={"tensor_parallel": 2, "micro_batches": 2})]
    ranks = [r[0] for r in run_ranks(tp_parity_cases, 4, cases, timeout=600)]
    assert [(r["tensor_parallel"], r["stages"]) for r in ranks] == [(2, 2)] * 4
    assert all(max(r["errors"]) < 1e-4 for r in ranks), [r["errors"] for r in ranks]
    assert ranks[0]["ours"] == ranks[0]["hf"] == ranks[0]["alone"]
    assert all(r["ours"] == ranks[0]["ours"] and r["sampled"] == ranks[0]["sampled"]
               for r in ranks)
