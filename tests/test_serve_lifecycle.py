"""``infergraft serve`` as an operator runs it: the key from INFERGRAFT_API_KEY, refused
options, and SIGTERM: the running stream finishes, the process exits 0."""
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from serve_support import Server, tiny_model

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.testing.models import random_model, tiny_llama_config

KEY = "from-the-environment"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tiny_model(tmp_path_factory), "--max-seq-len", "256",
               env={"INFERGRAFT_API_KEY": KEY}, api_key=KEY)
    try:
        yield s.wait_ready()
    finally:
        s.stop(signal.SIGKILL)  # the last test stops it; this is only for a failure


def test_the_environment_key_is_required(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="guess").completions.create(model=server.model, prompt="x",
                                                          max_tokens=1)
    assert e.value.status_code == 401
    r = server.client().completions.create(model=server.model, prompt="x", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_bad_options_exit_2_before_loading_the_model(capsys):
    for args, says in ((["--port", "70000"], "--port"), (["--max-waiting", "0"], "--max-waiting"),
                       (["--max-batch-size", "0"], "--max-batch-size")):
        assert main(["serve", "--model", "/nonexistent", *args]) == 2
        assert says in capsys.readouterr().err


def test_a_bad_max_request_bytes_exits_2_naming_it(capsys):
    for size, says in (("0", "at least 1 byte"), ("lots", "cannot read 'lots' as a size")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", "/nonexistent", "--max-request-bytes", size])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--max-request-bytes" in err and says in err, err


def test_the_help_says_how_max_seq_len_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    rule = re.search(r"--max-seq-len .*?\(default: the model's max_position_embeddings, at "
                     r"most (\d+)\)", said)
    assert rule, said
    cap = int(rule.group(1))
    for positions in (cap // 2, cap * 2):  # the model's own, then the cap
        hf = random_model(tiny_llama_config(max_position_embeddings=positions))
        assert core.build(hf, max_batch_size=1).plan.max_seq_len == min(positions, cap)


def test_sigterm_lets_the_running_stream_finish_then_exits_0(server):
    client, got = server.client(), {}
    started = threading.Event()

    def stream():
        chunks = client.completions.create(model=server.model, prompt="Go", max_tokens=200,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for c in chunks:
            started.set()
            if c.choices and c.choices[0].finish_reason:
                got["finish"] = c.choices[0].finish_reason
            if c.usage:
                got["tokens"] = c.usage.completion_tokens

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert got == {"finish": "length", "tokens": 200}  # drained, not cut
    assert server.proc.wait(60) == 0, server.output()
    log = server.output()
    assert "Traceback" not in log and "Shutting down" in log, log
    assert time.monotonic() - t0 < 30
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
