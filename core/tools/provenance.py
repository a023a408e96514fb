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
    """What code ran: ``$INFERGRAFT_COMMIT`` when whoever launched the run set it (a tree
    copied to a GPU machine may carry a stale ``.git``, or none), else ``git describe
    --always --dirty`` of the checkout this package runs from, else the installed version
    (``infergraft 0.1.0``)."""
    sent = os.environ.get("INFERGRAFT_COMMIT", "").strip()
    if sent:
        return f"{sent} (INFERGRAFT_COMMIT)"
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return f"infergraft {_version('infergraft')}"


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
