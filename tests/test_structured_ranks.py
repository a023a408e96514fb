"""Structured output across processes: under tp and pp on two gloo ranks every rank keeps
its requests' constraints in step with the tokens the sampling rank broadcasts (the other
ranks start and advance theirs without seeing logits), and the outputs are what one
process gives."""
import pytest

from infergraft.core.testing.distributed import run_ranks

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3}},
    "required": ["id", "tags"]}
REQUESTS = [dict(json_schema=SCHEMA), dict(regex=r"[a-c]{2,4}-\d{2}", temperature=1.0, seed=3),
            dict(choice=["left", "right"]), dict(json_schema=SCHEMA, jump_forward=True),
            dict()]


def constrained_texts(plugins: list) -> dict:
    import torch

    from structured_support import tiny_engine

    def texts(engine):
        done = [engine.generate("prompt %d" % i, max_new_tokens=40, **kw)[0]
                for i, kw in enumerate(REQUESTS)]
        return [(d.text, d.token_ids, d.finish_reason) for d in done]

    out = {"ranks": texts(tiny_engine(plugins=plugins))}
    if torch.distributed.get_rank() == 0:  # one process's engine: the reference
        out["alone"] = texts(tiny_engine())
    return out


@pytest.mark.parametrize("planner", ["tp", "pp"])
def test_constraints_across_ranks_match_one_process(planner):
    r0, r1 = run_ranks(constrained_texts, 2, [planner], timeout=300)
    assert r0["ranks"] == r1["ranks"] == r0["alone"]
    assert [finish for _, _, finish in r0["ranks"]][:4] == ["stop"] * 4
