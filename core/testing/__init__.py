"""Conformance kit for third-party plugins (see docs/plugins.md)."""
