"""Decoder layers whose weights live in host memory and are copied to the device layer by
layer each step (the ``offload-weights`` planner, ``plugins/offload_weights.py``; how and
why: docs/offload.md).

Each streamed layer's tensors (every buffer and parameter of its modules, and the tensors
inside a quantised projection's ``packed`` form) are packed into one host buffer, pinned
on CUDA, at ``ALIGN``-byte offsets. The device holds ``ring_size`` slots of the largest
layer's size. The j-th streamed layer takes slot j % ring_size, and its module tensors are
rebound once, for good, to views into that slot: the forward code reads them as any other
weight. ``DecoderModel.forward`` calls, each step:

    begin()      before any layer: the first ring_size streamed layers' copies are issued
                 (a no-op where the last step already issued them: see after)
    before(i)    layer i is about to run: a streamed layer waits for its copy
    after(i)     layer i is issued: a streamed layer's slot is refilled with the next layer
                 that uses it, j + ring_size, or, past the last, the next step's first

On CUDA the copies run on a stream of their own, ordered by two events per slot: a layer
runs once its copy is done, a slot is refilled once the layer in it has run. So the next
layer's copy overlaps the current layer's compute, and the copy engine never waits for the
host between steps. Under CUDA graph capture the same calls record the copies into the
graph: the copy stream forks from the capturing stream in ``begin`` and joins it in each
``before``. From the first capture on, steps are ``self_contained``: each one, replayed or
eager, issues its own first copies in ``begin`` (after all work issued before it) and none
for the next step, since a replay leaves the host no record of what the slots hold; the
first copies then overlap the resident layers instead of the last step's tail.

On the CPU the same code runs with the host as both sides: each copy is a synchronous
``copy_``. ``log``, when a list, receives ("copy", layer, slot) as each copy is issued and
("run", layer) as each layer starts (the tests read it).
"""
from __future__ import annotations

import dataclasses
import weakref

import attrs
import torch
from torch import nn

from ..errors import PlanError

# bytes: every tensor of a packed layer starts at a multiple, as aligned as the CUDA caching
# allocator's own tensors (kernels that pick a path by alignment pick the same one)
ALIGN = 512


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def map_tensors(obj, fn):
    """``obj`` with every tensor inside it replaced by ``fn(tensor)``, in a fixed order:
    a tensor, or attrs / dataclass instances, tuples, lists and dicts holding them."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if attrs.has(type(obj)):
        return attrs.evolve(obj, **{getattr(f, "alias", f.name.lstrip("_")):
                                    map_tensors(getattr(obj, f.name), fn)
                                    for f in attrs.fields(type(obj)) if f.init})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)):
        items = [map_tensors(x, fn) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def rebind(layer: nn.Module, fn, what: str = "layer") -> None:
    """Replace every tensor ``layer`` holds by ``fn(tensor)``, in a fixed order: its
    modules' buffers and parameters, and a quantised projection's ``packed`` form. A
    module holding a tensor any other way cannot stream: PlanError naming it."""
    for path, module in layer.named_modules():
        for name, t in list(module._buffers.items()):
            if t is not None:
                module._buffers[name] = fn(t)
        for name, p in list(module._parameters.items()):
            if p is not None:
                new = fn(p)
                module._parameters[name] = new if isinstance(new, nn.Parameter) \
                    else nn.Parameter(new, requires_grad=False)
        if "packed" in vars(module):  # core.runner.model.QuantizedLinear
            module.packed = map_tensors(module.packed, fn)
        stray = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
        if stray:
            raise PlanError(f"{what}: module {path or '(the layer)'!r} holds tensor attribute(s) "
                            f"{stray} outside its buffers, parameters and packed form; "
                            "offload-weights cannot stream it")


def tensors_of(layer: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``layer`` holds, in ``rebind``'s order."""
    found = []
    rebind(layer, lambda t: found.append(t) or t)
    return found


def packed_layout(tensors) -> tuple[list[tuple], int]:
    """(offset, shape, dtype) of each tensor in a packed buffer, and the buffer's bytes."""
    layout, end = [], 0
    for t in tensors:
        layout.append((end, t.shape, t.dtype))
        end += aligned(t.numel() * t.element_size())
    return layout, end


def _view(buf: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` over ``buf``'s bytes from ``offset``."""
    n = shape.numel() * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


def _host_buffer(nbytes: int, pin: bool, registered: list) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes``; with ``pin``, page-locked: registered with CUDA
    at its exact size (``pin_memory=True`` would round it up to a power of two), else
    through the pinned allocator. Registered pointers are appended to ``registered``."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return buf
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(getattr(err, "value", err)) == 0:
            registered.append((buf.data_ptr(), buf))
            return buf
        # a failed call leaves CUDA's last error set: the next launch check would raise it
        try:
            torch.zeros(1, device="cuda")
        except RuntimeError:
            pass
    except (AttributeError, RuntimeError, TypeError):  # a torch without the binding
        pass
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _unregister(registered: list) -> None:
    """Unpin registered buffers (then dropped); errors at interpreter exit ignored."""
    for ptr, _ in registered:
        try:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:  # the CUDA context may be gone already
            pass
    registered.clear()


class WeightStreamer:
    """The streamed layers of ``layers`` (indices ``streamed``, in order), their host
    buffers, the device ring and the copies between them (module docstring)."""

    def __init__(self, layers, streamed, ring_size: int, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.layers = tuple(streamed)  # model layer indices, in order
        self.index = {layer: j for j, layer in enumerate(self.layers)}
        if not self.layers or ring_size < 1:
            raise PlanError(f"a weight streamer needs layers and ring slots, got layers "
                            f"{self.layers} and ring_size={ring_size}")
        self.ring_size = min(ring_size, len(self.layers))
        modules = [layers[i] for i in self.layers]
        # 1) sizes only: a slot holds the largest packed layer
        layouts = [packed_layout(tensors_of(m)) for m in modules]
        self.slot_bytes = max(size for _, size in layouts)
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
                      for _ in range(self.ring_size)]
        # 2) layer by layer: packed into its host buffer, then its tensors rebound to views
        # into its slot (the loaded ones dropped as each layer goes: never two host copies)
        self._registered = []
        weakref.finalize(self, _unregister, self._registered)
        pin = self.cuda and torch.cuda.is_available()
        self.host = []
        for j, (module, (layout, size)) in enumerate(zip(modules, layouts)):
            buf = _host_buffer(size, pin, self._registered)
            for t, (off, shape, dtype) in zip(tensors_of(module), layout):
                _view(buf, off, shape, dtype).copy_(t)
            self.host.append(buf)
            slot = self.slots[j % self.ring_size]
            views = iter([_view(slot, *where) for where in layout])
            rebind(module, lambda t: next(views), f"layer {self.layers[j]}")
        self.holds = [None] * self.ring_size  # the streamed index each slot's last copy holds
        self.log: list | None = None
        self.capturing = self.self_contained = False
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copied = self._events()  # per slot: its copy is done
            self.used = self._events()  # per slot: the layer in it has run
            self.eager_events = (self.copied, self.used)

    def _events(self) -> list:
        return [torch.cuda.Event() for _ in range(self.ring_size)]

    @property
    def pinned(self) -> bool:
        """Whether the host buffers are page-locked (CUDA copies them asynchronously)."""
        return all(b.is_pinned() for b in self.host) if self.cuda else False

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers: the streamed layers, packed."""
        return sum(b.numel() for b in self.host)

    def begin(self) -> None:
        self.capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if self.capturing:
            # from the first capture on, every step copies its own first layers (a replay
            # cannot leave the host a record of what it copied); events recorded in a
            # capture cannot be waited on outside it: fresh ones for it
            self.self_contained = True
            self.copied, self.used = self._events(), self._events()
        elif self.cuda and self.copied is not self.eager_events[0]:
            self.copied, self.used = self.eager_events
        if self.self_contained:  # a slot of one layer keeps it (no other step writes it)
            self.holds = [h if s + self.ring_size >= len(self.layers) else None
                          for s, h in enumerate(self.holds)]
        if self.cuda and any(self.holds[s] != s for s in range(self.ring_size)):
            # the copies wait for all work issued so far (a replay reads the slots too; in
            # a capture this is the copy stream's fork from the capturing stream)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for s in range(self.ring_size):  # streamed layer s is slot s's first in a step
            self._fill(s, s)

    def before(self, layer: int) -> None:
        if self.log is not None:
            self.log.append(("run", layer))
        j = self.index.get(layer)
        if j is None:  # a resident layer
            return
        s = j % self.ring_size
        self._fill(s, j)  # issued already, unless a step was cut short
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[s])

    def after(self, layer: int) -> None:
        j = self.index.get(layer)
        if j is None:
            return
        s = j % self.ring_size
        if self.cuda:
            self.used[s].record(torch.cuda.current_stream(self.device))
        # the next layer of this slot: later in this step, else the next step's first
        # (where steps are self-contained, the next step's begin issues that one)
        nxt = j + self.ring_size
        if nxt < len(self.layers):
            self._fill(s, nxt)
        elif not self.self_contained:
            self._fill(s, s)

    def _fill(self, s: int, j: int) -> None:
        """Slot ``s`` gets streamed layer ``j`` (nothing to do where it holds it)."""
        if self.holds[s] == j:
            return
        self.holds[s] = j
        if self.log is not None:
            self.log.append(("copy", self.layers[j], s))
        src = self.host[j]
        dst = self.slots[s][:src.numel()]
        if not self.cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.used[s])  # the layer in it has run
            dst.copy_(src, non_blocking=True)
            self.copied[s].record(self.copy_stream)


def streamer_for(net, placement, device) -> WeightStreamer | None:
    """The streamer of a build's ``WeightPlacement`` (after the weights are loaded and
    folded), or None where nothing streams."""
    if placement is None or not placement.streamed:
        return None
    return WeightStreamer(net.layers, placement.streamed, placement.ring_size, device)


def host_slots(placement):
    """``load_weights``' ``device_of``: the streamed layers' slots load to the host."""
    if placement is None or not placement.streamed:
        return None
    prefixes = tuple(f"layers.{i}." for i in placement.streamed)
    return lambda slot: torch.device("cpu") if slot.startswith(prefixes) else None
