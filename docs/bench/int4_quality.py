"""int4-g128 quality on the demo model (SmolLM2-135M-Instruct, CPU, float32 activations):
the perplexity ratio to the float32 model over the quality tests' 2,048 tokens (pydoc's
"assignment" and "class" topics, never calibrated on), the greedy answer to the demo
question and the answer's first-token margin, for round to nearest at load time (the int4
plugin), GPTQ, and GPTQ with act-order over several calibration seeds. Each quantisation
takes one to three minutes on two cores; the checkpoints go to a temporary directory.

    python docs/bench/int4_quality.py [ACT_ORDER_SEEDS (default 0,1,2,3)] [--plain-gptq]
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

from infergraft.core.quantize.model import quantize_model

# the quality tests' own engine, text, perplexity and question: the figures here are what
# their thresholds are held against
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from demo_support import QUESTION, demo_engine, perplexity, text_ids  # noqa: E402


def answer(engine) -> tuple[str, float]:
    """The greedy answer and its first token's margin (top-1 minus top-2 probability)."""
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                add_generation_prompt=True, tokenize=False)
    top2 = engine.logits(engine.tokenizer.encode(chat))[-1].softmax(-1).topk(2).values
    text = engine.generate(chat, max_new_tokens=32)[0].text
    return text, float(top2[0] - top2[1])


def row(name, engine, ids, base, seconds):
    ratio = perplexity(engine, ids) / base
    text, margin = answer(engine)
    short = text.replace("\n", " ")[:48]
    print(f"| {name} | {ratio:.3f} | {'Paris' in text} | {margin:.3f} | {short} | "
          f"{seconds:.0f} |", flush=True)


def main(argv):
    plain = "--plain-gptq" in argv
    args = [a for a in argv if not a.startswith("--")]
    seeds = [int(s) for s in (args[0] if args else "0,1,2,3").split(",")]
    dense = demo_engine(["paged"])
    ids = text_ids(dense)
    base = perplexity(dense, ids)
    print(f"float32 perplexity {base:.3f} over {len(ids)} tokens; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| int4, groups of 128 | ppl ratio | Paris | first-token margin | answer | "
          "quantise s |\n|---|---|---|---|---|---|")
    row("float32 (no quantisation)", dense, ids, base, 0)
    del dense
    row("round to nearest (load time)", demo_engine(["paged", "int4"]), ids, base, 0)
    runs = [("GPTQ, seed 0", dict(seed=0))] if plain else []
    runs += [(f"GPTQ act-order, seed {s}", dict(seed=s, act_order=True)) for s in seeds]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, kw) in enumerate(runs):
            out = Path(tmp) / str(i)
            start = time.perf_counter()
            quantize_model("smollm2-135m", out, group_size=128, **kw)
            row(name, demo_engine(["paged", "int4"], model=out), ids, base,
                time.perf_counter() - start)


if __name__ == "__main__":
    main(sys.argv[1:])
