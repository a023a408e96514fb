"""What the ``infergraft`` command prints about itself, and how it ends when nobody reads
it: ``--help`` written for a user, ``--version``, the weight-loading bar, and a reader gone
(``| head -1``) ending every command with 141 and no traceback."""
import importlib.metadata
import os
import subprocess
import sys

import pytest

from infergraft.core import cli
from cli_support import tiny_chat_model, wait_or_kill

QUIET = dict(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


def no_trace(err: str) -> bool:
    """stderr without a traceback, nor Python's note of a flush that failed at exit."""
    return not any(s in err for s in ("Traceback", "Exception ignored", "BrokenPipeError"))


def test_help_tells_a_user_what_it_is_its_commands_and_an_example(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "infergraft runs LLMs" in out and "examples:" in out
    assert 'infergraft generate "' in out and "smollm2-135m" in out
    for command in ("generate", "chat", "plugins", "bench", "plan", "quantize", "serve"):
        assert f"\n    {command} " in out, command  # each listed with what it does
    assert "``" not in out and "core/tools" not in out  # not the module's docstring


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"infergraft {importlib.metadata.version('infergraft')}\n"


def run_unread(argv: list[str], buffered: bool = False) -> tuple[int, str]:
    """``infergraft ARGV | true``: stdout a pipe whose reader is gone before the command
    writes anything (the status, stderr). ``buffered``: Python's own buffer on the pipe,
    so that the write fails at the last flush, not at a print."""
    env = dict(os.environ, **QUIET)
    if buffered:
        env.pop("PYTHONUNBUFFERED")
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.Popen([sys.executable, "-m", "infergraft.core.cli", *argv], stdout=write,
                            stderr=subprocess.PIPE, env=env)
    os.close(write)
    err = proc.communicate(timeout=120)[1].decode()
    return proc.returncode, err


@pytest.mark.parametrize("argv, buffered", [(["plugins", "--json"], False),
                                            (["plugins"], True), (["--help"], True)])
def test_a_reader_gone_before_the_output_exits_141_quietly(argv, buffered):
    rc, err = run_unread(argv, buffered)
    assert rc == cli.READER_GONE == 141 and no_trace(err), err


def test_plan_json_to_a_reader_gone_exits_141_quietly(model_dir):
    rc, err = run_unread(["plan", model_dir, "--json"])
    assert rc == 141 and no_trace(err), err


def test_a_reader_gone_while_generate_streams_ends_it_quietly(model_dir):
    """``generate --stream | head -c 1``: the reader closes after the first bytes of a
    long answer; the next write fails and the command ends with 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "infergraft.core.cli", "generate", "hello there", "--model",
         model_dir, "--max-seq-len", "4096", "--max-new-tokens", "4000", "--stream"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, **QUIET))
    try:
        assert proc.stdout.read(1)  # the answer has begun
    finally:
        proc.stdout.close()
    rc = wait_or_kill(proc, 120)  # 4000 tokens would take minutes: it stops at once
    err = proc.stderr.read().decode()
    assert rc == 141 and no_trace(err), err


def test_the_loading_bar_counts_tensors_in_words(capsys, model_dir):
    argv = ["generate", "hi", "--model", model_dir, "--max-seq-len", "64",
            "--max-new-tokens", "1"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "loading weights: 0 tensors [" in err and "tensors/s" in err, err
    assert "0tensor" not in err
