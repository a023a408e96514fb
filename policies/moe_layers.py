"""The mixture-of-experts MLP every MoE family reuses (Mixtral, Qwen3-MoE), registered as
MLP ``moe`` through ``infergraft_register_layers`` (core/layer.py), and the weight-map
rules of its experts.

A layer whose ``LayerSpec.experts`` is set (``core.spec.ExpertSpec``) runs: router
logits (a linear [E, H] over the normed stream) -> softmax over all E in float32 -> the
top_k -> renormalised to sum to 1 where ``renormalize`` (Mixtral's router always,
Qwen3-MoE's with ``norm_topk_prob``) -> ``ops.fused_moe``: each token's top_k SwiGLU
experts, weighted and summed (kernels/fused_moe.py: grouped GEMMs over the tokens
sorted by expert). Under tensor parallelism each rank holds every expert's share of the
intermediate rows (as the dense MLP's), the router whole, and the layer all-reduces the
output. The expert weights may be 8-bit rows with a scale each (int8, fp8); a weight
quantiser of another form (int4's groups) is refused at build, by name.

It also runs in the fused decode layer (steps of <= ``ops.fuse_max_rows`` rows, 16-bit
weights), where the attention before it fuses as the LLaMA one does. Its input norm
stays unfolded (the router and every expert read the normed row; ``folds_input_norm``).
A step whose (token, expert) pairs hardly share experts (``takes_pair_path``: one token
always) takes ``ops.moe_decode`` (kernels/moe_decode.py: the norm, router, routing,
experts, weighted sum and residual add in three kernels); any other the norm kernel, the
router and the grouped kernels, whose last one adds the output to the stream.
"""
from __future__ import annotations

import attrs
import torch

from infergraft.core.errors import PlanError, UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.layer import LayerImpl
from infergraft.core.policy import WeightRule
from infergraft.core.runner.layers import Linear, gemm_operands, row_sum_sq
# (route: imported from here too)
from infergraft.kernels.moe_decode import route, takes_pair_path  # noqa: F401

EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")


class MixtureOfExperts:
    """router -> top_k routing -> ``ops.fused_moe``. Slots: ``router`` [E, H],
    ``experts_gate_up`` [E * 2I, H], ``experts_down`` [E * H, I] (core.slots.expert_slots).
    In the fused decode layer too, its input norm applied by itself (not folded)."""

    input_projection = "router"
    fuses = True
    folds_input_norm = False  # the experts read the normed row too, not the router alone

    def __init__(self, layer, spec, ops):
        self.experts, self.ops, self.spec = layer.layer_spec.experts, ops, spec
        if self.experts is None:
            raise UnsupportedModelError(
                f"{spec.architecture}: a layer names mlp 'moe' without experts; accepted: a "
                "LayerSpec with experts=ExpertSpec(num_experts, top_k, intermediate_size)")
        layer.router = Linear(ops)
        # the stacked expert matrices: weight holders, read by fused_moe (never called)
        layer.experts_gate_up = Linear(ops)
        layer.experts_down = Linear(ops)

    def fusable(self, layer) -> bool:
        return True  # every form it loads (refused at build otherwise) runs both paths

    def forward(self, layer, x, residual=None, sum_sq=False):
        # x: [T, H] normed -> [T, H] (under tp: this rank's share, summed by the layer);
        # with ``residual`` (the fused layer's stream): (residual + that, its sums or None)
        x = x.contiguous()
        weights, ids = route(layer.router(x), self.experts.top_k, self.experts.renormalize)
        (wgu, sgu), (wd, sd) = self._experts(layer)
        return self.ops.fused_moe(x, wgu, wd, weights, ids, sgu, sd, residual=residual,
                                  sum_sq=sum_sq)

    def forward_fused(self, layer, stream, sum_sq, want_next: bool):
        """stream [T, H] (the residual stream after the attention), its sums of squares
        [P, T] -> (stream + MoE(norm(stream)), its sums or None without ``want_next``)."""
        norm, top_k, t = layer.mlp_norm, self.experts.top_k, stream.shape[0]
        (wgu, sgu), (wd, sd) = self._experts(layer)
        router = gemm_operands(layer.router)
        if layer.tp is None and sgu is None and sd is None and router is not None and \
                router[2] is None and wgu.dtype == router[0].dtype == stream.dtype and \
                takes_pair_path(t, self.experts.num_experts, top_k):
            return self.ops.moe_decode(stream, sum_sq, norm.weight, self.spec.norm_eps,
                                       router[0], wgu, wd, top_k, self.experts.renormalize,
                                       want_next)
        x = norm(stream)[0]  # [T, H]
        if layer.tp is None:  # the grouped kernels' last adds the stream (and its sums)
            return self.forward(layer, x, residual=stream, sum_sq=want_next)
        out = stream + layer.tp.all_reduce(self.forward(layer, x))  # each rank's share
        return out, (row_sum_sq(out) if want_next else None)

    def _experts(self, layer):
        """((gate_up [E, 2I, H], its scales [E, 2I] or None), (down [E, H, I], scales))."""
        (wgu, sgu), (wd, sd) = (_operands(getattr(layer, name)) for name in EXPERT_WEIGHTS)
        e, h = self.experts.num_experts, wgu.shape[-1]
        i = wd.shape[-1]  # this rank's share of the intermediate rows
        return ((wgu.view(e, 2 * i, h), None if sgu is None else sgu.view(e, 2 * i)),
                (wd.view(e, h, i), None if sd is None else sd.view(e, h)))


def _operands(lin):
    """(weight, scale or None) of a stacked expert matrix: the model dtype's, or 8-bit
    rows with their scales; a quantiser's other forms are refused (at build, by
    ``infergraft_prepare_plan`` below; here for one that slipped past it)."""
    found = gemm_operands(lin)
    if found is None:
        raise UnsupportedModelError(_quantizer_refusal(getattr(lin, "quantizer", None)))
    return found[0], found[2]


def _quantizer_refusal(quantizer) -> str:
    name = getattr(quantizer, "name", repr(quantizer))
    return (f"weight quantizer {name!r} packs the mixture-of-experts weights "
            f"({', '.join(EXPERT_WEIGHTS)}) in a form the fused MoE kernel does not read; "
            "accepted for a model with experts: no weight quantizer, 'int8' or 'fp8' (8-bit "
            "rows with a scale each)")


@hookimpl
def infergraft_prepare_plan(plan, spec):
    """Refuse, before any weight loads, a weight quantiser that would pack the experts in
    a form the fused MoE kernel cannot read (int4's groups; GPTQ / AWQ checkpoints)."""
    if spec is None or not getattr(spec, "has_experts", False):
        return None
    from infergraft.core.plugin_manager import get_plugin_manager

    layer = next(i for i in range(spec.num_layers) if spec.layer(i).experts is not None)
    registered = get_plugin_manager().quantizers()
    for name in plan.quantizers:
        q = registered.get(name) if name in registered else None
        if q is None or q.applies_to != "weights" or \
                not q.quantizes(f"layers.{layer}.experts_gate_up.weight"):
            continue
        if q.scaled_rows(q.pack(torch.ones(1, 128))) is None:
            raise PlanError(f"{spec.architecture}: {_quantizer_refusal(q)}")
    return None


def expert_rules(spec, *, checkpoint: str, gate: str, up: str, down: str,
                 router: str = "gate", stacked: str = "model.layers.{i}.mlp"):
    """(rules, alternatives) of a weight map for the layers with experts: a checkpoint's
    one tensor an expert, ``{checkpoint}.experts.{j}.{gate|up|down}.weight`` (``{i}`` the
    layer), filling the stacked slots part by part, and its router
    ``{checkpoint}.{router}.weight``; or, as transformers 5 holds them in memory,
    ``{stacked}.experts.gate_up_proj`` [E, 2I, H] and ``.down_proj`` [E, H, I] whole
    (and the router at ``{stacked}.gate.weight``). Concrete layer numbers: dense layers
    may sit between (Qwen3-MoE's ``mlp_only_layers``)."""
    rules, alternatives = [], []
    for i in range(spec.num_layers):
        experts = spec.layer(i).experts
        if experts is None:
            continue
        src, mem, dst = checkpoint.format(i=i), stacked.format(i=i), f"layers.{i}."
        rules.append(WeightRule(f"{src}.{router}.weight", dst + "router.weight"))
        if f"{mem}.gate.weight" != f"{src}.{router}.weight":
            alternatives.append(WeightRule(f"{mem}.gate.weight", dst + "router.weight"))
        for j in range(experts.num_experts):
            expert = f"{src}.experts.{j}."
            rules += [WeightRule(expert + gate + ".weight", dst + "experts_gate_up.weight",
                                 part=2 * j),
                      WeightRule(expert + up + ".weight", dst + "experts_gate_up.weight",
                                 part=2 * j + 1),
                      WeightRule(expert + down + ".weight", dst + "experts_down.weight",
                                 part=j)]
        alternatives += [WeightRule(f"{mem}.experts.gate_up_proj", dst + "experts_gate_up.weight",
                                    stacked=True),
                         WeightRule(f"{mem}.experts.down_proj", dst + "experts_down.weight",
                                    stacked=True)]
    return tuple(rules), tuple(alternatives)


def dense_mlp_rules_where_dense(rules, spec) -> tuple:
    """``rules`` (a LLaMA-shaped map's) with those of the dense MLP's slots (gate_up,
    down) given for the layers without experts only, by their numbers."""
    dense = [i for i in range(spec.num_layers) if spec.layer(i).experts is None]
    out = []
    for r in rules:
        if "{i}" in r.slot and r.slot.split(".")[2] in ("gate_up", "down"):
            out += [attrs.evolve(r, source=r.source.replace("{i}", str(i)),
                                 slot=r.slot.replace("{i}", str(i))) for i in dense]
        else:
            out.append(r)
    return tuple(out)


LAYERS = (
    LayerImpl("mlp", "moe", MixtureOfExperts,
              "mixture of experts: softmax top-k routing, SwiGLU experts (fused MoE kernel)"),
)


@hookimpl
def infergraft_register_layers(register):
    for impl in LAYERS:
        register(impl)
