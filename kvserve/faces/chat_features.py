"""Chat request fields for tools, reasoning and the template (OpenAI's names, llama-server's and
vLLM's extensions) -> kvserve's :class:`~kvserve.serving.chat_request.ChatRequest`
(:func:`read_chat_options`); what they mean on the loaded model (the parser, the forcing grammar,
the generic format, the template's variables, the output mode) is decided by
:mod:`kvserve.serving.chat_plan`.

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

from typing import Any

from kvserve.chat.template import RESERVED_VARIABLES
from kvserve.faces.api_error import ApiError
from kvserve.faces.limits import MAX_TOOLS, check_count
from kvserve.faces.params import check_text, get_bool, get_int, get_str, type_error
from kvserve.serving.chat_plan import ChatFeatures, features, template_variables, with_system_text
from kvserve.serving.chat_request import ChatRequest, ReasoningOptions, TemplateOptions

__all__ = ["chat_features", "check_tool_choice", "parse_tool_choice", "parse_tools", "prompt_messages",
           "read_chat_options", "read_reasoning_options", "read_template_options", "request_chat_template",
           "template_kwargs",
           "with_system_text"]


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
    if isinstance(tc, str) and tc not in ("none", "auto", "required"):
        raise ApiError(400, f"Field 'tool_choice': expected 'none', 'auto', 'required' or a function, got {tc!r}")
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise ApiError(400, "Field 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}")
        tc = {"name": name}
    elif tc is not None and not isinstance(tc, str):
        raise type_error("tool_choice", "string or object", tc)
    return check_tool_choice(tc, tools)


def check_tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str | dict:
    """A tool choice (``None``: the default, ``"auto"`` with tools, else ``"none"``; ``"none"``,
    ``"auto"``, ``"required"``, ``{"name": ...}``) checked against ``tools``: 400 when it needs tools
    there are none of, or names a function not in them."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise ApiError(400, f"Field 'tool_choice': {choice!r} requires 'tools'")
        return choice
    name = choice["name"]
    if not tools or all(t["function"]["name"] != name for t in tools):
        raise ApiError(400, f"Field 'tool_choice': function {name!r} is not in 'tools'")
    return choice


def read_template_options(body: dict) -> TemplateOptions:
    """The request's ``documents`` (vLLM's RAG documents) and ``chat_template_kwargs`` (400 when
    not an object or setting a variable the renderer sets itself: ``RESERVED_VARIABLES``,
    messages, tools, add_generation_prompt, continue_final_message, which have fields of their
    own). ``add_generation_prompt`` / ``continue_final_message`` are left for the caller."""
    opts = TemplateOptions()
    docs = body.get("documents")  # vLLM's RAG documents for the template (Command-R, Granite)
    if docs is not None:
        if not isinstance(docs, list):
            raise type_error("documents", "array", docs)
        for i, d in enumerate(docs):
            if not isinstance(d, dict):
                raise type_error(f"documents[{i}]", "object", d)
        check_text(docs, "documents")
        opts.documents = docs
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
        opts.variables = req_kwargs
    return opts


#: vLLM's refusal of a request's chat template without ``--trust-request-chat-template``
#: (``OpenAIServing._validate_chat_template``), word for word
UNTRUSTED_CHAT_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.")


def request_chat_template(args, body: dict) -> str | None:
    """The request's own chat template (vLLM's ``chat_template`` field), None when it gives none.

    As vLLM: a ``chat_template`` field, or a ``chat_template`` key of ``chat_template_kwargs``,
    that is not null is refused unless the server runs with ``--trust-request-chat-template``;
    trusted, the field's Jinja text renders this request's prompt (the key is not a template
    variable: vLLM leaves ``chat_template`` out of the template's variables).
    llama-server has no such field (it ignores it).

    Raises:
        ApiError: 400 with vLLM's text when untrusted; 400 when the field is not a string.
    """
    source = body.get("chat_template")
    kwargs = body.get("chat_template_kwargs")
    in_kwargs = isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
    if source is None and not in_kwargs:
        return None
    if not getattr(args, "trust_request_chat_template", False):
        raise ApiError(400, UNTRUSTED_CHAT_TEMPLATE)
    if source is None:
        return None
    if not isinstance(source, str):
        raise type_error("chat_template", "string", source)
    check_text(source, "chat_template")
    return source


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
    opts = read_template_options(body)
    return template_variables(args, opts, get_str(body, "reasoning_effort"), template, tools)


def read_reasoning_options(args, body: dict) -> ReasoningOptions:
    """The reasoning fields of a chat body: ``include_reasoning`` (read under vLLM's
    ``--reasoning-parser``) or llama-server's ``reasoning_format`` (otherwise) and
    ``thinking_token_budget`` (``args``: the server's flags; 400 on bad values)."""
    r = ReasoningOptions()
    if args.reasoning_parser:
        inc = get_bool(body, "include_reasoning", True)
        r.include = True if inc is None else inc
    else:
        fmt = get_str(body, "reasoning_format") or None
        if fmt is not None and fmt not in ("auto", "none", "deepseek", "deepseek-legacy"):
            raise ApiError(400, f"Field 'reasoning_format': expected none, auto, deepseek or deepseek-legacy, "
                                f"got {fmt!r}")
        r.format = fmt
    budget = get_int(body, "thinking_token_budget")
    if budget is not None and budget < -1:
        raise ApiError(400, "Field 'thinking_token_budget': must be -1 (no limit) or >= 0")
    r.budget = budget
    return r


def read_chat_options(args, body: dict, req: ChatRequest) -> None:
    """Fill ``req``'s tools, ``tool_choice``, ``parallel_tool_calls``, template options (all but
    ``add_generation_prompt`` / ``continue_final_message``) and reasoning options from an
    OpenAI-style chat body (400 on bad values; ``args``: the server's flags, which decide whose
    reasoning fields are read)."""
    tools = parse_tools(body.get("tools"))
    req.tools = tools
    req.tool_choice = parse_tool_choice(body, tools)
    par = get_bool(body, "parallel_tool_calls", True)
    req.parallel_tool_calls = True if par is None else par
    opts = read_template_options(body)
    req.template.chat_template = request_chat_template(args, body)
    variables = {k: v for k, v in opts.variables.items() if k != "chat_template"}
    req.template.documents, req.template.variables = opts.documents, variables
    effort = get_str(body, "reasoning_effort")
    req.reasoning = read_reasoning_options(args, body)
    req.reasoning.effort = effort


def chat_features(state, body: dict) -> ChatFeatures:
    """Read the tool, reasoning and template fields of a chat request and decide them on
    ``state``'s model (:func:`kvserve.serving.chat_plan.features`; 400 on bad values)."""
    req = ChatRequest(messages=[], request_id="")
    read_chat_options(state.args, body, req)
    return features(state, req)


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


