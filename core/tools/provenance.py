"""What a benchmark result was measured with, so that two result files can be told apart:
the commit, every kernel switch's value, and the versions of what ran."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def commit() -> str:
    """``git describe --always --dirty`` of the checkout this package runs from; a copy
    without ``.git`` (a tree shipped to a GPU machine, say) records ``$INFERGRAFT_COMMIT``
    when its sender set it, else the installed version (``infergraft 0.1.0``)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    sent = os.environ.get("INFERGRAFT_COMMIT", "").strip()
    return f"{sent} (INFERGRAFT_COMMIT)" if sent else f"infergraft {_version('infergraft')}"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def provenance() -> dict:
    """{commit, switches, versions, python, machine} for a result file."""
    from infergraft.kernels import switches

    return {
        "commit": commit(),
        "switches": switches.snapshot(),
        "versions": {d: _version(d) for d in ("torch", "triton", "transformers", "infergraft")},
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
