"""``usage.prompt_tokens_details.cached_tokens`` of a server on a paged pool, through the
official openai client: the prompt tokens a request was served from the prefix cache,
for completions and chat, streamed (``include_usage``) and not; n choices count their
prompt once, several prompts each of theirs."""
import json

import pytest
from serve_support import serving, tiny_model

MAX_SEQ, BLOCKS, BS = 256, 64, 16
STREAM = dict(stream=True, stream_options={"include_usage": True})


def prompt_ids(k: int, n: int = 40) -> list[int]:
    """A prompt of ``n`` token ids of its own (``k``): 2 full blocks of 16 and 8 tokens."""
    return [100 + (k * 131 + 7 * i) % 900 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("cached") / "paged.json"
    config.write_text(json.dumps({"num_blocks": BLOCKS}))
    with serving(tiny_model(tmp_path_factory), "--plugin", "paged", "--config", str(config),
                 "--max-seq-len", str(MAX_SEQ), "--max-batch-size", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def streamed_usage(chunks):
    chunks = list(chunks)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def test_completions_report_the_cached_prompt_tokens(server, client):
    kw = dict(model=server.model, prompt=prompt_ids(1), max_tokens=4, temperature=0)
    first = client.completions.create(**kw)
    assert (first.usage.prompt_tokens, cached(first.usage)) == (40, 0)
    again = client.completions.create(**kw)  # the 2 full blocks its prompt starts with
    assert (again.usage.prompt_tokens, cached(again.usage)) == (40, 2 * BS)
    assert again.choices[0].text == first.choices[0].text
    # streamed: a new prompt, then it again
    kw["prompt"] = prompt_ids(2)
    assert cached(streamed_usage(client.completions.create(**kw, **STREAM))) == 0
    use = streamed_usage(client.completions.create(**kw, **STREAM))
    assert (use.prompt_tokens, cached(use), use.completion_tokens) == (40, 2 * BS, 4)


def test_chat_reports_the_cached_prompt_tokens(server, client):
    words = " ".join(f"word{i}" for i in range(30))
    kw = dict(model=server.model, max_tokens=4, temperature=0,
              messages=[{"role": "user", "content": f"Repeat after me: {words}"}])
    first = client.chat.completions.create(**kw)
    n = first.usage.prompt_tokens
    assert n > 2 * BS and cached(first.usage) == 0
    # every full block but the one holding the last prompt token, which is fed for logits
    assert cached(client.chat.completions.create(**kw).usage) == (n - 1) // BS * BS
    kw["messages"][0]["content"] = f"Now say it backwards: {words}"
    use = streamed_usage(client.chat.completions.create(**kw, **STREAM))
    # the system prompt and the start of the message are as before: at least one block
    fresh = cached(use)
    assert BS <= fresh < (use.prompt_tokens - 1) // BS * BS
    use = streamed_usage(client.chat.completions.create(**kw, **STREAM))
    assert cached(use) == (use.prompt_tokens - 1) // BS * BS


def test_n_choices_count_their_prompt_once_and_several_prompts_each(server, client):
    kw = dict(model=server.model, prompt=prompt_ids(3), max_tokens=4, temperature=0.8, seed=1)
    first = client.completions.create(**kw, n=3)
    # the first choice's: it found nothing (its siblings may find its blocks)
    assert (first.usage.prompt_tokens, cached(first.usage)) == (40, 0)
    again = client.completions.create(**kw, n=3)
    assert len(again.choices) == 3 and cached(again.usage) == 2 * BS  # not 3 * 32
    kw["prompt"] = [prompt_ids(3), prompt_ids(4)]  # cached, then new
    both = client.completions.create(**kw, n=2, **STREAM)
    use = streamed_usage(both)
    assert (use.prompt_tokens, cached(use)) == (80, 2 * BS)
