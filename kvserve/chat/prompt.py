"""Chat messages -> prompt text and token ids, with user text kept out of special tokens.

A chat template mixes two kinds of text: the template's own markup (``<|im_start|>user\\n``,
``<|im_end|>``) whose special-token texts must become special tokens, and message content,
which must be tokenized as ordinary text: a user who types ``<|im_end|>`` must not close the
turn (llama-server Example 7: ``/tokenize`` with ``parse_special: false``).

How :func:`render_chat` keeps the two apart:

1. Every non-empty string content is replaced by a unique sentinel (private-use characters
   and a random nonce) and the template is rendered; the output is split on the sentinels
   into markup pieces and content pieces. A second render with the real content checks that
   substituting the content back gives the same text (it does not when a template inspects
   or transforms content beyond ``trim``; then each content is located in the real render by
   searching in order, see :func:`_locate_contents`).
2. When no content contains special-token text, the whole prompt is tokenized in one call
   with special parsing on: exactly what llama-server does, ids identical by construction.
3. Otherwise the markup is split at its special-token texts, those become their ids, and
   every stretch of text between them (markup and content joined) is tokenized with special
   parsing off.

Boundary caveat: in step 3 a stretch of ordinary text is tokenized by itself; for BPE
tokenizers (byte-level, e.g. SmolLM2, Qwen, Llama 3) this equals what the whole string would
give, because the tokenizer also splits at special tokens first. For SentencePiece
vocabularies that add a leading space per call (``add_space_prefix``) a stretch that follows
a special token may get a different first token than llama.cpp would give. Only message
content strings are protected: text the template takes from elsewhere (tool definitions,
``tool_calls`` arguments, ``chat_template_kwargs``) is markup.

Continuing the final message (vLLM/transformers ``continue_final_message``, llama-server's
default "prefill assistant" for a final assistant message): the conversation is rendered
without the generation prompt and cut right after the final message's content, so the
end-of-turn text the template adds after it is dropped and the model continues that message.
"""

from __future__ import annotations

import logging
import re
import secrets
import weakref
from typing import Any

from kvserve.chat.template import ChatTemplate, TemplateError
from kvserve.errors import InvalidInputError
from kvserve.jsonvalues import check_text

log = logging.getLogger(__name__)

__all__ = ["ROLES", "continues_final_message", "normalize_messages", "render_chat"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # Unicode private-use characters delimit sentinels

#: The roles a message may have: OpenAI's (system, developer, user, assistant, tool, and the
#: deprecated function) and Llama 3.1's ipython. Roles are not validated against the template.
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


def _content_text(content: Any, i: int) -> str | None:
    """A message's content as a string: string, null, or a list of ``{"type": "text"}`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
        raise InvalidInputError(f"messages[{i}].content: at most {MAX_CONTENT_PARTS} parts per message, "
                                f"got {len(content)}")
    if not isinstance(content, list):
        raise InvalidInputError(f"messages[{i}].content: expected a string, null or an array of content "
                                f"parts, got {_type_name(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise InvalidInputError(f"{where}: expected an object, got {_type_name(part)}")
        kind = part.get("type")
        if kind is None:
            raise InvalidInputError(f"{where}: missing content part 'type'")
        if kind != "text":
            raise InvalidInputError(f"{where}: unsupported content part type {kind!r} (only 'text' is supported)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidInputError(f"{where}.text: expected a string, got {_type_name(text)}")
        texts.append(text)
    return "\n".join(texts)  # vLLM and llama.cpp join text parts with newlines


MAX_MESSAGES = 100_000  # messages of one request (Anthropic's own limit)
MAX_CONTENT_PARTS = 10_000  # content parts of one message (Anthropic's content blocks: the same)


def normalize_messages(messages: Any, *, parse_arguments: bool = True, keep_parts: bool = False,
                       allow_empty: bool = False) -> list[dict]:
    """Validate OpenAI-style chat messages and return copies with string/null content.

    Each message must be an object whose ``role`` is one of ``ROLES`` (a template writes the
    role as markup: any other text could open a new turn); ``content`` may be a string, null
    (e.g. an assistant message with ``tool_calls``) or an array of ``{"type": "text", "text"}``
    parts, which are joined with newlines. Other members (``tool_calls``, ``name``,
    ``tool_call_id``, ``reasoning_content``) are kept for the template. Tool-call ``arguments``
    given as a JSON string become the object it encodes (vLLM, llama.cpp) unless
    ``parse_arguments`` is False (then the string is checked and kept). With ``keep_parts``
    an array content stays an array of ``{"type": "text", "text"}`` parts (for templates that
    loop over content, see :attr:`~kvserve.chat.template.ChatTemplate.content_format`). With
    ``allow_empty`` an empty list is valid (the template then renders its generation prompt
    alone, as llama-server's Anthropic endpoint does); otherwise it is refused.

    Raises:
        InvalidInputError: ``'messages' is required`` when None, ``'messages' must not be empty``
            (unless ``allow_empty``), more than :data:`MAX_MESSAGES`
            messages or :data:`MAX_CONTENT_PARTS` parts in one, others naming the field (a face
            answers 400).
    """
    if messages is None:
        raise InvalidInputError("'messages' is required")
    if not isinstance(messages, list):
        raise InvalidInputError(f"Expected 'messages' to be an array, got {_type_name(messages)}")
    if not messages and not allow_empty:
        raise InvalidInputError("'messages' must not be empty")
    if len(messages) > MAX_MESSAGES:
        raise InvalidInputError(f"'messages': at most {MAX_MESSAGES} messages per request, got {len(messages)}")
    check_text(messages, "messages")  # a lone surrogate anywhere: 400 naming messages[i]...
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInputError(f"messages[{i}]: expected an object, got {_type_name(m)}")
        role = m.get("role")
        if role is None:
            raise InvalidInputError(f"messages[{i}]: missing 'role'")
        if not isinstance(role, str):
            raise InvalidInputError(f"messages[{i}].role: expected a string, got {_type_name(role)}")
        if role not in ROLES:
            raise InvalidInputError(f"messages[{i}].role: unknown role {role[:64]!r}; "
                                    f"expected one of {', '.join(ROLES)}")
        if "content" not in m and not m.get("tool_calls"):
            raise InvalidInputError(f"messages[{i}]: missing 'content'")
        msg = {**m, "content": _content_text(m.get("content"), i)}
        if keep_parts and isinstance(m.get("content"), list):  # validated by _content_text
            msg["content"] = [{"type": "text", "text": part["text"]} for part in m["content"]]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _normalize_tool_calls(m["tool_calls"], i, parse_arguments)
        if "reasoning" in m and "reasoning_content" not in m:
            msg["reasoning_content"] = m["reasoning"]  # vLLM's name; templates read reasoning_content
        out.append(msg)
    return out


def _normalize_tool_calls(calls: Any, i: int, parse_arguments: bool = True) -> list[dict]:
    """Assistant ``tool_calls`` for the template: ``function.arguments`` given as a JSON string
    (what OpenAI clients send back) becomes the object it encodes, as llama.cpp and vLLM do, so
    a template's ``arguments | tojson`` renders an object, not a quoted string (with
    ``parse_arguments`` False the string is only checked, and kept)."""
    import json

    if not isinstance(calls, list):
        raise InvalidInputError(f"messages[{i}].tool_calls: expected an array, got {_type_name(calls)}")
    out = []
    for j, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise InvalidInputError(f"messages[{i}].tool_calls[{j}]: expected an object with a 'function' object")
        f = dict(c["function"])
        if not isinstance(f.get("name"), str):
            raise InvalidInputError(f"messages[{i}].tool_calls[{j}].function.name: expected a string")
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                # RecursionError: nesting deeper than the interpreter's stack (e.g. "["*3000);
                # ValueError also covers integers over Python's 4300-digit conversion limit
                parsed = None
            if not isinstance(parsed, dict):
                # llama.cpp refuses these too: a template would print them as raw text
                raise InvalidInputError(f"messages[{i}].tool_calls[{j}].function.arguments: expected a JSON "
                                        f"object (as a string or an object), got {args[:80]!r}")
            if parse_arguments:
                f["arguments"] = parsed
        elif args is None:
            f["arguments"] = {}
        out.append({**c, "function": f})
    return out


def _as_template_input(messages: list[dict]) -> list[dict]:
    """The messages as vLLM hands a request's messages to transformers' ``apply_chat_template``:
    a null ``content`` (an assistant turn with only tool calls) becomes ``""`` (vLLM's string
    content format joins no parts), so vendor templates that concatenate or test
    ``message.content`` render it instead of failing on an absent member (transformers drops
    null members, :func:`~kvserve.chat.template.template_messages`)."""
    return [{**m, "content": ""} if m.get("content") is None else m for m in messages]


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def merge_system_message(messages: list[dict]) -> list[dict]:
    """llama-server's answer to a template that rejects the system role (gemma's raise "System role
    not supported"; ``supports_system_role`` false in :attr:`ChatTemplate.caps`): a leading system
    message's text goes before the next message's content, joined by ``"\n"``; alone, it is
    dropped with a warning (llama.cpp ``system_message_not_supported``), and the empty conversation
    left is refused as any empty ``messages`` is, so :func:`render_chat` answers the template's
    first error. Tools in the generic
    format, described in a system message, then work on such models too. Other messages as given."""
    if not messages or messages[0].get("role") != "system":
        return messages
    if len(messages) == 1:
        log.warning("removing the system prompt: the chat template does not support the system role")
        return []
    sys_text, nxt = _text_of(messages[0].get("content")), dict(messages[1])
    content = nxt.get("content")
    if isinstance(content, list):
        parts = list(content)
        at = next((i for i, p in enumerate(parts) if isinstance(p, dict) and p.get("type") == "text"), None)
        if at is None:
            parts.insert(0, {"type": "text", "text": sys_text})
        else:
            parts[at] = {**parts[at], "text": sys_text + "\n" + parts[at].get("text", "")}
        nxt["content"] = parts
    else:
        nxt["content"] = sys_text + "\n" + (content if isinstance(content, str) else "")
    return [nxt] + messages[2:]


def continues_final_message(messages: list[dict], continue_final_message: bool | None) -> bool:
    """Whether the final message is continued: forced by True, never by False, and with None
    (llama-server's default, ``prefill_assistant``) when the final message is the assistant's."""
    if continue_final_message is not None:
        return bool(continue_final_message) and bool(messages)
    # a final assistant message that carries tool calls is a finished turn: render it whole
    return bool(messages) and messages[-1].get("role") == "assistant" and not messages[-1].get("tool_calls")


#: tokenizer -> what :func:`_specials` computed for it. Weak keys: an entry dies with its
#: tokenizer (when its model is unloaded); the values hold no reference to the tokenizer.
_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _specials(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """Regex over the texts of the tokens that special parsing turns into one token
    (control/unknown types), longest first, and text -> id.

    Computed once per tokenizer (a vocabulary scan) and kept as long as that tokenizer lives;
    a tokenizer that cannot be weakly referenced is scanned on every call.
    """
    try:
        return _SPECIALS[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable (or unhashable): nothing to cache it by
        return _scan_specials(tokenizer)
    found = _scan_specials(tokenizer)
    _SPECIALS[tokenizer] = found  # two threads may both scan: the results are equal
    return found


def _scan_specials(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    table: dict[str, int] = {}
    for i in range(len(tokenizer)):
        if tokenizer.is_control(i):
            text = tokenizer.token_text(i)
            if text:
                table.setdefault(text, i)
    if not table:
        return None, table
    alternation = "|".join(re.escape(t) for t in sorted(table, key=len, reverse=True))
    return re.compile(alternation), table


# A segment is (text, content index or None for markup).
Segment = tuple[str, "int | None"]


def _split_marked(marked: str, nonce: str) -> list[Segment]:
    parts = re.split(f"{_OPEN}{nonce}(\\d+){_CLOSE}", marked)
    segs: list[Segment] = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            if part:
                segs.append((part, None))
        else:
            segs.append(("", int(part)))
    return segs


def _fill(segs: list[Segment], contents: list[str]) -> list[Segment]:
    return [(contents[c] if c is not None else t, c) for t, c in segs]


def _locate_contents(truth: str, contents: list[str]) -> list[Segment]:
    """Fallback when the template transforms content: find each content (or its stripped form)
    in the rendered text, in order; whatever is not found is treated as markup."""
    segs: list[Segment] = []
    pos = 0
    for idx, c in enumerate(contents):
        for needle in (c, c.strip()):
            at = truth.find(needle, pos) if needle else -1
            if at >= 0:
                if at > pos:
                    segs.append((truth[pos:at], None))
                segs.append((needle, idx))
                pos = at + len(needle)
                break
    if pos < len(truth):
        segs.append((truth[pos:], None))
    return segs


def _texts(m: dict) -> list[str]:
    """A message's non-empty content texts, in order: the string, or each text part's text."""
    c = m.get("content")
    if isinstance(c, str):
        return [c] if c else []
    if isinstance(c, list):
        return [p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]]
    return []


def _segments(template: ChatTemplate, messages: list[dict], gen: bool, tools, kwargs) -> tuple[str, list[Segment]]:
    """Render and split into markup/content segments (see module docstring). Content is a
    string or a list of text parts; each non-empty text is a content segment."""
    nonce = secrets.token_hex(6)
    contents: list[str] = []

    def mark(text: str) -> str:
        contents.append(text)
        return f"{_OPEN}{nonce}{len(contents) - 1}{_CLOSE}"

    marked_msgs = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and c:
            m = {**m, "content": mark(c)}
        elif isinstance(c, list):
            m = {**m, "content": [{**p, "text": mark(p["text"])} if p.get("text") else p for p in c]}
        marked_msgs.append(m)
    try:
        truth = template.render(messages, add_generation_prompt=gen, tools=tools, **kwargs)
        if not contents:
            return truth, [(truth, None)] if truth else []
        marked = template.render(marked_msgs, add_generation_prompt=gen, tools=tools, **kwargs)
    except TemplateError as e:
        raise InvalidInputError(str(e)) from e
    segs = _split_marked(marked, nonce)
    for variant in (contents, [c.strip() for c in contents]):  # templates often `| trim` content
        filled = _fill(segs, variant)
        if "".join(t for t, _ in filled) == truth:
            return truth, filled
    return truth, _locate_contents(truth, contents)


def _final_content_index(messages: list[dict]) -> int | None:
    """Index (among the non-empty content texts, :func:`_texts`) of the final message's last
    text, or None when it has none."""
    if not _texts(messages[-1]):
        return None
    return sum(len(_texts(m)) for m in messages) - 1


def _tokenize(tokenizer, segs: list[Segment], force_split: bool = False) -> list[int]:
    """Token ids of the rendered segments: template markup with special-token parsing,
    message contents without. Fast path (one encode of the whole text) when no content
    holds special-token text; ``force_split`` takes the split path anyway (tests)."""
    pattern, table = _specials(tokenizer)
    text = "".join(t for t, _ in segs)
    if pattern is None or (not force_split and not any(c is not None and pattern.search(t) for t, c in segs)):
        ids = tokenizer.encode(text, add_special=False, parse_special=True)
    else:
        ids, buf = [], []

        def flush() -> None:
            s = "".join(buf)
            buf.clear()
            if s:
                ids.extend(tokenizer.encode(s, add_special=False, parse_special=False))

        for t, c in segs:
            if c is not None:
                buf.append(t)
                continue
            pos = 0
            for m in pattern.finditer(t):
                buf.append(t[pos:m.start()])
                flush()
                ids.append(table[m.group()])
                pos = m.end()
            buf.append(t[pos:])
        flush()
    # llama-server tokenizes chat prompts with add_special: BOS when the vocabulary asks for
    # it. Unlike llama.cpp, no second BOS when the template already wrote one.
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


#: how llama-server joins the text parts of a continued final message (common_chat_msg::render_content)
PREFILL_PART_SEPARATOR = "\n\n"


def _prefill_parts_joined(messages: Any, msgs: list[dict], continue_final_message: bool | None,
                          parts: bool) -> list[dict]:
    """``msgs`` (normalized ``messages``) with a continued final message given as text parts
    joined as llama-server joins them (blank lines: it appends the parts after the rendered
    history, ``render_content``), not with the single newline of other messages. Unchanged for a
    template that takes the parts themselves."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if parts or not isinstance(last, dict) or not isinstance(last.get("content"), list) \
            or not continues_final_message(msgs, continue_final_message):
        return msgs
    text = PREFILL_PART_SEPARATOR.join(p["text"] for p in last["content"])  # validated: text parts only
    return [*msgs[:-1], {**msgs[-1], "content": text}]


def render_chat(template: ChatTemplate, tokenizer, messages: Any, /, *, add_generation_prompt: bool = True,
                tools: list | None = None, continue_final_message: bool | None = False,
                allow_empty: bool = False, **template_kwargs: Any) -> tuple[str, list[int]]:
    """Render ``messages`` with ``template`` and tokenize, user content without special tokens.

    Args:
        template: the model's ChatTemplate.
        tokenizer: the model's Tokenizer.
        messages: OpenAI-style messages (validated by :func:`normalize_messages`); a leading
            system message that the template rejects (it fails to render, and its
            ``supports_system_role`` cap is false: gemma's "System role not supported") is
            merged into the next message and the rendering tried once more
            (:func:`merge_system_message`, llama-server). Text parts
            are joined with newlines (a continued final message's with blank lines, as
            llama-server), or stay parts for a template whose ``content_format`` is
            ``openai`` (it loops over content: vLLM's auto rule). Tool-call
            arguments sent as JSON strings reach the template as objects (vLLM); when the
            template fails on that, it is rendered once more with the strings as sent
            (transformers renders what it is given).
        add_generation_prompt: append the assistant turn header (ignored when continuing).
        tools: OpenAI tool definitions for the template, or None.
        continue_final_message: True continues the final message (no generation prompt, no
            end-of-turn after its content); None does so when the final message is the
            assistant's (llama-server's default); False never.
        allow_empty: an empty ``messages`` renders the generation prompt alone (see
            :func:`normalize_messages`).
        **template_kwargs: extra template variables (``chat_template_kwargs``).

    Returns:
        (prompt text, prompt token ids). The text is what ``/apply-template`` shows.

    Raises:
        InvalidInputError: invalid messages or a template error (a face answers 400).
    """
    kw = dict(add_generation_prompt=add_generation_prompt, tools=tools, continue_final_message=continue_final_message,
              allow_empty=allow_empty)
    try:
        return _render_chat(template, tokenizer, messages, False, template_kwargs, **kw)
    except InvalidInputError as first:
        if not (isinstance(messages, list) and messages and isinstance(messages[0], dict)
                and messages[0].get("role") == "system") or template.caps.get("supports_system_role", True):
            raise
        try:  # llama-server: a template without the system role gets the system text in the next message
            return _render_chat(template, tokenizer, messages, True, template_kwargs, **kw)
        except InvalidInputError:
            raise first from None


def _render_chat(template: ChatTemplate, tokenizer, messages: Any, merge_system: bool, template_kwargs: dict, *,
                 add_generation_prompt: bool, tools: list | None,
                 continue_final_message: bool | None, allow_empty: bool) -> tuple[str, list[int]]:
    """:func:`render_chat`, with a leading system message merged into the next when ``merge_system``."""
    parts = getattr(template, "content_format", "string") == "openai"
    msgs = _prefill_parts_joined(messages, _as_template_input(normalize_messages(messages, keep_parts=parts,
                                                                                 allow_empty=allow_empty)),
                                 continue_final_message, parts)
    if merge_system:
        msgs = merge_system_message(msgs)
    try:
        return _render_segments(template, tokenizer, msgs, add_generation_prompt, tools, continue_final_message,
                                template_kwargs)
    except InvalidInputError as first:
        if not _has_string_arguments(messages):
            raise
        # A template that concatenates tool-call arguments as text (DeepSeek-V3.1,
        # firefunction-v2) fails on the parsed objects: render the client's JSON strings as
        # given, as transformers renders what it is given. If that fails too, the first error.
        raw = _as_template_input(normalize_messages(messages, parse_arguments=False, keep_parts=parts,
                                                    allow_empty=allow_empty))
        if merge_system:
            raw = merge_system_message(raw)
        try:
            return _render_segments(template, tokenizer, raw, add_generation_prompt, tools,
                                    continue_final_message, template_kwargs)
        except InvalidInputError:
            raise first from None


def _has_string_arguments(messages: list[dict]) -> bool:
    return any(isinstance(c, dict) and isinstance(c.get("function"), dict)
               and isinstance(c["function"].get("arguments"), str)
               for m in messages for c in (m.get("tool_calls") or []))


def _render_segments(template: ChatTemplate, tokenizer, msgs: list[dict], add_generation_prompt: bool,
                     tools: list | None, continue_final_message: bool | None,
                     template_kwargs: dict) -> tuple[str, list[int]]:
    """:func:`render_chat` on validated messages."""
    if continues_final_message(msgs, continue_final_message):
        final = _final_content_index(msgs)
        if final is None:
            # Nothing to continue: the final message is empty, so start the turn (llama.cpp's
            # prefill path renders the earlier messages with the generation prompt).
            truth, segs = _segments(template, msgs[:-1], True, tools, template_kwargs)
        else:
            truth, segs = _segments(template, msgs, False, tools, template_kwargs)
            ends = [k for k, (_, c) in enumerate(segs) if c == final]
            if not ends:
                raise InvalidInputError("cannot continue the final message: the chat template does not "
                                        "render its content")
            segs = segs[: ends[-1] + 1]
            truth = "".join(t for t, _ in segs)
    else:
        truth, segs = _segments(template, msgs, add_generation_prompt, tools, template_kwargs)
    return truth, _tokenize(tokenizer, segs)
