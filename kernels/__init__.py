"""Triton kernels, one op per file, each beside its plain-torch reference."""
from .dispatch import OPS, get_op, get_ops, resolve_backend

__all__ = ["OPS", "get_op", "get_ops", "resolve_backend"]
