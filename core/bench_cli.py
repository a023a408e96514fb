"""``infergraft bench`` (also ``python -m infergraft.core.bench_cli``): table, JSON, plot."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from .bench import run_benchmark

SHAPES = {  # random-initialised LLaMA shapes: name -> LlamaConfig overrides
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=4096),
    # GQA (8 kv heads for 32 query heads): the large-batch attention plans differ from MHA's
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                 max_position_embeddings=2048),
}


def load_models(name: str, device, dtype, max_batch_size: int, max_seq_len: int,
                plugins=(), max_prefill_tokens: int | None = None):
    """(hf_model, engine) on the same weights; ``plugins`` added to the engine's (the
    paged cache on CUDA), e.g. ("int8",); ``max_prefill_tokens``: the engine's prompt
    tokens a step (None: its default)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from . import build

    if name in SHAPES:
        cfg = LlamaConfig(**SHAPES[name], rms_norm_eps=1e-5, tie_word_embeddings=False)
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    else:
        from .demo import ensure_demo_model
        from .source import ALIASES

        path = ensure_demo_model(name) if name in ALIASES else name
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    base = ["paged"] if str(device).startswith("cuda") else []
    return hf, build(hf, plugins=base + list(plugins) or None,
                     dtype=dtype, device=device, max_batch_size=max_batch_size,
                     max_seq_len=max_seq_len, max_prefill_tokens=max_prefill_tokens)


def markdown_table(results, bw: float) -> str:
    by = {(r.system, r.batch): r for r in results}
    systems = sorted({r.system for r in results}, key=lambda s: (s != "infergraft", s))
    hf = [s for s in systems if s != "infergraft"]
    head = ["batch"] + [f"{s} TPOT ms" for s in systems] + [f"{s} TTFT ms" for s in systems] + \
        [f"speed-up vs {s}" for s in hf] + ["roofline TPOT ms", "ours / roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sorted({r.batch for r in results}):
        ours = by.get(("infergraft", b))
        row = [str(b)] + [f"{by[(s, b)].tpot_ms:.2f}" for s in systems] + \
            [f"{by[(s, b)].ttft_ms:.1f}" for s in systems]
        row += [f"{by[(s, b)].tpot_ms / ours.tpot_ms:.2f}x" if ours else "-" for s in hf]
        r0 = ours or by[(systems[0], b)]
        row += [f"{r0.roofline_ms:.2f}", f"{r0.roofline_fraction:.0%}" if ours else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"\ncopy bandwidth (roofline): {bw / 1e9:.1f} GB/s")
    return "\n".join(lines)


def plot(results, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in sorted({r.system for r in results}):
        rs = sorted((r for r in results if r.system == system), key=lambda r: r.batch)
        ax.plot([r.batch for r in rs], [r.tpot_ms for r in rs], marker="o", label=system)
    rs = sorted((r for r in results if r.system == results[0].system), key=lambda r: r.batch)
    ax.plot([r.batch for r in rs], [r.roofline_ms for r in rs], "k--", label="HBM roofline")
    ax.set(xscale="log", xlabel="batch size", ylabel="TPOT (ms)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infergraft bench", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help=f"alias, local dir, or a random shape: {', '.join(SHAPES)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", default=None, help="comma list (default 1,8,32,64 GPU; 1,8 CPU)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 512 GPU, 64 CPU")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 GPU, 32 CPU")
    p.add_argument("--systems", default=None,
                   help="comma list of infergraft,hf-eager,hf-static (static on CUDA only)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens our engine admits a step (default: the engine's, "
                        "max(prompt + new tokens, 2048)); a batch is timed only once all of "
                        "it decodes, so a large batch needs its prompts admitted in time")
    p.add_argument("--out", default=".bench", help="folder for results.json and tpot.png")
    p.add_argument("--plugins", default="",
                   help="comma list of plugins for our engine, e.g. int8 (weights; the "
                        "roofline then counts the packed bytes)")


def run(args) -> int:
    gpu = args.device.startswith("cuda")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if gpu else "float32")]
    batches = [int(b) for b in (args.batches or ("1,8,32,64" if gpu else "1,8")).split(",")]
    prompt_len = args.prompt_len or (512 if gpu else 64)
    new_tokens = args.new_tokens or (64 if gpu else 32)
    systems = (args.systems or ("infergraft,hf-eager,hf-static" if gpu else "infergraft,hf-eager")).split(",")
    plugins = [p for p in args.plugins.split(",") if p]
    hf, engine = load_models(args.model, args.device, dtype, max(batches), prompt_len + new_tokens,
                             plugins, args.max_prefill_tokens)
    print(engine.plan, file=sys.stderr)
    results, bw = run_benchmark(hf, engine, batches, prompt_len, new_tokens, systems,
                                log=lambda m: print(m, file=sys.stderr))
    device_name = torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine()
    title = f"{args.model} {str(dtype)[6:]} on {device_name}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, bw)
    (out / "results.json").write_text(json.dumps({
        "model": args.model, "dtype": str(dtype), "device": device_name,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "copy_bandwidth_Bps": bw,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M"),
        "results": [dict(r.__dict__ if hasattr(r, "__dict__") else {}, **{
            "system": r.system, "batch": r.batch, "ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms,
            "roofline_ms": r.roofline_ms, "tokens_per_s": r.tokens_per_s}) for r in results],
    }, indent=2))
    plotted = plot(results, out / "tpot.png", title)
    print(f"## {title}, prompt {prompt_len}, {new_tokens} new tokens\n\n{table}")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'tpot.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
