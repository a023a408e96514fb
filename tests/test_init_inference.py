"""DeepSpeed's ``init_inference`` call shape and HF's ``generate`` on our engine
(core/compat/): token for token what HF's own ``generate``
gives on the same weights, the plan of the equivalent ``core.build``, and the demo model."""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import InvalidRequestError
from infergraft.core.compat.hf_engine import InferenceEngine
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

QUESTION = "What is the capital of France?"
PAD = 0  # tiny_llama_config's pad_token_id


@pytest.fixture(scope="module")
def tiny():
    hf = random_model(tiny_llama_config(), seed=7, scale=5.0)
    return hf, InferenceEngine.adopt(core.build(hf, max_seq_len=64, max_batch_size=8))


def _left_padded(prompts, pad=PAD):
    """(input_ids, attention_mask) [B, T] as an HF tokenizer with padding_side="left"."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _batch():
    return _left_padded([random_prompt(n, 256, 10 + n) for n in (3, 9, 5)])


@torch.inference_mode()
def _hf_generate(hf, ids, **kw):
    return hf.generate(ids, do_sample=False, **kw)


def test_left_padded_batch_equals_hf_generate(tiny):
    hf, engine = tiny
    ids, mask = _batch()
    ref = _hf_generate(hf, ids, attention_mask=mask, max_new_tokens=12)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert out.dtype == torch.long and out.shape == ref.shape == (3, 9 + 12)
    assert torch.equal(out, ref)
    # the same through keywords, as generate(**tokenizer(...)) calls it, and .module
    assert torch.equal(engine.module.generate(input_ids=ids, attention_mask=mask,
                                              max_new_tokens=12), ref)


def test_single_unpadded_prompt_equals_hf_generate(tiny):
    hf, engine = tiny
    ids = torch.tensor([random_prompt(7, 256, 3)])
    with pytest.warns(UserWarning, match="max_length"):  # HF's default: 20 new tokens
        ref = _hf_generate(hf, ids)
    assert torch.equal(engine.generate(ids), ref) and ref.shape == (1, 7 + 20)
    ref = _hf_generate(hf, ids, max_length=15)  # max_length counts the prompt
    assert torch.equal(engine.generate(ids, max_length=15), ref) and ref.shape == (1, 15)


def test_rows_ending_at_eos_are_padded_like_hf(tiny):
    hf, engine = tiny
    ids, mask = _batch()
    free = _hf_generate(hf, ids, attention_mask=mask, max_new_tokens=12)[:, ids.shape[1]:]
    eos = int(free[0, 2])  # row 0's third new token: it ends there, the others run on
    assert eos not in free[0, :2].tolist() and eos not in free[1].tolist()
    # 1) eos_token_id (and pad_token_id) given to generate, as HF takes them
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=7)
    ref = _hf_generate(hf, ids, **kw)
    out = engine.generate(ids, **kw)
    assert torch.equal(out, ref)
    assert out[0, ids.shape[1] + 2] == eos and (out[0, ids.shape[1] + 3:] == 7).all()
    # 2) the model's own eos (its config's): the engine stops the row itself
    hf2 = random_model(tiny_llama_config(eos_token_id=eos), seed=7, scale=5.0)
    engine2 = InferenceEngine.adopt(core.build(hf2, max_seq_len=64, max_batch_size=4))
    ref = _hf_generate(hf2, ids, attention_mask=mask, max_new_tokens=12)
    out = engine2.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(out, ref) and (out[0, ids.shape[1] + 3:] == PAD).all()
    # every row at eos: the batch ends at the longest row, as HF's does
    short = engine2.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=12)
    assert torch.equal(short, _hf_generate(hf2, ids[:1], attention_mask=mask[:1],
                                           max_new_tokens=12))
    assert short.shape == (1, ids.shape[1] + 3)


def test_right_padded_rows_keep_their_padding_and_generate_as_alone(tiny):
    _, engine = tiny
    prompts = [random_prompt(n, 256, 20 + n) for n in (4, 8)]
    ids = torch.full((2, 8), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), 1
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(out[:, :8], ids)  # each input row as given, its padding included
    for i, p in enumerate(prompts):
        alone = engine.generate(p, max_new_tokens=6)[0].token_ids  # Engine.generate: id lists
        assert out[i, 8:].tolist() == alone


def test_mask_inferred_from_pad_like_hf(tiny):
    hf, engine = tiny
    ids, _ = _batch()  # no attention_mask: HF infers it from pad_token_id (not an eos)
    ref = _hf_generate(hf, ids, max_new_tokens=8)
    assert torch.equal(engine.generate(ids, max_new_tokens=8), ref)


def test_num_return_sequences_samples_each_row_in_turn(tiny):
    _, engine = tiny
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=2)
    torch.manual_seed(0)
    out = engine.generate(ids, **kw)
    assert out.shape[0] == 6 and out.shape[1] <= ids.shape[1] + 8
    # HF's layout: row 0's samples, then row 1's, ... (repeat_interleave)
    assert torch.equal(out[:, :ids.shape[1]], ids.repeat_interleave(2, dim=0))
    torch.manual_seed(0)  # seeded from torch's generator, as HF samples from it
    assert torch.equal(engine.generate(ids, **kw), out)
    assert not torch.equal(engine.generate(ids, **kw), out)
    # top_k=1 sampling is greedy, in every sample
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    top1 = engine.generate(ids, **kw, top_k=1, temperature=0.7)
    assert torch.equal(top1, greedy.repeat_interleave(2, dim=0))
    # greedy with more than one sequence per row is refused, as HF refuses it
    with pytest.raises(InvalidRequestError, match="do_sample=True"):
        engine.generate(ids, attention_mask=mask, num_return_sequences=2)


def test_sampling_options_apply_only_with_do_sample(tiny):
    _, engine = tiny
    ids, mask = _batch()
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    ignored = engine.generate(ids, attention_mask=mask, max_new_tokens=8, temperature=5.0,
                              top_k=3, top_p=0.5)
    assert torch.equal(ignored, greedy)
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.generate(ids, do_sample=True, temperature=0.0)


def test_forward_logits_and_loss_match_hf(tiny):
    hf, engine = tiny
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    out = engine(ids, attention_mask=mask, labels=labels)
    with torch.inference_mode():
        ref = hf(ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == ref.logits.shape == (3, 9, 256)
    real = mask.bool()
    assert torch.allclose(out.logits[real], ref.logits[real], atol=1e-4, rtol=1e-4)
    assert (out.logits[~real] == 0).all() and out.loss == pytest.approx(float(ref.loss), rel=1e-4)
    assert torch.equal(engine.forward(ids[1:2]).logits[0], engine.logits(ids[1].tolist()))


def test_plain_generate_keeps_its_behaviour(tiny):
    _, engine = tiny
    p = random_prompt(6, 256, 4)
    done = engine.generate([p, p], max_new_tokens=5)
    assert [type(c) for c in done] == [core.Completion] * 2 and len(done[0].token_ids) == 5
    assert engine.generate(torch.tensor([p]), max_new_tokens=5)[0, 6:].tolist() \
        == done[0].token_ids


@pytest.mark.parametrize("options, named", [
    (dict(num_beams=4), "num_beams=4"),
    (dict(output_scores=True), "output_scores=True"),
    (dict(typical_p=0.9), "typical_p"),
    (dict(token_type_ids=torch.zeros(3, 9, dtype=torch.long)), "token_type_ids"),
])
def test_unsupported_hf_options_are_refused_by_name(tiny, options, named):
    _, engine = tiny
    ids, mask = _batch()
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(ids, attention_mask=mask, **options)
    assert named in str(e.value) and "accepted: input_ids, attention_mask, max_new_tokens" \
        in str(e.value)
    assert engine.generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=2).shape[1] == 11


def test_generation_config_fields_apply_and_are_checked(tiny):
    from transformers import GenerationConfig

    hf, engine = tiny
    ids, mask = _batch()
    out = engine.generate(ids, attention_mask=mask, generation_config=GenerationConfig(
        max_new_tokens=4))
    assert torch.equal(out, engine.generate(ids, attention_mask=mask, max_new_tokens=4))
    # the model's own (bos, eos, pad, output_attentions=False, ...), keywords over it
    out = engine.generate(ids, attention_mask=mask, generation_config=hf.generation_config,
                          max_new_tokens=4)
    assert torch.equal(out, _hf_generate(hf, ids, attention_mask=mask, max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="num_beams=2"):
        engine.generate(ids, generation_config=GenerationConfig(num_beams=2))


@pytest.mark.parametrize("input_ids, mask, match", [
    (torch.ones(2, 4), None, "integer token ids"),
    (torch.ones(2, 4, dtype=torch.bool), None, "integer token ids"),
    (torch.ones(4, dtype=torch.long), None, r"2-d \[batch, length\].*input_ids\[None\]"),
    (torch.ones(1, 2, 4, dtype=torch.long), None, "2-d"),
    (torch.ones(2, 0, dtype=torch.long), None, "2-d"),
    (torch.tensor([[3, -1]]), None, "negative"),
    (torch.tensor([[3, 999]]), None, "outside the vocabulary"),
    (torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3), "shape"),
    (torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]),
     "rows \\[1\\] are all zeros"),
    (torch.ones(1, 2, dtype=torch.long), torch.tensor([[2, 1]]), "only 0"),
])
def test_bad_tensors_are_refused_clearly(tiny, input_ids, mask, match):
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(input_ids, attention_mask=mask, max_new_tokens=2)


def test_bad_call_shapes_are_refused(tiny):
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match="torch tensor"):
        engine.generate(input_ids=[[1, 2, 3]])
    with pytest.raises(InvalidRequestError, match="once"):
        engine.generate(torch.ones(1, 2, dtype=torch.long), input_ids=torch.ones(1, 2))
    with pytest.raises(InvalidRequestError, match="max_length"):
        engine.generate(torch.ones(1, 5, dtype=torch.long), max_length=5)
    with pytest.raises(InvalidRequestError, match="past_key_values"):
        engine(torch.ones(1, 2, dtype=torch.long), past_key_values=None)


# -- init_inference ------------------------------------------------------------------------

def test_init_inference_with_deepspeed_keywords_plans_as_build():
    hf = random_model(tiny_llama_config(), seed=1)
    engine = core.init_inference(hf, tensor_parallel={"tp_size": 1}, dtype=torch.float32,
                                 replace_with_kernel_inject=True, max_out_tokens=64)
    assert isinstance(engine, InferenceEngine) and isinstance(engine, core.Engine)
    plain = core.build(hf, dtype="float32", max_seq_len=64)
    assert engine.plan == plain.plan
    ids = torch.tensor([random_prompt(5, 256, 0)])
    assert engine.generate(ids, max_new_tokens=4)[0, 5:].tolist() \
        == plain.generate(ids[0].tolist(), max_new_tokens=4)[0].token_ids


def test_init_inference_merges_keywords_over_the_config(tmp_path):
    import json

    from infergraft.core.errors import ConfigError

    hf = random_model(tiny_llama_config(), seed=1)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"dtype": "fp32", "max_out_tokens": 64}))
    engine = core.init_inference(hf, config=str(path), max_out_tokens=64)  # equal: fine
    assert engine.plan == core.build(hf, dtype="float32", max_seq_len=64).plan
    engine = core.init_inference(hf, config={"max_out_tokens": 64}, max_batch_size=2)
    assert (engine.plan.max_seq_len, engine.plan.max_batch_size) == (64, 2)
    with pytest.raises(ConfigError, match="max_out_tokens"):  # as deepspeed: both, unequal
        core.init_inference(hf, config={"max_out_tokens": 64}, max_out_tokens=32)
    with pytest.raises(ConfigError, match="dtype: config 'fp16', keyword torch.bfloat16"):
        core.init_inference(hf, config={"dtype": "fp16"}, dtype=torch.bfloat16)
    # two spellings of one value agree (deepspeed compares them as written)
    engine = core.init_inference(hf, config={"dtype": "fp16"}, dtype=torch.half,
                                 max_out_tokens=64)
    assert engine.plan.dtype == "float16"


# -- the demo model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return core.init_inference("smollm2-135m", dtype=torch.float32, max_out_tokens=512)


def _chat(tokenizer, text):  # as core/cli.py's _prompt_text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
def test_demo_model_answers_paris(demo):
    done = demo.generate(_chat(demo.tokenizer, QUESTION), max_new_tokens=32)[0]
    assert "Paris" in done.text


@pytest.mark.slow
def test_demo_model_answers_paris_through_an_hf_tokenizer_call(demo):
    tokenizer = demo.tokenizer
    tokenizer.padding_side = "left"
    texts = [_chat(tokenizer, QUESTION), _chat(tokenizer, "Name a prime number.")]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    out = demo.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert out.shape[0] == 2 and torch.equal(out[:, :inputs["input_ids"].shape[1]],
                                             inputs["input_ids"])
    answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                     skip_special_tokens=True)
    assert "Paris" in answers[0]
    alone = demo.generate(input_ids=tokenizer([texts[0]], return_tensors="pt")["input_ids"],
                          max_new_tokens=32)
    assert tokenizer.decode(alone[0], skip_special_tokens=True).endswith(answers[0])
