"""bench_profile's kernel table (CUDA only to run for real): a kernel launched k times
per layer is reported per launch slot, in launch order; others are summed by name."""
import types

import torch

from infergraft.core.tools import bench_profile


class _Event:
    def __init__(self, name, start, us):
        self.name, self.device_time = name, us
        self.time_range = types.SimpleNamespace(start=start)
        self.device_type = types.SimpleNamespace(name="CUDA")


def _profile_of(events):
    class Profile:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return list(reversed(events))  # the table must not rely on the profiler's order
    return Profile


def test_gemms_are_split_by_their_slot_in_each_layer(monkeypatch):
    layer = [("gemm", 10), ("attn", 5), ("gemm", 20), ("gemm", 30), ("gemm", 40)]
    events = [_Event(n, i * 5 + j, us) for i in range(3) for j, (n, us) in enumerate(layer)]
    monkeypatch.setattr(torch.profiler, "profile", _profile_of(events))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    table = bench_profile.profiled(lambda: None, layers=3)
    rows = {line.split("  ")[-1]: line for line in table.splitlines()[1:]}
    assert set(rows) == {"gemm #0", "gemm #1", "gemm #2", "gemm #3", "attn"}
    assert "0.030 ms" in rows["gemm #0"] and "0.120 ms" in rows["gemm #3"]
    assert "x   3" in rows["attn"] and "over 15 kernels" in table
    # a launch count that is not a multiple of the layers: one row
    extra = events + [_Event("gemm", 99, 7)]
    monkeypatch.setattr(torch.profiler, "profile", _profile_of(extra))
    table = bench_profile.profiled(lambda: None, layers=3)
    assert "x  13  gemm" in table and "#" not in table
