"""One forward pass over a long prompt on the CPU: the demo model's 2,048 tokens of
pydoc's topics through ``engine.logits`` (every position's logits, as the perplexity tests
ask) on the paged and contiguous caches, beside HF transformers' own forward on the same
weights and ids, and the floor of its FLOPs at this host's float32 matmul rate, all in one
process. ``--before``: also the paged cache with the attention reference's 3-D inputs
given to torch as they were before 59d324b (its math path).

``python docs/bench/cpu_long_forward.py [--tokens 2048] [--rounds 3] [--before]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests"))
from demo_support import TEXT, demo_engine  # noqa: E402

from infergraft.kernels import attention_ref  # noqa: E402


def timed(fn, rounds: int) -> float:
    """Median seconds of ``rounds`` calls, after one untimed."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate() -> float:
    """float32 FLOP/s of a 2048 x 576 x 1536 matmul (the demo model's MLP shape)."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    return 2 * 2048 * 576 * 1536 / timed(lambda: a @ b, 5)


def forward_flops(spec, n: int) -> float:
    """The matmuls of one forward over n tokens: projections, the LM head (every
    position), causal attention (QK^T and PV over half the square)."""
    h, layers, d = spec.hidden_size, spec.num_layers, spec.head_dim
    q, kv, i = spec.num_heads * d, spec.num_kv_heads * d, spec.intermediate_size
    per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * spec.vocab_size
    return 2 * n * per_token + layers * 2 * spec.num_heads * d * n * n


def old_sdpa(q, k, v, *, scale, attn_mask=None, is_causal=False, softcap=None):
    """attention_ref.sdpa before 59d324b: 3-D inputs straight to torch."""
    assert softcap is None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", action="store_true")
    args = p.parse_args()
    paged = demo_engine(["paged"])
    ids = paged.tokenizer.encode(TEXT)[:args.tokens]
    rows = {"paged": timed(lambda: paged.logits(ids), args.rounds)}
    contiguous = demo_engine(["contiguous"])
    rows["contiguous"] = timed(lambda: contiguous.logits(ids), args.rounds)
    if args.before:
        new, attention_ref.sdpa = attention_ref.sdpa, old_sdpa
        import infergraft.kernels.varlen_attention as varlen
        varlen.sdpa = old_sdpa
        rows["paged, before 59d324b"] = timed(lambda: paged.logits(ids), args.rounds)
        attention_ref.sdpa = varlen.sdpa = new
    from transformers import AutoModelForCausalLM

    from infergraft.core.loading.demo import ensure_demo_model

    hf = AutoModelForCausalLM.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True),
                                              dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        rows["HF transformers (its default attention)"] = timed(lambda: hf(x).logits, args.rounds)
    floor = forward_flops(paged.spec, len(ids)) / matmul_rate()
    print(f"{len(ids)} tokens, one forward, median of {args.rounds}, "
          f"{torch.get_num_threads()} threads")
    print("| forward | seconds | of the FLOPs floor |\n| --- | ---: | ---: |")
    for name, s in rows.items():
        print(f"| {name} | {s:.2f} | {floor / s:.0%} |")
    print(f"| floor (FLOPs at the measured matmul rate) | {floor:.2f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
