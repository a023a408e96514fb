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

# Property tests draw the same examples on every run by default (CI runs a fresh clone,
# with no example database): a pass here is a pass there, and a failure reproduces.
# INFERGRAFT_HYPOTHESIS=explore draws new examples each run, to hunt for new failures.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("INFERGRAFT_HYPOTHESIS", "repeatable"))


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
