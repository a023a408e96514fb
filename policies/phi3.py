"""Phi-3 / Phi-4 family (``Phi3ForCausalLM``: Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini).

LLaMA-shaped (RMSNorm, GQA, SiLU-gated MLP, no biases) with its projections fused in the
checkpoint: ``qkv_proj`` holds q, k and v rows in that order and ``gate_up_proj`` gate
then up rows (HF splits them so: ``qkv[..., :q]``, ``chunk(2)``), the layout of our
``qkv`` and ``gate_up`` slots, so each fills its slot whole (the weight loader and the
tensor-parallel planner then cut it by the slot's parts, as for LLaMA's).

What Phi-3 configs add, each read by the shared pieces:
- LongRoPE (``rope_type`` "longrope", "su" in the first configs): short and long factors
  per frequency, cos and sin scaled by sqrt(1 + ln(s) / ln(original)) with s =
  max_position_embeddings / original_max_position_embeddings (core/rope.py); a sequence
  longer than original_max_position_embeddings reads the long table at every position,
  and one that grows past it is recomputed: HF's forward over the whole sequence
  (core/long_rope.py; transformers 5.17's generate differs there);
- partial rotary (``partial_rotary_factor``, 0.75 in Phi-4-mini): the first rotary_dim
  dims of each head rotate, the rest pass through (RopeSpec.rotary_dim; the fused qkv
  GEMM keeps RoPE out of its epilogue then: kernels/fused_linear.py);
- a sliding window (Phi-3-mini-4k: 2047), with Mistral's convention (mistral.py);
- tied embeddings (Phi-4-mini).
"""
import attrs

from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy, WeightMap, WeightRule
from infergraft.core.spec import ModelSpec

from .llama import llama_like_spec
from .mistral import sliding_window_from_config

ARCHITECTURE = "Phi3ForCausalLM"

_RULES = (
    WeightRule("model.embed_tokens.weight", "embed.weight"),
    WeightRule("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    # fused in the checkpoint in our slot's order: the whole slot at once
    WeightRule("model.layers.{i}.self_attn.qkv_proj.weight", "layers.{i}.qkv.weight"),
    WeightRule("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.o.weight"),
    WeightRule("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
    WeightRule("model.layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.gate_up.weight"),
    WeightRule("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.down.weight"),
    WeightRule("model.norm.weight", "final_norm.weight"),
)


class Phi3Policy(Policy):
    name = "phi3"
    architectures = (ARCHITECTURE,)
    model_types = ("phi3",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        spec = llama_like_spec(config, architecture=ARCHITECTURE,
                               sliding_window=sliding_window_from_config(config, ARCHITECTURE))
        # HF's Phi-3 projections have no biases, whatever attention_bias / mlp_bias say
        return attrs.evolve(spec, qkv_bias=False, o_bias=False, mlp_bias=False)

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        rules, aliases = _RULES, ()
        if spec.tie_embeddings:  # checkpoints keep either name of the shared tensor
            aliases = (("lm_head.weight", "model.embed_tokens.weight"),)
        else:
            rules += (WeightRule("lm_head.weight", "lm_head.weight"),)
        return WeightMap(rules, ignore=(r".*rotary_emb\.\w*inv_freq$",), aliases=aliases)


@hookimpl
def infergraft_register_policies(register):
    register(Phi3Policy())
