"""``infergraft plan --offload-weights``: the ``offload-weights`` planner's split of a
model between the device and host memory, and the TPOT its copies set, from the
host-to-device bandwidth measured here and now (``plugins/offload_weights.py``,
docs/offload.md)."""
from __future__ import annotations

import attrs
import torch

from ..errors import PlanError
from ..plugin_manager import get_plugin_manager
from ..units import fmt_bytes
from .bench import best_seconds, copy_bandwidth

CUDA_COPY_BYTES = 256 << 20  # the pinned host -> device copy timed on CUDA
CPU_COPY_BYTES = 64 << 20  # the host memcpy timed on the CPU (the host is both sides there)


def add_arguments(p) -> None:
    p.add_argument("--offload-weights", action="store_true",
                   help="plan the offload-weights planner: the layers beyond the budget in "
                        "host memory, copied to the device each step; prints the split and "
                        "the expected TPOT at the host-to-device bandwidth measured now")
    p.add_argument("--resident-layers", type=int, default=None, metavar="N",
                   help="with --offload-weights: layers kept on the device (default: as many "
                        "as fit)")
    p.add_argument("--ring-size", type=int, default=None, metavar="N",
                   help="with --offload-weights: device slots the streamed layers take turns "
                        "in (>= 2; default 2)")


def host_to_device_bandwidth(device, nbytes: int | None = None,
                             repeats: int = 5) -> tuple[float, str]:
    """(bytes/s, how it was measured): the best of ``repeats`` copies of a pinned host
    buffer to ``device`` timed by CUDA events, or on the CPU a host memcpy."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = best_seconds(device, lambda: dst.copy_(src, non_blocking=cuda), repeats)
    how = (f"a pinned {fmt_bytes(nbytes)} host->{device} copy, CUDA events" if cuda else
           f"a {fmt_bytes(nbytes)} host memcpy (on the CPU the host is both sides)")
    return nbytes / seconds, f"best of {repeats}: {how}"


def device_bandwidth(device) -> float:
    """Bytes/s of a device copy, read + written (``bench.copy_bandwidth``): the rate a
    decode step reads the weights on the device at."""
    device = torch.device(device)
    return copy_bandwidth(device, nbytes=CUDA_COPY_BYTES if device.type == "cuda"
                          else CPU_COPY_BYTES, repeats=5)


def expected_tpot(placement, weight_bytes: int, h2d: float, dev: float) -> tuple[float, float]:
    """(seconds of copies a step, seconds the device reads every weight in): the copies
    run on a stream of their own while the layers compute, so a memory-bound step takes
    about the larger of the two."""
    return placement.copied_bytes / h2d, weight_bytes / dev


def offload_plan(mem, spec, args, weight_quant, budget):
    """(``mem`` with the planner's placement, extra rows, extra JSON) for ``args``."""
    if args.tensor_parallel != 1 or args.pipeline_parallel != 1:
        raise PlanError("--offload-weights plans one device: it takes no --tensor-parallel "
                        "or --pipeline-parallel")
    planner = get_plugin_manager().planners().get("offload-weights")
    kw = dict(resident_layers=args.resident_layers, ring_size=args.ring_size)
    planner.plan(spec, 1, **kw)  # the options checked
    try:
        placement = planner.place_weights(mem, spec, budget, mem.kv_bytes_total, weight_quant,
                                          **kw)
    except PlanError as e:  # not even with every layer in host memory: shown as such
        refused = str(e)
        placement = planner.place_weights(mem, spec, budget, mem.kv_bytes_total, weight_quant,
                                          **dict(kw, resident_layers=0))
    else:
        refused = None
    mem = attrs.evolve(mem, weight_placement=placement)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h2d, how = host_to_device_bandwidth(device)
    dev = device_bandwidth(device)
    copies, reads = expected_tpot(placement, mem.weight_bytes, h2d, dev)
    rows = [("host->device bandwidth", f"{h2d / 1e9:.1f} GB/s ({how})"),
            ("device bandwidth", f"{dev / 1e9:.1f} GB/s (a {device} copy, read + written)"),
            ("expected TPOT", f"{1e3 * max(copies, reads):.2f} ms: the copies "
                              f"{1e3 * copies:.2f} ms ({fmt_bytes(placement.copied_bytes)} a "
                              f"step), the reads on the device {1e3 * reads:.2f} ms, "
                              "overlapping")]
    if refused:
        rows.append(("refused", refused))
    extra = {"device_weight_bytes": mem.device_weight_bytes,
             "streamed_bytes": placement.streamed_bytes, "copied_bytes": placement.copied_bytes,
             "ring_bytes": placement.ring_bytes, "h2d_bandwidth": h2d, "h2d_measured": how,
             "device_bandwidth": dev, "expected_tpot_s": max(copies, reads),
             "copy_s": copies, "read_s": reads, "refused": refused}
    return mem, rows, extra
