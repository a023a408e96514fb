"""A length-bounded string's two grammars compiled side by side: the pattern form (one
automaton state a character) and xgrammar's bounded repetition with its character class
corrected to JSON's (``schema_check.schema_grammar``, what the engine compiles).

``python docs/bench/structured_compile.py [--schemas 10] [--tokenizer DIR] [--threads 1,2]``:
the overhead bench's schemas (``structured_overhead.schema``: string bounds 1..20-59)
against the demo tokenizer (or DIR's), xgrammar's cache off, one after another, with
``--threads`` threads a compilation; ms a schema.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_overhead import schema  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemas", type=int, default=10)
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the demo model's)")
    p.add_argument("--threads", default="1,2",
                   help="xgrammar threads a compilation, for the corrected grammar (the "
                        "pattern form: the first)")
    args = p.parse_args(argv)
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from infergraft.core.loading.demo import ensure_demo_model
    from infergraft.core.structured.schema_check import (schema_grammar,
                                                         with_string_lengths_as_patterns)

    tok = AutoTokenizer.from_pretrained(args.tokenizer or
                                        ensure_demo_model("smollm2-135m", quiet=True))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    threads = [int(t) for t in args.threads.split(",")]
    forms = [("pattern", threads[0], lambda s: xgr.Grammar.from_json_schema(
        json.dumps(with_string_lengths_as_patterns(s)), any_whitespace=False))]
    forms += [("corrected", t, lambda s: schema_grammar(xgr, json.dumps(s))) for t in threads]
    requests = [i * 40 // args.schemas for i in range(args.schemas)]
    for name, n_threads, grammar_of in forms:
        compiler = xgr.GrammarCompiler(info, max_threads=n_threads, cache_enabled=False)
        name = f"{name}, {n_threads} thread{'s' if n_threads > 1 else ''}"
        ms = []
        for i in requests:
            t0 = time.perf_counter()
            compiler.compile_grammar(grammar_of(schema(i, 0)))
            ms.append((time.perf_counter() - t0) * 1e3)
        print(f"{name:<21} ms a schema: median {statistics.median(ms):7.1f}  min {min(ms):7.1f}"
              f"  max {max(ms):7.1f}  ({' '.join(f'{x:.1f}' for x in ms)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
