"""Helpers of the quality tests on the real demo model (SmolLM2-135M-Instruct, ``slow``):
the engine as those tests build it, its perplexity over 2,048 tokens of English that ships
with Python (pydoc's topics), and its answer to the demo question."""
import functools

import pydoc_data.topics
import torch

from infergraft import core

QUESTION = "What is the capital of France?"
TEXT = pydoc_data.topics.topics["assignment"] + pydoc_data.topics.topics["class"]


def demo_engine(plugins, model="smollm2-135m", **overrides):
    """``model``: the demo alias, or a directory made from it (a quantised checkpoint)."""
    kw = dict(max_seq_len=2048, max_batch_size=1, dtype="float32", device="cpu", **overrides)
    return core.build(str(model), plugins=plugins, **kw)


def text_ids(engine, n: int = 2048) -> list[int]:
    ids = engine.tokenizer.encode(TEXT)[:n]
    assert len(ids) == n, len(ids)
    return ids


def perplexity(engine, ids) -> float:
    """exp(mean next-token cross-entropy) of ``ids`` under the engine, one prefill."""
    logits = engine.logits(ids)
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()


def float_reference() -> tuple[list[int], float, int]:
    """(the text's 2,048 token ids, their perplexity, the weight bytes) under the float32
    engine on the paged cache: the baseline each quality test compares with, computed once
    a test process."""
    return _float_run()[:3]


def demo_answer(engine, max_new_tokens: int = 32) -> str:
    """The greedy answer to the demo question, through the model's chat template."""
    return engine.generate(_chat(engine), max_new_tokens=max_new_tokens)[0].text


def _chat(engine) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                add_generation_prompt=True, tokenize=False)


def float_first_token() -> tuple[int, float]:
    """(the float32 model's first answer token, its margin over the runner-up in
    probability). The margin is thin ("The" 0.15 against "L" 0.14), so a quantised model
    may open the other way ("L'..." and French) with its knowledge intact."""
    return _float_run()[3:]


@functools.cache
def _float_run() -> tuple[list[int], float, int, int, float]:
    """float_reference's and float_first_token's figures, from one float32 engine once a
    test process."""
    engine = demo_engine(["paged"])
    ids = text_ids(engine)
    text_perplexity = perplexity(engine, ids)
    probs = engine.logits(engine.tokenizer.encode(_chat(engine)))[-1].softmax(-1)
    top = probs.topk(2)
    return (ids, text_perplexity, engine.plan.weight_bytes, int(top.indices[0]),
            float(top.values[0] - top.values[1]))


def demo_answer_after_float_opening(engine, max_new_tokens: int = 32) -> str:
    """The greedy answer when it opens as the float32 model's does (its first token given):
    what the quantised model knows, apart from the near-tie of the opening."""
    first, _ = float_first_token()
    ids = engine.tokenizer.encode(_chat(engine)) + [first]
    return engine.tokenizer.decode([first]) + \
        engine.generate(ids, max_new_tokens=max_new_tokens)[0].text
