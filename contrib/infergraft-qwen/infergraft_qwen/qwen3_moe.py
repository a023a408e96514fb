"""infergraft injection policy for Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention
(this package's ``qwen3``: an RMSNorm over each head of q and of k before RoPE) and
infergraft's built-in mixture-of-experts MLP (``moe``, infergraft.policies.moe_layers)
composed by name, as any third party composes parts it did not write.

A layer's MLP is a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``
(softmax over all experts, the top ``num_experts_per_tok``, renormalised only where
``norm_topk_prob``) where HF makes it one: not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the other layers keep a dense MLP of
``intermediate_size``. Weights: a checkpoint's ``mlp.experts.{j}.gate_proj`` /
``up_proj`` / ``down_proj`` and ``mlp.gate`` (the router), or transformers 5's stacked
``mlp.experts.gate_up_proj`` / ``down_proj`` of a model in memory.
"""
import attrs

from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy
from infergraft.core.spec import ExpertSpec, LayerSpec
from infergraft.policies.llama import llama_like_spec, llama_like_weight_map
from infergraft.policies.moe_layers import dense_mlp_rules_where_dense, expert_rules

from .qwen2 import sliding_window
from .qwen3 import _QK_NORM_RULES, ATTENTION, qk_norm_slots

#: hook contract versions this plugin is written against
INFERGRAFT_CONTRACT = ">=1,<2"


def sparse_layers(config, policy: str) -> list[int]:
    """The layers whose MLP is a mixture of experts, as Qwen3MoeDecoderLayer picks them."""
    step, only = getattr(config, "decoder_sparse_step", 1), getattr(config, "mlp_only_layers", None)
    only = [] if only is None else only
    layers = config.num_hidden_layers
    if isinstance(step, bool) or not isinstance(step, int) or step < 1 or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise UnsupportedModelError(
            f"policy {policy!r}: decoder_sparse_step={step!r} and mlp_only_layers={only!r} "
            "cannot pick the sparse layers; accepted: decoder_sparse_step an integer >= 1, "
            f"mlp_only_layers a list of layer numbers (0 .. {layers - 1})")
    if getattr(config, "num_experts", 0) in (0, None):
        return []
    return [i for i in range(layers) if i not in only and (i + 1) % step == 0]


class Qwen3MoePolicy(Policy):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)

    def describe(self, config):
        self.check(config)
        arch = "Qwen3MoeForCausalLM"
        spec = llama_like_spec(config, architecture=arch,
                               sliding_window=sliding_window(config, self.name, arch))
        sparse = sparse_layers(config, self.name)
        experts = ExpertSpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                             intermediate_size=config.moe_intermediate_size,
                             renormalize=bool(config.norm_topk_prob)) if sparse else None
        slots = qk_norm_slots(spec.head_dim)
        layers = tuple(LayerSpec(attention=ATTENTION.name, slots=slots, mlp="moe", experts=experts)
                       if i in sparse else LayerSpec(attention=ATTENTION.name, slots=slots)
                       for i in range(spec.num_layers))
        return attrs.evolve(spec, layers=layers)

    def weight_map(self, spec):
        wmap = llama_like_weight_map(spec)  # the LLaMA key names, the dense layers' MLP too
        rules, alternatives = expert_rules(spec, checkpoint="model.layers.{i}.mlp",
                                           gate="gate_proj", up="up_proj", down="down_proj")
        return attrs.evolve(wmap, rules=dense_mlp_rules_where_dense(wmap.rules, spec)
                            + _QK_NORM_RULES + rules, alternatives=alternatives)


@hookimpl
def infergraft_register_policies(register):
    register(Qwen3MoePolicy())
