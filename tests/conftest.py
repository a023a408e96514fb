"""Test-wide setup. Keep the TRITON_INTERPRET line first: ``triton.jit`` reads it when a
kernel is *defined*, i.e. when ``infergraft.kernels.<op>`` is imported, so it must be set
before any test module (or infergraft itself) is imported."""
import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    # no GPU: run Triton kernels on the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
