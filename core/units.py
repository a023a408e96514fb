"""Byte sizes: for humans and from humans (``80GiB``, ``512MiB``), and the few sizes every
layer shares (an element, one token's K/V), so that contracts need not import the planner."""
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def rows_table(rows: list[tuple[str, str]]) -> str:
    """(label, value) rows as the plans print them: labels padded to one column."""
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_decimal_bytes(n: float) -> str:
    """``n`` bytes in powers of 1000 (kB, MB, GB), as sizes are often quoted: 2^30 bytes
    is "1.07 GB" where ``fmt_bytes`` says 1.00 GiB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def both_units(n: float) -> str:
    """"1.00 GiB = 1.07 GB": a size in both conventions, for figures quoted either way."""
    return f"{fmt_bytes(n)} = {fmt_decimal_bytes(n)}"


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MiB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class KVSizes:
    """K/V totals derived from ``kv_bytes_per_token``, ``max_seq_len``, ``max_batch_size``
    (shared by the build's Plan and the weight-free MemoryPlan)."""

    @property
    def kv_bytes_per_sequence(self) -> int:
        return self.kv_bytes_per_token * self.max_seq_len

    @property
    def kv_bytes_total(self) -> int:
        return self.kv_bytes_per_sequence * self.max_batch_size


def activations_label(step_tokens: int | None) -> str:
    """The name both plans print for the activations' row: which step they were sized for."""
    return f"activations (a {step_tokens}-token step)" if step_tokens else "activations"


def element_bytes(dtype) -> int:
    """Bytes of one element of a torch dtype."""
    return dtype.itemsize


def kv_bytes_per_token(spec, dtype, kv_quantizer=None) -> int:
    """K and V bytes of one token across all layers (scales included when quantised):
    2 x layers x kv_heads x head_dim x element bytes."""
    if kv_quantizer is not None:
        return kv_quantizer.kv_bytes_per_token(spec)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element_bytes(dtype)
