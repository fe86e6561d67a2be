"""A :class:`~kvserve.serving.chat_request.ChatRequest` -> a :class:`Plan`: the rendered prompt,
the output constraint and the engine requests, for any face (:func:`plan_chat`).

What the plan decides, with the loaded model in hand:

- tools: the tool-call parser (``--tool-call-parser`` (vLLM's rules and texts when it or
  ``--enable-auto-tool-choice`` is given, or with ``--no-jinja``), else the one detected from the
  chat template, as llama-server does); ``required`` and a named function add a grammar that
  forces valid calls; a template with no tool-call format kvserve detects gets llama-server's
  generic format (:mod:`kvserve.chat.tool_generic`: the tools and the answer's shape in the
  system prompt, the output constrained to a JSON call-or-response object for every choice but
  ``none``). ``--exclude-tools-when-tool-choice-none`` leaves tools out of the prompt for ``none``.
- reasoning: llama-server's ``--reasoning-format`` (``auto`` = ``deepseek``; gpt-oss's harmony
  analysis channel) fills ``reasoning_content``; vLLM's ``--reasoning-parser`` fills ``reasoning``.
  A thinking budget forces ``</think>`` after N thinking tokens when the prompt opened a
  thinking block; a grammar then applies after the block.
- the template's variables: ``--chat-template-kwargs``, ``--reasoning on|off``
  (``enable_thinking``), llama-server's Jinja context (:func:`server_context`), the request's
  documents, variables and reasoning effort.
- the prompt: rendered and tokenized (:func:`kvserve.chat.prompt.render_chat`), refused before
  rendering when its text alone cannot fit the context, truncated when asked.
- the engine requests: one per choice, admitted now (:func:`kvserve.serving.admission.admit`) so a
  stream never starts for a request the engine would refuse.

Errors are :mod:`kvserve.errors`' domain errors (a face maps them to its envelope).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.chat.prompt import continues_final_message, normalize_messages, render_chat
from kvserve.chat.template import RESERVED_VARIABLES
from kvserve.engine.request import SEED_RANDOM, InvalidRequestError, Request, SamplingParams
from kvserve.errors import InvalidInputError, ServerFaultError
from kvserve.serving.admission import admit
from kvserve.serving.chat_output import OutputMode, preserved_token_ids
from kvserve.serving.chat_request import ChatRequest, TemplateOptions

if TYPE_CHECKING:
    from kvserve.serving.chat_runner import Runner

__all__ = ["ChatFeatures", "Plan", "apply_sampling", "constraint_factory", "engine_requests", "features",
           "grammar_text", "is_harmony", "plan_chat", "request_template", "server_context", "template_variables",
           "thinking_opened", "tool_constraint", "truncate_ids", "validate_requests", "with_prompt_logprobs",
           "with_request_template", "with_system_text"]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclass
class Plan:
    """What one request asks for: the engine requests (one per choice) and output options."""

    kind: str  # "chat" | "text"
    response_id: str
    created: int
    model: str
    requests: list[Request]  # prompt-major: choice k = prompt k // n, sample k % n
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top candidates to report (chat: top_logprobs; legacy: logprobs)
    echo_texts: list[str] = field(default_factory=list)  # legacy echo: prompt text per choice
    mode: OutputMode = field(default_factory=OutputMode)  # chat: reasoning split and tool-call parsing
    grammar: str = ""  # the constraint's grammar text, shown in /slots params
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: candidates per prompt token to report
    role: str = "assistant"  # chat: the answer's role (vLLM's --response-role rule, :func:`_response_role`)
    token_ids: bool = False  # logprobs tokens as "token_id:N" (vLLM's --return-tokens-as-token-ids)
    verbose: dict | None = None  # llama-server's "__verbose" object (the rendered prompt), non-streaming chat
    remote: Any = None  # a remote model's plan: the ChatRequest forwarded whole (kvserve.remote)

    def input_tokens(self) -> int:
        """Tokens of the first prompt (the token-counting routes).

        Raises:
            NotSupportedError: a remote model's plan (its upstream tokenizes; kvserve has no tokenizer for it).
        """
        if self.remote is not None:
            from kvserve.errors import NotSupportedError

            raise NotSupportedError(f"model '{self.model}' is a remote model: its upstream counts its tokens")
        return len(self.requests[0].prompt_token_ids)


# ------------------------------------------------------------------------ tools and reasoning


@dataclass
class ChatFeatures:
    """What :func:`features` decided for one chat request.

    Attributes:
        template_tools: tools passed to the template (None: none).
        template_kwargs: extra template variables (chat_template_kwargs, enable_thinking...).
        tool_choice: the parsed tool_choice.
        tool_parser: parser name used on the output (None: no parsing).
        parallel: parallel_tool_calls.
        tool_grammar: GBNF forcing the call(s) for required/named (None otherwise).
        generic: the generic format's (choice, parallel, system text) when the template has no
            tool-call format (:mod:`kvserve.chat.tool_generic`), else None.
        reasoning_style, include_reasoning: see OutputMode.
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
    include_reasoning: bool = True
    thinking_budget: int = -1

    def output_mode(self, prompt_text: str, prefill: str) -> OutputMode:
        """The OutputMode for a rendered prompt (``prefill``: continued assistant content)."""
        from kvserve.chat.reasoning import prompt_thinking_tail

        tail = prompt_thinking_tail(prompt_text) if thinking_opened(prompt_text, prefill) else None
        return OutputMode(tool_parser=self.tool_parser, parallel_tool_calls=self.parallel, tools=self.template_tools,
                          reasoning_style=self.reasoning_style,
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


def _resolve_parser(args, choice: str | dict, template) -> str | None:
    """The tool-call parser for this request (``generic`` when the template has no format
    kvserve detects), raising vLLM's 400s in vLLM mode."""
    if choice == "none":
        return None
    if args.vllm_tools:
        if choice == "auto":
            if not (args.enable_auto_tool_choice and args.tool_call_parser):
                raise InvalidInputError('"auto" tool choice requires --enable-auto-tool-choice and '
                                        '--tool-call-parser to be set')
            return args.tool_call_parser
        if not args.tool_call_parser:
            shown = choice if isinstance(choice, str) else {"type": "function", "function": choice}
            raise InvalidInputError(f"tool_choice={json.dumps(shown)} requires --tool-call-parser to be set")
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


def tool_constraint(feats: ChatFeatures, spec):
    """The request's constraint with the tool-call one applied: the GBNF of a forced call, or
    the generic format's JSON schema (whose ``response`` takes a JSON schema / json_object
    constraint). Returns a ConstraintSpec or None.

    Raises:
        InvalidInputError: when a forced call meets another constraint, or the generic format
            one that is not a JSON schema.
    """
    from kvserve.structured.spec import ConstraintSpec

    if feats.generic is not None:
        from kvserve.chat.tool_generic import generic_schema

        choice, parallel, _ = feats.generic
        response = None
        if spec is not None:
            if choice != "auto" or spec.kind not in ("json_schema", "json_object"):
                raise InvalidInputError("tools on a chat template without tool-call support can be combined only "
                                        "with a JSON schema or json_object response_format and tool_choice 'auto'")
            response = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
        schema = generic_schema(feats.template_tools or [], choice, parallel, response)
        return ConstraintSpec("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if feats.tool_grammar is None:
        return spec
    if spec is not None:
        raise InvalidInputError("tool_choice 'required' or a named function cannot be combined with "
                                "response_format or structured outputs")
    return ConstraintSpec("grammar", feats.tool_grammar)


def template_variables(args, opts: TemplateOptions, effort: str | None, template=None,
                       tools: list | None = None) -> dict:
    """Extra template variables: ``--chat-template-kwargs``, ``--reasoning on|off``
    (``enable_thinking``), the variables llama-server gives a Jinja ``template``
    (:func:`server_context`), the request's documents (vLLM), then its variables (which may set
    ``documents`` too, as vLLM merges them) and its reasoning effort (unless a variable set it)."""
    kwargs = {k: v for k, v in args.chat_template_kwargs.items() if k not in RESERVED_VARIABLES}
    if args.reasoning is not None:
        kwargs["enable_thinking"] = args.reasoning == "on"
    if template is not None:
        for k, v in server_context(args, template, tools).items():
            kwargs.setdefault(k, v)
    if opts.documents is not None:
        kwargs["documents"] = opts.documents
    kwargs.update(opts.variables)
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


def _tool_features(f: ChatFeatures, runner: Runner, req: ChatRequest) -> None:
    """Fill ``f``'s tool decisions: parser, tools in the prompt, generic format or forcing grammar."""
    args, tools = runner.args, req.tools
    f.tool_choice, f.parallel = req.tool_choice, req.parallel_tool_calls
    f.tool_parser = _resolve_parser(args, f.tool_choice, runner.template) if tools else None
    if isinstance(f.tool_choice, dict):
        f.parallel = False  # a named function is called once (OpenAI, vLLM)
    if tools and not (f.tool_choice == "none" and args.exclude_tools_when_tool_choice_none):
        f.template_tools = tools
    if f.tool_parser == "generic":
        f.generic = _generic(runner.template, tools, f.tool_choice, f.parallel)
    elif f.tool_parser is not None and f.tool_choice not in ("none", "auto"):
        from kvserve.chat.tool_grammar import tool_call_grammar

        name = f.tool_choice["name"] if isinstance(f.tool_choice, dict) else None
        try:
            f.tool_grammar = tool_call_grammar(f.tool_parser, tools, required_name=name, parallel=f.parallel)
        except ValueError as e:
            raise InvalidInputError(f"tools: {e}") from None


def features(runner: Runner, req: ChatRequest) -> ChatFeatures:
    """The request's tool, reasoning and template decisions on ``runner``'s model and flags."""
    args = runner.args
    f = ChatFeatures()
    _tool_features(f, runner, req)
    f.template_kwargs = template_variables(args, req.template, req.reasoning.effort, runner.template, req.tools)
    if args.reasoning_parser:
        f.reasoning_style = args.reasoning_parser
        f.include_reasoning = req.reasoning.include
    else:
        fmt = req.reasoning.format or args.reasoning_format
        f.reasoning_style = "deepseek" if fmt == "auto" else fmt
        if f.reasoning_style == "deepseek" and is_harmony(runner.template):
            f.reasoning_style = "openai_gptoss"  # llama-server's gpt-oss format: the analysis channel is reasoning
    f.thinking_budget = args.reasoning_budget if req.reasoning.budget is None else req.reasoning.budget
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


# ------------------------------------------------------------------------ sampling and engine requests


def apply_sampling(defaults: SamplingParams, fields: dict[str, Any]) -> SamplingParams:
    """``defaults`` (the model's) with the request's sampling ``fields`` set: a ``logit_bias``
    adds to the defaults' (the request's wins per token), a ``spec_n_max`` lowers the server's,
    never raises it.

    Raises:
        InvalidInputError: a value :class:`SamplingParams` refuses (its text).
    """
    kw = dict(fields)
    if "logit_bias" in kw:
        kw["logit_bias"] = {**defaults.logit_bias, **kw["logit_bias"]}
    if kw.get("spec_n_max") is not None and defaults.spec_n_max is not None:
        kw["spec_n_max"] = max(min(kw["spec_n_max"], defaults.spec_n_max), 0)
    try:
        return dataclasses.replace(defaults, **kw)
    except InvalidRequestError as e:
        raise InvalidInputError(str(e)) from e


def with_prompt_logprobs(params: SamplingParams, k: int | None) -> SamplingParams:
    """Ask the engine for prompt logprobs (at least the top one, which gives rank 1) and for
    logits at every prompt position (no prefix reuse)."""
    if k is None:
        return params
    return dataclasses.replace(params, prompt_logprobs=max(k, params.prompt_logprobs or 0, 1), cache_prompt=False)


def with_special_tokens(params: SamplingParams, skip: bool, spaces: bool,
                        preserved: frozenset[int] = frozenset()) -> SamplingParams:
    """``params`` with the detokenizer's control-token rules: ``skip`` hides control tokens but
    the ``preserved`` ones (the chat parsers' markers, :func:`preserved_token_ids`)."""
    if skip and spaces and not preserved:
        return params
    return dataclasses.replace(params, skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                               preserved_token_ids=preserved)


def truncate_ids(ids: list[int], k: int | None) -> list[int]:
    """The last ``k`` of ``ids`` (all of them when ``k`` is None)."""
    return ids[len(ids) - k:] if k is not None and len(ids) > k else ids


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: a distinct seed derived from the request's seed (random stays random)."""
    if i == 0 or params.seed == SEED_RANDOM:
        return params
    seed = (params.seed + i) % SEED_RANDOM
    return dataclasses.replace(params, seed=seed)


def resolve_lora(runner: Runner, lora) -> tuple[tuple[int, float], ...]:
    """A request's LoRA adapters for the engine: ``lora`` (``(id, scale)`` pairs; None or empty =
    the global scales) checked by the runner's registry (kvserve.lora.LoraRegistry.resolve).

    Raises InvalidRequestError: adapters asked of a runner without LoRA support, an unknown id, a
    bad scale, more adapters than --max-loras."""
    reg = getattr(runner, "lora", None)
    if reg is None:
        if lora:
            raise InvalidRequestError("this model has no LoRA adapters")
        return ()
    return reg.resolve(lora or None)


def engine_requests(runner: Runner, response_id: str, prompts: list[list[int]], params: SamplingParams, n: int,
                    make_constraint=None, *, id_slot: int = -1, cache_salt: str | None = None,
                    owner: str | None = None, return_progress: bool = False,
                    seed_per_request: bool = True, lora=None) -> list[Request]:
    """One engine request per prompt and choice, prompt-major (request k = prompt k // n,
    choice k % n, id ``<response_id>-<k>``); each choice gets its own constraint. Request k
    samples with ``seed + k`` (``seed_per_request``), else with ``seed + k % n`` (every prompt's
    first choice keeps the seed, llama-server's ``/completion``). ``lora``: the request's
    adapters, resolved by :func:`resolve_lora`."""
    eog = runner.tokenizer.eog_token_ids
    adapters = resolve_lora(runner, lora)
    reqs = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            k = p * n + i
            seeded = _choice_params(params, k if seed_per_request else i)
            reqs.append(Request(f"{response_id}-{k}", list(ids), seeded, eog_token_ids=eog,
                                priority_slot=id_slot, cache_salt=cache_salt, owner=owner, lora=adapters,
                                grammar=make_constraint() if make_constraint is not None else None,
                                return_progress=return_progress))
    return reqs


def validate_requests(runner: Runner, reqs: list[Request]) -> None:
    """Admit ``reqs`` for ``runner``'s model (:func:`kvserve.serving.admission.admit`: the one
    check of prompt, limit and ``id_slot``, and the cap of a default ``n_predict``), so a stream
    never starts for a request the engine would refuse.

    Raises:
        InvalidRequestError / ContextSizeExceededError: the prompt or its limit.
        InvalidInputError: ``Invalid id_slot: N`` for a slot the server does not have.
    """
    engine, slots = runner.engine, runner.slots
    n_slots = len(slots.slots) if slots is not None else None
    for r in reqs:
        admit(r, n_ctx_slot=engine.n_ctx_slot, n_vocab=engine.n_vocab, n_slots=n_slots)


def grammar_text(runner: Runner, spec) -> str:
    """The constraint's grammar text as ``/slots`` shows it ("" without one)."""
    return runner.grammars.grammar_text(spec) if spec is not None and runner.grammars is not None else ""


# ------------------------------------------------------------------------ the chat plan


def _check_fits(runner: Runner, req: ChatRequest) -> None:
    """Refuse before rendering and tokenizing a chat whose text alone cannot fit the context:
    the strings of the messages and tools are (nearly all) rendered into the prompt, so their
    length bounds its token count (``Tokenizer.check_fits``; TooManyTokensError)."""
    texts, stack = [], [req.messages, req.tools]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    runner.tokenizer.check_fits(texts, runner.engine.n_ctx_slot)


def _response_role(runner: Runner, msgs: list[dict], add_generation_prompt: bool) -> str:
    """vLLM's ``get_chat_request_role``: ``--response-role`` (default ``assistant``) when the
    prompt ends with the generation prompt, else the role of the last message (the one being
    continued)."""
    if add_generation_prompt or not msgs:
        return str(getattr(runner.args, "response_role", "assistant") or "assistant")
    return str(msgs[-1].get("role") or "assistant")


def _continuation(req: ChatRequest) -> tuple[list[dict], bool | None, bool]:
    """The normalized messages, ``continue_final_message`` as rendered and whether the final
    message is continued; refuses two assistant messages at the end of a continued chat
    (llama-server's text)."""
    opts = req.template
    cont, add_gen = opts.continue_final_message, opts.add_generation_prompt
    if add_gen is False and cont is None:
        cont = False
    msgs = normalize_messages(req.messages, allow_empty=req.messages_may_be_empty)
    continued = continues_final_message(msgs, cont)
    if continued and len(msgs) >= 2 and msgs[-1].get("role") == msgs[-2].get("role") == "assistant":
        raise InvalidInputError("Cannot have 2 or more assistant messages at the end of the list.")
    return msgs, cont, continued


def render_prompt(runner: Runner, messages: Any, *, add_generation_prompt: bool = True, tools: list | None = None,
                  continue_final_message: bool | None = False, variables: dict | None = None,
                  allow_empty: bool = False) -> tuple[str, list[int]]:
    """The one place a chat prompt is rendered with a runner's template and tokenizer
    (:func:`kvserve.chat.prompt.render_chat`, whose arguments these are; ``variables`` are the
    extra template variables): the chat planner, the prompt-showing routes (``/apply-template``,
    ``/tokenize`` with messages) and Ollama's ``/api/generate`` with ``context``.

    Returns:
        (prompt text, prompt token ids).

    Raises:
        InvalidInputError: invalid messages or a template error.
    """
    return render_chat(runner.template, runner.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       tools=tools, continue_final_message=continue_final_message, allow_empty=allow_empty,
                       **(variables or {}))


def _render(runner: Runner, req: ChatRequest, feats: ChatFeatures, cont: bool | None) -> tuple[str, list[int]]:
    """The prompt's text and token ids (truncated when asked)."""
    render_msgs = req.messages
    if feats.generic is not None and isinstance(render_msgs, list):  # the tools and the JSON answer's shape
        render_msgs = with_system_text(render_msgs, feats.generic[2])
    text, ids = render_prompt(runner, render_msgs, add_generation_prompt=req.template.add_generation_prompt is not False,
                              tools=feats.template_tools, continue_final_message=cont, variables=feats.template_kwargs,
                              allow_empty=req.messages_may_be_empty)
    return text, truncate_ids(ids, req.truncate_prompt_tokens)


def _sampling(runner: Runner, req: ChatRequest, mode: OutputMode) -> SamplingParams:
    """The engine's sampling parameters: the model's defaults, the request's fields, logprobs and
    the detokenizer's rules."""
    fields = dict(req.sampling)
    if "n_predict" in fields:
        # the request's own limit is checked against the context; a default is capped to it
        fields["n_predict_default"] = req.n_predict_is_default
    params = apply_sampling(runner.default_params, fields)
    if req.logprobs is not None:
        params = dataclasses.replace(params, n_probs=max(req.logprobs, 1))
    params = with_prompt_logprobs(params, req.prompt_logprobs)
    return with_special_tokens(params, req.skip_special_tokens, req.spaces_between_special_tokens,
                               preserved_token_ids(runner.tokenizer, mode))


class _RequestTemplate:
    """``runner`` seen with a request's own chat template (vLLM's ``chat_template`` field): every
    decision of the plan (tool format, reasoning, rendering) reads ``template``; the rest is the
    runner's."""

    def __init__(self, runner: Runner, template) -> None:
        self._runner = runner
        self.template = template

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str, bos: str, eos: str, content_format: str):
    from kvserve.chat.builtin_templates import with_content_format
    from kvserve.chat.template import ChatTemplate

    return with_content_format(ChatTemplate, content_format)(source, bos, eos)


def request_template(runner: Runner, source: str):
    """A request's Jinja chat template (``source``) compiled for ``runner``'s tokenizer (its
    BOS/EOS texts, ``--chat-template-content-format``), as vLLM renders a trusted request's
    ``chat_template`` in place of the model's. The last 16 compiled templates are kept.

    Raises:
        InvalidInputError: the template does not compile.
    """
    from kvserve.chat.template import TemplateError

    tok = runner.tokenizer
    fmt = getattr(runner.args, "chat_template_content_format", "auto") or "auto"
    try:
        return _compiled_template(source, getattr(tok, "bos_token", "") or "", getattr(tok, "eos_token", "") or "",
                                  fmt)
    except TemplateError as e:
        raise InvalidInputError(f"chat_template: {e}") from None


def with_request_template(runner: Runner, source: str | None) -> Runner:
    """``runner`` itself (``source`` None), or ``runner`` seen with the request's own chat template
    ``source`` (:func:`request_template`) for planning and rendering.

    Raises:
        InvalidInputError: the template does not compile.
    """
    if source is None:
        return runner
    return _RequestTemplate(runner, request_template(runner, source))  # type: ignore[return-value]


def plan_chat(runner: Runner, req: ChatRequest) -> Plan:
    """Plan ``req`` on ``runner``: render, constrain, build and check the engine requests.

    Raises:
        ServerFaultError: the runner's engine died or was unloaded; the model has no chat template.
        NotSupportedError: an encoder (it generates no text).
        InvalidInputError: messages the renderer refuses, a template error, tool or constraint
            conflicts, a value the sampler refuses, an unknown slot.
        TooManyTokensError / ContextSizeExceededError: the prompt cannot fit the context.

    A remote model (:class:`kvserve.remote.RemoteRunner`) plans its own: the request is kept whole
    for its upstream (``plan.remote``).
    """
    if getattr(runner, "remote", None) is not None:
        return runner.plan_chat(req)
    runner.require_ready()
    runner.require_generative()
    runner = with_request_template(runner, req.template.chat_template)
    if runner.template is None:
        raise ServerFaultError("this model has no chat template; use /v1/completions")
    feats = features(runner, req)
    if req.truncate_prompt_tokens is None:  # a prompt to be truncated may be longer than the context
        _check_fits(runner, req)
    msgs, cont, continued = _continuation(req)
    text, ids = _render(runner, req, feats, cont)
    prefill = (msgs[-1].get("content") or "") if continued else ""
    mode = feats.output_mode(text, prefill)
    params = _sampling(runner, req, mode)
    spec = tool_constraint(feats, req.response_format)
    make = constraint_factory(runner, spec, prefill, mode, feats.thinking_budget)
    reqs = engine_requests(runner, req.request_id, [ids], params, req.n, make, id_slot=req.id_slot,
                           cache_salt=req.cache_salt, owner=req.owner, return_progress=req.stream.return_progress,
                           lora=req.lora)
    validate_requests(runner, reqs)
    add_gen = req.template.add_generation_prompt is not False and not continued
    return Plan("chat", req.request_id, int(time.time()), runner.model_alias, reqs, req.n, req.stream.stream,
                req.stream.include_usage, req.logprobs, mode=mode, grammar=grammar_text(runner, spec),
                prompt_logprobs=req.prompt_logprobs, role=_response_role(runner, msgs, add_gen),
                token_ids=req.token_ids, verbose={"prompt": text} if req.verbose else None)
