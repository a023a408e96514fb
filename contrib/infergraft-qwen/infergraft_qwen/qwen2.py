"""infergraft injection policy for Qwen2 (``Qwen2ForCausalLM``).

Qwen2 is LLaMA-shaped (RMSNorm, RoPE, GQA, SiLU-gated MLP) with a bias on the q, k and v
projections only, so the LLaMA layers serve it from a ModelSpec and the LLaMA weight
map; no modelling code is needed. Registered through the ``infergraft`` entry-point
group (plugin ``qwen2``), exactly like any third-party plugin.
"""
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy
from infergraft.policies.llama import llama_like_spec, llama_like_weight_map

#: hook contract versions this plugin is written against
INFERGRAFT_CONTRACT = ">=1,<2"


def sliding_layers(config) -> list[int]:
    """Indices of layers HF runs with sliding-window attention.

    transformers derives ``layer_types`` from ``use_sliding_window`` and
    ``max_window_layers`` (layers >= max_window_layers slide); older configs lack it.
    """
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return list(range(getattr(config, "max_window_layers", 0), config.num_hidden_layers))
    return []


def sliding_window(config, policy: str, architecture: str):
    """The window every layer slides over, or None for full attention; a window on only
    some layers is refused (the spec's sliding window is the whole model's)."""
    sliding, layers = sliding_layers(config), config.num_hidden_layers
    if not sliding:
        return None
    window = getattr(config, "sliding_window", None)
    if len(sliding) != layers or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(
            f"policy {policy!r}: {architecture} with sliding-window attention on "
            f"layers {sliding} of 0..{layers - 1} (use_sliding_window="
            f"{getattr(config, 'use_sliding_window', None)}, sliding_window={window!r}, "
            f"max_window_layers={getattr(config, 'max_window_layers', None)}) is not "
            "supported; supported: full attention on every layer "
            "(use_sliding_window=False, as released Qwen checkpoints ship) or one "
            "positive sliding_window on every layer (max_window_layers=0)")
    return window


class Qwen2Policy(Policy):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    def describe(self, config):
        self.check(config)
        window = sliding_window(config, self.name, "Qwen2ForCausalLM")
        return llama_like_spec(config, architecture="Qwen2ForCausalLM", qkv_bias=True,
                               sliding_window=window)

    def weight_map(self, spec):
        return llama_like_weight_map(spec)


@hookimpl
def infergraft_register_policies(register):
    register(Qwen2Policy())
