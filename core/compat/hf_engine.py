"""Scripts written against DeepSpeed + HF transformers, run on our engine.

``InferenceEngine`` (DeepSpeed's class name) is an ``Engine`` that also takes HF's calls:

    out = engine.generate(**tokenizer(texts, return_tensors="pt", padding=True),
                          max_new_tokens=20, do_sample=False)  # LongTensor [B * n, T + new]
    logits = engine(input_ids).logits                           # [B, T, V]

``generate`` lays its output out as HF's ``generate`` does: each input row as given
(padding included), its new tokens after it, rows that finished early (EOS) padded with
``pad_token_id``, ``num_return_sequences`` rows per input row, one after the other. The
padding (``attention_mask == 0``) is removed before the engine sees a prompt, so left- and
right-padded batches give each row what it gives alone. Given strings or token-id lists,
``generate`` is ``Engine.generate``. The subclass holds no state of its own:
``InferenceEngine.adopt(engine)`` turns a built engine into one (``core.init_inference``).

HF options outside ``GENERATE_OPTIONS`` (beam search, ``output_scores``, ...) are refused
by name, not dropped."""
from __future__ import annotations

import attrs
import torch

from ..engine import Engine
from ..errors import InvalidRequestError
from ..request import Sequence
from ..streaming import raise_failed
from .hf_request import HFRequest, check_ids, check_mask, cut_at_eos, hf_request, prompt_rows

class InferenceEngine(Engine):
    """An Engine that also takes HF's ``generate(input_ids, ...)`` and ``engine(input_ids)``."""

    @classmethod
    def adopt(cls, engine: Engine) -> "InferenceEngine":
        """``engine`` itself, as an InferenceEngine (it adds methods, no state)."""
        if not isinstance(engine, Engine):
            raise TypeError(f"adopt takes a core.Engine, got {type(engine).__name__}")
        engine.__class__ = cls
        return engine

    @property
    def module(self) -> "InferenceEngine":
        """DeepSpeed scripts call ``engine.module.generate(...)``: here that is the engine."""
        return self

    def generate(self, prompts=None, *args, **kwargs):
        """HF's ``generate`` for a tensor of token ids (or ``input_ids=`` / ``inputs=``):
        a LongTensor [B * num_return_sequences, T + new]; else ``Engine.generate``."""
        hf_input = "input_ids" in kwargs or "inputs" in kwargs
        if not hf_input and not isinstance(prompts, torch.Tensor):
            return super().generate(prompts, *args, **kwargs)
        given = [x for x in (prompts, kwargs.pop("input_ids", None), kwargs.pop("inputs", None))
                 if x is not None]
        if len(given) != 1 or args:
            raise InvalidRequestError("give the prompt tensor once, as generate(input_ids, "
                                      "**options) or generate(input_ids=..., **options); "
                                      "the options by keyword")
        return self.generate_ids(given[0], **kwargs)

    def generate_ids(self, input_ids, **options) -> torch.LongTensor:
        """HF's ``generate`` on a [B, T] integer tensor; ``options`` as GENERATE_OPTIONS."""
        ids = check_ids(input_ids, "input_ids")
        req = hf_request(self, ids, options)
        done = self._run_rows(req)
        # HF's layout: each row as given, repeated n times, its new tokens after it
        new = [cut_at_eos(s.output_ids, req.eos) for s in done]
        width = max(len(t) for t in new)
        out = torch.full((len(new), ids.shape[1] + width), req.pad, dtype=torch.long)
        out[:, :ids.shape[1]] = ids.cpu().long().repeat_interleave(req.n, dim=0)
        for row, tokens in enumerate(new):
            out[row, ids.shape[1]:ids.shape[1] + len(tokens)] = torch.tensor(tokens,
                                                                            dtype=torch.long)
        return out.to(ids.device)

    def forward(self, input_ids, attention_mask=None, labels=None, **options):
        """HF's causal-LM forward: an HF ``CausalLMOutput`` with ``.logits`` [B, T, V]
        float32 (zeros at padding) and, given ``labels``, HF's shifted cross-entropy
        ``.loss`` (labels -100 ignored). DeepSpeed's engine forwards to its module alike."""
        from transformers.modeling_outputs import CausalLMOutput

        unknown = sorted(k for k in options if k != "use_cache")  # (always cached: ignored)
        if unknown:
            raise InvalidRequestError(f"forward option(s) {', '.join(unknown)} are not "
                                      "supported; accepted: input_ids, attention_mask, "
                                      "labels, use_cache")
        ids = check_ids(input_ids, "input_ids")
        mask = check_mask(attention_mask, ids)
        logits = torch.zeros(*ids.shape, self.spec.vocab_size)  # [B, T, V]
        for b, row in enumerate(prompt_rows(ids, mask)):
            logits[b, mask[b]] = self.logits(row)  # [len, V] at the row's unpadded positions
        loss = None
        if labels is not None:
            labels = check_ids(labels, "labels", allow_negative=True).cpu()
            if labels.shape != ids.shape:
                raise InvalidRequestError(f"labels must have input_ids' shape {list(ids.shape)}, "
                                          f"got {list(labels.shape)}")
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100).to(ids.device)
        return CausalLMOutput(loss=loss, logits=logits.to(ids.device))

    __call__ = forward

    def _run_rows(self, req: HFRequest) -> list[Sequence]:
        """Queue every row (n samples each, forked from its prefill) and step until they
        finish; a row emitting one of ``req.eos`` is finished there."""
        for ids in req.rows:  # validate everything before queueing anything
            self._check(ids, req.params)
        seqs, seed = [], req.params.seed
        with self.lock:  # a step between a row and its forks would prefill it unforked
            for ids in req.rows:
                parent = self.add_request(ids, req.params)
                children = [Sequence(list(ids), attrs.evolve(req.params, seed=seed + i))
                            for i in range(1, req.n)]
                if children:
                    self._forks[parent.id] = children
                seqs += [parent, *children]
        if req.eos is None:
            self._run(seqs)
        else:
            self._run_to_eos(seqs, req.eos)
        raise_failed(seqs, [self._completion(s) for s in seqs])
        return seqs

    def _run_to_eos(self, seqs: list[Sequence], eos: frozenset) -> None:
        """``_run`` for requests sampled with ``ignore_eos``: those whose last token is in
        ``eos`` are finished (aborted, reason "stop") between steps."""
        try:
            while True:
                with self.lock:
                    ended = [s for s in seqs if not s.finished and s.output_ids
                             and s.output_ids[-1] in eos]
                    if ended:
                        self.abort(ended, reason="stop")
                    if all(s.finished for s in seqs):
                        return
                    self.step()
        except BaseException:
            self.abort(seqs)
            raise
