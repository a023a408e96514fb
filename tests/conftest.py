"""Test-wide setup. Keep the TRITON_INTERPRET line first, before anything imports triton:
triton decorates its own ``tl`` helpers (``tl.sum``, ``tl.sigmoid``, ...) with ``@jit`` when
it is imported, and kernels when they are defined, and each reads TRITON_INTERPRET then.
Set too late, CPU runs fail with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
import os

import pytest
import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    # no GPU: run Triton kernels on the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# the interpreter patches triton.language once a launch, not at every helper call
# (tests/interpreter_support.py); INFERGRAFT_PLAIN_INTERPRETER=1 runs Triton's as it is
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_support  # noqa: E402

    interpreter_support.install()

# xdist's workers share the cores: each takes its share of torch's threads, and so do the
# Pythons it starts (torch's default, a thread per core in every worker, has the threads
# of two workers spin against each other on a two-core machine).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

# Property tests draw the same examples on every run by default (CI runs a fresh clone,
# with no example database): a pass here is a pass there, and a failure reproduces.
# INFERGRAFT_HYPOTHESIS=explore draws new examples each run, to hunt for new failures.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("INFERGRAFT_HYPOTHESIS", "repeatable"))


def pytest_collection_modifyitems(items):
    """The ``slow`` tests first (each takes a minute or more): xdist's workers start on
    them together and the short tests fill in around them, instead of one worker running
    a late long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def sampling_fails_at_seed_666(monkeypatch):
    """The sampler raises, as NaN logits make it, in any step that samples a request
    seeded 666; the other steps sample as usual."""
    from infergraft.core.runner import sampler as sampler_module

    real = sampler_module.sample

    def failing(logits, seqs):
        if any(s.params.seed == 666 for s in seqs):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, seqs)

    monkeypatch.setattr(sampler_module, "sample", failing)


# tiny float32 models the prefix-caching and swap tests share (greedy tokens against HF)
@pytest.fixture(scope="module")
def llama():  # GQA: 4 query heads, 2 K/V heads
    from infergraft.core.testing.models import random_model, tiny_llama_config
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


@pytest.fixture(scope="module")
def mistral():  # a window of 8 tokens, two blocks
    from infergraft.core.testing.models import random_model, tiny_mistral_config
    return random_model(tiny_mistral_config(sliding_window=8), seed=6, scale=5.0)
