"""Conformance kit for weight quantisers (``applies_to = "weights"``).

A quantiser's suite subclasses :class:`QuantizerTests` and provides a ``quantizer``
fixture. The weight-quantiser contract (``core.quant.Quantizer`` with these methods)::

    max_relative_error: float      # declared bound on max|unpack(pack(w)) - w| / max|w|
    pack(weight [out, in]) -> packed          # any tensor / tuple / dict / attrs object
    unpack(packed) -> weight [out, in]        # the dequantised weight, weight's dtype
    matmul(x [..., in], packed) -> y [..., out]   # == x @ unpack(packed).T
    packed_bytes(packed) -> int               # bytes the packed form really holds

``matmul_rtol`` (relative to max(|x| @ |W|^T), the size of the summed terms) and
``dense_shape`` may be overridden.
"""
from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from ..quant import QUANTIZER_TARGETS
from ..registry import _NAME
from . import strategies

_SETTINGS = strategies.kit_settings(max_examples=40, deadline=None,
                                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                           HealthCheck.differing_executors])


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor a packed object holds (tensors, sequences, dicts, attrs/plain objects)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif attrs.has(type(obj)):
        items = [getattr(obj, f.name) for f in attrs.fields(type(obj))]
    elif hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in tensors_in(item)]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((a.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_round_trip(quantizer, w: torch.Tensor) -> float:
    """unpack(pack(w)) has w's shape and dtype and stays within the declared bound."""
    who = f"quantizer {quantizer.name!r}"
    kept = w.clone()
    back = quantizer.unpack(quantizer.pack(w))
    assert torch.equal(w, kept), f"{who}: pack() modified its input"
    assert back.shape == w.shape and back.dtype == w.dtype, \
        f"{who}: unpack gave {tuple(back.shape)} {back.dtype}, packed {tuple(w.shape)} {w.dtype}"
    assert torch.isfinite(back).all(), f"{who}: unpack() produced inf/NaN (a zero scale?)"
    if not w.any():
        assert not back.any(), f"{who}: an all-zero weight does not round-trip to zero"
        return 0.0
    err = _rel(back, w)
    assert err <= quantizer.max_relative_error, \
        f"{who}: round-trip error {err:.3g} exceeds declared max_relative_error " \
        f"{quantizer.max_relative_error:.3g} for a {tuple(w.shape)} {w.dtype} weight"
    return err


def check_packed_bytes(quantizer, w: torch.Tensor) -> int:
    """packed_bytes() reports the bytes the packed form really holds."""
    packed = quantizer.pack(w)
    held = tensors_in(packed)
    assert held, f"quantizer {quantizer.name!r}: packed form holds no tensor"
    real = sum({id(t): t.numel() * t.element_size() for t in held}.values())
    said = quantizer.packed_bytes(packed)
    assert said == real, f"quantizer {quantizer.name!r}: packed_bytes() says {said}, holds {real}"
    return said


def check_matmul(quantizer, w: torch.Tensor, x: torch.Tensor, rtol: float) -> float:
    """matmul(x, packed) equals x @ unpack(packed).T, for any leading dims of x."""
    packed = quantizer.pack(w)
    y = quantizer.matmul(x, packed)
    ref = F.linear(x, quantizer.unpack(packed))
    assert y.shape == ref.shape, f"quantizer {quantizer.name!r}: matmul gave {tuple(y.shape)}, " \
                                 f"expected {tuple(ref.shape)}"
    # relative to the size of the summed terms, max(|x| @ |W|^T): rounding in a long dot
    # product with cancellation is bounded by that, not by |y| (which can be much smaller)
    terms = F.linear(x.float().abs(), quantizer.unpack(packed).float().abs()).max()
    diff = (y.float() - ref.float()).abs().max()
    err = float(diff / terms) if terms > 0 else float(y.abs().max())
    assert err <= rtol, f"quantizer {quantizer.name!r}: matmul differs from the dequantised " \
                        f"reference by {err:.3g} of max(|x| @ |W|^T) (allowed {rtol:.3g})"
    return err


class QuantizerFixtures:
    matmul_rtol = 1e-4
    dense_shape = (64, 256)


class QuantizerContractTests(QuantizerFixtures):
    def test_name_is_valid(self, quantizer):
        assert isinstance(quantizer.name, str) and _NAME.match(quantizer.name), quantizer.name

    def test_is_a_weight_quantizer(self, quantizer):
        assert quantizer.applies_to in QUANTIZER_TARGETS and quantizer.applies_to == "weights"
        for method in ("pack", "unpack", "matmul", "packed_bytes"):
            assert callable(getattr(quantizer, method, None)), f"missing {method}()"

    def test_declares_an_error_bound(self, quantizer):
        assert 0 < quantizer.max_relative_error < 1, quantizer.max_relative_error


class QuantizerRoundTripTests(QuantizerFixtures):
    @_SETTINGS
    @given(w=strategies.weight_tensors())
    def test_round_trip_within_declared_bound(self, quantizer, w):
        check_round_trip(quantizer, w)

    def test_zero_weight_round_trips_to_zero(self, quantizer):
        check_round_trip(quantizer, torch.zeros(self.dense_shape))

    def test_pack_is_deterministic(self, quantizer):
        w = torch.randn(self.dense_shape, generator=torch.Generator().manual_seed(1))
        assert torch.equal(quantizer.unpack(quantizer.pack(w)), quantizer.unpack(quantizer.pack(w)))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_packed_bytes_are_real_and_smaller(self, quantizer, dtype):
        w = torch.randn(self.dense_shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        dense = w.numel() * w.element_size()
        assert check_packed_bytes(quantizer, w) < dense


class QuantizerMatmulTests(QuantizerFixtures):
    @_SETTINGS
    @given(w=strategies.weight_tensors(), data=st.data())
    def test_matmul_matches_dequantised_reference(self, quantizer, w, data):
        rows = data.draw(st.integers(1, 9), "tokens")
        seed = data.draw(st.integers(0, 2**16), "seed")
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed))
        check_matmul(quantizer, w, x.to(w.dtype), self.matmul_rtol)

    def test_matmul_keeps_leading_dims(self, quantizer):
        g = torch.Generator().manual_seed(3)
        w, x = torch.randn(self.dense_shape, generator=g), torch.randn(2, 5, self.dense_shape[1], generator=g)
        check_matmul(quantizer, w, x, self.matmul_rtol)


class QuantizerTests(QuantizerContractTests, QuantizerRoundTripTests, QuantizerMatmulTests):
    """Everything a weight quantiser must pass; subclass with a ``quantizer`` fixture."""
