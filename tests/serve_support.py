"""Helpers of the server tests: ``infergraft serve`` started as a real process on
127.0.0.1 with a free port, waited for on /health, and driven through the official
``openai`` client (no retries: a 503 must reach the test). One server per test module."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from cli_support import tiny_chat_model, wait_or_kill
from prometheus_client.parser import text_string_to_metric_families

from infergraft.core.testing import distributed

HOST = "127.0.0.1"


def free_port() -> int:
    return distributed.free_port(HOST)


def tiny_model(tmp_path_factory) -> Path:
    """cli_support's tiny chat model, written once per test session (per xdist worker)."""
    path = tmp_path_factory.getbasetemp() / "serve-tiny-chat"
    if not (path / "config.json").exists():
        part = tiny_chat_model(tmp_path_factory.mktemp("writing"))
        part.rename(path)  # whole or absent
    return path


class Server:
    """``python -m infergraft.core.cli serve --model MODEL --port P ARGS``, one torch thread
    (two spin against each other on a busy 2-core machine), its output kept."""

    def __init__(self, model, *args: str, env: dict | None = None, api_key: str | None = None):
        self.model, self.api_key, self.port = str(model), api_key, free_port()
        self.url = f"http://{HOST}:{self.port}"
        # a key in the caller's environment would change what the tests expect: none but
        # the one a test sets
        base = {k: v for k, v in os.environ.items() if k != "INFERGRAFT_API_KEY"}
        env = dict(base, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infergraft.core.cli", "serve", "--model", self.model,
             "--host", HOST, "--port", str(self.port), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.log = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            self.log.extend(chunk)

    def output(self) -> str:
        return self.log.decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        end = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < end, f"not ready in {timeout} s:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0,
                             api_key=kw.pop("api_key", self.api_key or "none"), **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0,
                                  api_key=kw.pop("api_key", self.api_key or "none"), **kw)

    def metrics(self) -> dict:
        """Every sample of /metrics: {(name, ((label, value), ...)): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def gauge(self, name: str) -> float:
        return self.metrics()[(name, ())]

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig``; the exit status (killed if it takes longer than ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return wait_or_kill(self.proc, timeout)
        finally:
            self._reader.join(5)


@contextmanager
def serving(model, *args: str, **kw):
    """A ready server for the ``with`` block; stopped (SIGTERM) after it."""
    server = Server(model, *args, **kw)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def wait_until(predicate, timeout: float = 10.0, every: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds; fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(every)
    return time.monotonic() - start


CHROMIUM = "/usr/bin/chromium"  # Debian's package
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def require_chromium() -> None:
    """Skip without a headless Chromium and playwright; under CI (CI set) fail instead."""
    try:
        import playwright.sync_api  # noqa: F401
        why = None if shutil.which(CHROMIUM) else "apt-get install chromium"
    except ImportError:
        why = "pip install playwright"
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the chat page tests need a headless Chromium: {why}")
    pytest.skip(f"no headless Chromium here: {why}")


@contextmanager
def chromium_page(width: int = 900, height: int = 600):
    """A page of Debian's chromium, driven by playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def screenshot(page, tmp_path: Path, name: str) -> Path:
    """Save a PNG of ``page`` (to $INFERGRAFT_SCREENSHOT_DIR when set, else ``tmp_path``)."""
    shot = Path(os.environ.get("INFERGRAFT_SCREENSHOT_DIR") or tmp_path) / name
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    return shot
