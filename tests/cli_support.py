"""Helpers of the CLI tests: a tiny random chat model (SmolLM2's tokenizer and chat
template over a two-layer random Llama, milliseconds a token on the CPU) and the real
``infergraft`` command run as a process, to be interrupted as a user would."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import safetensors.torch

from infergraft.core.loading.demo import ensure_demo_model
from infergraft.core.testing.models import random_model, tiny_llama_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_chat_model(path: Path, seed: int = 0) -> Path:
    """Write the model into ``path`` (config, weights, tokenizer) and return it."""
    demo = Path(ensure_demo_model("smollm2-135m", quiet=True))  # cached: its tokenizer only
    hf = random_model(tiny_llama_config(vocab_size=49152, tie_word_embeddings=True,
                                        max_position_embeddings=4096, pad_token_id=2),
                      seed=seed, scale=5.0)
    hf.config.save_pretrained(path)
    safetensors.torch.save_model(hf, str(path / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, path / name)
    return path


def wait_or_kill(proc, timeout: float) -> int:
    """``proc``'s exit status once it exits; killed if it takes longer than ``timeout``."""
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode


class Cli:
    """``python -m infergraft.core.cli ARGS`` with its output read as it comes. One torch
    thread: on a busy 2-core machine two threads spin against each other (10x slower)."""

    def __init__(self, *args: str, stdin=subprocess.DEVNULL):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "infergraft.core.cli", *args],
                                     stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.out, self.err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                         for f, buf in ((self.proc.stdout, self.out),
                                        (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(f, buf: bytearray) -> None:
        while chunk := f.read1(4096):
            buf.extend(chunk)

    def wait_for(self, ready, timeout: float = 60.0) -> None:
        """Until ``ready(stdout, stderr)`` (decoded so far) holds; fails if it exits first."""
        end = time.monotonic() + timeout
        while not ready(self.out.decode(errors="replace"), self.err.decode(errors="replace")):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.err.decode()}"
            assert time.monotonic() < end, f"timed out; stderr: {self.err.decode()}"
            time.sleep(0.01)

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self, timeout: float = 60.0) -> tuple[int, str, str]:
        """(returncode, stdout, stderr) once it exits; killed if it takes too long."""
        wait_or_kill(self.proc, timeout)
        for t in self._readers:
            t.join(5)
        return self.proc.returncode, self.out.decode(errors="replace"), self.err.decode(
            errors="replace")


def assert_flag_refused(call, argv, flag, says, capsys, out_dir) -> None:
    """``call(argv)`` exits 2 (returned or argparse's SystemExit) with a last stderr line
    naming ``flag`` and saying ``says``, and writes nothing to ``out_dir``."""
    try:
        rc = call(argv)
    except SystemExit as e:  # argparse's usage error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # one line: what, and what works
    assert flag in err and says in err, err
    assert not out_dir.exists()
