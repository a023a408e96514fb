"""``/metrics`` of a server on a paged pool: engine.stats()'s K/V memory (prefix-cache
queries and hits, blocks total and free, preemptions) exported with the values the same
requests give an engine in this process, and the free blocks falling while a request
runs."""
import json

import httpx
import pytest
from serve_support import serving, tiny_model, wait_until

from infergraft import core

MAX_SEQ, BLOCKS = 256, 64
KV = ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
      "num_swapped_out_total", "num_recomputed_total", "kv_blocks", "kv_blocks_free")
# a prompt of token ids spanning full blocks (what a prefix cache can share), sent twice
PROMPT = [100 + (7 * i) % 900 for i in range(40)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("kv") / "paged.json"
    config.write_text(json.dumps({"num_blocks": BLOCKS}))
    with serving(model_dir, "--plugin", "paged", "--config", str(config), "--max-seq-len",
                 str(MAX_SEQ), "--max-batch-size", "4") as s:
        yield s


def _kv(server) -> dict:
    return {k: v for (name, _), v in server.metrics().items()
            if (k := name.removeprefix("infergraft_")) in KV}


def test_kv_metrics_are_the_engines_stats_for_the_same_requests(server, model_dir):
    engine = core.build(str(model_dir), plugins=["paged"], max_seq_len=MAX_SEQ,
                        max_batch_size=4, num_blocks=BLOCKS)
    want = engine.stats()
    for _ in range(2):
        seq = engine.add_request(list(PROMPT), core.SamplingParams(max_new_tokens=4))
        while not seq.finished:
            engine.step()
    after = engine.stats()
    before = _kv(server)
    client = server.client()
    for _ in range(2):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                  temperature=0)
    got = _kv(server)
    assert set(got) == set(KV), set(KV) - set(got)
    for key in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                "num_swapped_out", "num_recomputed"):
        assert got[f"{key}_total"] - before[f"{key}_total"] == after[key] - want[key], key
    assert got["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] >= 80
    assert got["kv_blocks"] == BLOCKS == after["kv_blocks_total"]
    assert got["kv_blocks_free"] == after["kv_blocks_free"] == BLOCKS  # none held now


def test_free_blocks_fall_while_a_request_runs(server):
    body = {"prompt": PROMPT, "max_tokens": MAX_SEQ - len(PROMPT) - 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
        # its prompt and first tokens: at least 3 blocks of 16
        assert server.gauge("infergraft_kv_blocks_free") <= BLOCKS - 3
    wait_until(lambda: server.gauge("infergraft_kv_blocks_free") == BLOCKS, timeout=5)
