"""Without a GPU, Triton kernels run on the CPU interpreter: set before anything imports
triton (as infergraft's own tests/conftest.py does), so the fused decode layer's test runs
on any machine."""
import os

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
