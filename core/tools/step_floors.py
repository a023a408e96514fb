"""The floor of an engine step's time: what its GEMMs and its attention take at best on
this device, at the rates measured in the same run (``bench.matmul_rate``, the compute
roofline; ``bench.copy_bandwidth``, the memory one). step_profile.py sets each part of a
profiled window beside these; step_census.py each class of a whole run's steps.

- GEMMs (the layers' matmuls and the LM head's rows): the longer of their FLOPs at the
  matmul rate (2 a weight for each token fed, ``throughput_report.fed_flops``) and one
  read of every weight at the copy rate (what a decode step of a few rows is bound by;
  of a mixture of experts, the experts the step's rows route to: ``bench.step_bytes``).
- attention, span by span (a sequence's tokens fed in the step): the longer of its QK^T
  and PV FLOPs at the matmul rate and the K/V bytes it reads at the copy rate. A prompt
  chunk is bound by the FLOPs, a decoding row by the bytes: it reads its whole context
  (keys x kv_heads x head_dim x 2 x dtype bytes a layer) for one query. Each span's own,
  summed, so that neither kind hides the other in one step.

A step's floor is the two parts' sum (they run as separate kernels). Norms, rotary,
activations, sampling and copies have none: their bytes are small beside the weights'.
"""
from __future__ import annotations

import attrs
import torch

from .bench import copy_bandwidth, step_bytes
from .throughput_report import fed_flops, layer_windows, span_keys, span_keys_read

COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 26}  # the copy rate's buffer, by device type


def copy_rate(device) -> float:
    """Bytes/s of ``bench.copy_bandwidth`` (read plus written, best of 20) over a buffer of
    ``COPY_BYTES``: measured before the models take the device's memory."""
    device = torch.device(device)
    return copy_bandwidth(device, COPY_BYTES.get(device.type, COPY_BYTES["cpu"]))


@attrs.frozen
class StepFloors:
    spec: object  # the model's ModelSpec
    matmul_rate: float  # FLOP/s
    copy_rate: float  # bytes/s, read plus written (bench.copy_bandwidth)
    weight_bytes: int  # what a step reads of the weights (plan.step_weight_bytes or all)
    kv_bytes_per_token: int  # K and V of one token, all layers (plan.kv_bytes_per_token)
    expert_bytes: int = 0  # of weight_bytes, the experts' (bench.expert_bytes)
    windows: dict = attrs.field(init=False)

    @windows.default
    def _windows(self):
        return layer_windows(self.spec)

    @classmethod
    def of(cls, engine, matmul_rate: float, copy_rate: float) -> "StepFloors":
        """The floors of ``engine``'s steps at these measured rates."""
        from .bench import expert_bytes

        plan = engine.plan
        return cls(engine.spec, matmul_rate, copy_rate,
                   plan.step_weight_bytes or plan.weight_bytes, plan.kv_bytes_per_token,
                   expert_bytes(engine.model))

    def gemm_s(self, tokens: int, sampled: int, rows: int) -> float:
        """Seconds of one step's GEMMs at best: ``tokens`` fed by ``rows`` sequences,
        ``sampled`` rows through the LM head."""
        flops = fed_flops(self.spec, [(0, tokens)], sampled)
        read = step_bytes(self.spec, self.weight_bytes, 0, rows, 0, self.expert_bytes)
        return max((flops["matmul"] + flops["lm_head"]) / self.matmul_rate,
                   read / self.copy_rate)

    def attention_s(self, spans) -> float:
        """Seconds of the attention of (first position, tokens) ``spans`` at best: each
        span's FLOPs or K/V bytes, whichever take longer, summed."""
        flop_s = 4 * self.spec.q_size / self.matmul_rate
        byte_s = self.kv_bytes_per_token / self.spec.num_layers / self.copy_rate
        return sum(max(span_keys(self.windows, start, n) * flop_s,
                       span_keys_read(self.windows, start, n) * byte_s)
                   for start, n in spans)

    def attention_bounds_s(self, spans) -> tuple[float, float]:
        """(FLOPs at the matmul rate, K/V bytes at the copy rate) of ``spans``' attention,
        each summed alone: what each bound would say of them."""
        keys = sum(span_keys(self.windows, s, n) for s, n in spans)
        read = sum(span_keys_read(self.windows, s, n) for s, n in spans)
        return (4 * self.spec.q_size * keys / self.matmul_rate,
                read * self.kv_bytes_per_token / self.spec.num_layers / self.copy_rate)

    def parts_s(self, step) -> dict:
        """{gemm, attention}: the floors of one census.StepRecord's parts."""
        return {"gemm": self.gemm_s(step.tokens, step.sampled, step.rows),
                "attention": self.attention_s(step.spans)}
