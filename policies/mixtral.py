"""Mixtral family (MixtralForCausalLM): Mistral's attention (its sliding window, where
the config has one) and a mixture of experts as every layer's MLP: the router's softmax
over all ``num_local_experts``, the top ``num_experts_per_tok``, always renormalised
(HF's MixtralTopKRouter), each expert a SwiGLU MLP of ``intermediate_size``: the MLP
``moe`` of policies/moe_layers.py.

Weights: a checkpoint has one tensor an expert (``block_sparse_moe.experts.{j}.w1`` gate,
``w3`` up, ``w2`` down, ``block_sparse_moe.gate`` the router); a model in memory under
transformers 5 holds them stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], ``mlp.gate``). Either loads.
"""
import attrs

from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy, WeightMap
from infergraft.core.spec import ExpertSpec, LayerSpec, ModelSpec

from .llama import llama_like_spec, llama_like_weight_map
from .mistral import sliding_window_from_config
from .moe_layers import dense_mlp_rules_where_dense, expert_rules


class MixtralPolicy(Policy):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        arch = "MixtralForCausalLM"
        spec = llama_like_spec(config, architecture=arch,
                               sliding_window=sliding_window_from_config(config, arch))
        experts = ExpertSpec(num_experts=config.num_local_experts,
                             top_k=config.num_experts_per_tok,
                             intermediate_size=config.intermediate_size, renormalize=True)
        return attrs.evolve(spec, layers=(LayerSpec(mlp="moe", experts=experts),) * spec.num_layers)

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        wmap = llama_like_weight_map(spec)  # the attention's, norms', embeddings' and head's
        rules, alternatives = expert_rules(spec, checkpoint="model.layers.{i}.block_sparse_moe",
                                           gate="w1", up="w3", down="w2")
        return attrs.evolve(wmap, rules=dense_mlp_rules_where_dense(wmap.rules, spec) + rules,
                            alternatives=alternatives)


@hookimpl
def infergraft_register_policies(register):
    register(MixtralPolicy())
