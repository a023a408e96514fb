"""The kernels' micro-benchmarks (CUDA), the figures their launch plans and thresholds rest
on: ``python -m infergraft.core.tools.kernel_bench.gemms`` (``.attention``, ``.varlen``,
``.read``, ``.int4``, ``.moe``); docs/kernels.md says what each measures."""
