"""Mistral family (MistralForCausalLM): the LLaMA layout plus sliding-window attention.

Window convention (HF ``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``):
the query at position p sees keys p-W+1 .. p, i.e. exactly W positions including itself,
in prefill and in decode. ``sliding_window=None`` is full attention.
"""
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.policy import Policy, WeightMap
from infergraft.core.spec import ModelSpec

from .llama import llama_like_spec, llama_like_weight_map


def sliding_window_from_config(config, architecture: str):
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"{architecture}: sliding_window must be a positive integer "
                                    f"or None (full attention), got {window!r}")
    return window  # HF Mistral applies it to every layer


class MistralPolicy(Policy):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        arch = "MistralForCausalLM"
        return llama_like_spec(config, architecture=arch,
                               sliding_window=sliding_window_from_config(config, arch))

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        return llama_like_weight_map(spec)  # same HF key names as LLaMA


@hookimpl
def infergraft_register_policies(register):
    register(MistralPolicy())
