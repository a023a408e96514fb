"""torch's intra-op threads for an engine on the CPU, chosen at ``build``.

One thread for each core this process may run on (its CPU affinity, and its cgroup's CPU
quota, which torch's own default ignores), shared among the ranks torchrun starts on this
host, less the engine's other busy threads: an ``AsyncEngine`` steps on a thread beside
the server's event loop, which takes a core of its own. Never more than torch had when
infergraft was imported (torch's default counts physical cores, not hyperthreads).

Why: OpenMP's threads spin at the end of every parallel op until all have finished. A
pool with more threads than the cores left to it waits, op after op, for a thread the
kernel has descheduled; the step time then grows many times over.

The user's choice stands: with ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the
environment, or ``torch.set_num_threads`` called since infergraft was imported (any count
other than the one chosen here last), nothing is changed.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
EXPLICIT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_at_import = torch.get_num_threads()  # torch's default, or what the user set before import
_chosen: int | None = None  # what use_cores set last


def affinity_cores() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; else all of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _quota(directory: Path) -> float | None:
    """The CPU quota set in one cgroup directory, in cores (v2 ``cpu.max``: "QUOTA PERIOD"
    or "max PERIOD"; v1 ``cpu.cfs_quota_us``, -1 for none, over ``cpu.cfs_period_us``)."""
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (directory / "cpu.cfs_quota_us").is_file():
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota < 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's CPU cgroup directory and those above it, up to ``root``: v2's one
    hierarchy ("0::/path") or v1's cpu controller ("N:cpu,cpuacct:/path"). A path not
    under ``root`` (another cgroup namespace's) leaves ``root``'s own files."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    starts = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        names = controllers.split(",")
        if controllers == "":  # v2
            starts.append(root / path.lstrip("/"))
        elif "cpu" in names:  # v1, mounted under the joined names or "cpu"
            starts += [root / controllers / path.lstrip("/"), root / "cpu" / path.lstrip("/")]
    dirs = []
    for start in starts or [root, root / "cpu"]:
        d = start
        while True:
            dirs.append(d)
            if d == root or root not in d.parents:
                break
            d = d.parent
    return list(dict.fromkeys(dirs))


def cgroup_cores(root: str | Path = CGROUP_ROOT,
                 proc_cgroup: str | Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in cores (the smallest set along its path),
    or None where none is set."""
    quotas = [q for d in _cgroup_dirs(Path(root), Path(proc_cgroup)) if (q := _quota(d))]
    return min(quotas) if quotas else None


def available_cores() -> int:
    """Cores this process may use: its affinity, cut to its cgroup quota (rounded down:
    threads beyond the quota get throttled mid-op), at least 1."""
    cores = affinity_cores()
    quota = cgroup_cores()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota + 1e-9)))
    return max(1, cores)


def ranks_on_this_host() -> int:
    """Processes torchrun started on this host (``LOCAL_WORLD_SIZE``), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def choose_threads(cores: int, busy_threads: int = 1, ranks: int = 1) -> int:
    """Intra-op threads for an engine stepped by one thread (itself one of the pool)
    beside ``busy_threads - 1`` other busy threads of its process, with ``ranks``
    processes sharing ``cores``: at least 1."""
    return max(1, cores // max(1, ranks) - (busy_threads - 1))


def user_choice() -> str | None:
    """How the user set torch's threads (an environment variable, or
    ``torch.set_num_threads`` since import), or None where nobody did."""
    for name in EXPLICIT_VARIABLES:
        if os.environ.get(name, "").strip():
            return name
    if torch.get_num_threads() != (_at_import if _chosen is None else _chosen):
        return "torch.set_num_threads"
    return None


def use_cores(device, busy_threads: int = 1) -> int:
    """Set torch's intra-op threads for an engine on ``device`` (on the CPU, unless the
    user chose: ``user_choice``); ``busy_threads``: this process's busy threads, the one
    stepping the engine included. Returns torch's thread count."""
    global _chosen
    if torch.device(device).type != "cpu" or user_choice() is not None:
        return torch.get_num_threads()
    n = min(_at_import, choose_threads(available_cores(), busy_threads, ranks_on_this_host()))
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    _chosen = n
    return n
