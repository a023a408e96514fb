"""What a decode bench run tells besides its table: the TPOT plot, and a warning where the
repeated runs of one measurement disagree (the host was busy; the speed-ups beside them are
then not to be trusted)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

# Repeated runs of one measurement further apart than this (the slowest run's TPOT over the
# fastest's, less one): something else had the host, and a speed-up is not to be trusted.
UNSTEADY = 0.10


def disagreement(values) -> float:
    """The largest of ``values`` over the smallest, less one (0.25: 25% apart); 0.0 for
    fewer than two."""
    return max(values) / min(values) - 1 if len(values) > 1 else 0.0


def unsteady_warning(results) -> Optional[str]:
    """A warning naming each result whose repeated runs disagree by more than UNSTEADY (the
    host was busy: the speed-ups beside them are unreliable); None when all agree."""
    busy = [r for r in results if r.runs_disagree > UNSTEADY]
    if not busy:
        return None
    rows = "; ".join(f"{r.system} batch {r.batch}: {r.runs_disagree:.0%}" for r in busy)
    return (f"warning: repeated runs of the same measurement disagree by more than "
            f"{UNSTEADY:.0%} ({rows}): the host was busy, so the speed-ups are unreliable; "
            f"rerun on an idle machine")


def plot(results, path: Path, title: str) -> bool:
    """TPOT against batch, a line per system and the first system's roofline, as a PNG at
    ``path``; False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r.system for r in results}):
        rs = sorted((r for r in results if r.system == system), key=lambda r: r.batch)
        ax.plot([r.batch for r in rs], [r.tpot_ms for r in rs], marker="o", label=system)
    rs = sorted((r for r in results if r.system == results[0].system), key=lambda r: r.batch)
    ax.plot([r.batch for r in rs], [r.roofline_ms for r in rs], "k--", label="HBM roofline")
    ax.set(xscale="log", xlabel="batch size", ylabel="TPOT (ms)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
