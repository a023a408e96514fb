"""Conformance state machine for KV-cache backends (hypothesis ``RuleBasedStateMachine``).

It drives a cache through random allocate / append (``prepare`` + per-layer ``attention``
with random q, k, v) / fork / free / read steps and compares every read and every attention
output with a trusted reference: a dict of the K/V each sequence was given. After every step the
backend's ``check_invariants()`` runs and its accounting must agree with the reference
(sequences, tokens, blocks free + used = total); at the end, with every sequence freed,
no block may still be in use. A refused operation (``CacheFullError``, or
``NotImplementedError`` from ``fork``) must leave everything unchanged, and
``can_allocate`` / ``can_append`` must predict ``allocate`` / ``prepare`` exactly.

A backend's test suite: ``TestMyCache = make_cache_test(cache_factory("my-cache",
block_size=4, num_blocks=12))``, or subclass :class:`CacheBackendMachine`, override
``make_cache`` (and ``stored`` for a lossy K/V format), and run ``MyMachine.TestCase``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..cache import CacheFullError
from ..spec import ModelSpec, RopeSpec
from .reference import reference_attention  # noqa: F401  (named here too)
from .strategies import kit_settings


def tiny_cache_spec(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    sliding_window=None) -> ModelSpec:
    """A ModelSpec with just what a cache needs (layers, heads, head_dim, window)."""
    return ModelSpec(architecture="LlamaForCausalLM", num_layers=num_layers,
                     hidden_size=num_heads * head_dim, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=8,
                     vocab_size=16, max_position=1024, rope=RopeSpec(),
                     sliding_window=sliding_window)


def cache_factory(backend, spec: Optional[ModelSpec] = None, *, max_seq_len: int = 24,
                  max_batch_size: int = 4, dtype=torch.float32, kv_quantizer=None,
                  **options) -> Callable:
    """A zero-argument callable making a fresh CPU cache from a registered backend (name
    or object), the way ``core.build`` would; ``.spec`` / ``.max_seq_len`` ride along."""
    from infergraft.kernels.dispatch import get_ops

    from ..plan import ParallelPlan, Plan
    from ..plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    backend = pm.cache_backends().get(backend) if isinstance(backend, str) else backend
    if isinstance(kv_quantizer, str):
        kv_quantizer = pm.quantizers().get(kv_quantizer)
    spec = spec or tiny_cache_spec()
    plan = Plan(model="tiny", architecture=spec.architecture, policy="-", dtype=str(dtype),
                device="cpu", kernels="torch", max_seq_len=max_seq_len,
                max_batch_size=max_batch_size, cache_backend=backend.name, kv_dtype=str(dtype),
                quantizers=(), planner="-", parallel=ParallelPlan(), weight_bytes=0,
                kv_bytes_per_token=backend.bytes_per_token(spec, dtype),
                sliding_window=spec.kv_window)
    if kv_quantizer is not None:
        options["kv_quantizer"] = kv_quantizer

    def make():
        return backend.create(spec, plan, device="cpu", dtype=dtype, ops=get_ops("cpu", "torch"),
                              **options)
    make.spec, make.max_seq_len, make.dtype = spec, max_seq_len, dtype
    make.kv_quantizer = kv_quantizer
    return make


class CacheBackendMachine(RuleBasedStateMachine):
    """Subclass and override ``make_cache`` (or use :func:`make_cache_test`)."""

    #: made by ``make_cache_test`` from the factory; override when subclassing by hand
    spec: ModelSpec = tiny_cache_spec()
    max_seq_len: int = 24
    dtype = torch.float32
    #: attention outputs are compared within this (absolute and relative) tolerance
    atol: float = 1e-5
    #: also call ``prepare`` on steps ``can_append`` refuses, to check that it raises
    #: CacheFullError and changes nothing (turn off only for a known, reported bug)
    probe_refused_steps: bool = True

    def make_cache(self):
        raise NotImplementedError("override make_cache() to return a fresh, empty cache")

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What reading back a written [T, Hkv, D] must give (lossy formats override)."""
        return x.to(self.dtype)

    # -- state -----------------------------------------------------------------------------
    def __init__(self):
        super().__init__()
        self.cache = self.make_cache()
        # seq id -> per layer (K, V) as written so far, [n, Hkv, D] each
        self.ref: dict[int, list[list[torch.Tensor]]] = {}
        self.next_id = 0

    def _empty(self):
        s = self.spec
        return [[torch.empty(0, s.num_kv_heads, s.head_dim, dtype=self.dtype)] * 2
                for _ in range(s.num_layers)]

    def _live(self, data, label="seq"):
        return data.draw(st.sampled_from(sorted(self.ref)), label=label)

    def _snapshot(self):
        return self.cache.stats(), {s: self.cache.length(s) for s in self.ref}

    def _refused(self, before, what):
        assert self._snapshot() == before, f"a refused {what} changed the cache: " \
                                           f"{before} -> {self._snapshot()}"

    # -- rules -------------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        n = data.draw(st.integers(1, self.max_seq_len + 2), label="tokens")
        sid, before = self.next_id, self._snapshot()
        self.next_id += 1
        can = self.cache.can_allocate(n)
        try:
            self.cache.allocate(sid, n)
        except CacheFullError:
            assert not can, f"can_allocate({n}) was True but allocate raised CacheFullError"
            return self._refused(before, "allocate")
        assert can, f"can_allocate({n}) was False but allocate succeeded"
        assert n <= self.max_seq_len, f"allocate accepted {n} > max_seq_len tokens"
        self.ref[sid] = self._empty()
        if data.draw(st.booleans(), label="prefill"):  # the engine's pattern
            self._append([sid], [n], data)

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def append(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.ref)), min_size=1, max_size=4,
                                 unique=True), label="seqs")
        big = data.draw(st.booleans(), label="long")
        counts = [data.draw(st.integers(1, self.max_seq_len if big else 3), label="count")
                  for _ in ids]
        self._append(ids, counts, data)

    def _append(self, ids, counts, data):
        before, can = self._snapshot(), self.cache.can_append(ids, counts)
        if not can and not self.probe_refused_steps:
            return
        try:
            meta = self.cache.prepare(ids, counts)
        except CacheFullError:
            assert not can, f"can_append({ids}, {counts}) was True but prepare raised"
            return self._refused(before, "prepare")
        assert can, f"can_append({ids}, {counts}) was False but prepare succeeded"
        s, t = self.spec, sum(counts)
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        rand = lambda *shape: torch.randn(*shape, generator=g).to(self.dtype)  # noqa: E731
        for layer in range(s.num_layers):
            q, (k, v) = rand(t, s.num_heads, s.head_dim), self._new_kv(ids, counts, layer, rand)
            out = self.cache.attention(layer, q, k, v, meta)
            assert out.shape == q.shape, f"attention returned {tuple(out.shape)}, want {tuple(q.shape)}"
            off = 0
            for sid, n in zip(ids, counts):
                kv = self.ref[sid][layer]
                kv[0] = torch.cat([kv[0], self.stored(k[off:off + n])])
                kv[1] = torch.cat([kv[1], self.stored(v[off:off + n])])
                a = s.layer_attention(layer)
                want = reference_attention(q[off:off + n], kv[0], kv[1], len(kv[0]) - n,
                                           a.window, scale=a.scale, softcap=a.softcap)
                torch.testing.assert_close(out[off:off + n].double(), want, atol=self.atol,
                                           rtol=self.atol,
                                           msg=lambda m: f"attention of seq {sid}, layer {layer}: {m}")
                off += n

    def _new_kv(self, ids, counts, layer, rand):
        """The K and V ([T, Hkv, D] each) a step writes: random (overridable)."""
        shape = (sum(counts), self.spec.num_kv_heads, self.spec.head_dim)
        return rand(*shape), rand(*shape)

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def fork(self, data):
        parent, child, before = self._live(data, "parent"), self.next_id, self._snapshot()
        self.next_id += 1
        try:
            self.cache.fork(parent, child)
        except (CacheFullError, NotImplementedError):
            return self._refused(before, "fork")
        self._forked(parent, child)

    def _forked(self, parent, child):
        self.ref[child] = [list(kv) for kv in self.ref[parent]]  # the child holds a copy

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def free(self, data):
        sid = self._live(data)
        self.cache.free(sid)
        del self.ref[sid]

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def read(self, data):
        layer = data.draw(st.integers(0, self.spec.num_layers - 1), label="layer")
        self._check_read(self._live(data), layer)

    def _check_read(self, sid, layer):
        k, v = self.cache.read(sid, layer)
        want_k, want_v = self.ref[sid][layer]
        n, held, w = len(want_k), k.shape[0], self.spec.kv_window
        # a sliding-window cache may drop what no later query sees, keeping the last w
        assert min(n, w or n) <= held <= n and v.shape[0] == held, \
            f"read({sid}, {layer}) gave {held} tokens of {n} (window {w})"
        torch.testing.assert_close(k.cpu(), want_k[n - held:], atol=0, rtol=0)
        torch.testing.assert_close(v.cpu(), want_v[n - held:], atol=0, rtol=0)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def accounting_agrees(self):
        self.cache.check_invariants()
        st_ = self.cache.stats()
        assert st_["sequences"] == len(self.ref), st_
        lens = {s: len(kv[0][0]) for s, kv in self.ref.items()}
        assert {s: self.cache.length(s) for s in self.ref} == lens
        if "tokens" in st_:
            assert st_["tokens"] == sum(lens.values()), st_
        if "blocks_total" in st_:
            assert st_["blocks_free"] + st_["blocks_used"] == st_["blocks_total"], st_

    def teardown(self):
        for sid in list(self.ref):
            self.cache.free(sid)
        self.ref.clear()
        self.cache.check_invariants()
        st_ = self.cache.stats()
        assert st_["sequences"] == 0, st_
        if "blocks_total" in st_:
            assert st_["blocks_free"] == st_["blocks_total"], f"blocks leaked: {st_}"


def quantized_stored(kv_dtype="int8", dtype=torch.float32):
    """``stored`` for per-token, per-head scaled K/V: ``kv_dtype`` "int8" (the kv-int8
    format) or "fp8" (kv-fp8's e4m3), the write kernel's exact math."""
    from infergraft.kernels.kv_write import KV_STORAGE_DTYPES, quantize_kv_torch

    def stored(self, x):
        q, scale = quantize_kv_torch(x, KV_STORAGE_DTYPES[kv_dtype])
        return (q.float() * scale[..., None]).to(dtype)
    return stored


def make_cache_test(factory, *, max_examples: int = 200, step_count: int = 25,
                    stored=None, atol: float = 1e-5, name: Optional[str] = None,
                    probe_refused_steps: bool = True, machine=None, **attributes):
    """A ``unittest.TestCase`` running the machine on caches from ``factory()``.

    ``factory`` is a zero-argument callable (see :func:`cache_factory`; a plain function
    must carry ``.spec`` and ``.max_seq_len`` attributes); ``machine``: a subclass of
    CacheBackendMachine to run instead, given ``attributes``. For quantised K/V made by a
    ``cache_factory(..., kv_quantizer="kv-int8")`` (or ``"kv-fp8"``) ``stored`` is chosen.
    """
    if stored is None and getattr(factory, "kv_quantizer", None) is not None:
        stored = quantized_stored(factory.kv_quantizer.kv_dtype, factory.dtype)
    body = {"make_cache": lambda self: factory(), "spec": factory.spec,
            "max_seq_len": factory.max_seq_len, "dtype": getattr(factory, "dtype", torch.float32),
            "atol": atol, "probe_refused_steps": probe_refused_steps, **attributes}
    if stored is not None:
        body["stored"] = stored
    machine = type(name or "CacheMachine", (machine or CacheBackendMachine,), body)

    class CacheMachineTest(machine.TestCase):
        settings = _settings(max_examples, step_count)

        # tiny tensors: a second torch thread only adds spinning, ~5x slower on a busy host
        def setUp(self):
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

        def tearDown(self):
            torch.set_num_threads(self._threads)
    CacheMachineTest.__name__ = CacheMachineTest.__qualname__ = f"{machine.__name__}Test"
    return CacheMachineTest


def _settings(max_examples: int, step_count: int) -> settings:
    return kit_settings(max_examples=max_examples, stateful_step_count=step_count, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                               HealthCheck.data_too_large])
