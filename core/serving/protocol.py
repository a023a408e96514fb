"""OpenAI's request shapes in, the engine's terms out: ``parse_completion`` and
``parse_chat`` check a JSON body parameter by parameter and return a ``ParsedRequest``
(prompts or message lists, ``SamplingParams`` keyword arguments, n, stream, tools, ...),
or raise ``OpenAIError`` naming the parameter and what is accepted. Unknown parameters
are refused by name, as OpenAI does; known ones we do not implement (logit_bias, audio,
...) are refused unless they hold their no-op value. Structured output: ``structured.py``;
messages: ``messages.py``; tools: ``tool_calls/``; response shapes: ``responses.py``."""
from __future__ import annotations

import math
from typing import Any, Optional

import attrs

from ..request import SEED_LIMIT
from .messages import parse_messages
from .openai_errors import OpenAIError, bad, short
from .structured import KEYS as STRUCTURED_KEYS, checked_constraint, constraint_sources
from .tool_calls import ToolRequest, parse_tools

__all__ = ["OpenAIError", "ParsedRequest", "bad", "param_of", "parse_chat", "parse_completion"]

MAX_N = 128  # choices per request, as OpenAI
MAX_STOP = 4  # stop strings, as OpenAI
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs; vLLM's logprobs)


@attrs.frozen
class ParsedRequest:
    kind: str  # "completion" or "chat"
    model: Optional[str]  # as sent (None: the served one)
    prompts: list  # completion: str or list[int] each; chat: one list of {role, content}
    sampling: dict  # SamplingParams keyword arguments; max_new_tokens None: fill the context
    n: int
    stream: bool
    include_usage: bool
    logprobs: Optional[int]  # None: no logprobs; k: the sampled token's and the top k
    max_tokens_name: str = "max_tokens"  # chat: or max_completion_tokens, as sent
    tools: Optional[ToolRequest] = None  # chat with tools: what to show and parse


# Accepted and ignored: they change nothing about the output.
IGNORED = {"user", "store", "metadata", "service_tier"}
# Known OpenAI parameters we do not implement, with their no-op values (accepted as such).
UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "echo": (None, False),
               "functions": (None, []), "function_call": (None, "none", "auto"),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
               "reasoning_effort": (None,), "web_search_options": (None,)}
TOOL_KEYS = {"tools", "tool_choice", "parallel_tool_calls"}
# /v1/completions has no tools: accepted there only as no-ops
NO_TOOLS = {"tools": (None, []), "tool_choice": (None, "none", "auto"),
            "parallel_tool_calls": (None, True, False)}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
          "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs",
          # vLLM's extensions (the openai client sends them through ``extra_body``)
          "top_k", "min_p", "repetition_penalty", "ignore_eos",
          # ours: false keeps this request out of speculative decoding
          "speculative"} | STRUCTURED_KEYS
COMPLETION_KEYS = COMMON | {"prompt", "best_of"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | TOOL_KEYS


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # true is not 1 token


def _as_float(x) -> Optional[float]:
    """``x`` as a finite float, or None if it is not a number (or past float's range)."""
    if not (_is_int(x) or isinstance(x, float)):
        return None
    try:
        x = float(x)  # an int past float's range: OverflowError
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def integer(body: dict, name: str, lo: int, hi: Optional[int] = None, default=None,
            accepted: Optional[str] = None):
    x = body.get(name)
    if x is None:
        return default
    if not _is_int(x) or x < lo or (hi is not None and x > hi):
        what = accepted or (f"an integer in [{lo}, {hi}]" if hi is not None
                            else f"an integer >= {lo}")
        raise bad(name, f"{name} must be {what}, got {x!r}")
    return x


def number(body: dict, name: str, lo: float, hi: Optional[float], default,
           lo_open: bool = False):
    x = body.get(name)
    if x is None:
        return default
    # as a float: the sampler's tensors take no int past int64's range
    value = _as_float(x)
    if value is None or value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        what = f"a number in {lo_s}, {hi}]" if hi is not None else f"a finite number > {lo}"
        raise bad(name, f"{name} must be {what}, got {short(x)}")
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    x = body.get(name)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise bad(name, f"{name} must be true or false, got {x!r}")
    return x


def _check_keys(body: dict, known: set, unsupported: dict = UNSUPPORTED) -> None:
    for key in body:
        if key not in known and key not in IGNORED and key not in unsupported:
            raise bad(key, f"Unrecognized request argument supplied: {key}")
    for key, allowed in unsupported.items():
        if key in body and body[key] not in allowed:
            raise bad(key, f"{key} is not supported by this server (accepted: "
                           f"{' or '.join(repr(a) for a in allowed if a is not None)} or "
                           f"leaving it out)")


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not 1 <= len(stop) <= MAX_STOP or \
            any(not isinstance(s, str) or not s for s in stop):
        raise bad("stop", f"stop must be a non-empty string or a list of 1 to {MAX_STOP} of "
                          f"them, got {body.get('stop')!r}")
    return tuple(stop)


def _common(body: dict) -> tuple[dict, int, bool, bool]:
    """(sampling keyword arguments less max_new_tokens, n, stream, include_usage)."""
    top_k = integer(body, "top_k", -1, accepted="-1 or 0 (no limit) or an integer >= 1")
    kw = {"temperature": number(body, "temperature", 0, 2, 1.0),
          "top_p": number(body, "top_p", 0, 1, None, lo_open=True),
          "top_k": top_k if top_k and top_k > 0 else None,
          "seed": integer(body, "seed", 0, SEED_LIMIT - 1, accepted="an integer in [0, 2**63)"),
          "stop": _stop(body), "ignore_eos": boolean(body, "ignore_eos"),
          "presence_penalty": number(body, "presence_penalty", -2, 2, 0.0),
          "frequency_penalty": number(body, "frequency_penalty", -2, 2, 0.0),
          "repetition_penalty": number(body, "repetition_penalty", 0, None, 1.0, lo_open=True),
          "min_p": number(body, "min_p", 0, 1, 0.0),
          "speculative": boolean(body, "speculative", True)}
    if kw["top_p"] == 1:
        kw["top_p"] = None
    n = integer(body, "n", 1, MAX_N, default=1)
    if kw["seed"] is not None and kw["seed"] + n - 1 >= SEED_LIMIT:
        raise bad("seed", f"seed + n - 1 must stay below 2**63 (choice i uses seed + i), "
                          f"got seed={kw['seed']}, n={n}")
    stream = boolean(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad("stream_options", f"stream_options must be an object with "
                                        f"include_usage (true or false), got {opts!r}")
        include_usage = boolean(opts, "include_usage")
    return kw, n, stream, include_usage


def _model(body: dict) -> Optional[str]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model must be a string (see GET /v1/models), got {model!r}")
    return model


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion(body: Any) -> ParsedRequest:
    """POST /v1/completions."""
    body = _object(body)
    _check_keys(body, COMPLETION_KEYS, dict(UNSUPPORTED, **NO_TOOLS))
    kw, n, stream, include_usage = _common(body)
    kw.update(checked_constraint(constraint_sources(body)))
    best_of = integer(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of is not supported: leave it out or equal to n ({n}), "
                             f"got {best_of}")
    kw["max_new_tokens"] = integer(body, "max_tokens", 1, default=16)
    logprobs = integer(body, "logprobs", 0, MAX_LOGPROBS)
    return ParsedRequest("completion", _model(body), _prompts(body.get("prompt")), kw, n,
                         stream, include_usage, logprobs)


def _prompts(prompt) -> list:
    """A string, a list of token ids, or a non-empty list of either -> a list of prompts."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p))
            for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", f"prompt must be a string, a list of token ids, or a non-empty "
                            f"list of those, got {short(prompt)}")
    for p in prompts:
        if not p or (isinstance(p, str) and not p.strip()):
            raise bad("prompt", "prompt is empty: give at least one non-blank character or "
                                "one token id")
    return prompts


def parse_chat(body: Any, arguments_key: str = "arguments") -> ParsedRequest:
    """POST /v1/chat/completions; ``arguments_key``: what a forced call's JSON names its
    arguments (the tool-call family's: ``parameters`` for LLaMA 3)."""
    body = _object(body)
    _check_keys(body, CHAT_KEYS)
    kw, n, stream, include_usage = _common(body)
    given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    kw["max_new_tokens"] = integer(body, given[0], 1) if given else None
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if boolean(body, "logprobs"):
        logprobs = top or 0
    elif top is not None:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        logprobs = None
    messages = parse_messages(body.get("messages"))
    sources = constraint_sources(body)
    tools, forced = parse_tools(body, arguments_key)
    kw.update(checked_constraint(sources + forced))
    if tools is not None and sources and tools.choice == "auto":
        # the output is held to the response format: no call can come, none is shown
        tools = attrs.evolve(tools, choice="none")
    return ParsedRequest("chat", _model(body), [messages], kw, n, stream, include_usage,
                         logprobs, (given or ["max_tokens"])[0], tools)


# SamplingParams' field names in the engine's errors -> the request's parameter names
PARAM_OF_FIELD = {"max_new_tokens": "max_tokens", "temperature": "temperature",
                  "top_k": "top_k", "top_p": "top_p", "seed": "seed", "stop": "stop",
                  "logprobs": "logprobs", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "prompt": "prompt",
                  "speculative": "speculative",
                  "token": "prompt"}


def param_of(message: str, kind: str) -> Optional[str]:
    """The request parameter an engine error is about (its first word names the field)."""
    word = message.split(" ", 1)[0].strip(":,")
    param = PARAM_OF_FIELD.get(word)
    if kind == "chat" and param == "prompt":
        return "messages"
    if kind == "chat" and param == "logprobs":
        return "top_logprobs"
    return param
