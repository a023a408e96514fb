"""A mixture-of-experts model down the paths that need nothing of their own for it: int8
K/V with the prefix cache (the experts sit after the attention, which is LLaMA's), and
``infergraft serve`` (a real process, the official ``openai`` client)."""
import shutil

import pytest
import safetensors.torch

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_mixtral_config
from infergraft.core.testing.parity import hf_greedy


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_mixtral_config(), seed=21, scale=5.0)


def test_int8_kv_and_the_prefix_cache(hf):
    """A second prompt sharing the first's 40 tokens takes their blocks from the prefix
    cache; both continue as HF does on K/V stored as int8 rows."""
    engine = core.build(hf, plugins=["paged", "kv-int8"], max_seq_len=96, max_batch_size=2,
                        block_size=8)
    shared = random_prompt(40, hf.config.vocab_size, 1)
    prompts = [shared + random_prompt(5, hf.config.vocab_size, 2),
               shared + random_prompt(7, hf.config.vocab_size, 3)]
    first = engine.generate(prompts[0], max_new_tokens=10)[0]
    second = engine.generate(prompts[1], max_new_tokens=10)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    assert [first.token_ids, second.token_ids] == \
        [hf_greedy(hf, p, 10, kv_int8=True) for p in prompts]


def test_served_over_http_as_the_engine_runs_it(tmp_path):
    from cli_support import TOKENIZER_FILES
    from serve_support import serving

    from infergraft.core.loading.demo import ensure_demo_model

    # the demo model's tokenizer over a tiny Mixtral of its vocabulary
    hf = random_model(tiny_mixtral_config(vocab_size=49152, tie_word_embeddings=True,
                                          max_position_embeddings=4096), seed=22, scale=5.0)
    hf.config.save_pretrained(tmp_path)
    safetensors.torch.save_model(hf, str(tmp_path / "model.safetensors"))
    demo = ensure_demo_model("smollm2-135m", quiet=True)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{demo}/{name}", tmp_path / name)
    engine = core.build(str(tmp_path), max_seq_len=256, max_batch_size=1)
    want = engine.generate("The experts", max_new_tokens=8)[0]
    ids = engine.tokenizer.encode("The experts")
    assert want.token_ids == hf_greedy(hf, ids, 8)
    with serving(tmp_path, "--max-seq-len", "256") as server:
        got = server.client().completions.create(model=str(tmp_path), prompt="The experts",
                                                 max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
