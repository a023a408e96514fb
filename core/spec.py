"""ModelSpec: what the engine needs to know about a decoder, taken from the HF config."""
from __future__ import annotations

from typing import Optional

import attrs


@attrs.frozen
class RopeSpec:
    """Rotary embedding settings (transformers 5: ``config.rope_parameters``)."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rotary_dim: Optional[int] = None  # None: the whole head_dim


@attrs.frozen
class ModelSpec:
    """Shape and flavour of a decoder-only transformer, independent of any HF class."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    norm: str = "rms"  # rms | layer
    norm_eps: float = 1e-6
    activation: str = "silu"  # silu | gelu_tanh | gelu
    gated_mlp: bool = True  # gate_up fused (LLaMA) or a single fc_in (GPT-2)
    position: str = "rope"  # rope | learned
    rope: Optional[RopeSpec] = None
    sliding_window: Optional[int] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None

    def __attrs_post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def param_count(self) -> int:
        """Parameters of the fused model (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = h * i * (3 if self.gated_mlp else 2)
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias + \
            (i * (2 if self.gated_mlp else 1) + h) * self.mlp_bias
        per_layer = attn + mlp + norms + biases
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        pos = self.max_position * h if self.position == "learned" else 0
        return self.num_layers * per_layer + embed + pos + h * (2 if self.norm == "layer" else 1)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused projection's rows: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D],
    k [T, Hkv, D], v [T, Hkv, D] (the fused slot's order, core.model.slot_layout)."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))
