"""Kernel micro-benchmarks (CUDA): ``python -m infergraft.kernels.bench.gemms``, ``.attention``, ``.read``, ``.int4``."""
