"""CPU+GPU weight placement (``plugins=["offload-weights"]``): the layers beyond the device
budget live in host memory and are copied into a ring of device slots layer by layer. On
the CPU the same code runs with the host as both sides: logits and greedy tokens equal to
the plain build's (caches, quantisers), the order of the copies from the streamer's log,
the split and the budget in the plan, and ``infergraft plan --offload-weights``."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import PlanError
from infergraft.core.runner.weight_stream import ALIGN, tensors_of
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config, with_random_norm_weights)
from infergraft.core.testing.planner_kit import PlannerTests
from infergraft.kernels._triton import HAVE_TRITON, interpreting

KW = dict(max_seq_len=64, max_batch_size=2)
LAYERS = 5
PROMPTS = [random_prompt(11, 256, 1), random_prompt(6, 256, 2)]


@pytest.fixture(scope="module")
def hf():
    return with_random_norm_weights(
        random_model(tiny_llama_config(num_hidden_layers=LAYERS), seed=1, scale=2.0), seed=2)


class TestOffloadWeightsPlanner(PlannerTests):
    """The planner conformance kit: one device, one stage."""

    world_sizes = (1,)
    bad_world_sizes = (2,)
    plan_options = {"ring_size": 3}

    @pytest.fixture
    def planner(self):
        return core.get_plugin_manager().planners().get("offload-weights")


def _kv_device(engine) -> int:
    backend = core.get_plugin_manager().cache_backends().get(engine.plan.cache_backend)
    return getattr(backend, "device_bytes", lambda p: p.kv_bytes_total)(engine.plan)


def _need(engine) -> int:
    """What the plan puts on the device: weights there + K/V + activations."""
    p = engine.plan
    return p.device_weight_bytes + _kv_device(engine) + p.activation_bytes


def _budget_for(hf, resident: int, plugins=(), **kw) -> int:
    """The smallest budget the planner keeps ``resident`` layers on the device in."""
    probe = core.build(hf, plugins=["offload-weights", *plugins], resident_layers=resident,
                       **KW, **kw)
    return _need(probe)


def _greedy(engine, n=6):
    return [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=n)]


def _held_bytes(engine) -> int:
    """Bytes of the distinct storages the model's tensors live in (a ring slot once)."""
    storages = {}
    for t in tensors_of(engine.model):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("plugins", [[], ["paged"], ["int8"], ["paged", "kv-int8"],
                                     ["paged", "int8", "kv-int8"]])
def test_streamed_layers_give_the_plain_builds_logits_and_tokens(hf, plugins):
    ref = core.build(hf, plugins=plugins or None, **KW)
    budget = _budget_for(hf, 2, plugins)
    engine = core.build(hf, plugins=["offload-weights", *plugins], device_memory=budget, **KW)
    placement = engine.plan.weight_placement
    assert placement.resident == (0, 1) and placement.streamed == (2, 3, 4)
    assert engine.model.streamer is not None and engine.decode_graphs is None
    for prompt in PROMPTS:
        a, b = ref.logits(prompt), engine.logits(prompt)
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    assert _greedy(engine) == _greedy(ref)


@pytest.mark.parametrize("plugins", [[], ["paged", "int8"]])
def test_every_layer_streamed(hf, plugins):
    ref = core.build(hf, plugins=plugins or None, **KW)
    engine = core.build(hf, plugins=["offload-weights", *plugins], resident_layers=0, **KW)
    assert engine.plan.weight_placement.streamed == tuple(range(LAYERS))
    assert torch.allclose(ref.logits(PROMPTS[0]), engine.logits(PROMPTS[0]), rtol=0, atol=1e-6)
    assert _greedy(engine) == _greedy(ref)


def test_gpt2_layers_stream_too():  # LayerNorm with biases, learned positions, a tied head
    hf2 = random_model(tiny_gpt2_config(n_layer=4), seed=3)
    ref = core.build(hf2, **KW)
    engine = core.build(hf2, plugins=["offload-weights"], resident_layers=1, **KW)
    assert engine.plan.weight_placement.streamed == (1, 2, 3)
    assert torch.allclose(ref.logits(PROMPTS[0]), engine.logits(PROMPTS[0]), rtol=0, atol=1e-6)
    assert _greedy(engine) == _greedy(ref)


def test_streamed_tensors_are_views_into_the_ring_and_the_host_holds_one_copy(hf):
    engine = core.build(hf, plugins=["offload-weights", "int8"], resident_layers=1, **KW)
    st, placement = engine.model.streamer, engine.plan.weight_placement
    assert st.ring_size == placement.ring_size == 2 and len(st.host) == 4
    # the planner's slot (an upper bound, each tensor aligned) holds the packed layer
    assert st.slot_bytes <= placement.slot_bytes < st.slot_bytes + 16 * ALIGN
    assert st.host_bytes == sum(b.numel() for b in st.host) >= placement.streamed_bytes
    for j, layer in enumerate(placement.streamed):
        slot = st.slots[j % st.ring_size]
        lo, hi = slot.data_ptr(), slot.data_ptr() + slot.numel()
        tensors = tensors_of(engine.model.layers[layer])
        assert len(tensors) >= 6 and any(t.dtype == torch.int8 for t in tensors)  # packed q
        assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for t in tensors)
        assert all((t.data_ptr() - lo) % ALIGN == 0 for t in tensors)  # aligned offsets
    for layer in placement.resident:  # untouched: their own storages
        assert not any(s.data_ptr() <= t.data_ptr() < s.data_ptr() + s.numel()
                       for t in tensors_of(engine.model.layers[layer]) for s in st.slots)


def _events(log, layer):
    return [e[0] for e in log if e[0] in ("copy", "run") and e[1] == layer]


@pytest.mark.parametrize("ring_size,resident", [(2, 0), (2, 1), (3, 1)])
def test_the_order_of_the_copies(hf, ring_size, resident):
    engine = core.build(hf, plugins=["offload-weights"], resident_layers=resident,
                        ring_size=ring_size, **KW)
    st, placement = engine.model.streamer, engine.plan.weight_placement
    streamed = placement.streamed
    st.log = []
    steps = 2  # the prefill, one decode step
    engine.generate(PROMPTS[0], max_new_tokens=steps)
    log = st.log
    runs = [e for e in log if e[0] == "run"]
    assert len(runs) == steps * LAYERS
    first_run = log.index(("run", 0))
    # 1) the first ring_size copies are issued before the first layer runs, one per slot
    assert log[:first_run] == [("copy", streamed[s], s) for s in range(ring_size)]
    for layer in streamed:
        ev = _events(log, layer)
        assert ev[0] == "copy" and ev.count("run") == steps
        if layer in placement.copied:  # 2) copied once per step, each copy before its run
            assert ev[:2 * steps] == ["copy", "run"] * steps and len(ev) <= 2 * steps + 1
        else:  # alone in its slot: copied once, kept
            assert ev == ["copy"] + ["run"] * steps
    # 3) a slot is refilled only after the layer copied into it has run
    for s in range(st.ring_size):
        pending = None
        for e in log:
            if e[0] == "copy" and e[2] == s:
                assert pending is None, f"slot {s} refilled before layer {pending} ran: {log}"
                pending = e[1]
            elif e[0] == "run" and e[1] == pending:
                pending = None
    # 4) while a streamed layer runs, the next one's copy is already issued (overlap)
    for i, e in enumerate(log):
        if e[0] == "run" and e[1] in streamed[:-1]:
            nxt = streamed[streamed.index(e[1]) + 1]
            before = [x for x in log[:i] if x[0] in ("copy", "run") and x[1] == nxt]
            assert before and (before[-1][0] == "copy" or nxt not in placement.copied), log


def test_a_slot_alone_keeps_its_layer_and_the_plan_counts_only_the_copies(hf):
    engine = core.build(hf, plugins=["offload-weights"], resident_layers=1, ring_size=3, **KW)
    p = engine.plan.weight_placement
    # streamed 1..4 over slots 0, 1, 2, 0: layers 2 and 3 have a slot each
    assert p.streamed == (1, 2, 3, 4) and p.copied == (1, 4)
    assert p.copied_bytes == p.layer_bytes[1] + p.layer_bytes[4] < p.streamed_bytes
    assert "4 layers (1-4), " in str(engine.plan)
    assert "copied into the ring each step (1, 4)" in str(engine.plan)


def test_the_plan_shows_the_split_and_respects_the_budget(hf):
    budget = _budget_for(hf, 2, ["paged"]) + 1000  # less than another layer
    engine = core.build(hf, plugins=["offload-weights", "paged"], device_memory=budget, **KW)
    p, placement = engine.plan, engine.plan.weight_placement
    text = str(p)
    assert "weights on the device" in text and "2 of 5 layers (0-1)" in text
    assert "weights in host memory" in text and "3 layers (2-4)" in text
    assert "2-slot ring" in text
    held = _held_bytes(engine)  # what the model holds: resident weights + the ring
    assert held <= p.device_weight_bytes
    assert held + _kv_device(engine) + p.activation_bytes <= budget
    assert p.weight_bytes == core.build(hf, plugins=["paged"], **KW).plan.weight_bytes
    assert p.device_weight_bytes == p.weight_bytes - placement.streamed_bytes \
        + placement.ring_bytes


def test_everything_fits_nothing_streams(hf):
    engine = core.build(hf, plugins=["offload-weights"], device_memory="1GiB", **KW)
    placement = engine.plan.weight_placement
    assert placement.streamed == () and placement.resident == tuple(range(LAYERS))
    assert engine.model.streamer is None
    assert "all 5 layers on the device, nothing streams (every layer fits the budget)" \
        in str(engine.plan)
    assert engine.plan.device_weight_bytes == engine.plan.weight_bytes


def test_a_budget_too_small_for_the_ring_is_refused_with_the_numbers(hf):
    budget = _budget_for(hf, 0) - 1
    with pytest.raises(PlanError, match=r"does not fit even with every layer in host memory: "
                       r"embeddings, norms and head .* \+ a 2-slot ring .* \+ K/V .* \+ "
                       r"activations .* > the budget") as e:
        core.build(hf, plugins=["offload-weights"], device_memory=budget, **KW)
    assert "Lower max_batch_size" in str(e.value)
    # a layer count given by hand is checked by the memory check, naming the device's share
    with pytest.raises(PlanError, match="does not fit: weights on the device"):
        core.build(hf, plugins=["offload-weights"], device_memory=budget, resident_layers=3,
                   **KW)


@pytest.mark.parametrize("options,why", [
    (dict(ring_size=1), "ring_size=1 must be an integer >= 2"),
    (dict(ring_size=True), "ring_size=True must be an integer >= 2"),
    (dict(resident_layers=6), "resident_layers=6 must be an integer from 0 to 5"),
    (dict(resident_layers=-1), "resident_layers=-1 must be an integer from 0 to 5"),
    (dict(resident_layers="2"), "resident_layers='2' must be an integer from 0 to 5"),
])
def test_bad_options_are_refused(hf, options, why):
    with pytest.raises(PlanError, match=why):
        core.build(hf, plugins=["offload-weights"], **KW, **options)


@pytest.mark.parametrize("ring_size", [2, 3])
def test_self_contained_steps_copy_their_own_first_layers(hf, ring_size):
    """As from the first CUDA graph capture on: every step issues its first copies in
    ``begin``, none for the next step; a slot of one layer keeps it; tokens unchanged."""
    ref = core.build(hf, plugins=["paged"], **KW)
    engine = core.build(hf, plugins=["offload-weights", "paged"], resident_layers=1,
                        ring_size=ring_size, **KW)
    st, placement = engine.model.streamer, engine.plan.weight_placement
    st.self_contained = True
    st.log = []
    steps = 3  # the prefill, two decode steps
    out = engine.generate(PROMPTS[0], max_new_tokens=steps)
    assert out[0].token_ids == ref.generate(PROMPTS[0], max_new_tokens=steps)[0].token_ids
    log = st.log
    ends = [i for i, e in enumerate(log) if e == ("run", LAYERS - 1)]  # each step's last
    assert len(ends) == steps and not [e for e in log[ends[-1]:] if e[0] == "copy"]
    for n in range(steps):
        part = log[ends[n - 1] + 1 if n else 0:ends[n] + 1]  # from the last step's end
        copies = [e[1] for e in part if e[0] == "copy"]
        first = part.index(("run", 0))
        # each step copies its own layers after the last one ended: every streamed layer
        # at first, then those that share a slot (a lone slot keeps its layer), each once
        assert sorted(copies) == list(placement.streamed if n == 0 else placement.copied)
        # its first copies, one per shared slot, before its first layer runs
        assert [e[1:] for e in part[:first]] == [
            (placement.streamed[s], s) for s in range(st.ring_size)
            if n == 0 or placement.streamed[s] in placement.copied]


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_the_fused_decode_layer_streams_its_folded_int8_rows():
    hf3 = with_random_norm_weights(random_model(
        tiny_llama_config(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                          vocab_size=128), seed=5, scale=2.0), seed=6)
    kw = dict(KW, dtype="float16", kernels="triton", plugins=["int8"])
    ref = core.build(hf3, **kw)
    engine = core.build(hf3, **dict(kw, plugins=["offload-weights", "int8"]), resident_layers=1)
    assert engine.model.norms_folded and engine.model._fused(1)  # the fused loop runs
    prompt = random_prompt(5, 128, 3)
    assert [c.token_ids for c in engine.generate(prompt, max_new_tokens=3)] == \
        [c.token_ids for c in ref.generate(prompt, max_new_tokens=3)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a real copy stream)")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("quantizers", [[], ["int8"], ["kv-int8"]])
def test_cuda_copy_stream_parity(hf, quantizers, graphs):
    """Against the all-on-GPU build run the same way (graphs: the same bucket shapes), with
    the copies inside the graphs; ``logits`` runs eagerly between the replays (those steps
    copy their own first layers too); a long prompt's chunks replay the step graphs."""
    kw = dict(KW, device="cuda", dtype="bfloat16", cuda_graphs=graphs,
              max_num_batched_tokens=16)
    ref = core.build(hf, plugins=["paged", *quantizers], **kw)
    engine = core.build(hf, plugins=["offload-weights", "paged", *quantizers],
                        resident_layers=1, **kw)
    st = engine.model.streamer
    assert st.cuda and st.pinned and st.slots[0].device.type == "cuda"
    assert all(b.device.type == "cpu" for b in st.host)
    assert (engine.decode_graphs is not None) == graphs == st.self_contained
    long_prompt = random_prompt(40, 256, 4)  # three chunks of a 16-token budget
    for prompt in [*PROMPTS, long_prompt]:
        assert torch.equal(ref.logits(prompt), engine.logits(prompt))
    assert _greedy(engine, 12) == _greedy(ref, 12)
    replays = engine.decode_graphs.replays if graphs else 0
    out = engine.generate([long_prompt, PROMPTS[0]], max_new_tokens=8)
    assert [c.token_ids for c in out] == \
        [c.token_ids for c in ref.generate([long_prompt, PROMPTS[0]], max_new_tokens=8)]
    assert not graphs or engine.decode_graphs.replays > replays
    assert torch.equal(ref.logits(long_prompt), engine.logits(long_prompt))  # eager again


def _config_dir(tmp_path):
    tiny_llama_config(num_hidden_layers=LAYERS).save_pretrained(tmp_path)
    return str(tmp_path)


def test_plan_cli_prints_the_split_and_an_expected_tpot(tmp_path, capsys):
    d = _config_dir(tmp_path)
    args = ["plan", d, "--offload-weights", "--device-memory", "1MiB", "--max-seq-len", "64",
            "--max-batch-size", "2", "--max-num-batched-tokens", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "weights on the device" in out and "weights in host memory" in out
    assert "host->device bandwidth" in out and "host memcpy" in out and "expected TPOT" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    placement = data["weight_placement"]
    assert placement["streamed"] and placement["resident"] == list(range(len(
        placement["resident"])))
    assert data["expected_tpot_s"] >= data["copy_s"] > 0 and data["h2d_bandwidth"] > 0
    assert data["device_weight_bytes"] < data["weight_bytes"] and data["fits"]
    # too small even with every layer in host memory: printed, refused, exit status 1
    assert main(args[:4] + ["100KiB"] + args[5:]) == 1
    out = capsys.readouterr().out
    assert "does not fit even with every layer in host memory" in out and "NO" in out
    # the ring options ask for the planner
    assert main(["plan", d, "--ring-size", "3"]) == 2
    assert "give it too" in capsys.readouterr().err
