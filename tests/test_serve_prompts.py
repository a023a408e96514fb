"""The server's prompts as token ids (core/serving/prompts.py) against a fake engine with
SmolLM2's real tokenizer: a prompt whose bytes prove it too long is refused without being
tokenised, the bound it uses never exceeds the true count, and tokenizers it does not
hold for get none."""
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer

from infergraft.core.errors import InvalidRequestError
from infergraft.core.loading.demo import ensure_demo_model
from infergraft.core.prompt import encode_prompt
from infergraft.core.serving.prompts import PromptEncoder, TokenBound, byte_chars, token_bound
from infergraft.core.serving.protocol import OpenAIError, parse_chat, parse_completion

LIMIT = 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True))


@pytest.fixture(scope="module")
def bound(tokenizer):
    return token_bound(tokenizer)


class FakeEngine:
    """What PromptEncoder reads of an engine; ``encoded`` counts the prompts tokenised."""

    def __init__(self, tokenizer, max_seq_len: int = LIMIT):
        self.tokenizer, self.encoded = tokenizer, 0
        self.plan = types.SimpleNamespace(max_seq_len=max_seq_len)

    def encode(self, prompt):
        self.encoded += 1
        return encode_prompt(prompt, self.tokenizer, len(self.tokenizer))


def refusal(encoder, body, parse=parse_completion) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        encoder.encode(parse(body))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert f"max_seq_len={LIMIT}" in e.value.message
    return e.value


def test_a_prompt_its_bytes_prove_too_long_is_never_tokenised(tokenizer):
    engine = FakeEngine(tokenizer)
    encoder = PromptEncoder(engine)
    most = encoder.bound.max_token_bytes
    assert most == max(len(t) for t in tokenizer.get_vocab())  # "#" * 80 and the like
    # ceil(bytes / most) >= LIMIT: the prompt and one new token cannot fit
    e = refusal(encoder, {"prompt": "x" * ((LIMIT - 1) * most + 1)})
    assert e.param == "prompt" and f"at least {LIMIT} tokens" in e.message
    e = refusal(encoder, {"messages": [{"role": "user", "content": "é" * (LIMIT * most)}]},
                parse_chat)
    assert e.param == "messages" and "at least" in e.message
    assert engine.encoded == 0
    # one byte less proves nothing: tokenised (and then too long by its true count)
    ids = encoder.encode(parse_completion({"prompt": "x" * ((LIMIT - 1) * most)}))
    assert engine.encoded == 1 and len(ids[0]) >= LIMIT


def test_bytes_the_vocabulary_lacks_are_not_counted(tokenizer):
    # SmolLM2 has no token for a few control characters: the tokenizer drops them
    assert tokenizer.encode("\x04\x06\x13", add_special_tokens=True) == []
    engine = FakeEngine(tokenizer)
    encoder = PromptEncoder(engine)
    assert encoder.bound.dropped == b"\x04\x06\x13\x14\x16\x1d\xf1\xf2"
    with pytest.raises(InvalidRequestError, match="prompt is empty"):  # not "too long"
        encoder.encode(parse_completion({"prompt": "\x04" * (LIMIT * 100)}))
    assert engine.encoded == 1


def test_byte_chars_are_the_byte_level_alphabet():
    chars = byte_chars()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert (chars[ord(" ")], chars[ord("\n")], chars[ord("a")]) == ("Ġ", "Ċ", "a")


# text a tokenizer could pack densely: long runs the vocabulary has entries for, special
# tokens written out, and everything else
dense = st.lists(st.sampled_from(["#" * 80, " " * 64, "\n" + " " * 80, "<|im_start|>",
                                  "<|endoftext|>", "-" * 64, "=" * 65, "\u00e9", "\U0001F600",
                                  "\x04\x06\x13", "\U00040000\U00080000"])
                 | st.text(max_size=20), max_size=12)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(dense, max_size=4), text=st.text())
def test_the_bound_never_exceeds_the_true_count(tokenizer, bound, parts, text):
    prompt = "".join(p for ps in parts for p in ps) + text
    assert len(tokenizer.encode(prompt, add_special_tokens=True)) >= bound.at_least(prompt)


def backend(tok: Tokenizer):
    return types.SimpleNamespace(backend_tokenizer=tok)


def byte_level_bpe() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"ĠĠ": 256, "ĠĠĠĠ": 257})
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def test_the_bound_holds_only_where_the_tokenizer_keeps_every_byte():
    tok = byte_level_bpe()
    assert token_bound(backend(tok)) == TokenBound(4, b"")
    assert len(tok.encode(" " * 40).ids) == 10  # 40 bytes, 4 at most a token

    lstrip = byte_level_bpe()  # "<m>" swallows the spaces before it: one token for 1000
    lstrip.add_special_tokens([AddedToken("<m>", lstrip=True)])
    assert len(lstrip.encode(" " * 1000 + "<m>").ids) == 1
    assert token_bound(backend(lstrip)) is None

    deleting = byte_level_bpe()  # the normaliser deletes what it strips
    deleting.normalizer = normalizers.Strip()
    assert token_bound(backend(deleting)) is None

    removing = byte_level_bpe()  # a splitter that drops the spaces it splits on
    removing.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()])
    assert token_bound(backend(removing)) is None

    isolating = byte_level_bpe()  # Llama 3's kind: split, keep, then bytes
    isolating.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="isolated"),
        pre_tokenizers.ByteLevel(use_regex=False)])
    assert token_bound(backend(isolating)).max_token_bytes == 4

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert wordpiece.encode("b" * 90).ids == [0]  # one token for 90 bytes
    assert token_bound(backend(wordpiece)) is None
    assert token_bound(None) is None  # no tokenizer: token-id prompts only


def test_without_a_bound_every_prompt_is_tokenised_and_counted(tokenizer):
    engine = FakeEngine(tokenizer)
    encoder = PromptEncoder(engine)
    encoder.bound = None
    assert len(encoder.encode(parse_completion({"prompt": "x" * 10_000}))[0]) >= LIMIT
    assert engine.encoded == 1
