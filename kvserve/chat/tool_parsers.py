"""The registry of tool-call parsers under vLLM's ``--tool-call-parser`` names: the formats of
:mod:`kvserve.chat.tool_calls` (hermes, llama3_json, mistral, pythonic) and of
:mod:`kvserve.chat.tool_formats` (qwen3_coder, kimi_k2, openai, ...), the names vLLM registers, the
start-up error for a name kvserve lacks, and :func:`get_tool_parser`. Its own module so that the two
format modules import each other in one direction only (tool_formats builds on tool_calls).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.chat.tool_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
)
from kvserve.chat.tool_formats import NEW_TOOL_PARSERS

__all__ = ["TOOL_PARSERS", "VLLM_TOOL_PARSERS", "get_tool_parser", "tool_parser_error"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

TOOL_PARSERS.update((p.name, p) for p in NEW_TOOL_PARSERS)
TOOL_PARSERS = dict(sorted(TOOL_PARSERS.items()))

#: Every ``--tool-call-parser`` name vLLM registers (vllm/tool_parsers/__init__.py, recent
#: releases together); those not in :data:`TOOL_PARSERS` are refused at start-up.
VLLM_TOOL_PARSERS: tuple[str, ...] = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite", "granite-20b-fc", "granite4",
    "hermes", "hunyuan_a13b", "hy_v3", "internlm", "jamba", "kimi_k2", "lfm2", "llama3_json", "llama4_json",
    "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax", "minimax_m2", "minimax_m3", "mistral", "olmo3",
    "openai", "phi4_mini_json", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_xml", "seed_oss", "step3",
    "step3p5", "xlam", "zaya_xml",
)


def tool_parser_error(name: str) -> str | None:
    """The start-up error for ``--tool-call-parser name``, or None when kvserve implements it.

    A name vLLM registers but kvserve does not implement and an unknown name both list the
    implemented names.
    """
    if name in TOOL_PARSERS:
        return None
    names = ", ".join(TOOL_PARSERS)
    if name in VLLM_TOOL_PARSERS:
        return (f"--tool-call-parser {name!r} is a vLLM parser that kvserve does not implement; "
                f"implemented: {names}")
    return f"invalid --tool-call-parser {name!r}: choose from {names}"


def get_tool_parser(name: str, make_id: Callable[[], str] | None = None,
                    tools: list[dict] | None = None) -> ToolParser:
    """The parser registered as ``name``; ``tools`` (the request's OpenAI ``tools``) give the
    parameter types the XML formats (``qwen3_coder``, ``glm45``) convert values by. ``generic``
    is :class:`kvserve.chat.tool_generic.GenericToolParser` (templates without a format of their own).

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    cls = TOOL_PARSERS.get(name)
    if cls is None and name == "generic":  # the chat plan's own format, not a --tool-call-parser name
        from kvserve.chat.tool_generic import GenericToolParser

        cls = GenericToolParser
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; valid names: {', '.join(sorted(TOOL_PARSERS))}")
    return cls(make_id, tools)
