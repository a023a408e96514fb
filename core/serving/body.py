"""A request's body before its parameters are read: read up to the server's limit
(``read_body``: 413 beyond it, whether the client declares the length or streams the body
chunked), then decoded as JSON (``decode_json``), nested no deeper than OpenAI's shapes
need and holding only text that UTF-8 can carry (400 naming where it is wrong otherwise).
Needs nothing beyond the core."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from .protocol import OpenAIError, bad

# Room for a 128k-token context sent as JSON token ids (7 bytes or so each) several times
# over, and no more: a body is held whole in memory, and its text tokenised
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

# The deepest request shape is 5 levels (body, messages, a message, its content parts,
# a part); a JSON schema (a tool's parameters start 5 levels down, a response format's 4)
# keeps some 27 levels of its own: far more than pydantic's schemas take (nested models
# are $defs beside the root).
MAX_DEPTH = 32
# A lone UTF-16 surrogate: JSON lets "\ud800" through, UTF-8 (the tokenizer, the reply)
# cannot carry it
_SURROGATE = re.compile("[\ud800-\udfff]")
_NESTED = (str, list, dict)  # what check_values looks into


async def read_body(request, limit: int) -> bytes:
    """The body of ``request`` (Starlette's), or OpenAIError 413 as soon as it is known
    to be longer than ``limit`` bytes: from its Content-Length before reading any of it,
    else (a chunked upload) once what has come passes the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server takes: {limit} "
                            "bytes at most (infergraft serve --max-request-bytes); send a "
                            "shorter prompt, or start the server with a larger "
                            "--max-request-bytes", code="request_too_large")


def decode_json(raw: bytes) -> Any:
    """The JSON value of ``raw``, checked by ``check_values``."""
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder's own limit, far past MAX_DEPTH
        raise too_deep(None) from None
    except ValueError as e:  # JSONDecodeError, bytes that are not UTF-8, a 5000-digit int
        raise bad(None, f"the request body is not valid JSON: {e}") from e
    check_values(body)
    return body


def check_values(body: Any) -> None:
    """400 if ``body`` nests deeper than MAX_DEPTH or a string in it (a key too) holds a
    lone surrogate; ``param`` says where (``messages[0].content``)."""
    stack = [(body, None, 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, (list, dict)):  # a number, true, false or null
            continue
        if depth > MAX_DEPTH:
            raise too_deep(where)
        if isinstance(value, dict):
            for key in value:
                _check_text(key, where, key=True)
            stack.extend((v, _path(where, key), depth + 1) for key, v in value.items()
                         if isinstance(v, _NESTED))
        else:
            stack.extend((v, f"{where or ''}[{i}]", depth + 1) for i, v in enumerate(value)
                         if isinstance(v, _NESTED))


def too_deep(where: Optional[str]):
    return bad(where, f"the request body nests deeper than {MAX_DEPTH} levels of arrays and "
                      f"objects{' at ' + where if where else ''}: OpenAI's shapes need 5, "
                      "and a JSON schema in one (tools, response_format) its own levels")


def _check_text(text: str, where: Optional[str], key: bool = False) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    what = f"a key of {where or 'the body'}" if key else (where or "the body")
    raise bad(where, f"{what} holds a lone UTF-16 surrogate ({ascii(found.group())} at "
                     f"character {found.start()}), which is not text: send a character "
                     "as itself, or a surrogate pair (\\ud83d\\ude00) as JSON escapes")


def _path(where: Optional[str], key: str) -> str:
    return key if where is None else f"{where}.{key}"
