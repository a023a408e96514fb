"""The floor of a decode step's time: the bytes it must read (every weight once, of a
mixture of experts the experts a batch routes to, and each sequence's K/V) over the copy
bandwidth ``bench.copy_bandwidth`` measures in the same run. ``Roofline`` keeps what an
engine's floor needs once the engine is freed (``bench_fit``: HF measured after it)."""
from __future__ import annotations

import attrs


def step_bytes(spec, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int,
               expert_bytes: int = 0) -> int:
    """Bytes one decode step must read: every weight once plus each sequence's K/V. Of a
    mixture of experts' ``expert_bytes`` only the experts the batch routes to: a share
    1 - (1 - k / E)^batch of them, as expected under uniform routing (k / E at batch 1:
    the active parameters; nearly all of them by batch 32 at top-2 of 8)."""
    layers = [x.experts for x in getattr(spec, "layers", ()) if x.experts is not None]
    if layers and expert_bytes:
        k, e = layers[0].top_k, layers[0].num_experts
        weight_bytes -= round(expert_bytes * (1 - k / e) ** batch)
    return weight_bytes + batch * context * kv_bytes_per_token


def expert_bytes(model) -> int:
    """Bytes of a model's expert matrices as loaded (packed where quantised): the
    ``experts_gate_up`` / ``experts_down`` slots of its mixture-of-experts layers."""
    from ..runner.layers import QuantizedLinear

    total = 0
    for layer in model.layers:
        for m in (getattr(layer, n, None) for n in ("experts_gate_up", "experts_down")):
            if isinstance(m, QuantizedLinear):
                total += m.quantizer.packed_bytes(m.packed)
            elif m is not None:
                total += m.weight.numel() * m.weight.element_size()
    return total


def rank_floors(per_rank, batch: int, context: int, bw: float) -> tuple[float, float]:
    """(the largest rank's step bytes / bw, the sum over stages of each stage's largest)
    in ms: the floor of ranks reading at once, and of stages running in turn; ``per_rank``:
    each rank's {stage, weight_bytes, kv_bytes_per_token} (bench_parallel)."""
    ms = {}
    for s in per_rank:
        t = step_bytes(None, s["weight_bytes"], s["kv_bytes_per_token"], batch, context) / bw
        ms[s["stage"]] = max(ms.get(s["stage"], 0.0), t * 1e3)
    return max(ms.values()), sum(ms.values())


@attrs.frozen
class Roofline:
    """What a decode step's floor needs of an engine, kept once the engine is freed (HF
    measured after it: bench_fit): its spec and the bytes its plan reads a step."""
    spec: object
    weight_bytes: int  # read a step (plan.step_weight_bytes, else all it holds)
    kv_bytes_per_token: int
    expert_bytes: int  # of a mixture of experts (``expert_bytes``)

    @classmethod
    def of(cls, engine) -> "Roofline":
        plan = engine.plan
        return cls(engine.spec, plan.step_weight_bytes or plan.weight_bytes,
                   plan.kv_bytes_per_token, expert_bytes(engine.model))

    def seconds(self, batch: int, prompt_len: int, new_tokens: int, bw: float) -> float:
        """TPOT floor of ``batch`` at the mean context over the timed steps."""
        return step_bytes(self.spec, self.weight_bytes, self.kv_bytes_per_token, batch,
                          prompt_len + new_tokens // 2, self.expert_bytes) / bw
