"""``infergraft serve`` through the official openai client, sync and async: completions and
chat completions, streamed and not, n, logprobs (against the engine's own log-softmax),
16 concurrent streams, a client leaving mid-request, the metrics page."""
import asyncio

import httpx
import pytest
import torch
from serve_support import serving, tiny_model, wait_until

from infergraft import core

MAX_SEQ = 512
METRICS = ("infergraft_requests_running", "infergraft_requests_waiting",
           "infergraft_kv_cache_usage_ratio", "infergraft_prompt_tokens_total",
           "infergraft_generation_tokens_total", "infergraft_request_success_total",
           "infergraft_time_to_first_token_seconds_count",
           "infergraft_time_per_output_token_seconds_count",
           "infergraft_e2e_request_latency_seconds_count",
           # engine.stats()'s K/V memory (tests/test_serve_kv_metrics.py: a paged pool's)
           "infergraft_prefix_cache_queries_total", "infergraft_prefix_cache_hits_total",
           "infergraft_num_preemptions_total", "infergraft_num_swapped_out_total",
           "infergraft_num_recomputed_total", "infergraft_kv_blocks", "infergraft_kv_blocks_free")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, "--max-seq-len", str(MAX_SEQ), "--max-batch-size", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same model in this process: what the server's answers must equal."""
    return core.build(str(model_dir), max_seq_len=MAX_SEQ, max_batch_size=2)


def chat_text(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True, tokenize=False)


def test_models_health_and_the_page(server, client):
    assert [m.id for m in client.models.list()] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and "/static/chat.js" in page.text
    assert "text/event-stream" not in page.headers["content-type"]
    assert "getReader" in httpx.get(f"{server.url}/static/chat.js").text


def test_completion_equals_the_offline_engine(server, client, engine):
    done = engine.generate("The sea is", max_new_tokens=10)[0]
    r = client.completions.create(model=server.model, prompt="The sea is", max_tokens=10,
                                  temperature=0)
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    assert r.choices[0].text == done.text and r.choices[0].finish_reason == done.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(engine.encode("The sea is")), 10, len(engine.encode("The sea is")) + 10)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # a contiguous cache: no prefix cache
    ids = client.completions.create(model=server.model, prompt=engine.encode("The sea is"),
                                    max_tokens=10, temperature=0)
    assert ids.choices[0].text == done.text  # a prompt of token ids


def test_streamed_completion_equals_non_streamed(server, client):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_non_streamed_and_the_engine(server, client, engine):
    messages = [{"role": "user", "content": "Tell me a story."}]
    done = engine.generate(chat_text(engine, "Tell me a story."), max_new_tokens=20)[0]
    whole = client.chat.completions.create(model=server.model, messages=messages,
                                           max_tokens=20, temperature=0)
    msg = whole.choices[0].message
    assert (msg.role, msg.content, whole.object) == ("assistant", done.text, "chat.completion")
    assert whole.usage.prompt_tokens == len(engine.encode(chat_text(engine, "Tell me a story.")))
    chunks = list(client.chat.completions.create(model=server.model, messages=messages,
                                                 max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)


def test_async_client_streams_and_completes(server):
    async def main():
        client = server.async_client()
        messages = [{"role": "user", "content": "Hello there"}]
        whole = await client.chat.completions.create(model=server.model, messages=messages,
                                                     max_tokens=16, temperature=0)
        stream = await client.chat.completions.create(model=server.model, messages=messages,
                                                      max_tokens=16, temperature=0,
                                                      stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        comp = await client.completions.create(model=server.model, prompt="Hello there",
                                               max_tokens=8, temperature=0)
        await client.close()
        return whole.choices[0].message.content, text, comp.choices[0].text

    whole, streamed, comp = asyncio.run(main())
    assert whole == streamed and whole and comp


def test_16_concurrent_streams_each_equal_what_they_give_alone(server, client):
    prompts = [f"Item {i}: the {w} of the" for i, w in enumerate(
        "cat dog sky sea sun moon tree road car bird fish rain snow wind fire stone".split())]
    kw = dict(model=server.model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def main():
        aclient = server.async_client()

        async def one(p):
            stream = await aclient.completions.create(prompt=p, stream=True, **kw)
            return "".join([c.choices[0].text async for c in stream])

        out = await asyncio.gather(*(one(p) for p in prompts))
        await aclient.close()
        return out

    together = asyncio.run(main())
    assert together == alone and len(set(alone)) > 1


def test_n_choices_use_seed_plus_i(server, client):
    kw = dict(model=server.model, max_tokens=8, temperature=1.0)
    two = client.completions.create(prompt="Pick a word:", n=2, seed=41, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    second = client.completions.create(prompt="Pick a word:", seed=42, **kw)
    assert two.choices[1].text == second.choices[0].text
    assert two.usage.completion_tokens == 16
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], n=2,
                                          seed=5, **kw)
    alone = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                           seed=6, **kw)
    assert chat.choices[1].message.content == alone.choices[0].message.content
    streamed = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], n=2, seed=5, stream=True, **kw))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == i)
        assert text == chat.choices[i].message.content


def reference_logprobs(engine, prompt_ids, out_ids):
    """log-softmax of the engine's logits at each generated position: [len(out), V]."""
    logits = engine.logits(prompt_ids + out_ids)  # [P + O, V]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].double(), -1)


def test_completion_logprobs_are_the_engines_log_softmax(server, client, engine):
    prompt = "Numbers: one, two,"
    done = engine.generate(prompt, max_new_tokens=6)[0]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref = reference_logprobs(engine, engine.encode(prompt), done.token_ids)
    tok = engine.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in done.token_ids]
    for i, t in enumerate(done.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i, t]), abs=1e-4)
        top = ref[i].topk(3)
        want = {tok.decode([j]): float(v) for v, j in zip(top.values, top.indices.tolist())}
        assert lp.top_logprobs[i] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_are_the_engines_log_softmax(server, client, engine):
    text = chat_text(engine, "Count to three.")
    done = engine.generate(text, max_new_tokens=5)[0]
    r = client.chat.completions.create(model=server.model, max_tokens=5, temperature=0,
                                       messages=[{"role": "user", "content": "Count to three."}],
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    ref = reference_logprobs(engine, engine.encode(text), done.token_ids)
    assert len(content) == len(done.token_ids) == 5
    for i, (entry, t) in enumerate(zip(content, done.token_ids)):
        assert entry.token == engine.tokenizer.decode([t])
        assert entry.logprob == pytest.approx(float(ref[i, t]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        top = ref[i].topk(2)
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4)
    plain = client.chat.completions.create(model=server.model, max_tokens=5, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
    assert plain.choices[0].logprobs is None


def test_stop_strings_trim_the_text(server, client, engine):
    done = engine.generate("The sea is", max_new_tokens=10)[0]
    stop = done.text[len(done.text) // 2:][:3]
    assert stop.strip()
    r = client.completions.create(model=server.model, prompt="The sea is", max_tokens=10,
                                  temperature=0, stop=[stop])
    assert r.choices[0].text == done.text[:done.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def offline(engine, prompt: str, **params) -> str:
    """The in-process engine's text for ``prompt`` under these SamplingParams."""
    seq = engine.add_request(prompt, core.SamplingParams(**params))
    while not seq.finished:
        engine.step()
    return seq.text


OPENAI_ARGS = {"temperature", "seed", "presence_penalty", "frequency_penalty"}


def test_penalties_min_p_and_top_k_reach_the_sampler(server, client, engine):
    plain = offline(engine, "xi xi xi", max_new_tokens=16, ignore_eos=True)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 1.5},
                  {"repetition_penalty": 1.5}, {"min_p": 0.5, "temperature": 1.0, "seed": 3},
                  {"top_k": 2, "temperature": 1.0, "seed": 3}):
        want = offline(engine, "xi xi xi", max_new_tokens=16, ignore_eos=True, **extra)
        sent = dict({"temperature": 0}, **{k: v for k, v in extra.items() if k in OPENAI_ARGS})
        vllm = {k: v for k, v in extra.items() if k not in OPENAI_ARGS}  # extensions
        got = client.completions.create(model=server.model, prompt="xi xi xi", max_tokens=16,
                                        extra_body=dict(vllm, ignore_eos=True), **sent)
        assert got.choices[0].text == want, extra
        if "seed" not in extra:
            assert want != plain, extra  # the penalty changed the greedy choice


LONG = {"prompt": "Go on", "max_tokens": MAX_SEQ - 8, "temperature": 0, "ignore_eos": True}


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    aborted = server.metrics()[("infergraft_request_success_total",
                                (("finish_reason", "abort"),))]
    with httpx.stream("POST", f"{server.url}/v1/completions", json=dict(LONG, stream=True),
                      timeout=30) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(lines)
        assert server.gauge("infergraft_requests_running") == 1  # still generating
    waited = wait_until(lambda: server.gauge("infergraft_requests_running") == 0, timeout=5)
    assert waited < 2
    assert server.metrics()[("infergraft_request_success_total",
                             (("finish_reason", "abort"),))] == aborted + 1


def test_a_client_leaving_a_whole_response_frees_its_slot(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=0.5)
    assert wait_until(lambda: server.gauge("infergraft_requests_running") == 0,
                      timeout=5) < 2


def test_metrics_lists_every_name_after_requests(server, client):
    client.completions.create(model=server.model, prompt="warm", max_tokens=4, temperature=0)
    samples = server.metrics()
    names = {name for name, _ in samples}
    assert set(METRICS) <= names, set(METRICS) - names
    assert samples[("infergraft_request_success_total", (("finish_reason", "length"),))] >= 1
    assert samples[("infergraft_generation_tokens_total", ())] > 0
    assert samples[("infergraft_prompt_tokens_total", ())] > 0
    assert samples[("infergraft_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("infergraft_e2e_request_latency_seconds_count", ())] >= 1
    assert 0 <= samples[("infergraft_kv_cache_usage_ratio", ())] <= 1
    kv = {name[11:]: v for (name, _), v in samples.items() if name in METRICS[9:]}
    # a row per sequence: no blocks, nothing found in a prefix cache, nothing swapped
    assert kv["prefix_cache_queries_total"] > 0 and kv["prefix_cache_hits_total"] == 0
    assert kv["kv_blocks"] == kv["kv_blocks_free"] == kv["num_swapped_out_total"] == 0
    assert kv["num_recomputed_total"] == kv["num_preemptions_total"]
