"""Tool calling in the chat API: the request's tools and tool_choice (``request``), the
prompt that shows them (``templates``), and the model's text read back as OpenAI's
``tool_calls`` (``shaping``, with one parser per template family: ``hermes`` for Hermes
and Qwen's ``<tool_call>``, ``llama3`` for LLaMA 3.x's bare JSON, ``mistral`` for
``[TOOL_CALLS]``). ``infergraft serve --tool-call-parser`` picks the family; by default
the chat template's own says (``templates.detect``)."""
from .request import ToolRequest, parse_tools
from .templates import FAMILIES, detect, render, special_marker_id, template_of

__all__ = ["FAMILIES", "ToolRequest", "detect", "parse_tools", "render", "special_marker_id",
           "template_of"]
