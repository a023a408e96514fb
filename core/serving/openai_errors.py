"""OpenAI's error shape: ``OpenAIError`` (an HTTP status and ``{"error": {message, type,
param, code}}``), ``bad`` (a 400 naming the parameter at fault) and ``short`` (a value as
an error message quotes it). Every module of the server raises these."""
from __future__ import annotations

from typing import Optional


class OpenAIError(Exception):
    """An HTTP error in OpenAI's JSON shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: Optional[str], message: str, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def short(x) -> str:
    """``repr(x)``, cut to 80 characters."""
    s = repr(x)
    return s if len(s) <= 80 else s[:77] + "..."
