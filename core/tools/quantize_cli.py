"""``infergraft quantize MODEL --out DIR``: a dense LLaMA / Mistral model written as a 4-bit
HF GPTQ checkpoint (``core.quantize.quantize_model``), calibrated by GPTQ on Python's own
docs or rounded to nearest (``--method rtn``). ``infergraft generate --model DIR`` (or
``core.build(DIR)``) then runs it on the ``int4`` quantiser's kernels.

Exit status: 0 written, 2 an error (one line on stderr; nothing written).
"""
from __future__ import annotations

import argparse
import sys

from ..quantize.model import DEFAULT_TOKENS, GROUP_SIZES, METHODS, SEQ_LEN, quantize_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Write a dense LLaMA / Mistral model as a 4-bit HF GPTQ checkpoint, "
                     "calibrated by GPTQ on Python's own docs or rounded to nearest (--method "
                     "rtn); core.build(DIR) or `infergraft generate --model DIR` runs it.")
    p.add_argument("model", help="local HF model directory (safetensors) or alias "
                                 "(smollm2-135m)")
    p.add_argument("--out", required=True,
                   help="directory to write (must not exist, or be empty)")
    p.add_argument("--method", default="gptq",
                   help=f"{' or '.join(METHODS)} (default gptq; rtn: round to nearest, "
                        "no calibration)")
    p.add_argument("--bits", type=int, default=4, help="4 (the only one written)")
    p.add_argument("--group-size", type=int, default=128,
                   help=f"input columns per scale and zero-point: "
                        f"{', '.join(map(str, GROUP_SIZES))} (default 128)")
    p.add_argument("--calibration-tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"GPTQ: tokens of calibration text, in sequences of {SEQ_LEN} "
                        f"(default {DEFAULT_TOKENS})")
    p.add_argument("--seed", type=int, default=0,
                   help="GPTQ: draws the calibration sequences (default 0)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: columns in descending order of their inputs' energy, each "
                        "group's scale and zero fixed first (static groups: the groups stay "
                        "contiguous and the checkpoint loads as any other); default: on "
                        "for gptq (--no-act-order: off, plain GPTQ)")


def run(args) -> int:
    done = quantize_model(args.model, args.out, method=args.method, bits=args.bits,
                          group_size=args.group_size,
                          calibration_tokens=args.calibration_tokens, seed=args.seed,
                          act_order=args.act_order, progress=True)
    calibrated = f", {done.calibration_tokens} calibration tokens" if done.method == "gptq" \
        else ""
    calibrated += ", act-order" if done.act_order else ""
    print(f"wrote {done.out}: {done.projections} projections, {done.method} int4 in groups of "
          f"{done.group_size}{calibrated}, {done.seconds:.1f} s", file=sys.stderr)
    return 0
