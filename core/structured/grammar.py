"""The built-in ``grammar`` logits processor: a request's Constraint run by xgrammar.

Why xgrammar (docs/bench/structured.md has the measurements beside llguidance's):
its token masks cost microseconds a row, and a mask is on every constrained step's path,
while a grammar's compilation, the slower part, runs once per schema, off that path.

* The tokenizer's vocabulary (byte-level BPE, SentencePiece, added tokens: xgrammar reads
  them from the Hugging Face tokenizer) is compiled once per (tokenizer, vocabulary size,
  stop tokens) and kept: ``Compiler``.
  Its width is the tokenizer's, not the logits' (``core/structured/batch.py`` says why).
* Each Constraint is compiled once per (kind, text) and kept (the newest ``CACHED``). For
  an engine on a GPU, in background threads (half the host's cores, at most 8: a batch of
  new schemas compiles side by side): ``start`` returns at once and the request's prompt
  is prefilled meanwhile (its first mask waits for the compilation if it has not
  finished). For an engine on the CPU, at once in ``start``: there a compiling thread
  would take a core from the model's threads, which then wait for it at every barrier
  (docs/bench/structured.md has what that cost).
* ``GrammarState`` holds one request's matcher: its masks, the tokens it accepts, whether
  the grammar is complete (then the request stops without sampling its stop token) and
  the text the grammar forces next (jump-forward: tokenised and appended at once). A
  step's masks are filled together, in one call (``batch``: ``core/structured/batch.py``).
"""
from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..errors import InvalidRequestError
from ..logits_processor import ConstraintState, LogitsProcessor, Vocabulary, pack_bitmask
from .batch import GrammarBatch
from .constraint import PROCESSOR, Constraint, xgrammar
from .schema_check import schema_grammar

#: compiled grammars kept per tokenizer, at most, and the bytes they may hold together
#: (xgrammar's own count; the least recently asked for are dropped first)
CACHED, CACHED_BYTES = 1024, 256 << 20
# what a json_object request compiles: any object, compact like every schema's output
_ANY_OBJECT = '{"type": "object"}'


class GrammarProcessor(LogitsProcessor):
    """``SamplingParams(json_schema=...)`` and its siblings, through xgrammar."""
    name = PROCESSOR

    def __init__(self):
        self._compilers: dict[tuple, Compiler] = {}
        self._lock = threading.Lock()

    def start(self, arg, vocab: Vocabulary) -> "GrammarState":
        if not isinstance(arg, Constraint):
            raise InvalidRequestError(f"logits processor {self.name!r} takes a structured-output "
                                      f"Constraint: give SamplingParams json_schema, json_object, "
                                      f"regex, grammar or choice instead, got {arg!r}")
        if vocab.tokenizer is None:
            raise InvalidRequestError("structured output needs the engine's tokenizer; this "
                                      "engine has none (build with tokenizer=...)")
        compiler = self.compiler(vocab)
        return GrammarState(compiler.compile(arg), compiler)

    def compiler(self, vocab: Vocabulary) -> "Compiler":
        key = (id(vocab.tokenizer), vocab.size, tuple(sorted(vocab.eos_token_ids)),
               vocab.device)
        with self._lock:
            if key not in self._compilers:
                self._compilers[key] = Compiler(vocab)
            return self._compilers[key]


class Compiler:
    """One tokenizer's xgrammar compiler and its compiled grammars, by (kind, text)."""

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab  # (holds the tokenizer: its id stays this one's key)
        self._xgr = xgrammar()
        self._compiler = None  # made by the first compilation, in a background thread
        self.width = _tokenizer_width(vocab)  # the masks' tokens
        self.batch = GrammarBatch(self._xgr, self.width)  # a step's masks in one call
        self._futures: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._bytes: dict[tuple, int] = {}  # of those compiled
        self._lock = threading.Lock()
        self._vocabulary_lock = threading.Lock()  # (compilations run side by side)
        self._pool = ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)),
                                        thread_name_prefix="infergraft-grammar")
        self.compile_seconds: list[float] = []  # each compilation's wall time
        self._forced: dict[str, list[int]] = {}  # forced text -> its ids (``encode``)

    def compile(self, constraint: Constraint) -> Future:
        """The compiled grammar of ``constraint`` (a Future; compiled once)."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._submit(constraint)
            self._futures.move_to_end(key)
            while len(self._futures) > 1 and (len(self._futures) > CACHED or
                                              sum(self._bytes.values()) > CACHED_BYTES):
                old, _ = self._futures.popitem(last=False)
                self._bytes.pop(old, None)
        return future

    def _submit(self, constraint: Constraint) -> Future:
        if self.vocab.device != "cpu":
            return self._pool.submit(self._compile, constraint)
        future = Future()  # here and now (see the module's docstring)
        try:
            future.set_result(self._compile(constraint, locked=True))
        except Exception as e:  # raised where the state first needs it, as in the background
            future.set_exception(e)
        return future

    def _compile(self, constraint: Constraint, locked: bool = False):
        t0 = time.perf_counter()
        compiler = self._grammar_compiler()
        kind, text = constraint.kind, constraint.text
        if kind == "json_schema":
            out = compiler.compile_grammar(schema_grammar(self._xgr, text))
        elif kind == "json_object":
            out = compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False,
                                               strict_mode=False)
        elif kind == "regex":
            out = compiler.compile_regex(text)
        elif kind == "lark":
            out = compiler.compile_grammar(self._xgr.Grammar.from_lark(text))
        else:  # ebnf, choice
            out = compiler.compile_grammar(text)
        self.compile_seconds.append(time.perf_counter() - t0)
        if locked:  # (compiled in compile(), which holds the lock)
            self._bytes[(kind, text)] = out.memory_size_bytes
            return out
        with self._lock:
            if (kind, text) in self._futures:  # (not dropped meanwhile)
                self._bytes[(kind, text)] = out.memory_size_bytes
        return out

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids of a forced text (the same few texts recur: a schema's
        punctuation and keys, kept, the newest ``CACHED``)."""
        ids = self._forced.get(text)
        if ids is None:
            ids = self._forced[text] = self.vocab.tokenizer.encode(text, add_special_tokens=False)
            if len(self._forced) > CACHED:
                self._forced.pop(next(iter(self._forced)))
        return ids

    def _grammar_compiler(self):
        with self._vocabulary_lock:  # the vocabulary: once per tokenizer
            if self._compiler is None:
                xgr, vocab = self._xgr, self.vocab
                info = xgr.TokenizerInfo.from_huggingface(
                    vocab.tokenizer, vocab_size=self.width,
                    stop_token_ids=sorted(vocab.eos_token_ids) or None)
                # one thread a compilation: a schema's grammar has one or two states
                # worth splitting (a string's), so a second thread only waits (batches of
                # new schemas compile side by side on the pool instead)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _tokenizer_width(vocab: Vocabulary) -> int:
    """The tokens a mask covers: the tokenizer's ids (xgrammar's count of them) and the
    stop tokens, within the logits' width; the ids past it are never allowed."""
    ids = vocab.tokenizer.get_vocab()
    known = max(len(ids), max(ids.values(), default=-1) + 1,
                max(vocab.eos_token_ids, default=-1) + 1)
    return min(vocab.size, known)


class GrammarState(ConstraintState):
    """One request's xgrammar matcher (made when its first mask is asked for)."""

    def __init__(self, compiled: Future, compiler: Compiler):
        self._compiled, self._vocab, self._compiler = compiled, compiler.vocab, compiler
        self.batch = compiler.batch  # fills many states' masks in one call
        self._matcher = None

    @property
    def matcher(self):
        if self._matcher is None:
            try:
                grammar = self._compiled.result()  # waits while it compiles
            except Exception as e:  # named on the request (finish_reason "error")
                raise RuntimeError(f"the grammar failed to compile: {e}") from e
            self._matcher = xgrammar().GrammarMatcher(grammar)
        return self._matcher

    def ready(self) -> bool:
        return self._matcher is not None or self._compiled.done()

    def wait(self) -> None:
        wait([self._compiled])  # (a failed compilation is named at its first mask)

    def fill_bitmask(self, bitmask, row: int) -> None:
        # (a step's rows come to ``batch.fill`` together; this is a row of its own)
        words = self.batch.words
        bitmask[row, :words] = self._mask()[0]
        bitmask[row, words:] = 0  # the ids past the tokenizer's

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_complete(self) -> bool:
        m = self.matcher
        if m.is_terminated():
            return True
        if not m.is_completed():  # (cheap; the mask below only at the grammar's end)
            return False
        return torch.equal(self._mask(), stop_only(self._vocab, self.batch.width))

    def _mask(self) -> torch.Tensor:
        """The tokens it allows next: [1, batch.words]."""
        mask = torch.empty(1, self.batch.words, dtype=torch.int32)
        failed = self.batch.fill([self], mask)
        if failed:
            raise failed[0]
        return mask

    def take_forced(self, limit: int) -> list[int]:
        m = self.matcher
        try:
            text = m.find_jump_forward_string()
        except Exception:  # (a forced tail that is not whole UTF-8 characters)
            return []
        if not text or limit < 1:
            return []
        ids = self._compiler.encode(text)[:limit]
        # the tokenizer's own split of the forced text; one the grammar refuses (a
        # tokenizer that adds a prefix space, say) is rolled back and nothing is forced
        for n, token in enumerate(ids):
            if not m.accept_token(token):
                if n:
                    m.rollback(n)
                return []
        return ids


_STOP_ONLY: dict[tuple, torch.Tensor] = {}


def stop_only(vocab: Vocabulary, width: int) -> torch.Tensor:
    """The bitmask [1, bitmask_words(width)] allowing the stop tokens alone."""
    key = (width, vocab.eos_token_ids)
    if key not in _STOP_ONLY:
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[sorted(vocab.eos_token_ids)] = True
        _STOP_ONLY[key] = pack_bitmask(allowed)[None]
    return _STOP_ONLY[key]
