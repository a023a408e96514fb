"""Speculation beside the greedy decode look-ahead (core/runner/lookahead.py): while a
request's drafts are paused (``AdaptiveK``: drafts wholly refused in a row) its steps are
plain decode steps, launched one ahead of another; each of them counts toward its pause,
as a step the engine schedules does, so it proposes again when its pause ends, as it
would without the look-ahead (a lone request used to stay paused to its end: the pause
only counted down in steps the look-ahead did not launch). Run on the CPU through the
graph runners' static buffers (``use_graphs=False``: the look-ahead as on a GPU)."""
from speculative_support import lone_requests

from infergraft import core
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.speculative.adaptive import AdaptiveK
from infergraft.core.speculative.config import draft_rows
from infergraft.core.testing.models import random_model, tiny_llama_config

NGRAM = {"method": "ngram", "k": 4}


def engine_for(hf, look_ahead: bool):
    engine = core.build(hf, plugins=["paged"], block_size=4, max_seq_len=160,
                        max_batch_size=2, speculative=NGRAM)
    engine.speculation.cost.share = lambda *args, **kw: 0.0  # (the cost rule reads the
    if look_ahead:  # clock: off, so that both engines' requests decide alike)
        net, cache = engine.runner.model, engine.cache
        engine.decode_graphs = CudaGraphRunner(net, cache, 2, use_graphs=False)
        engine.decode_graphs.capture()
        engine.runner.step_graphs = StepGraphRunner(
            net, cache, 64, 2, use_graphs=False,
            extra_rows=draft_rows(engine.speculation.config, 2))
        engine.runner.step_graphs.capture()
    return engine


def test_a_pause_ends_under_the_look_ahead(monkeypatch):
    paused, take = [], AdaptiveK.take

    def counted(self):  # decode steps a pause took
        k = take(self)
        paused.append(k == 0)
        return k
    monkeypatch.setattr(AdaptiveK, "take", counted)
    hf = random_model(tiny_llama_config(), seed=5, scale=5.0)
    runs = {}
    for look_ahead in (False, True):
        engine, launched = engine_for(hf, look_ahead), []
        if look_ahead:
            advance = engine.lookahead.advance
            engine.lookahead.advance = lambda: (launched.append(1), advance())[1]
        runs[look_ahead] = [(seq.output_ids, seq.metrics.num_drafts,
                             seq.metrics.num_draft_tokens, seq.metrics.num_accepted_tokens)
                            for seq in lone_requests(engine, 256)]
        assert any(paused), "no request was paused: nothing tested"
        assert not look_ahead or len(launched) > 20  # its plain steps ran under it
        paused.clear()
    assert runs[True] == runs[False]  # the same tokens, the same drafts
