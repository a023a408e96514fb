"""xgrammar against llguidance on the same constraints and the same tokenizer (the demo
model's, SmolLM2's 49,152-token byte-level BPE): which one the ``grammar`` processor
runs on (core/structured/grammar.py; the verdict is in structured.md).

``python docs/bench/structured_backends.py [--repeats 5] [--out FILE.json]``

Per library: the vocabulary's compilation (once per tokenizer), then for each constraint
(JSON schemas, regexes, a grammar: each library's own syntax for the same language) the
compilation (xgrammar's cache off, so each repeat compiles; llguidance builds lazily, so
its matcher's construction is the compilation it does up front), the first mask, and the
mean mask and accept time walking a valid output token by token, as a decode does. Each
figure is the median of ``repeats`` runs, in one process, one thread each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {
    "type": "string"}, "population": {"type": "integer"}}, "required": ["name", "country",
                                                                         "population"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999999},
    "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "gift": {"type": "boolean"}}, "required": ["sku", "qty", "gift"]}},
    "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"]}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer",
                                                                 "boolean"][i % 3]}
                                         for i in range(16)},
        "required": [f"field_{i}" for i in range(16)]}
EBNF = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") '
        'factor)*\nfactor ::= [0-9]+ | "(" expr ")"')
LARK = ('start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
        'factor: /[0-9]+/ | "(" expr ")"')
CASES = [  # name, kind, xgrammar's text, llguidance's text, a valid output
    ("json: city", "json", CITY, CITY,
     '{"name": "Paris", "country": "France", "population": 2102650}'),
    ("json: order (nested)", "json", ORDER, ORDER,
     '{"id": 1234, "items": [{"sku": "ABC-1234", "qty": 2, "gift": false}, {"sku": '
     '"XYZ-0001", "qty": 10, "gift": true}], "status": "paid"}'),
    ("json: 16 fields", "json", WIDE, WIDE, json.dumps(
        {f"field_{i}": ["some text", 12345, True][i % 3] for i in range(16)})),
    ("regex: date", "regex", r"\d{4}-\d{2}-\d{2}", r"\d{4}-\d{2}-\d{2}", "2024-05-17"),
    ("regex: email", "regex", r"[a-z0-9._]{1,20}@[a-z0-9]{1,20}\.(com|org|net)",
     r"[a-z0-9._]{1,20}@[a-z0-9]{1,20}\.(com|org|net)", "jane.doe@example.com"),
    ("grammar: arithmetic", "grammar", EBNF, LARK, "(12+3)*45-6/7"),
]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_ms = (time.perf_counter() - t0) * 1e3
        self.vocab_size = vocab_size

    def compile(self, kind, text):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(text), any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token):
        assert matcher.accept_token(token), token


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt = llguidance, llguidance.torch
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_ms = (time.perf_counter() - t0) * 1e3
        self.vocab_size = vocab_size

    def compile(self, kind, text):
        m = self.llg.LLMatcher
        grammar = (m.grammar_from_json_schema(text) if kind == "json" else
                   m.grammar_from_regex(text) if kind == "regex" else m.grammar_from_lark(text))
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def bitmask(self):
        return self.llt.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask):
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), (token, matcher.get_error())


def measure(lib, tokenizer, repeats: int) -> list[dict]:
    rows = []
    for name, kind, xgr_text, llg_text, output in CASES:
        text = xgr_text if lib.name == "xgrammar" else llg_text
        ids = tokenizer.encode(output, add_special_tokens=False)
        compile_ms = _median_ms(lambda: lib.compile(kind, text), repeats)
        compiled = lib.compile(kind, text)
        bitmask = lib.bitmask()
        first, walk, accept = [], [], []
        for _ in range(repeats):
            m = lib.matcher(compiled)
            t0 = time.perf_counter()
            lib.fill(m, bitmask)
            first.append(time.perf_counter() - t0)
            lib.accept(m, ids[0])
            for token in ids[1:]:
                t0 = time.perf_counter()
                lib.fill(m, bitmask)
                t1 = time.perf_counter()
                lib.accept(m, token)
                walk.append(t1 - t0)
                accept.append(time.perf_counter() - t1)
        rows.append({"library": lib.name, "constraint": name, "tokens": len(ids),
                     "compile_ms": compile_ms,
                     "first_mask_ms": statistics.median(first) * 1e3,
                     "mask_us": statistics.mean(walk) * 1e6,
                     "accept_us": statistics.mean(accept) * 1e6})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer (default: the demo's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from infergraft.core.loading.source import model_directory
    torch.set_num_threads(1)
    path = model_directory(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = len(tokenizer)
    rows, vocab_ms = [], {}
    for cls in (XGrammar, LLGuidance):
        lib = cls(tokenizer, vocab)
        vocab_ms[lib.name] = lib.vocab_ms
        rows += measure(lib, tokenizer, args.repeats)
    print(f"tokenizer: {args.model}, {vocab} tokens; vocabulary compiled once: " +
          ", ".join(f"{k} {v:.0f} ms" for k, v in vocab_ms.items()))
    print(f"{'constraint':<22} {'library':<11} {'tokens':>6} {'compile ms':>10} "
          f"{'1st mask ms':>11} {'mask us':>8} {'accept us':>9}")
    for r in rows:
        print(f"{r['constraint']:<22} {r['library']:<11} {r['tokens']:>6} "
              f"{r['compile_ms']:>10.2f} {r['first_mask_ms']:>11.3f} {r['mask_us']:>8.1f} "
              f"{r['accept_us']:>9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab_ms": vocab_ms, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
