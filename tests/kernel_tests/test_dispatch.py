"""The dispatcher: references on CPU, Triton where it can run, errors where it cannot."""
import pytest
import torch

import infergraft.kernels.dispatch as K
from infergraft.core.errors import KernelUnavailableError
from infergraft.kernels._triton import HAVE_TRITON


def test_cpu_auto_gives_torch_references():
    ops = K.get_ops("cpu")
    assert ops.backend == "torch"
    for name, module in K.OPS.items():
        ref = getattr(__import__(f"infergraft.kernels.{module}", fromlist=["_"]), f"{name}_torch")
        assert getattr(ops, name) is ref


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_cpu_triton_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = K.get_ops("cpu", "triton")
    assert ops.backend == "triton"
    assert all(getattr(ops, name).__name__ == f"{name}_triton" for name in K.OPS)


def test_cpu_triton_without_interpreter_raises(monkeypatch):
    # import every op module first: a kernel defined while the env says 0 would stay
    # compiled-only for the rest of this process (other tests run it on the CPU)
    K.get_ops("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # dispatch reads the env at call time
    with pytest.raises(KernelUnavailableError, match="triton"):
        K.get_ops("cpu", "triton")
    assert K.get_ops("cpu").backend == "torch"  # auto still falls back


def test_unknown_backend_and_op_raise():
    with pytest.raises(KernelUnavailableError, match="unknown kernel backend"):
        K.get_ops("cpu", "cutlass")
    with pytest.raises(KernelUnavailableError, match="unknown op"):
        K.get_op("layer_norm_9000", "torch")


def test_ops_namespace_runs(device, randn, poisoned_empty):
    # every op reached through get_ops agrees with its reference on the test device
    ops, ref = K.get_ops(device, "triton"), K.get_ops(device, "torch")
    x, w = randn(3, 24), randn(24)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    torch.testing.assert_close(ops.silu_mul(x), ref.silu_mul(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_picks_triton():
    assert K.get_ops("cuda").backend == "triton"
