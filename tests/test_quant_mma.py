"""``INFERGRAFT_QUANT_MMA`` through the engine: a tiny random LLaMA quantised int4 (groups
of 128), fp8 and int8, built with the switch at 0, unset (``auto``, its default) and 1 in
one process (it is read at each build), gives the same greedy tokens and close logits,
decoding one sequence and three at once. At 1 the tensor-core MMA kernels run (int4:
``int4_mma`` in the plain layer; e4m3 and int8: the fused decode layer's WORDS tiles, and
``rows_mma`` where a step has more rows than the fused layer takes), at 0 never, under
auto only int4's GEMMs of ``int4_linear.MMA_MIN_ROWS`` rows or more. Triton in the
interpreter, float16 (its bfloat16 dots are not the GPU's); the GPU case: bfloat16 under
the decode CUDA graphs. GPTQ (act-order) and AWQ checkpoints load into the format
``int4_mma`` reads (``Int4Weight``: nibble j of 32-bit word c is column 8c + j), no
re-layout."""
import pytest
import torch

from infergraft import core
from infergraft.core.testing.gptq_pack import write_quantized
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.kernels import fp8_linear, fused_linear, int4_linear, int8_linear
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.kernels.gemv import takes_int8_gemv

from test_gptq_act_order import write_act_order

pytestmark = pytest.mark.filterwarnings("ignore::infergraft.core.errors.PerformanceWarning")
FORMATS = ("int4", "fp8", "int8")
# K of every projection a multiple of 8 and int4's one group of 128 whole
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1)


def _spies(monkeypatch) -> dict:
    """{kernel: rows of each call}: the MMA kernels as the launchers reach them, and the
    fused GEMMs' launches on WORDS tiles."""
    seen = {"int4_mma": [], "rows_mma": [], "words": []}
    for module, name in ((int4_linear, "int4_mma"), (fp8_linear, "rows_mma"),
                         (int8_linear, "rows_mma")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda x, *a, _r=real, _n=name, **kw:
                            seen[_n].append(x.shape[0]) or _r(x, *a, **kw))
    launch = fused_linear.launch_gemm

    def spy(grid, cfg, x, *a, **kw):
        if cfg.get("WORDS"):
            seen["words"].append(x.shape[0])
        return launch(grid, cfg, x, *a, **kw)
    monkeypatch.setattr(fused_linear, "launch_gemm", spy)
    return seen


def _build(monkeypatch, setting: str | None, hf, **kw):
    """An engine built with INFERGRAFT_QUANT_MMA at ``setting`` (None: unset, its default)."""
    if setting is None:
        monkeypatch.delenv("INFERGRAFT_QUANT_MMA", raising=False)
    else:
        monkeypatch.setenv("INFERGRAFT_QUANT_MMA", setting)
    return core.build(hf, **kw)


def _run(engine, prompts, long_prompt):
    """(logits of the long prompt, greedy tokens of one prompt, of three at once)."""
    logits = engine.logits(long_prompt).float()
    one = engine.generate(prompts[0], max_new_tokens=3)[0].token_ids
    three = [c.token_ids for c in engine.generate(prompts, max_new_tokens=2)]
    return logits, one, three


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_setting_gives_the_switch_off_tokens_through_its_kernels(monkeypatch, fmt):
    hf = with_random_norm_weights(random_model(tiny_llama_config(**CONFIG), seed=11,
                                               dtype=torch.float16, scale=2.0))
    kw = dict(plugins=["paged", fmt], kernels="triton", dtype="float16", max_seq_len=96,
              max_batch_size=4)
    prompts = [random_prompt(n, hf.config.vocab_size, seed) for n, seed in ((7, 1), (5, 2),
                                                                            (9, 3))]
    # 40 tokens: more than the fused layer's 32 rows (8-bit rows: the plain layer's GEMM)
    long_prompt = random_prompt(40, hf.config.vocab_size, 4)
    seen = _spies(monkeypatch)
    off = _build(monkeypatch, "0", hf, **kw)
    want = _run(off, prompts, long_prompt)
    assert off.model.ops.quant_mma is False
    assert seen == {"int4_mma": [], "rows_mma": [], "words": []}

    # auto: int4's steps of 16 rows or more on int4_mma (the 40-token prompt, the three
    # prompts' 21 tokens in one step), the 7-token prompt and decode steps of 1-3 rows on
    # the shipped paths; e4m3 and int8 rows on theirs throughout
    auto = _build(monkeypatch, None, hf, **kw)
    got = _run(auto, prompts, long_prompt)
    assert auto.model.ops.quant_mma == "auto"
    assert relative_error(got[0], want[0]) < 5e-3, relative_error(got[0], want[0])
    assert got[1:] == want[1:]
    assert seen == {"int4_mma": [40] * 4 + [21] * 4 if fmt == "int4" else [],
                    "rows_mma": [], "words": []}, seen

    seen["int4_mma"].clear()
    on = _build(monkeypatch, "1", hf, **kw)
    got = _run(on, prompts, long_prompt)
    assert on.model.ops.quant_mma is True
    assert relative_error(got[0], want[0]) < 5e-3, relative_error(got[0], want[0])
    assert got[1:] == want[1:]
    if fmt == "int4":  # the plain layer (int4 has no fused one): every projection, every step
        assert on.model.norms_folded is False
        assert {1, 3, 40} <= set(seen["int4_mma"]) and not seen["words"]
    else:  # the fused layer's GEMMs at <= 32 rows (one int8 row: its word loop, as at 0),
        assert on.model.norms_folded  # the 40-token prefill on rows_mma
        loop = takes_int8_gemv(1, CONFIG["hidden_size"], fp8=fmt == "fp8")
        assert ({3, 7} if loop else {1, 3, 7}) <= set(seen["words"])
        assert set(seen["rows_mma"]) == {40} and not (loop and 1 in seen["words"])


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("method", ["gptq-act-order", "awq"])
def test_checkpoints_load_into_what_int4_mma_reads(tmp_path, monkeypatch, method):
    hf = random_model(tiny_llama_config(**CONFIG), seed=13, scale=20.0)
    if method == "awq":
        write_quantized(hf, tmp_path, "awq", group_size=128)
    else:  # down (256 columns: two groups) comes in an act order, folded into gate_up
        write_act_order(hf, tmp_path, group_size=128)
    kw = dict(kernels="triton", dtype="float16", max_seq_len=64, max_batch_size=4)
    prompts = [random_prompt(n, hf.config.vocab_size, seed) for n, seed in ((6, 1), (4, 2))]
    seen = _spies(monkeypatch)
    monkeypatch.setenv("INFERGRAFT_QUANT_MMA", "0")
    want = [c.token_ids for c in core.build(str(tmp_path), **kw).generate(prompts, max_new_tokens=3)]
    monkeypatch.setenv("INFERGRAFT_QUANT_MMA", "1")
    on = core.build(str(tmp_path), **kw)
    assert on.plan.quantizers == ("int4",) and on.model.layers[0].down.packed.perm is None
    assert [c.token_ids for c in on.generate(prompts, max_new_tokens=3)] == want
    assert {2, 10} <= set(seen["int4_mma"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA sm_89+ (e4m3)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_switch_auto_and_on_under_the_decode_graphs(monkeypatch, fmt):
    """On the GPU, decode replayed from CUDA graphs (split-K counters inside them), one
    sequence and three: with the switch at auto and at 1, logits close to the switch-off
    build's in bfloat16 and float16, and in float16 (bfloat16 rounds too coarsely for ties
    not to flip between two kernels) the same greedy tokens."""
    hf = random_model(tiny_llama_config(**CONFIG), seed=12, scale=2.0)
    prompts = [random_prompt(n, hf.config.vocab_size, seed) for n, seed in ((7, 1), (5, 2),
                                                                            (9, 3))]
    long_prompt = random_prompt(40, hf.config.vocab_size, 4)
    seen = _spies(monkeypatch)
    for dtype, tol in (("bfloat16", 3e-2), ("float16", 5e-3)):
        kw = dict(plugins=["paged", fmt], device="cuda", dtype=dtype, max_seq_len=96,
                  max_batch_size=4)
        off = _build(monkeypatch, "0", hf, **kw)
        want = _run(off, prompts, long_prompt)
        del off
        for setting in (None, "1"):  # auto, then every GEMM the MMA kernels take
            engine = _build(monkeypatch, setting, hf, **kw)
            assert engine.decode_graphs is not None
            assert engine.model.ops.quant_mma == ("auto" if setting is None else True)
            got = _run(engine, prompts, long_prompt)
            err = relative_error(got[0], want[0])
            assert err < tol, (dtype, setting, err)
            if dtype == "float16":
                assert got[1:] == want[1:], setting
            del engine
    assert seen["int4_mma"] if fmt == "int4" else seen["words"] and seen["rows_mma"]
