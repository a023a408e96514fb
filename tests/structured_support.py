"""Helpers of the structured-output tests: a tiny random model with an ASCII byte-level
tokenizer (so every output is text a checker can read back exactly), hypothesis
strategies for JSON schemas and regexes, and the checks that an output obeys them."""
import json
import string

import jsonschema
import regex
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.testing.models import random_model, tiny_llama_config

VOCAB, EOS = 260, 257  # tokens 0..127: the ASCII bytes; 257: the stop token


def ascii_tokenizer():
    """Byte-level BPE over the 128 ASCII bytes, one token each (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _byte_to_char()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(128)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def tiny_engine(seed: int = 3, **options):
    hf = random_model(tiny_llama_config(vocab_size=VOCAB, eos_token_id=EOS), seed=seed,
                      scale=5.0)
    options = dict(dict(max_seq_len=384, max_batch_size=8), **options)
    return core.build(hf, tokenizer=ascii_tokenizer(), **options)


# -- JSON schemas: objects with required properties of string, integer, boolean, enum and
#    array types, nested; every string and number bounded, so an output always completes
NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=6)
TEXT = st.text(string.printable, max_size=5)  # quotes, backslashes, newlines included


def scalar_schemas():
    lengths = st.tuples(st.integers(0, 3), st.integers(1, 6)).map(sorted)
    return st.one_of(
        lengths.map(lambda mn: {"type": "string", "minLength": mn[0], "maxLength": mn[1]}),
        st.tuples(st.integers(-300, 300), st.integers(0, 500)).map(
            lambda a: {"type": "integer", "minimum": a[0], "maximum": a[0] + a[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.one_of(TEXT, st.integers(-99, 99), st.booleans()), min_size=1,
                 max_size=4, unique_by=json.dumps).map(lambda xs: {"enum": xs}),
    )


def schemas(depth: int = 2):
    if depth == 0:
        return scalar_schemas()
    inner = schemas(depth - 1)
    arrays = st.tuples(inner, st.integers(0, 1), st.integers(1, 3)).map(
        lambda a: {"type": "array", "items": a[0], "minItems": a[1], "maxItems": a[1] + a[2]})
    objects = st.dictionaries(NAMES, inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})
    return st.one_of(scalar_schemas(), arrays, objects)


def object_schemas():
    return st.dictionaries(NAMES, schemas(1), min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})


# -- regexes from a few shapes: literals (escaped), classes, alternations, bounded
#    repetition; Python's `regex` reads them the same way
LITERAL = st.sampled_from(list("abcxyz019-_.:/")).map(regex.escape)
CLASS = st.sampled_from(["[a-z]", "[0-9]", "[abc]", r"\d", "[A-F0-9]", "[^a-z]"])


def regexes():
    atom = st.one_of(LITERAL, CLASS)
    group = st.lists(st.lists(atom, min_size=1, max_size=3).map("".join), min_size=2,
                     max_size=3).map(lambda alts: "(" + "|".join(alts) + ")")
    piece = st.tuples(st.one_of(atom, group), st.sampled_from(
        ["", "?", "{2}", "{1,3}", "{0,2}"])).map("".join)
    return st.lists(piece, min_size=1, max_size=5).map("".join)


def max_chars(schema: dict) -> int:
    """The longest compact JSON text (", " and ": ") that ``schemas()``' ``schema`` allows:
    with the ASCII tokenizer, its most tokens."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return schema["maxLength"] + 2  # (its characters unescaped: schema_check)
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_chars(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 4 + max_chars(v) for k, v in schema["properties"].items())


def check_json(text: str, schema: dict) -> None:
    """``text`` parses as JSON and validates against ``schema``."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str, finished: bool) -> None:
    """A finished output matches ``pattern`` whole; a cut one ("length") starts a match."""
    match = regex.fullmatch(pattern, text, partial=not finished)
    assert match is not None, (pattern, text)
