"""Chat request fields for tools, reasoning and constrained output -> what the chat plan needs:
the tools to render, the template kwargs, the output mode and a constraint per choice.

Tool calling (seed 002 Example 10, seed 000 Example 13):

- ``tools``: OpenAI function definitions; ``tool_choice``: ``none`` | ``auto`` | ``required`` |
  ``{"type": "function", "function": {"name": ...}}`` (default ``auto`` with tools, else ``none``);
  ``parallel_tool_calls`` (default true).
- Parser: ``--tool-call-parser`` (vLLM names), else (with ``--jinja``) detected from the chat
  template, as llama-server does.
- vLLM's rules apply when ``--tool-call-parser``/``--enable-auto-tool-choice`` is given or with
  ``--no-jinja``: ``auto`` needs both flags, ``required``/named need the parser, with vLLM's 400
  texts. Otherwise llama-server's: every tool_choice works with any template (generic format below).
- ``required`` and a named function add a grammar that forces valid calls (arguments match
  the tool's JSON schema) from the first generated token; ``auto`` parses what the model
  writes. ``--exclude-tools-when-tool-choice-none`` leaves tools out of the prompt for ``none``.
  A forced call cut by max_tokens is dropped (finish_reason ``length``), never content.
- A template with no tool-call format kvserve detects (SmolLM2's, ChatML...) gets llama-server's
  generic format (:mod:`kvserve.chat.tool_generic`): the tools and the answer's shape in the
  system prompt, the output constrained to a JSON call-or-response object for every
  ``tool_choice`` but ``none``, parsed back into ``tool_calls`` / content.

Reasoning (seed 000 Example 14, seed 002 Example 12): llama-server's ``--reasoning-format`` /
request ``reasoning_format`` (``auto`` = ``deepseek``) fills ``reasoning_content``; with vLLM's
``--reasoning-parser`` the field is ``reasoning`` and ``include_reasoning`` may drop it.
``--reasoning-budget`` / ``thinking_token_budget`` force ``</think>`` after N thinking tokens when
the prompt opened a thinking block. ``chat_template_kwargs``, ``reasoning_effort`` and
``--reasoning on|off`` (``enable_thinking``) reach the template. A grammar (schema, tool call)
applies after the thinking block when the prompt opened one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.chat.template import RESERVED_VARIABLES
from kvserve.faces.chat_output import OutputMode
from kvserve.faces.errors import ApiError
from kvserve.faces.limits import MAX_TOOLS, check_count
from kvserve.faces.params import check_text, get_bool, get_int, get_str, type_error

__all__ = ["ChatFeatures", "chat_features", "parse_tool_choice", "parse_tools", "template_kwargs", "tool_constraint",
           "prompt_messages", "with_system_text"]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def parse_tools(tools: Any) -> list[dict] | None:
    """Validate ``tools`` (400 naming the bad entry, or a lone surrogate in it); None/[] -> None."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise type_error("tools", "array", tools)
    check_count("tools", len(tools), MAX_TOOLS, "tools")
    check_text(tools, "tools")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(400, f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError(400, f"tools[{i}].function.name: expected a non-empty string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters: expected a JSON schema object")
    return tools or None


def parse_tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    """``tool_choice`` as ``"none"``/``"auto"``/``"required"`` or the named function's name
    wrapped as ``{"name": ...}``; 400 for unknown values or a function not in ``tools``."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else "none"
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise ApiError(400, f"Field 'tool_choice': expected 'none', 'auto', 'required' or a function, got {tc!r}")
        if tc != "none" and not tools:
            raise ApiError(400, f"Field 'tool_choice': {tc!r} requires 'tools'")
        return tc
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise ApiError(400, "Field 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if not tools or all(t["function"]["name"] != name for t in tools):
            raise ApiError(400, f"Field 'tool_choice': function {name!r} is not in 'tools'")
        return {"name": name}
    raise type_error("tool_choice", "string or object", tc)


@dataclass
class ChatFeatures:
    """What :func:`chat_features` decided for one chat request.

    Attributes:
        template_tools: tools passed to the template (None: none).
        template_kwargs: extra template variables (chat_template_kwargs, enable_thinking...).
        tool_choice: the parsed tool_choice.
        tool_parser: parser name used on the output (None: no parsing).
        parallel: parallel_tool_calls.
        tool_grammar: GBNF forcing the call(s) for required/named (None otherwise).
        generic: the generic format's (choice, parallel, system text) when the template has no
            tool-call format (:mod:`kvserve.chat.tool_generic`), else None.
        reasoning_style, reasoning_field, include_reasoning: see OutputMode.
        thinking_budget: thinking tokens before ``</think>`` is forced (-1: no limit).
    """

    template_tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    tool_choice: str | dict = "none"
    tool_parser: str | None = None
    parallel: bool = True
    tool_grammar: str | None = None
    generic: tuple[str | dict, bool, str] | None = None
    reasoning_style: str | None = None
    reasoning_field: str = "reasoning_content"
    include_reasoning: bool = True
    thinking_budget: int = -1

    def output_mode(self, prompt_text: str, prefill: str) -> OutputMode:
        """The OutputMode for a rendered prompt (``prefill``: continued assistant content)."""
        from kvserve.chat.reasoning import prompt_thinking_tail

        tail = prompt_thinking_tail(prompt_text) if thinking_opened(prompt_text, prefill) else None
        return OutputMode(tool_parser=self.tool_parser, parallel_tool_calls=self.parallel, tools=self.template_tools,
                          reasoning_style=self.reasoning_style, reasoning_field=self.reasoning_field,
                          include_reasoning=self.include_reasoning, started_in_prompt=tail is not None,
                          forced_tools=self.tool_parser is not None and self.tool_choice not in ("none", "auto"),
                          prompt_tail=tail or "", thinking_enabled=self.template_kwargs.get("enable_thinking") is not False,
                          prefill=prefill)


def thinking_opened(prompt_text: str, prefill: str = "") -> bool:
    """True when the prompt ends inside an opened thinking block: the generation prompt ends
    with ``<think>`` (and whitespace), or the continued assistant message opened one."""
    if prefill:
        return prefill.rfind(_THINK_OPEN) > prefill.rfind(_THINK_CLOSE)
    return prompt_text.rstrip().endswith(_THINK_OPEN)


def _resolve_parser(state, choice: str | dict, template) -> str | None:
    """The tool-call parser for this request (``generic`` when the template has no format
    kvserve detects), raising vLLM's 400s in vLLM mode."""
    args = state.args
    if choice == "none":
        return None
    if args.vllm_tools:
        if choice == "auto":
            if not (args.enable_auto_tool_choice and args.tool_call_parser):
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                    '--tool-call-parser to be set')
            return args.tool_call_parser
        if not args.tool_call_parser:
            shown = choice if isinstance(choice, str) else {"type": "function", "function": choice}
            raise ApiError(400, f"tool_choice={json.dumps(shown)} requires --tool-call-parser to be set")
        return args.tool_call_parser
    from kvserve.chat.tool_calls import detect_tool_parser
    from kvserve.chat.tool_generic import GENERIC

    parser = detect_tool_parser(template.source) if template is not None else None
    return GENERIC if parser is None else parser  # llama-server's generic format for any other template


def _generic(template, tools: list[dict], choice: str | dict, parallel: bool) -> tuple[str | dict, bool, str]:
    """The generic format's (choice, parallel, system text): the tools are listed in the system
    text unless the template renders them itself (llama.cpp's minja polyfill)."""
    from kvserve.chat.tool_generic import generic_system_text

    rendered = bool(template.caps.get("supports_tools"))
    return choice, parallel, generic_system_text(None if rendered else tools, choice, parallel)


def with_system_text(messages: list, text: str) -> list:
    """``messages`` with ``text`` appended to the first system message's content (after a
    newline), or a system message carrying it in front (llama.cpp's ``add_system``). The
    input list is not changed; non-dict entries are left for the renderer to refuse."""
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        first = dict(messages[0])
        c = first.get("content")
        if isinstance(c, list):
            first["content"] = [*c, {"type": "text", "text": text}]
        else:
            first["content"] = (c + "\n" + text) if isinstance(c, str) and c else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def prompt_messages(state, body: dict) -> list:
    """``body["messages"]`` as the chat endpoint renders them: with the generic tool format's
    system text when the request's tools use it (``/apply-template``, ``/tokenize`` with
    ``messages``). 400s as :func:`chat_features` for bad tool fields."""
    msgs = body["messages"]
    if body.get("tools") and isinstance(msgs, list):
        feats = chat_features(state, body)
        if feats.generic is not None:
            return with_system_text(msgs, feats.generic[2])
    return msgs


def tool_constraint(feats: ChatFeatures, spec):
    """The request's constraint with the tool-call one applied: the GBNF of a forced call, or
    the generic format's JSON schema (whose ``response`` takes a JSON schema / json_object
    ``response_format``). Returns a ConstraintSpec or None.

    Raises:
        ApiError: 400 when a forced call meets another constraint, or the generic format one
            that is not a JSON schema.
    """
    from kvserve.structured.spec import ConstraintSpec

    if feats.generic is not None:
        from kvserve.chat.tool_generic import generic_schema

        choice, parallel, _ = feats.generic
        response = None
        if spec is not None:
            if choice != "auto" or spec.kind not in ("json_schema", "json_object"):
                raise ApiError(400, "tools on a chat template without tool-call support can be combined only with "
                                    "a JSON schema or json_object response_format and tool_choice 'auto'")
            response = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
        schema = generic_schema(feats.template_tools or [], choice, parallel, response)
        return ConstraintSpec("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if feats.tool_grammar is None:
        return spec
    if spec is not None:
        raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with "
                            "response_format or structured outputs")
    return ConstraintSpec("grammar", feats.tool_grammar)


def template_kwargs(args, body: dict, template=None, tools: list | None = None) -> dict:
    """Extra template variables: ``--chat-template-kwargs``, ``--reasoning on|off``
    (``enable_thinking``), the variables llama-server gives a Jinja ``template``
    (:func:`server_context`), the request's ``documents`` (vLLM), then its ``chat_template_kwargs``
    (which may set ``documents`` too, as vLLM merges them) and ``reasoning_effort``.

    Raises:
        ApiError: 400 when ``chat_template_kwargs`` is not an object or sets a variable the
            renderer sets itself (``RESERVED_VARIABLES``: messages, tools,
            add_generation_prompt, continue_final_message; the request has fields for them).
    """
    kwargs = {k: v for k, v in args.chat_template_kwargs.items() if k not in RESERVED_VARIABLES}
    if args.reasoning is not None:
        kwargs["enable_thinking"] = args.reasoning == "on"
    if template is not None:
        for k, v in server_context(args, template, tools).items():
            kwargs.setdefault(k, v)
    docs = body.get("documents")  # vLLM's RAG documents for the template (Command-R, Granite)
    if docs is not None:
        if not isinstance(docs, list):
            raise type_error("documents", "array", docs)
        for i, d in enumerate(docs):
            if not isinstance(d, dict):
                raise type_error(f"documents[{i}]", "object", d)
        check_text(docs, "documents")
        kwargs["documents"] = docs
    req_kwargs = body.get("chat_template_kwargs")
    if req_kwargs is not None:
        if not isinstance(req_kwargs, dict):
            raise type_error("chat_template_kwargs", "object", req_kwargs)
        clash = RESERVED_VARIABLES.intersection(req_kwargs)
        if clash:
            key = min(clash)
            raise ApiError(400, f"Field 'chat_template_kwargs': key '{key}' is reserved: set it with the "
                                f"request's own '{key}' field")
        check_text(req_kwargs, "chat_template_kwargs")
        kwargs.update(req_kwargs)
    effort = get_str(body, "reasoning_effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def is_harmony(template) -> bool:
    """True for a chat template that writes OpenAI's harmony format (gpt-oss: ``<|start|>`` and
    ``<|message|>``; llama.cpp's built-in "gpt-oss" has no channels): its output is harmony messages,
    whose ``analysis`` channel is the reasoning (kvserve.chat.harmony), as llama-server's gpt-oss
    chat format parses it."""
    src = getattr(template, "source", "") or "" if template is not None else ""
    return "<|start|>" in src and "<|message|>" in src


def server_context(args, template, tools: list | None) -> dict:
    """What llama-server adds to a Jinja template's context (``common/chat.cpp``): ``enable_thinking``
    always defined (``--reasoning auto``, the default: true unless ``--reasoning-budget 0``) and the
    Llama 3.x / firefunction variables of :func:`kvserve.chat.llama_context.family_context`. Nothing
    for an Ollama Go template, which has its own ``think`` rule."""
    from kvserve.chat.go_chat_template import GoChatTemplate
    from kvserve.chat.llama_context import family_context

    if isinstance(template, GoChatTemplate):
        return {}
    return {"enable_thinking": args.reasoning_budget != 0, **family_context(template.source, tools)}


def chat_features(state, body: dict) -> ChatFeatures:
    """Read the tool, reasoning and template fields of a chat request (400 on bad values)."""
    args = state.args
    f = ChatFeatures()
    tools = parse_tools(body.get("tools"))
    f.tool_choice = parse_tool_choice(body, tools)
    par = get_bool(body, "parallel_tool_calls", True)
    f.parallel = True if par is None else par
    f.tool_parser = _resolve_parser(state, f.tool_choice, state.template) if tools else None
    if isinstance(f.tool_choice, dict):
        f.parallel = False  # a named function is called once (OpenAI, vLLM)
    if tools and not (f.tool_choice == "none" and args.exclude_tools_when_tool_choice_none):
        f.template_tools = tools
    if f.tool_parser == "generic":
        f.generic = _generic(state.template, tools, f.tool_choice, f.parallel)
    elif f.tool_parser is not None and f.tool_choice not in ("none", "auto"):
        from kvserve.chat.tool_grammar import tool_call_grammar

        name = f.tool_choice["name"] if isinstance(f.tool_choice, dict) else None
        try:
            f.tool_grammar = tool_call_grammar(f.tool_parser, tools, required_name=name, parallel=f.parallel)
        except ValueError as e:
            raise ApiError(400, f"tools: {e}") from None

    f.template_kwargs = template_kwargs(args, body, state.template, tools)

    if args.reasoning_parser:
        f.reasoning_style, f.reasoning_field = args.reasoning_parser, "reasoning"
        inc = get_bool(body, "include_reasoning", True)
        f.include_reasoning = True if inc is None else inc
    else:
        fmt = get_str(body, "reasoning_format") or args.reasoning_format
        if fmt not in ("auto", "none", "deepseek", "deepseek-legacy"):
            raise ApiError(400, f"Field 'reasoning_format': expected none, auto, deepseek or deepseek-legacy, "
                                f"got {fmt!r}")
        f.reasoning_style = "deepseek" if fmt == "auto" else fmt
        if f.reasoning_style == "deepseek" and is_harmony(state.template):
            f.reasoning_style = "openai_gptoss"  # llama-server's gpt-oss format: the analysis channel is reasoning
    budget = get_int(body, "thinking_token_budget")
    if budget is None:
        budget = args.reasoning_budget
    if budget < -1:
        raise ApiError(400, "Field 'thinking_token_budget': must be -1 (no limit) or >= 0")
    f.thinking_budget = budget
    return f


def constraint_factory(state, spec, prefill: str, mode: OutputMode, budget: int) -> Callable[[], Any] | None:
    """A function making one fresh engine constraint per choice, or None when nothing constrains
    the output. The grammar (``spec``) starts after a thinking block the prompt opened; the
    thinking budget forces ``</think>``. Compiles once now so a bad grammar is a 400 before any
    output."""
    gate = mode.started_in_prompt and mode.reasoning_style not in (None, "none")
    if spec is None and not (gate and budget >= 0):
        return None
    tok = state.tokenizer
    n_vocab = state.engine.core.model_config.n_vocab  # the logits' width

    def make():
        inner = state.grammars.constraint(spec, prefill=prefill if not gate else "") if spec is not None else None
        if not gate:
            return inner
        from kvserve.chat.reasoning import ThinkingBudget

        return ThinkingBudget(budget, end_tag_token_ids=tok.encode("\n" + _THINK_CLOSE + "\n\n"), n_vocab=n_vocab,
                              started_in_prompt=True, start_tag_ids=tok.encode(_THINK_OPEN), inner=inner,
                              token_text=lambda t: tok.token_bytes(t).decode("utf-8", errors="replace"),
                              eog_token_ids=sorted(tok.eog_token_ids))

    make()  # compile (and check the prefill) now: errors are 400s before the response starts
    return make
