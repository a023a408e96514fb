"""infergraft injection policy for Qwen3 (``Qwen3ForCausalLM``), and the layer it needs.

Qwen3 is LLaMA-shaped (RMSNorm, RoPE, GQA, SiLU-gated MLP, no biases by default) with
two differences: an RMSNorm over each head's head_dim on q and on k, after the projection
and before RoPE (``q_norm`` / ``k_norm``: one [head_dim] weight each, shared by the
heads), and a head_dim the config gives (not hidden / heads). The attention is the LLaMA
one plus those norms, registered as attention ``qwen3`` through
``infergraft_register_layers`` from this package, the way any third party adds a layer;
the policy's spec names it for every layer and declares the norms' weights.
"""
import attrs

from infergraft.core.hookspecs import hookimpl
from infergraft.core.layer import LayerImpl
from infergraft.core.policy import Policy, WeightRule
from infergraft.core.spec import LayerSpec
from infergraft.policies.llama import llama_like_spec, llama_like_weight_map
from infergraft.policies.llama_layers import LlamaAttention, Norm

from .qwen2 import sliding_window

#: hook contract versions this plugin is written against
INFERGRAFT_CONTRACT = ">=1,<2"


class QKNormAttention(LlamaAttention):
    """The LLaMA attention with an RMSNorm over head_dim on each head of q and of k
    before RoPE. Slots: ``qkv``, ``o`` (the LLaMA attention's), ``q_norm``, ``k_norm``.

    In the fused decode layer its qkv GEMM still takes the input norm in its prologue,
    but RoPE and the K/V write cannot go into its epilogue (the per-head norm comes
    between): q and k are normed and rotated after the GEMM, then the cache writes K/V."""

    rope_in_qkv_epilogue = False

    def __init__(self, layer, spec, ops):
        super().__init__(layer, spec, ops)
        layer.q_norm = Norm("rms", spec.norm_eps, ops)
        layer.k_norm = Norm("rms", spec.norm_eps, ops)

    def rotate_inputs(self, layer, q, k):
        # q [T, Hq, D], k [T, Hkv, D] (views of the qkv rows): each head's D normed
        d = q.shape[-1]
        q = layer.q_norm(q.reshape(-1, d))[0].view(q.shape)
        k = layer.k_norm(k.reshape(-1, d))[0].view(k.shape)
        return q, k


ATTENTION = LayerImpl("attention", "qwen3", QKNormAttention,
                      "the LLaMA attention with per-head RMSNorm on q and k before RoPE")


def qk_norm_slots(head_dim: int) -> tuple:
    """The weights ``QKNormAttention`` adds to a layer (a LayerSpec's ``slots``)."""
    return (("q_norm.weight", (head_dim,)), ("k_norm.weight", (head_dim,)))


_QK_NORM_RULES = tuple(
    WeightRule(f"model.layers.{{i}}.self_attn.{p}_norm.weight", f"layers.{{i}}.{p}_norm.weight")
    for p in "qk")


class Qwen3Policy(Policy):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    def describe(self, config):
        self.check(config)
        arch = "Qwen3ForCausalLM"
        spec = llama_like_spec(config, architecture=arch,
                               sliding_window=sliding_window(config, self.name, arch))
        layer = LayerSpec(attention=ATTENTION.name, slots=qk_norm_slots(spec.head_dim))
        return attrs.evolve(spec, layers=(layer,) * spec.num_layers)

    def weight_map(self, spec):
        wmap = llama_like_weight_map(spec)  # the LLaMA key names, attention_bias included
        return attrs.evolve(wmap, rules=wmap.rules + _QK_NORM_RULES)


@hookimpl
def infergraft_register_layers(register):
    register(ATTENTION)


@hookimpl
def infergraft_register_policies(register):
    register(Qwen3Policy())
