"""Every ``INFERGRAFT_*`` kernel switch, declared once (in the spirit of vLLM's ``envs.py``).

Each switch selects the path a default replaced, so a benchmark can compare both in one
process or two. A switch is read at one of three moments, and keeps that moment:

- ``import``: a module constant takes the value once, when its kernel module is imported
  (e.g. ``linear.SWAP_TILES``); setting the variable later changes nothing in-process.
- ``build``: read each time an engine builds its ops (``dispatch.get_ops``).
- ``launch``: read on every kernel launch (``_triton.pdl_launch``).

``value(name)`` parses the environment now; ``snapshot()`` gives every switch's effective
value, for result files (an import-time switch reports the value its module took).
``docs/kernels.md`` carries the same table as ``markdown_table()``; a test holds the two
together. It needs only the standard library: it never imports Triton or torch.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

BOOL, ROWS = "bool", "rows"
AUTO = "bool or auto"  # 0, 1, or auto: a measured rule between the two paths
CHOICE = "choice"  # one of the names in ``choices`` (several paths, none a plain on / off)
READ_AT = ("import", "build", "launch")


class SwitchError(ValueError):
    """A switch set to a value it does not accept, or a name that is no switch."""


@dataclass(frozen=True)
class Switch:
    """One environment switch. ``default`` is the raw string an unset variable stands for;
    ``constant`` ("module.NAME" in this package) holds an import-time switch's value;
    ``changes_results``: the other path may give other output bits (another kernel or
    another summation order), where False means only the schedule, never the values,
    changes."""

    name: str
    kind: str
    default: str
    read_at: str
    set_to: str
    selects: str
    changes_results: bool
    constant: str | None = None
    choices: tuple[str, ...] = ()

    def parse(self, raw: str) -> bool | int | str:
        """The value of ``raw`` (the variable's text); raises ``SwitchError`` on a bad one.
        A ``BOOL`` is True or False, ``ROWS`` an int, ``AUTO`` True, False or "auto", a
        ``CHOICE`` one of its ``choices``."""
        text = raw.strip()
        if self.kind == CHOICE:
            if text not in self.choices:
                raise SwitchError(f"{self.name}={raw!r} is not one of "
                                  f"{', '.join(self.choices)} (default {self.default})")
            return text
        if self.kind == AUTO:
            if text not in ("0", "1", "auto"):
                raise SwitchError(f"{self.name}={raw!r} is not 0, 1 or auto "
                                  f"(default {self.default}; {self.selects})")
            return "auto" if text == "auto" else text == "1"
        if self.kind == BOOL:
            if text not in ("0", "1"):
                raise SwitchError(f"{self.name}={raw!r} is not 0 or 1 "
                                  f"(default {self.default}; 0 selects {self.selects})")
            return text == "1"
        if not (text.isascii() and text.isdigit()):  # no sign: rows are never negative
            raise SwitchError(f"{self.name}={raw!r} is not an integer >= 0 "
                              f"({self.set_to}; default {self.default})")
        return int(text)


def _switches(*entries: Switch) -> dict[str, Switch]:
    return {s.name: s for s in entries}


#: name -> Switch, in the order of the docs table
SWITCHES = _switches(
    Switch("INFERGRAFT_FUSE", BOOL, "1", "build", "`0`",
           "the plain decoder layer (norm kernels, weights as loaded) instead of the fused one",
           changes_results=True),
    Switch("INFERGRAFT_INT4_FUSED", BOOL, "0", "build", "`1`",
           "int4 models in the fused decode layer (`int4_fused.py`: the norm applied as x "
           "loads, the epilogues fused) instead of the plain one; off until its GPU run",
           changes_results=True),
    Switch("INFERGRAFT_FUSE_MAX_ROWS", ROWS, "32", "import", "rows",
           "up to how many rows a step takes the fused layer",
           changes_results=True, constant="fused_linear.FUSE_MAX_ROWS"),
    Switch("INFERGRAFT_FP8_SKINNY_ROWS", ROWS, "64", "import", "rows",
           "up to how many rows an e4m3 GEMM outside the fused layer streams its weight "
           "through the skinny kernel; above, W8A8 on `torch._scaled_mm`",
           changes_results=True, constant="fp8_linear.SKINNY_MAX_ROWS"),
    Switch("INFERGRAFT_QKV_ROPE_MAX_ROWS", ROWS, "32", "import", "rows (`0`: never)",
           "up to how many rows the qkv GEMM rotates and writes K/V itself",
           changes_results=True, constant="fused_linear.QKV_ROPE_MAX_ROWS"),
    Switch("INFERGRAFT_MOE_DECODE_ROWS", ROWS, "8", "import", "rows (`0`: never)",
           "up to how many rows the fused layer's mixture of experts may take "
           "`moe_decode.py`'s pair path (where the step's pairs hardly share experts) "
           "instead of the grouped kernels",
           changes_results=True, constant="moe_decode.DECODE_MAX_ROWS"),
    Switch("INFERGRAFT_GEMV", BOOL, "1", "import", "`0`",
           "one-row GEMMs on the tensor-core tiles instead of `gemv.py`'s register loop",
           changes_results=True, constant="gemv.GEMV_ON"),
    Switch("INFERGRAFT_GEMV_INT8", BOOL, "1", "import", "`0`",
           "one-row int8 GEMMs of the fused layer on the tensor-core tiles instead of "
           "`gemv.py`'s word loop (each byte widened through a float's mantissa)",
           changes_results=True, constant="gemv.GEMV_INT8"),
    Switch("INFERGRAFT_GEMV_FP8", BOOL, "0", "import", "`1`",
           "one-row e4m3 GEMMs of the fused layer through `gemv.py`'s word loop (each byte's "
           "bits moved into a float32's, times 2^120) instead of the tensor-core tiles (an "
           "arm to measure)",
           changes_results=True, constant="gemv.GEMV_FP8"),
    Switch("INFERGRAFT_QUANT_MMA", AUTO, "auto", "build", "`0` or `1`",
           "the quantised decode GEMMs' route: `auto`, int4-g128 GEMMs of 16-64 rows "
           "(`int4_linear.MMA_MIN_ROWS`) on `int4_mma.py`'s tensor-core kernel, fewer rows "
           "and e4m3 / int8 weights on the shipped paths; `1`, every int4-g128, e4m3 and int8 "
           "decode GEMM of 1-64 rows (the fused layer's over 8-bit rows too) on the MMA "
           "kernels, the weight widened by bit tricks (`int4_mma.py`, `fp8_mma.py`); `0`, "
           "the shipped paths only",
           changes_results=True),
    Switch("INFERGRAFT_SWAP", BOOL, "1", "import", "`0`",
           "unswapped tiles at 2-32 rows in the plain and fused GEMMs",
           changes_results=True, constant="linear.SWAP_TILES"),
    Switch("INFERGRAFT_ROPE_SWAP", BOOL, "1", "import", "`0`",
           "unswapped tiles in the qkv + RoPE GEMM (which then fuses up to 16 rows only)",
           changes_results=True, constant="fused_linear.ROPE_SWAP_TILES"),
    Switch("INFERGRAFT_SKINNY_MAX_M", ROWS, "16", "import", "rows",
           "up to how many rows the plain layer's qkv / gate_up (and o / down where split-K "
           "does not apply) take the skinny kernel; cuBLAS above",
           changes_results=True, constant="linear.MAX_SKINNY_M"),
    Switch("INFERGRAFT_FP8_W8A8", BOOL, "1", "launch", "`0`",
           "fp8 weights above 64 rows widened for cuBLAS instead of W8A8 (x quantised per "
           "token, `torch._scaled_mm`)",
           changes_results=True),
    Switch("INFERGRAFT_KV_LOAD_T", BOOL, "0", "launch", "`1`",
           "int8 / e4m3 K tiles of decode attention read as [D, N] and widened, instead of "
           "read as [N, D], widened and transposed (an arm to measure: 8-bit K/V decode "
           "attention runs at 30% of the copy rate)",
           changes_results=True),
    Switch("INFERGRAFT_KV8_WIDEN", CHOICE, "cvt", "launch",
           "`f16`, `words` or `words16`",
           "how decode and varlen attention widen int8 / e4m3 K/V for their dots: `cvt`, "
           "Triton's converts to q's dtype; `f16`, converts to fp16 (e4m3: one hardware "
           "convert a pair) with q in fp16 (a power of two a row); `words`, the cache read "
           "as 32-bit words widened by bit tricks to q's dtype (`fp8_mma.py`'s); `words16`, "
           "the same into fp16 with q in fp16; the three besides `cvt` plan key tiles by "
           "bytes (`kv8.py`; arms to measure)",
           changes_results=True, choices=("cvt", "f16", "words", "words16")),
    Switch("INFERGRAFT_PDL", BOOL, "1", "launch", "`0`",
           "plain launches instead of programmatic dependent launch (which needs sm90+)",
           changes_results=False),
    Switch("INFERGRAFT_PDL_LATE", BOOL, "1", "import", "`0`",
           "GEMMs release their dependents at their start instead of after their loop",
           changes_results=False, constant="linear.LATE_PDL_RELEASE"),
    Switch("INFERGRAFT_ARGMAX_SPLIT", BOOL, "1", "import", "`0`",
           "`logits_argmax` walks each row on one program",
           changes_results=False, constant="greedy.SPLIT_ON"),
    Switch("INFERGRAFT_STEP_GRAPHS", BOOL, "1", "build", "`0`",
           "mixed steps (prompt chunks beside decode tokens) run eagerly instead of "
           "replaying a CUDA graph per token bucket (`build(step_graphs=None)` only)",
           changes_results=True),
    Switch("INFERGRAFT_SCHEDULE_AHEAD", BOOL, "1", "build", "`0`",
           "the next step scheduled after this one's tokens are sampled instead of while "
           "the GPU runs it (CUDA, one process; a slot freed by a stop is refilled a step "
           "sooner)",
           changes_results=True),
    # Not a kernel path: how long a rank waits in a collective for the others
    # (core/distributed/failure.py says why 120 s); an integer, as the row counts are.
    Switch("INFERGRAFT_COLLECTIVE_TIMEOUT", ROWS, "120", "build", "seconds (`0`: torch's own)",
           "how long a rank waits in a collective across processes (`tp`, `pp`) before the "
           "step fails with `RankFailedError`, instead of torch's 30 min (gloo) / 10 min (NCCL)",
           changes_results=False),
)


def switch(name: str) -> Switch:
    """The declaration of ``name``; raises ``SwitchError`` naming the known switches."""
    try:
        return SWITCHES[name]
    except KeyError:
        raise SwitchError(f"unknown kernel switch {name!r}; known: "
                          f"{', '.join(SWITCHES)}") from None


def value(name: str) -> bool | int | str:
    """``name``'s value in the environment now (unset or empty: its default)."""
    s = switch(name)
    raw = os.environ.get(name)
    return s.parse(s.default if raw is None or raw == "" else raw)


def default(name: str) -> bool | int | str:
    """``name``'s value when the variable is unset."""
    s = switch(name)
    return s.parse(s.default)


def effective(name: str) -> bool | int | str:
    """The value the kernels use: for an import-time switch whose module is imported, its
    module constant (what it took at import, or what a test patched in); else ``value``."""
    s = switch(name)
    if s.constant:
        module, attr = s.constant.rsplit(".", 1)
        # sys.modules, not an import: importing a kernel module would import Triton
        loaded = sys.modules.get(f"{__package__}.{module}")
        if loaded is not None and hasattr(loaded, attr):
            return getattr(loaded, attr)
    return value(name)


def snapshot() -> dict[str, bool | int | str]:
    """{name: effective value} for every switch, for a result file."""
    return {name: effective(name) for name in SWITCHES}


def results_key() -> str:
    """A short hash of the switches that may change output bits, at their effective
    values: two result files with the same key computed the same thing."""
    items = sorted((n, effective(n)) for n, s in SWITCHES.items() if s.changes_results)
    return hashlib.sha256(repr(items).encode()).hexdigest()[:12]


#: the docs table's header, in column order
TABLE_HEADER = ("variable", "default", "set to", "read at", "selects", "changes results")


def table_rows() -> list[tuple[str, ...]]:
    """One row of ``docs/kernels.md``'s Switches table per switch, cells as written there."""
    return [(f"`{s.name}`", f"`{s.default}`", s.set_to, s.read_at, s.selects,
             "yes" if s.changes_results else "no") for s in SWITCHES.values()]


def markdown_table() -> str:
    """The Switches table of ``docs/kernels.md``, to paste there after editing a switch."""
    rows = [TABLE_HEADER, ("---",) * len(TABLE_HEADER), *table_rows()]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)
