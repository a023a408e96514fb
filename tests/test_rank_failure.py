"""A rank that fails mid-step under tp / pp (gloo ranks on the CPU): the others raise
RankFailedError naming it, with its message where it raised, well within the collective
timeout; a stuck rank is named once the timeout runs out. And ``infergraft serve`` under
torchrun exits when a rank is killed, ending the request in flight with an error.

One set of four processes runs every run_ranks case (start-up paid once): each case is a
fresh two-rank group of two of them, its own port and store, built from the same seeded
model; the stuck case on two of them while the other two run the raises, the killed ones
last."""
import datetime
import os
import signal
import time
from pathlib import Path

import pytest

from infergraft.core.distributed.failure import CENSUS_S, GONE, leave_group
from infergraft.core.testing.distributed import free_port, run_ranks

TIMEOUT_S = 10  # these groups' collective timeout: a raise or a kill is named well before
STALL_TIMEOUT_S = 5  # the stuck case's, set through INFERGRAFT_COLLECTIVE_TIMEOUT
PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3]]
AT_CALL = 3  # the faulty rank fails in its last layer's 3rd call: the second decode step


def cases_on_processes(cases: list, marks: str) -> None:
    """On each of the processes: run the cases it is a member of, in order; each rank's
    outcome lands in ``marks`` as it comes (a process killed later loses none). The host
    of a stuck rank's group stays until that rank is back and has read its store."""
    import json

    me = int(os.environ["RANK"])
    leave_group()  # run_ranks' group of all four: each case makes its own
    for i, case in enumerate(cases):
        if me in case["members"]:
            got = _case(marks, i, **case)
            Path(marks, f"{i}.{case['members'].index(me)}.json").write_text(json.dumps(got))
            if case["fault"][1] == "stall" and case["members"][0] == me:
                back, end = Path(marks, f"{i}.1.json"), time.monotonic() + 60
                while not back.exists() and time.monotonic() < end:
                    time.sleep(0.05)


def _case(marks, index, members, plugins, port, fault, timeout=None, env_timeout=None):
    import torch.distributed as dist

    from infergraft import core
    from infergraft.core.errors import RankFailedError
    from infergraft.core.testing.models import random_model, tiny_llama_config

    rank = members.index(int(os.environ["RANK"]))
    if env_timeout is not None:  # a group made without a timeout takes the switch's
        os.environ["INFERGRAFT_COLLECTIVE_TIMEOUT"] = str(env_timeout)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    store.set(f"here/{rank}", "1")  # both here (the second may still be in a case before)
    store.wait([f"here/{1 - rank}"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=None if
                            timeout is None else datetime.timedelta(seconds=timeout))
    try:
        hf = random_model(tiny_llama_config(), seed=3, scale=5.0)  # the same on both ranks
        engine = core.build(hf, plugins=plugins, dtype="float32", device="cpu",
                            max_seq_len=64, max_batch_size=2)
        faulty, kind = fault
        if rank == faulty:
            _arm(engine.model.layers[-1], kind, Path(marks, f"{index}"))
        try:
            engine.generate(PROMPTS, max_new_tokens=8)
        except RankFailedError as e:
            return {"error": str(e), "ranks": list(e.ranks), "at": time.time(),
                    "cause": repr(e.__cause__), "after": _after(engine)}
        return {"finished": True}
    finally:
        os.environ.pop("INFERGRAFT_COLLECTIVE_TIMEOUT", None)
        if dist.is_initialized():
            leave_group()


def _after(engine) -> str:
    """What a second step raises: the same error (the group is left)."""
    try:
        engine.generate(PROMPTS[:1], max_new_tokens=2)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "finished"


def _arm(layer, kind: str, mark: Path) -> None:
    """The layer's AT_CALL-th forward raises, kills its process or stalls past the
    timeout; ``mark`` gets the time it did."""
    forward, calls = layer.forward, [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == AT_CALL:
            mark.write_text(str(time.time()))
            if kind == "raise":
                raise RuntimeError("injected fault in the last layer")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(STALL_TIMEOUT_S + CENSUS_S + 1)  # "stall": the others give up first
        return forward(*args, **kwargs)

    layer.forward = faulty


CASES = [  # members: run_ranks' processes, the first the group's rank 0 (its store's host)
    dict(members=[0, 1], plugins=["tp"], fault=(1, "raise"), timeout=TIMEOUT_S),
    dict(members=[0, 1], plugins=["pp"], fault=(1, "raise"), timeout=TIMEOUT_S),
    dict(members=[2, 3], plugins=["tp"], fault=(1, "stall"), env_timeout=STALL_TIMEOUT_S),
    dict(members=[0, 1], plugins=["tp"], fault=(0, "raise"), timeout=TIMEOUT_S),
    dict(members=[0, 1], plugins=["pp"], fault=(1, "kill"), timeout=TIMEOUT_S),
    dict(members=[2, 0], plugins=["tp"], fault=(0, "kill"), timeout=TIMEOUT_S),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Per case: ((its rank 0's outcome, rank 1's), when the fault struck); a killed
    rank's outcome is its process's exit code."""
    import json

    marks = tmp_path_factory.mktemp("faults")
    cases = [dict(c, port=free_port()) for c in CASES]
    per_process = run_ranks(cases_on_processes, 4, cases, str(marks), timeout=240,
                            outcomes=True)
    out = []
    for i, case in enumerate(CASES):
        got = [json.loads(f.read_text()) if (f := Path(marks, f"{i}.{r}.json")).exists()
               else per_process[p] for r, p in enumerate(case["members"])]
        out.append((got, float(Path(marks, str(i)).read_text())))
    return out


@pytest.mark.parametrize("case", [0, 1], ids=["tp", "pp"])
def test_a_rank_that_raises_is_named_with_its_message_on_both(outcomes, case):
    (survivor, failed), fault_at = outcomes[case]
    assert survivor["ranks"] == [1] and failed["ranks"] == [1], (survivor, failed)
    for o in (survivor, failed):
        assert "rank 1 of 2 failed during a step: RuntimeError: injected fault in the last " \
               "layer" in o["error"], o
        assert o["after"] == f"RankFailedError: {o['error']}"  # left: no step hangs later
    assert "injected fault" in failed["cause"] and any(s in survivor["cause"] for s in GONE)
    # named at once: the raise left the group, the survivor's collective failed then
    assert survivor["at"] - fault_at < 2.0, survivor["at"] - fault_at


def test_the_store_hosts_raise_reaches_the_other_rank_with_its_message(outcomes):
    """Rank 0 hosts the group's store: it waits for the survivor to read its record."""
    (failed, survivor), fault_at = outcomes[3]
    for o in (failed, survivor):
        assert o["ranks"] == [0] and "rank 0 of 2 failed during a step: RuntimeError: " \
            "injected fault in the last layer" in o["error"], o
    assert survivor["at"] - fault_at < 2.0, survivor["at"] - fault_at


def test_a_stuck_rank_is_named_once_the_switchs_timeout_runs_out(outcomes):
    (survivor, stuck), fault_at = outcomes[2]
    waited = survivor["at"] - fault_at
    assert survivor["ranks"] == [1], survivor
    assert "rank 1 of 2 stopped responding during a step: it did not answer within the " \
           f"collective timeout ({STALL_TIMEOUT_S} s)" in survivor["error"]
    assert STALL_TIMEOUT_S - 0.5 < waited < STALL_TIMEOUT_S + CENSUS_S + 3, waited
    # the stuck rank, once back, learns that the others gave up on it
    assert stuck["ranks"] == [1] and "this rank" in stuck["error"], stuck


def test_a_killed_rank_is_named_within_the_timeout(outcomes):
    (survivor, killed), fault_at = outcomes[4]
    assert killed == {"exitcode": -signal.SIGKILL}
    assert survivor["ranks"] == [1], survivor
    assert "rank 1 of 2 stopped responding during a step: it closed its connection " \
           "(killed or crashed)" in survivor["error"]
    assert survivor["after"] == f"RankFailedError: {survivor['error']}"
    assert survivor["at"] - fault_at < TIMEOUT_S, survivor["at"] - fault_at


def test_the_store_hosts_death_names_rank_zero(outcomes):
    (killed, survivor), fault_at = outcomes[5]
    assert killed == {"exitcode": -signal.SIGKILL}
    assert survivor["ranks"] == [0] and "rank 0 of 2 is gone" in survivor["error"], survivor
    assert survivor["at"] - fault_at < TIMEOUT_S, survivor["at"] - fault_at


def _worker_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker ``rank`` (a child of ``parent`` with RANK=rank)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_serve_under_torchrun_exits_when_a_rank_is_killed(tmp_path_factory, tmp_path):
    """Rank 1 killed mid-stream: the stream ends with an error naming it, and torchrun's
    whole process tree is gone within the collective timeout."""
    import subprocess
    import sys
    import threading

    import httpx
    import openai
    from serve_support import HOST, tiny_model

    model, port = tiny_model(tmp_path_factory), free_port()
    env = {k: v for k, v in os.environ.items() if k != "INFERGRAFT_API_KEY"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               INFERGRAFT_COLLECTIVE_TIMEOUT=str(TIMEOUT_S))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "infergraft.core.cli", "serve", "--model", str(model), "--plugin", "tp",
         "--device", "cpu", "--host", HOST, "--port", str(port), "--max-seq-len", "1024"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env, cwd=tmp_path)
    log = bytearray()
    reader = threading.Thread(target=lambda: [log.extend(c) for c in iter(
        lambda: proc.stdout.read1(4096), b"")], daemon=True)
    reader.start()
    workers = []
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.decode(errors="replace")
            assert time.monotonic() < end, log.decode(errors="replace")
            try:
                if httpx.get(f"http://{HOST}:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = [_worker_pid(proc.pid, r) for r in (0, 1)]
        assert None not in workers, workers
        client = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        stream = client.completions.create(model=str(model), prompt="Hello", max_tokens=900,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # generating
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as failed:
            for _ in chunks:
                pass
        assert "rank 1 of 2" in str(failed.value), failed.value
        status = proc.wait(TIMEOUT_S + 10)
        gone = time.monotonic() - killed
    finally:
        for pid in [proc.pid, *filter(None, workers)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        reader.join(5)
    out = log.decode(errors="replace")
    assert status != 0 and gone < TIMEOUT_S, (gone, out[-3000:])
    assert "rank 1 of 2 stopped responding" in out, out[-3000:]
    assert not Path(f"/proc/{workers[0]}").exists()  # rank 0 exited too (not left behind)


def test_a_graph_replay_that_never_finishes_fails_as_a_timed_out_collective():
    """NCCL's watchdog does not see a replayed graph's collectives: the host gives up on
    the replay's event after the timeout, with an error the census reads as a timeout."""
    from infergraft.core.distributed.failure import is_collective_error, wait_for_device
    from infergraft.core.runner.cuda_graph import PendingTokens

    class Stuck:  # a CUDA event whose work never completes (a peer died mid-replay)
        def query(self):
            return False

    import torch

    pending = PendingTokens(torch.zeros(2, dtype=torch.long), 2, Stuck(),
                            datetime.timedelta(seconds=0.2))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.2 s") as failed:
        pending.get()
    assert 0.2 <= time.monotonic() - start < 2 and is_collective_error(failed.value)
    with pytest.raises(RuntimeError, match="timed out"):
        wait_for_device(Stuck(), datetime.timedelta(seconds=0.05))


def left_group_references() -> list:
    """Leave the group once transformers has imported torch.distributed.nn.functional."""
    import sys

    import torch.distributed as dist

    from infergraft.core.testing.models import random_model, tiny_llama_config

    random_model(tiny_llama_config())  # (imports torch.distributed.nn.functional)
    module = sys.modules["torch.distributed.nn.functional"]
    held = lambda: [n for n, f in vars(module).items() if any(  # noqa: E731
        isinstance(d, dist.ProcessGroup) for d in getattr(f, "__defaults__", None) or ())]
    before = held()
    leave_group()
    return [before, held(), dist.is_initialized()]


def test_leaving_drops_the_reference_torch_keeps_to_the_group():
    """Else the gloo group lives on to interpreter exit, where C++ aborts the process.
    A fresh interpreter (spawn): a forkserver's rank has imported transformers before it
    joined a group, and the functions' defaults then hold none."""
    (before, after, initialized), = run_ranks(left_group_references, 1, start_method="spawn")
    assert "all_reduce" in before and after == [] and not initialized, (before, after)
