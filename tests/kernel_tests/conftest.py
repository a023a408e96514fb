"""Fixtures shared by the kernel tests: device/dtype grid, seeded inputs, poisoned outputs.

TRITON_INTERPRET is set in tests/conftest.py (it must precede the first `import triton`).
"""
import zlib

import pytest
import torch

from infergraft.kernels._triton import interpreting

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Triton on CPU tensors only runs in the interpreter, which tests/conftest.py enables
# when there is no GPU; a GPU machine skips the CPU cases unless TRITON_INTERPRET=1.
_needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU needs TRITON_INTERPRET=1")

DEVICES = {"cpu": [_needs_interpreter], "cuda": [pytest.mark.gpu, _needs_cuda]}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (cpu, bf16) is never generated: the CPU runs Triton only in the interpreter, which
# truncates float32 -> bfloat16 (numpy has no bf16) where the GPU and torch round to
# nearest even, so results differ by an ulp in ~1/3 of elements; a case that would skip
# on every machine is left out instead
NEVER = {("cpu", "bf16")}


def pytest_generate_tests(metafunc):
    """The ``device`` x ``dtype`` grid, less ``NEVER``, for every test that uses them
    (directly or through a fixture); ids as ``cpu-fp32``, or ``cpu`` without a dtype."""
    names = metafunc.fixturenames
    if "device" not in names:
        return
    if "dtype" in names:
        grid = [pytest.param(dev, dt, id=f"{dev}-{tag}", marks=marks)
                for dev, marks in DEVICES.items() for tag, dt in DTYPES.items()
                if (dev, tag) not in NEVER]
        metafunc.parametrize(("device", "dtype"), grid, indirect=True)
    else:
        metafunc.parametrize("device", [pytest.param(dev, id=dev, marks=marks)
                                        for dev, marks in DEVICES.items()], indirect=True)


@pytest.fixture
def device(request) -> str:
    return request.param


@pytest.fixture
def dtype(request, device) -> torch.dtype:
    return request.param


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id, so every parametrisation gets its own data."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def randn(gen, device):
    """randn(*shape, dtype=...) on the test's device, drawn from the test's generator."""
    def make(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    return make


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Make ``torch.empty`` NaN-filled, so an output element a kernel forgets to write
    fails the comparison instead of passing on leftover memory."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)
    yield


@pytest.fixture
def shared_counters(monkeypatch):
    """An empty shared counter pool for this test only."""
    from infergraft.kernels import paged_plan

    pool = paged_plan.CounterPool()
    monkeypatch.setattr(paged_plan, "SHARED_COUNTERS", pool)  # counters_for reads it here
    return pool
