"""The old path of the kernels' micro-benchmarks, which moved to
``infergraft.core.tools.kernel_bench`` (``python -m infergraft.core.tools.kernel_bench.gemms``).
Kept for one release: ``python -m infergraft.kernels.bench.gemms`` still runs, warned, through
core/_moved.py's aliases, which importing the core installs. It goes in the next release."""
import infergraft.core  # noqa: F401
