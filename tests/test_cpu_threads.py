"""torch's threads on the CPU (core/cpu_threads.py): the cores a process may use from its
affinity and its cgroup's CPU quota (v2 and v1 files faked under a temporary root), the
engine's own busy threads and the ranks on the host taken off, and the user's choice
(``OMP_NUM_THREADS``, ``torch.set_num_threads``) left as it is; ``build`` and
``AsyncEngine`` set them."""
import pytest
import torch

from infergraft import core
from infergraft.core import cpu_threads
from infergraft.core.serving.async_engine import AsyncEngine
from infergraft.core.testing.models import random_model, tiny_llama_config


def _cgroups(tmp_path, membership: str, files: dict[str, str]):
    """A fake cgroup root holding ``files`` (path -> content), and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(membership)
    return root, proc


@pytest.mark.parametrize("membership,files,cores", [
    # v2: "QUOTA PERIOD" in cores, "max" for none
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # the smallest quota along the path, from this process's cgroup up
    ("0::/a/b\n", {"a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000"}, 2.0),
    ("0::/a/b\n", {"a/cpu.max": "400000 100000", "a/b/cpu.max": "50000 100000"}, 0.5),
    # a path from another cgroup namespace: the root's own files
    ("0::/elsewhere/c1\n", {"cpu.max": "300000 100000"}, 3.0),
    # v1: cfs_quota_us over cfs_period_us, -1 for none, under the cpu controller's mount
    ("5:memory:/x\n4:cpu,cpuacct:/docker/c1\n",
     {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "300000",
      "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000"}, 3.0),
    ("4:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    # nothing readable: no quota
    ("", {}, None),
    ("0::/\n", {"cpu.max": "garbage"}, None),
])
def test_cgroup_quota_in_cores(tmp_path, membership, files, cores):
    root, proc = _cgroups(tmp_path, membership, files)
    assert cpu_threads.cgroup_cores(root, proc) == cores


@pytest.mark.parametrize("affinity,quota,want", [
    (8, None, 8), (8, 2.0, 2), (8, 1.5, 1), (8, 0.25, 1), (2, 4.0, 2), (1, None, 1)])
def test_available_cores_are_the_affinity_cut_to_the_quota(monkeypatch, affinity, quota, want):
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(cpu_threads, "cgroup_cores", lambda: quota)
    assert cpu_threads.available_cores() == want


def test_the_engine_threads_and_the_ranks_on_the_host_take_their_share():
    assert cpu_threads.choose_threads(8) == 8
    assert cpu_threads.choose_threads(8, busy_threads=2) == 7  # a server's event loop
    assert cpu_threads.choose_threads(2, busy_threads=2) == 1
    assert cpu_threads.choose_threads(1, busy_threads=2) == 1
    assert cpu_threads.choose_threads(8, ranks=2) == 4
    assert cpu_threads.choose_threads(8, busy_threads=2, ranks=3) == 1


@pytest.fixture
def threads(monkeypatch):
    """torch's threads as they were after, nobody's choice on record, no OMP_NUM_THREADS
    (the test plugin sets it under xdist), and a machine of ``cores`` cores."""
    before = torch.get_num_threads()
    for name in cpu_threads.EXPLICIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(cpu_threads, "_at_import", 8)  # torch's default on an 8-core host
    monkeypatch.setattr(cpu_threads, "_chosen", None)
    torch.set_num_threads(8)

    def machine(cores: int):
        monkeypatch.setattr(cpu_threads, "available_cores", lambda: cores)
    yield machine
    torch.set_num_threads(before)


def test_the_count_is_set_on_the_cpu_only(threads):
    threads(3)
    assert cpu_threads.use_cores("cuda") == 8 == torch.get_num_threads()
    assert cpu_threads.use_cores("cpu") == 3 == torch.get_num_threads()
    threads(16)  # never above torch's own count at import (physical cores)
    assert cpu_threads.use_cores("cpu") == 8 == torch.get_num_threads()


def test_ranks_on_the_host_share_the_cores(threads, monkeypatch):
    threads(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_threads.use_cores("cpu") == 2


@pytest.mark.parametrize("name", cpu_threads.EXPLICIT_VARIABLES)
def test_an_explicit_environment_variable_is_respected(threads, monkeypatch, name):
    threads(2)
    monkeypatch.setenv(name, "6")
    torch.set_num_threads(6)
    assert cpu_threads.user_choice() == name
    assert cpu_threads.use_cores("cpu") == 6 == torch.get_num_threads()


def test_torch_set_num_threads_is_respected(threads):
    threads(2)
    assert cpu_threads.use_cores("cpu") == 2
    torch.set_num_threads(5)  # the user's, after a build
    assert cpu_threads.user_choice() == "torch.set_num_threads"
    assert cpu_threads.use_cores("cpu") == 5 == torch.get_num_threads()


def test_build_and_the_async_engine_set_the_threads(threads):
    """``build`` on the CPU takes the cores left to the process; an AsyncEngine leaves one
    of them to the callers' event loop."""
    threads(4)
    hf = random_model(tiny_llama_config(), seed=0)
    engine = core.build(hf, device="cpu", max_seq_len=32, max_batch_size=2)
    assert torch.get_num_threads() == 4
    AsyncEngine(engine)  # not started: the thread count is set as it is made
    assert torch.get_num_threads() == 3
    threads(1)
    core.build(hf, device="cpu", max_seq_len=32, max_batch_size=2)
    assert torch.get_num_threads() == 1
