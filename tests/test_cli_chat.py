"""``infergraft chat``: sampling options reach every reply, a conversation that outgrows
max_seq_len loses its oldest turns and goes on, Ctrl-C stops a reply but not the chat,
line editing where there is a terminal."""
import io
import re
import subprocess
import sys

import pytest
import torch

from infergraft.core import cli
from infergraft.core.engine import Engine
from infergraft.core.tools import chat
from cli_support import Cli, tiny_chat_model

SYSTEM = "Answer in one word."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine two threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def replies(monkeypatch):
    """Every engine.stream call of the test: (engine, prompt ids, sampling kwargs)."""
    calls, real = [], Engine.stream

    def spy(self, prompt, **kw):
        calls.append((self, prompt, kw))
        return real(self, prompt, **kw)

    monkeypatch.setattr(Engine, "stream", spy)
    return calls


def run_chat(monkeypatch, capsys, model_dir, lines, *options):
    """``infergraft chat`` in this process, reading ``lines`` (an exception is raised
    where one stands), then EOF; returns (exit code, stdout, stderr)."""
    script = iter(lines)

    def read_line(prompt):
        line = next(script, EOFError)
        if isinstance(line, type) and issubclass(line, BaseException):
            raise line
        return line

    monkeypatch.setattr("builtins.input", read_line)
    rc = cli.main(["chat", "--model", model_dir, *options])
    out, err = capsys.readouterr()
    return rc, out, err


def text_of(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=False)


def test_seed_top_k_top_p_and_temperature_reach_every_reply(monkeypatch, capsys, model_dir,
                                                            replies):
    opts = ("--max-new-tokens", "6", "--temperature", "1.0", "--top-k", "50", "--top-p",
            "0.9", "--max-seq-len", "256")
    lines = ["hello", "tell me more"]
    first = run_chat(monkeypatch, capsys, model_dir, lines, *opts, "--seed", "7")
    again = run_chat(monkeypatch, capsys, model_dir, lines, *opts, "--seed", "7")
    other = run_chat(monkeypatch, capsys, model_dir, lines, *opts, "--seed", "8")
    assert first[0] == again[0] == other[0] == 0
    assert first[1] == again[1] != other[1]  # reproducible, and the seed is what changes it
    assert [kw for _, _, kw in replies[:2]] == [
        dict(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, seed=s) for s in (7, 8)]


def test_an_outgrown_history_drops_its_oldest_turns_and_keeps_the_system_message(
        monkeypatch, capsys, model_dir, replies):
    lines = ["tell me about the sea and its waves"] * 6
    rc, out, err = run_chat(monkeypatch, capsys, model_dir, lines, "--max-seq-len", "96",
                            "--max-new-tokens", "8", "--system", SYSTEM)
    assert rc == 0 and len(replies) == 6  # every line got its reply
    assert "oldest turn" in err and "the conversation outgrew max_seq_len=96" in err
    engine = replies[0][0]
    for _, ids, kw in replies:
        assert len(ids) + kw["max_new_tokens"] <= engine.plan.max_seq_len
        assert text_of(engine, ids).startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")
        assert text_of(engine, ids).count("<|im_start|>user") >= 1
    assert text_of(engine, replies[-1][1]).count("<|im_start|>user") < 6  # some went


def test_a_message_too_long_even_alone_is_refused_and_the_chat_goes_on(
        monkeypatch, capsys, model_dir, replies):
    rc, out, err = run_chat(monkeypatch, capsys, model_dir, ["word " * 100, "hi"],
                            "--max-seq-len", "96", "--max-new-tokens", "8")
    assert rc == 0 and "does not fit max_seq_len=96 even alone" in err
    assert len(replies) == 1 and "word" not in text_of(replies[0][0], replies[0][1])


@pytest.mark.parametrize("at_step", [3, 1])
def test_ctrl_c_during_a_reply_stops_it_and_the_chat_goes_on(monkeypatch, capsys, model_dir,
                                                             replies, at_step):
    steps, real = [], Engine.step

    def step(self):  # Ctrl-C lands in the engine, as it mostly does
        steps.append(1)
        if len(steps) == at_step:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    rc, out, err = run_chat(monkeypatch, capsys, model_dir, ["hello", "and then?"],
                            "--max-seq-len", "256", "--max-new-tokens", "6")
    assert rc == 0 and "Traceback" not in err and len(replies) == 2
    engine, second = replies[1][0], text_of(replies[1][0], replies[1][1])
    assert not engine.has_unfinished()  # the interrupted request was freed
    kept = re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", second, flags=re.S)
    if at_step == 3:  # two tokens came: they stay as the assistant's turn
        assert "what it said so far stays" in err
        assert len(kept) == 1 and kept[0] and out.startswith(kept[0] + "\n")
    else:  # nothing came: the question goes too
        assert "your message is dropped too" in err and out.startswith("\n")
        assert kept == [] and "hello" not in second


@pytest.mark.parametrize("end, status", [(KeyboardInterrupt, 130), (EOFError, 0), ("", 0)])
def test_ctrl_c_ctrl_d_or_an_empty_line_at_the_prompt_ends_quietly(monkeypatch, capsys,
                                                                    model_dir, end, status):
    rc, out, err = run_chat(monkeypatch, capsys, model_dir, [end], "--max-seq-len", "64",
                            "--max-new-tokens", "8")
    assert rc == status and "Traceback" not in err and "interrupted" not in err


def test_ctrl_c_at_the_prompt_exits_130(model_dir):
    """A real SIGINT while the chat waits for a line: 130, as Ctrl-C in every command."""
    run = Cli("chat", "--model", model_dir, "--max-seq-len", "64", "--max-new-tokens", "8",
              stdin=subprocess.PIPE)
    run.wait_for(lambda out, err: out.endswith("> "))  # waiting at the prompt
    run.interrupt()
    rc, out, err = run.finish()
    assert rc == 130 and "Traceback" not in err, err
    assert out == "> \n"  # the shell's prompt starts on a line of its own


def test_max_new_tokens_leaving_no_room_is_refused(monkeypatch, capsys, model_dir):
    rc, out, err = run_chat(monkeypatch, capsys, model_dir, ["hi"], "--max-seq-len", "64")
    assert rc == 2 and "--max-new-tokens 128 leaves no room" in err


def test_line_editing_on_a_terminal_only(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Tty())
    assert chat.enable_line_editing() and "readline" in sys.modules
    monkeypatch.setitem(sys.modules, "readline", None)  # as on Windows: no readline
    assert chat.enable_line_editing() is False
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert chat.enable_line_editing() is False  # a piped stdin needs none


def test_piped_chat_survives_ctrl_c_during_a_reply(model_dir):
    run = Cli("chat", "--model", model_dir, "--max-seq-len", "4096", "--max-new-tokens",
              "4000", stdin=subprocess.PIPE)
    run.proc.stdin.write(b"hello there\n")
    run.proc.stdin.flush()
    run.wait_for(lambda out, err: len(out) > len("> "))  # the reply has begun
    run.interrupt()
    run.wait_for(lambda out, err: "reply interrupted" in err)
    run.proc.stdin.close()  # then Ctrl-D
    rc, out, err = run.finish()
    assert rc == 0 and "Traceback" not in err, err
    assert out.startswith("> ") and out.endswith("\n> \n")  # back at the prompt, then EOF
