"""Test-wide setup. Keep the TRITON_INTERPRET line first, before anything imports triton:
triton decorates its own ``tl`` helpers (``tl.sum``, ``tl.sigmoid``, ...) with ``@jit`` when
it is imported, and kernels when they are defined, and each reads TRITON_INTERPRET then.
Set too late, CPU runs fail with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    # no GPU: run Triton kernels on the CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
