"""Ollama's Modelfile: parse it, write it back, and turn it into what ``create`` stores.

The grammar is Ollama's ``parser/parser.go``, character for character:

- A file is UTF-8 (a UTF-8 BOM is skipped; a UTF-16 BOM switches to UTF-16). A line whose
  first non-blank character is ``#`` is a comment; a ``#`` anywhere else is text.
- A command is a word of ASCII letters, case-insensitive (``FROM``, ``from``, ``From``), then
  one space or tab, then its value. ``PARAMETER`` is followed by a name (letters, digits,
  ``_``; case-sensitive) and ``MESSAGE`` by a role (``system``, ``user`` or ``assistant``).
- A value runs to the end of its line, blanks around it removed. Spaces never end it. A value
  that starts with ``"`` runs until a line ends right after a closing ``"``; one that starts with
  three double quotes until a line ends right after three: both may span lines and keep their inner
  text exactly (newlines, leading and trailing blanks). There are no escapes.
- Characters Go does not count as printable (controls other than tab and newline, format
  characters such as U+200B, spaces other than U+0020) are dropped, as Ollama drops them.
- A file needs a FROM line (``no FROM line``).

Commands and what :class:`Modelfile` keeps of them:

======================  =====================================================================
FROM x                  :attr:`Modelfile.from_` (the first; every one in :attr:`froms`): a model
                        name, a ``.gguf`` path, a blob digest ``sha256:<hex>``, or a directory
                        (Hugging Face safetensors); :func:`classify_from`/:func:`resolve_from`
                        say which.
PARAMETER name value    :attr:`Modelfile.parameters`, typed by Ollama's ``api.Options`` (see
                        :data:`PARAMETER_TYPES`); ``stop`` repeated makes a list. An unknown
                        name or a value of the wrong type is an error naming the line. The
                        parameters Ollama deprecated (``mirostat``, ``use_mlock``...) are
                        dropped with a warning (:attr:`Modelfile.warnings`), as Ollama does.
TEMPLATE t              :attr:`Modelfile.template`: a Go template (checked by :meth:`create_request`).
SYSTEM s                :attr:`Modelfile.system` (the last one).
ADAPTER path            :attr:`Modelfile.adapters`: parsed and kept; ``create`` refuses it
                        (:meth:`Modelfile.check_supported`: kvserve has no LoRA yet).
LICENSE l               :attr:`Modelfile.licenses` (repeatable: one license layer each).
MESSAGE role content    :attr:`Modelfile.messages`.
REQUIRES version        :attr:`Modelfile.requires`: a semantic version (``0.14.0``, ``v0.14``);
                        anything else is refused, as Ollama refuses it.
DRAFT path              :attr:`Modelfile.draft`: parsed and kept; ``create`` refuses it (no
                        speculative decoding in kvserve yet).
RENDERER name           :attr:`Modelfile.renderer`: kept and stored (the config's ``renderer``),
PARSER name             :attr:`Modelfile.parser`: like RENDERER. kvserve renders prompts with the
                        model's Jinja or Go template and parses tool calls with its own parsers,
                        so both are carried for ``show`` and for Ollama, not acted on.
CAPABILITY name         :attr:`Modelfile.capabilities` (repeatable): one of Ollama's capability
                        names (:data:`CAPABILITIES`); kept and stored in the config.
REMOTE url [k=v...]     kvserve's own command (Ollama refuses the file): a remote model
                        (:mod:`kvserve.remote`): FROM names the upstream's model, ``url`` its
                        base URL, then ``dialect=openai|ollama`` and ``key=ENV_VAR``
                        (:attr:`Modelfile.remote`); stored as the config's ``remote_host``,
                        ``remote_model`` (Ollama's fields), ``remote_dialect``, ``remote_key_env``.
======================  =====================================================================

Errors are :class:`ModelfileError` (an InvalidInputError) with Ollama's wording and a line
number: ``(line 3): command must be one of "from", ...``. Where Ollama reports no line (an
unterminated quote: ``unexpected EOF``) this parser still gives one; where Ollama counts a
CRLF as two lines, this parser counts one.

What the create step calls: :func:`parse_modelfile`, then :meth:`Modelfile.check_supported`,
:meth:`Modelfile.create_request` (Ollama's ``/api/create`` JSON form), and for the layers
:func:`params_layer`, :func:`messages_layer`, :func:`text_layers`. What ``show`` calls:
:func:`show_modelfile` and :func:`show_parameters`.
"""

from __future__ import annotations

import codecs
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kvserve.chat.go_template import (GoTemplateError, JsonObject, OllamaTemplate, go_format_float, go_json,
                                      go_quote)
from kvserve.errors import InvalidInputError, NotFoundError, NotSupportedError

__all__ = [
    "CAPABILITIES", "COMMANDS", "DEPRECATED_PARAMETERS", "PARAMETER_TYPES", "Command", "CreateRequest",
    "FromSource", "Message", "Modelfile", "ModelfileError", "classify_from", "format_command",
    "messages_layer", "params_layer", "parse_modelfile", "parse_parameter", "resolve_from",
    "show_modelfile", "show_parameters", "text_layers",
]

#: Commands a Modelfile may use, lower-case (Ollama's ``isValidCommand``, plus CAPABILITY of
#: Ollama's later versions).
COMMANDS = ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser",
            "parameter", "message", "requires", "capability", "remote")

#: PARAMETER names and their types: Ollama's ``api.Options`` and ``api.Runner`` JSON names.
#: ``list`` is a list of strings (``stop``, one per PARAMETER line).
PARAMETER_TYPES: dict[str, type] = {
    # api.Runner: fixed when the model loads
    "num_ctx": int, "num_batch": int, "num_gpu": int, "main_gpu": int, "use_mmap": bool,
    "num_thread": int, "draft_num_predict": int,
    # api.Options: per request
    "num_keep": int, "seed": int, "num_predict": int, "top_k": int, "top_p": float, "min_p": float,
    "typical_p": float, "repeat_last_n": int, "temperature": float, "repeat_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "stop": list,
}

#: Names Ollama drops with ``warning: parameter NAME is deprecated``.
DEPRECATED_PARAMETERS = ("penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only",
                         "use_mlock", "mirostat", "mirostat_tau", "mirostat_eta")

#: CAPABILITY values: Ollama's ``types/model`` capabilities.
CAPABILITIES = ("completion", "tools", "insert", "vision", "embedding", "thinking", "image", "audio")

_ROLES = ("system", "user", "assistant")

_ERR_COMMAND = ('command must be one of "from", "license", "template", "system", "adapter", "draft", '
                '"renderer", "parser", "parameter", "message", "requires", or "capability"')
_ERR_ROLE = 'message role must be one of "system", "user", or "assistant"'


class ModelfileError(InvalidInputError):
    """A Modelfile that cannot be parsed or used. ``line`` is the 1-based line at fault (0: the
    whole file, as for ``no FROM line``). The message reads ``(line N): ...`` as Ollama's
    ``ParserError`` does."""

    def __init__(self, message: str, line: int = 0):
        super().__init__(f"(line {line}): {message}" if line > 0 else message)
        self.line = line
        self.reason = message


@dataclass(frozen=True, slots=True)
class Command:
    """One command as Ollama's ``parser.Command`` holds it.

    Attributes:
        name: ``model`` (FROM), ``adapter``, ``license``, ``template``, ``system``, ``message``,
            ``requires``, ``draft``, ``renderer``, ``parser``, ``capability``, or a PARAMETER's name.
        args: the value (``"role: content"`` for a MESSAGE).
        line: the 1-based line the command starts on.
    """

    name: str
    args: str
    line: int = 0

    def __str__(self) -> str:
        return format_command(self.name, self.args)


@dataclass(frozen=True, slots=True)
class Message:
    """A MESSAGE: ``role`` (system, user, assistant) and ``content``."""

    role: str
    content: str

    def to_dict(self) -> dict:
        """The ``api.Message`` JSON object (``role``, ``content``)."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class FromSource:
    """What a FROM value names.

    Attributes:
        kind: ``model`` (a model name, resolved by the store), ``blob`` (a digest already in the
            store), ``gguf`` (a GGUF file), ``directory`` (a Hugging Face safetensors directory,
            or one holding GGUF files), ``path`` (looks like a path; not checked on disk).
        value: the FROM value as written.
        digest: ``sha256:<64 hex>`` for a blob.
        path: the absolute path for gguf/directory (after :func:`resolve_from`).
    """

    kind: str
    value: str
    digest: str = ""
    path: str = ""


@dataclass(slots=True)
class CreateRequest:
    """What a create step needs from a Modelfile (Ollama's ``api.CreateRequest`` before the
    client hashes files). Built by :meth:`Modelfile.create_request`.

    Attributes:
        sources: every FROM, resolved (:class:`FromSource`); ``from_`` is the model name or blob
            digest to build on, ``None`` when the FROM lines are files.
        adapters, draft: paths (absolute when resolved against a directory).
        template, system: ``None`` when the Modelfile does not set them.
        licenses: one layer each. parameters: typed (see :data:`PARAMETER_TYPES`).
        messages, requires, renderer, parser, capabilities, warnings: as in :class:`Modelfile`.
    """

    sources: list[FromSource]
    from_: str | None
    adapters: list[str] = field(default_factory=list)
    draft: str | None = None
    template: str | None = None
    system: str | None = None
    licenses: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    requires: str | None = None
    renderer: str | None = None
    parser: str | None = None
    capabilities: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    remote: dict[str, str] | None = None  # REMOTE: remote_host, remote_dialect, remote_key_env

    def to_json(self, model: str = "", files: dict[str, str] | None = None,
                adapters: dict[str, str] | None = None) -> dict:
        """The POST /api/create body Ollama's client sends: ``model``, ``from`` or ``files``
        (path -> ``sha256:<hex>``, computed by the caller), ``adapters``, ``template``,
        ``system``, ``license`` (a list), ``parameters``, ``messages``, ``renderer``, ``parser``,
        ``requires``; unset members omitted. ``capabilities`` go in ``info``, where Ollama's
        create reads them."""
        body: dict[str, Any] = {"model": model} if model else {}
        if files:
            body["files"] = dict(files)
        elif self.from_ is not None:
            body["from"] = self.from_
        if adapters:
            body["adapters"] = dict(adapters)
        for key, value in (("template", self.template), ("system", self.system)):
            if value:
                body[key] = value
        if self.licenses:
            body["license"] = list(self.licenses)
        if self.parameters:
            body["parameters"] = {k: list(v) if isinstance(v, list) else v for k, v in self.parameters.items()}
        if self.messages:
            body["messages"] = [m.to_dict() for m in self.messages]
        for key, value in (("renderer", self.renderer), ("parser", self.parser), ("requires", self.requires)):
            if value:
                body[key] = value
        if self.capabilities:
            body["info"] = {"capabilities": list(self.capabilities)}
        if self.remote:  # kvserve's REMOTE: Ollama's remote_host and kvserve's two fields
            body.update(self.remote)
        return body


@dataclass(slots=True)
class Modelfile:
    """A parsed Modelfile (:func:`parse_modelfile`).

    ``commands`` holds every command in order (what :meth:`to_text` writes back); the other
    attributes are views of them. ``parameters`` maps a name to its typed value (int, float,
    bool, or a list of strings for ``stop``); a repeated non-list parameter keeps its last value.
    """

    commands: list[Command] = field(default_factory=list)
    froms: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    draft: str | None = None
    template: str | None = None
    system: str | None = None
    licenses: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    requires: str | None = None
    renderer: str | None = None
    parser: str | None = None
    capabilities: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    remote: str | None = None  # REMOTE's value (kvserve: a remote model)

    @property
    def from_(self) -> str:
        """The first FROM value."""
        return self.froms[0]

    def line_of(self, name: str) -> int:
        """The line of the first command called ``name`` (0 if none)."""
        return next((c.line for c in self.commands if c.name == name), 0)

    def to_text(self) -> str:
        """The Modelfile as text, one command a line in the original order (Ollama's
        ``Modelfile.String``); parsing it again gives the same commands (see :func:`quote`)."""
        return "".join(str(c) + "\n" for c in self.commands)

    def check_supported(self) -> None:
        """Refuse what kvserve's create cannot build yet.

        Raises:
            NotSupportedError: an ADAPTER (``ADAPTER is not supported yet: kvserve has no LoRA
                adapters``) or a DRAFT (no speculative decoding), naming the line.
        """
        for cmd in self.commands:
            if cmd.name == "adapter":
                raise NotSupportedError(
                    f"(line {cmd.line}): ADAPTER is not supported yet: kvserve has no LoRA adapters")
            if cmd.name == "draft":
                raise NotSupportedError(
                    f"(line {cmd.line}): DRAFT is not supported yet: kvserve has no draft-model speculative decoding (prompt lookup: kvserve serve --spec-type ngram)")

    def create_request(self, base_dir: str | os.PathLike | None = None, *,
                       check_template: bool = True) -> CreateRequest:
        """What create stores (Ollama's ``Modelfile.CreateRequest``).

        Args:
            base_dir: the Modelfile's directory: FROM/ADAPTER/DRAFT paths are resolved against
                it and checked on disk (:func:`resolve_from`). None: classified by their text
                only (:func:`classify_from`), nothing read (the POST /api/create path).
            check_template: parse TEMPLATE with the Go template renderer.

        Raises:
            ModelfileError: a TEMPLATE that does not parse or uses what kvserve cannot render
                (``(line N): template error: ...``, Ollama's wording), two FROM model names.
            NotFoundError: a FROM/ADAPTER/DRAFT path that does not exist (with ``base_dir``).
        """
        if check_template and self.template is not None:
            try:
                OllamaTemplate(self.template)
            except GoTemplateError as e:
                raise ModelfileError(f"template error: {e}", self.line_of("template")) from None
        sources = []
        for cmd in self.commands:
            if cmd.name == "model":
                sources.append(resolve_from(cmd.args, base_dir, cmd.line) if base_dir is not None
                               else classify_from(cmd.args))
        names = [s for s in sources if s.kind in ("model", "blob")]
        from_ = (names[-1].digest or names[-1].value) if names else None
        adapters = [_resolve_path(a, base_dir, self.line_of("adapter")) for a in self.adapters]
        draft = _resolve_path(self.draft, base_dir, self.line_of("draft")) if self.draft is not None else None
        return CreateRequest(
            sources=sources, from_=from_, adapters=adapters, draft=draft, template=self.template,
            system=self.system, licenses=list(self.licenses),
            parameters={k: list(v) if isinstance(v, list) else v for k, v in self.parameters.items()},
            messages=list(self.messages), requires=self.requires, renderer=self.renderer,
            parser=self.parser, capabilities=list(self.capabilities), warnings=list(self.warnings),
            remote=self._remote_fields(names))

    def _remote_fields(self, names: list) -> dict[str, str] | None:
        """REMOTE's value -> the create request's ``remote_host``, ``remote_dialect`` and
        ``remote_key_env`` (ModelfileError naming the line: a bad option, no FROM model name)."""
        if self.remote is None:
            return None
        line = self.line_of("remote")
        url, *opts = self.remote.split()
        out = {"remote_host": url, "remote_dialect": "openai"}
        for o in opts:
            k, sep, v = o.partition("=")
            if not sep or k not in ("dialect", "key") or not v:
                raise ModelfileError(f"REMOTE takes a base URL, then dialect=openai|ollama and key=ENV_VAR; "
                                     f"got {o[:64]!r}", line)
            out["remote_dialect" if k == "dialect" else "remote_key_env"] = v
        if not names or names[-1].kind != "model":
            raise ModelfileError("REMOTE needs FROM to name the upstream's model", line)
        return out


# --------------------------------------------------------------------------------------------
# Parsing


def _go_isprint(ch: str) -> bool:
    """Go's ``strconv.IsPrint`` (Python's ``str.isprintable`` is the same set)."""
    return ch.isprintable()


def _decode(data: bytes | str) -> str:
    """Text of a Modelfile: Ollama's ``unicode.BOMOverride(UTF8)``: a UTF-8 BOM is dropped, a
    UTF-16 BOM selects UTF-16; bytes that are not UTF-8 become U+FFFD."""
    if isinstance(data, str):
        return data[1:] if data.startswith("\ufeff") else data
    if data.startswith(codecs.BOM_UTF8):
        return data[3:].decode("utf-8", "replace")
    if data.startswith(codecs.BOM_UTF16_LE):
        return data[2:].decode("utf-16-le", "replace")
    if data.startswith(codecs.BOM_UTF16_BE):
        return data[2:].decode("utf-16-be", "replace")
    return data.decode("utf-8", "replace")


def _unquote(s: str) -> tuple[str, bool]:
    """Ollama's ``unquote``: (value, complete). A value opened with three double quotes or one
    is complete once it also ends with them."""
    if s.startswith('"""'):
        if len(s) >= 6 and s.endswith('"""'):
            return s[3:-3], True
        return "", False
    if s.startswith('"'):
        if len(s) >= 2 and s.endswith('"'):
            return s[1:-1], True
        return "", False
    return s, True


_BLANKS = " \t\r\n"


class _Scanner:
    """Ollama's ParseFile state machine: states nil, name, value, parameter, message, comment."""

    def __init__(self, text: str):
        self.text = text
        self.commands: list[Command] = []
        self.line = 1

    def fail(self, msg: str, line: int | None = None) -> None:
        raise ModelfileError(msg, self.line if line is None else line)

    def run(self) -> list[Command]:
        state, buf = "nil", []
        name = role = ""
        start_line = 1
        prev = ""
        for ch in self.text:
            if ch == "\n" and prev == "\r":
                prev = ch  # CRLF is one line end
            elif ch in "\r\n":
                self.line += 1
                prev = ch
            else:
                prev = ch
            at = self.line - 1 if ch in "\r\n" else self.line  # the line this character is on
            if state == "nil":
                if ch == "#":
                    state = "comment"
                elif ch not in _BLANKS:
                    state, buf, start_line = "name", [ch] if _go_isprint(ch) else [], at
            elif state == "comment":
                if ch in "\r\n":
                    state = "nil"
            elif state == "name":
                if ch.isascii() and ch.isalpha():
                    buf.append(ch)
                elif ch in " \t":
                    word = "".join(buf).lower()
                    if word not in COMMANDS:
                        self.fail(_ERR_COMMAND, at)
                    state, buf = {"parameter": "parameter", "message": "message"}.get(word, "value"), []
                    name = "model" if word == "from" else word
                else:
                    self.fail(_ERR_COMMAND, at)
            elif state in ("parameter", "message"):
                if ch in " \t":
                    word = "".join(buf)
                    if state == "parameter":
                        name = word
                    else:
                        if word not in _ROLES:
                            self.fail(_ERR_ROLE, at)
                        role = word
                    state, buf = "value", []
                elif ch.isascii() and (ch.isalpha() or (state == "parameter" and (ch.isdigit() or ch == "_"))):
                    buf.append(ch)
                else:
                    need = ("PARAMETER needs a name (letters, digits, _) and a value" if state == "parameter"
                            else "MESSAGE needs a role and a content")
                    self.fail(f"unexpected EOF: {''.join(buf)} ({need})", at)
            else:  # value
                if ch in " \t\r\n":
                    value, complete = _unquote("".join(buf).strip(_BLANKS))
                    if not complete or ch in " \t":
                        buf.append(ch)
                        continue
                    self.commands.append(Command(name, f"{role}: {value}" if role else value, start_line))
                    state, buf, role = "nil", [], ""
                elif _go_isprint(ch):
                    buf.append(ch)
        return self.finish(state, buf, name, role, start_line)

    def finish(self, state: str, buf: list[str], name: str, role: str, start_line: int) -> list[Command]:
        if state == "value":
            value, complete = _unquote("".join(buf).strip(_BLANKS))
            if not complete:
                self.fail("unexpected EOF: unterminated quoted value", start_line)
            self.commands.append(Command(name, f"{role}: {value}" if role else value, start_line))
        elif state in ("name", "parameter", "message"):
            self.fail("unexpected EOF", start_line)
        return self.commands


def parse_modelfile(data: bytes | str) -> Modelfile:
    """Parse a Modelfile (bytes as read from disk, or text).

    Returns:
        the :class:`Modelfile`, parameters typed and validated.

    Raises:
        ModelfileError: a syntax error, an unknown PARAMETER name, a value of the wrong type, an
            invalid MESSAGE role, REQUIRES version or CAPABILITY, or no FROM line; every one but
            the last names its line.
    """
    commands = _Scanner(_decode(data)).run()
    mf = Modelfile(commands=commands)
    for cmd in commands:
        _apply(mf, cmd)
    if not mf.froms:
        raise ModelfileError("no FROM line")
    return mf


_SEMVER = re.compile(r"v(0|[1-9]\d*)(\.(0|[1-9]\d*)(\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
                     r"(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?)?)?")


def _valid_semver(v: str) -> bool:
    """golang.org/x/mod/semver.IsValid: vMAJOR[.MINOR[.PATCH[-PRE][+BUILD]]], no leading zeros
    (also in numeric pre-release parts)."""
    m = _SEMVER.fullmatch(v)
    if not m:
        return False
    pre = m.group(6)
    return not pre or all(not (p.isdigit() and len(p) > 1 and p[0] == "0") for p in pre[1:].split("."))


def _apply(mf: Modelfile, cmd: Command) -> None:
    name, args = cmd.name, cmd.args
    if name == "model":
        mf.froms.append(args)
    elif name == "adapter":
        mf.adapters.append(args)
    elif name == "draft":
        mf.draft = args
    elif name == "remote":
        mf.remote = args
    elif name in ("template", "system", "renderer", "parser"):
        setattr(mf, name, args)
    elif name == "license":
        mf.licenses.append(args)
    elif name == "message":
        role, _, content = args.partition(": ")
        mf.messages.append(Message(role, content))
    elif name == "requires":
        v = args if args.startswith("v") else "v" + args
        if not _valid_semver(v):
            raise ModelfileError("requires must be a valid semver (e.g. 0.14.0)", cmd.line)
        mf.requires = v[1:]
    elif name == "capability":
        if args not in CAPABILITIES:
            raise ModelfileError("capability must be one of " + ", ".join(f'"{c}"' for c in CAPABILITIES), cmd.line)
        if args not in mf.capabilities:
            mf.capabilities.append(args)
    elif name in DEPRECATED_PARAMETERS:
        mf.warnings.append(f"(line {cmd.line}): parameter {name} is deprecated")
    else:
        value = parse_parameter(name, args, cmd.line)
        if isinstance(value, list):
            mf.parameters.setdefault(name, []).extend(value)
        else:
            mf.parameters[name] = value


# --------------------------------------------------------------------------------------------
# PARAMETER values (Go's strconv, as Ollama's api.FormatParams uses it)

_INT = re.compile(r"[+-]?[0-9]+")
_DEC_FLOAT = re.compile(r"[+-]?(?:[0-9](?:_?[0-9])*(?:\.(?:[0-9](?:_?[0-9])*)?)?|\.[0-9](?:_?[0-9])*)"
                        r"(?:[eE][+-]?[0-9](?:_?[0-9])*)?")
_HEX_FLOAT = re.compile(r"[+-]?0[xX](?:_?[0-9a-fA-F])*(?:\.(?:[0-9a-fA-F](?:_?[0-9a-fA-F])*)?)?"
                        r"[pP][+-]?[0-9](?:_?[0-9])*")
_SPECIAL_FLOAT = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
_BOOLS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
          "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}


def _float32(x: float) -> float:
    """``x`` rounded to float32 and written with the fewest digits that round-trip (what Ollama's
    client sends for a float32 option), back as a float64."""
    f32 = struct.unpack("<f", struct.pack("<f", x))[0]
    for digits in range(1, 10):
        s = f"{f32:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(s)))[0] == f32:
            return float(s)
    return f32


def _parse_float(s: str) -> float | None:
    """Go's ``strconv.ParseFloat(s, 32)`` for finite values; None where it fails (or gives
    an infinity or NaN, which Ollama's JSON cannot carry)."""
    if _DEC_FLOAT.fullmatch(s) and any(c.isdigit() for c in s):
        x = float(s.replace("_", ""))
    elif _HEX_FLOAT.fullmatch(s):
        sign = -1.0 if s.startswith("-") else 1.0
        try:
            x = sign * float.fromhex(s.lstrip("+-").replace("_", ""))
        except (ValueError, OverflowError):
            return None
    else:
        return None
    if x != x or abs(x) == float("inf"):
        return None
    if abs(x) > _FLOAT32_MAX:
        # Go rounds to float32 first: values just above the largest float32 may still round down
        try:
            struct.pack("<f", x)
        except OverflowError:
            return None
    return _float32(x)


def parse_parameter(name: str, value: str, line: int = 0) -> Any:
    """A PARAMETER's value, typed as Ollama's ``api.FormatParams`` types it.

    Returns:
        int (Go ``strconv.ParseInt(v, 10, 64)``), float (``ParseFloat(v, 32)``: rounded to
        float32 and kept with the digits Ollama's client would send: ``0.1`` stays ``0.1``),
        bool (``ParseBool``: 1 t T TRUE true True 0 f F FALSE false False), or a one-element
        list for ``stop``.

    Raises:
        ModelfileError: ``unknown parameter 'NAME'``, ``invalid int value [V]``,
            ``invalid float value [V]`` (also for inf/NaN, which cannot be stored as JSON),
            ``invalid bool value [V]``, with the line.
    """
    kind = PARAMETER_TYPES.get(name)
    if kind is None:
        raise ModelfileError(f"unknown parameter '{name}'", line)
    if kind is list:
        return [value]
    if kind is int:
        if _INT.fullmatch(value):
            n = int(value)
            if -(1 << 63) <= n < (1 << 63):
                return n
        raise ModelfileError(f"invalid int value [{value}]", line)
    if kind is float:
        f = None if _SPECIAL_FLOAT.fullmatch(value) else _parse_float(value)
        if f is None:
            raise ModelfileError(f"invalid float value [{value}]", line)
        return f
    if value in _BOOLS:
        return _BOOLS[value]
    raise ModelfileError(f"invalid bool value [{value}]", line)


# --------------------------------------------------------------------------------------------
# FROM


_DIGEST = re.compile(r"@?sha256[:-]([0-9a-fA-F]{64})")
_PATHLIKE = ("/", "./", "../", "~", "\\", ".\\", "..\\")


def classify_from(value: str) -> FromSource:
    """What a FROM value names, from its text alone: ``blob`` for ``sha256:<64 hex>`` (also
    ``sha256-<hex>`` and ``@sha256:<hex>``), ``gguf`` for a name ending ``.gguf``, ``path`` for
    anything that starts like a path (``/``, ``./``, ``../``, ``~``, ``.``), else ``model``."""
    m = _DIGEST.fullmatch(value)
    if m:
        return FromSource("blob", value, digest="sha256:" + m.group(1).lower())
    if value.lower().endswith(".gguf"):
        return FromSource("gguf", value)
    if value.startswith(_PATHLIKE) or value in (".", ".."):
        return FromSource("path", value)
    return FromSource("model", value)


def _expand(path: str, base_dir: str | os.PathLike) -> Path:
    """Ollama's ``expandPath``: ``~`` and ``~user`` expanded, relative paths taken from the
    Modelfile's directory, the result absolute."""
    p = os.path.expanduser(path) if path.startswith("~") else path
    return Path(os.path.abspath(os.path.join(base_dir, p)))


def resolve_from(value: str, base_dir: str | os.PathLike, line: int = 0) -> FromSource:
    """What a FROM value names, looking at the disk as Ollama's client does: a path that exists
    (relative to ``base_dir``) is a file (``gguf``) or a ``directory``; a digest is a ``blob``;
    anything else a ``model`` name.

    Raises:
        NotFoundError: the value looks like a path (see :func:`classify_from`) but nothing is
            there (Ollama would send it as a model name and fail with ``invalid model name``).
    """
    lexical = classify_from(value)
    if lexical.kind == "blob":
        return lexical
    try:
        path = _expand(value, base_dir)
    except (RuntimeError, KeyError):  # ~user that does not exist
        path = None
    if path is not None and path.is_file():
        return FromSource("gguf", value, path=str(path))
    if path is not None and path.is_dir():
        return FromSource("directory", value, path=str(path))
    if lexical.kind in ("gguf", "path"):
        raise NotFoundError(f"(line {line}): no such file or directory: {value}" if line else
                            f"no such file or directory: {value}")
    return lexical


def _resolve_path(value: str, base_dir: str | os.PathLike | None, line: int) -> str:
    if base_dir is None:
        return value
    path = _expand(value, base_dir)
    if not path.exists():
        raise NotFoundError(f"(line {line}): no such file or directory: {value}")
    return str(path)


# --------------------------------------------------------------------------------------------
# Writing Modelfiles back


def quote(s: str) -> str:
    """A value as a Modelfile writes it (Ollama's ``quote``): in ``"..."`` when it holds a line
    break or starts or ends with a blank, in ``\"\"\"...\"\"\"`` when it also holds a ``"``.
    Unlike Ollama, an empty value is written ``""`` and a value that starts with ``"`` is
    quoted, so that the text parses back to the same value. (A value holding ``\"\"\"`` at a
    line's end cannot be written in Ollama's grammar at all.)"""
    if s == "" or "\n" in s or "\r" in s or s[0] in " \t" or s[-1] in " \t" or s[0] == '"':
        return f'"""{s}"""' if '"' in s else f'"{s}"'
    return s


def format_command(name: str, args: str) -> str:
    """One command as Ollama's ``Command.String`` writes it: ``FROM x``, ``TEMPLATE "..."``,
    ``MESSAGE role content``, ``PARAMETER name value``... (values through :func:`quote`)."""
    if name == "model":
        return f"FROM {quote(args)}"
    if name in ("license", "template", "system", "adapter", "renderer", "parser", "requires", "draft", "capability",
                "remote"):
        return f"{name.upper()} {quote(args)}"
    if name == "message":
        role, _, content = args.partition(": ")
        return f"MESSAGE {role} {quote(content)}"
    return f"PARAMETER {name} {quote(args)}"


def _param_text(name: str, value: Any) -> str:
    """A stored parameter value as ``%v`` prints it; integral values of integer parameters as
    integers (Ollama prints a float64 ``1048576`` as ``1.048576e+06``, which its own parser then
    refuses)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and PARAMETER_TYPES.get(name) is int and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return go_format_float(value)
    return str(value)


def _param_items(params: dict[str, Any] | None) -> Iterable[tuple[str, Any]]:
    """(name, value) pairs, names sorted (Go's map order is random), lists expanded in order."""
    for k in sorted(params or {}):
        v = params[k]
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            yield k, item


def show_modelfile(*, short_name: str, model_path: str, template: str | None = "{{ .Prompt }}",
                   system: str = "", adapters: Iterable[str] = (), draft: str = "",
                   projectors: Iterable[str] = (), renderer: str = "", parser: str = "",
                   parameters: dict[str, Any] | None = None, licenses: Iterable[str] = (),
                   messages: Iterable[Message | dict] = (), capabilities: Iterable[str] = ()) -> str:
    """The ``modelfile`` of /api/show and ``ollama show --modelfile`` for a stored model.

    Args:
        short_name: the model's shortest name (``llama3.2:latest``), for the comment header.
        model_path: the weights blob's path (``.../blobs/sha256-<hex>``), written as FROM.
        template: the template layer's text (Ollama shows ``{{ .Prompt }}`` for a model without
            one); None: no TEMPLATE line.
        system, adapters, draft, projectors, renderer, parser, licenses, messages: the other
            layers and config fields, written when set.
        parameters: the params layer (JSON-decoded): one PARAMETER line per value, names sorted.
        capabilities: CAPABILITY lines (kvserve's; after PARSER).

    Returns the text Ollama writes: the three comment lines and a blank line, then FROM, ADAPTER,
    DRAFT, FROM (projectors), TEMPLATE, SYSTEM, RENDERER, PARSER, PARAMETER, LICENSE, MESSAGE.
    """
    cmds = [("model", model_path), *(("adapter", a) for a in adapters)]
    if draft:
        cmds.append(("draft", draft))
    cmds += [("model", p) for p in projectors]
    if template is not None:
        cmds.append(("template", template))
    if system:
        cmds.append(("system", system))
    if renderer:
        cmds.append(("renderer", renderer))
    if parser:
        cmds.append(("parser", parser))
    cmds += [("capability", c) for c in capabilities]
    cmds += [(k, _param_text(k, v)) for k, v in _param_items(parameters)]
    cmds += [("license", lic) for lic in licenses]
    for m in messages:
        role, content = (m.role, m.content) if isinstance(m, Message) else (m.get("role", ""), m.get("content", ""))
        cmds.append(("message", f"{role}: {content}"))
    header = ('# Modelfile generated by "ollama show"\n'
              "# To build a new Modelfile based on this, replace FROM with:\n"
              f"# FROM {short_name}\n\n")
    return header + "".join(format_command(n, a) + "\n" for n, a in cmds)


def show_parameters(params: dict[str, Any] | None) -> str:
    """The ``parameters`` text of /api/show: ``%-30s %#v`` per value (strings Go-quoted),
    names sorted, lines joined by newlines (no trailing newline)."""
    lines = []
    for k, v in _param_items(params):
        text = go_quote(v) if isinstance(v, str) else _param_text(k, v)
        lines.append(f"{k:<30} {text}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Layers a create step writes

PARAMS_MEDIA_TYPE = "application/vnd.ollama.image.params"
MESSAGES_MEDIA_TYPE = "application/vnd.ollama.image.messages"


def params_layer(parameters: dict[str, Any], base: dict[str, Any] | None = None) -> bytes | None:
    """The params blob (``application/vnd.ollama.image.params``) Ollama's create writes.

    Args:
        parameters: the new model's parameters (:attr:`CreateRequest.parameters`).
        base: the params of the model it builds on: kept where ``parameters`` does not set them
            (Ollama's ``setParameters``; a new ``stop`` replaces the base's list).

    Returns:
        the JSON bytes as Go's encoder writes them (keys sorted, compact, ``<``/``>``/``&``
        escaped, a newline at the end), or None when there are no parameters at all (no layer).
    """
    merged = {**(base or {}), **parameters}
    if not merged:
        return None
    return (go_json(dict(merged)) + "\n").encode("utf-8")


def messages_layer(messages: Iterable[Message | dict]) -> bytes | None:
    """The messages blob (``application/vnd.ollama.image.messages``): a JSON array of
    ``{"role","content"}`` as Go's encoder writes it; None when there are none (Ollama then
    keeps the base model's messages)."""
    items = [m.to_dict() if isinstance(m, Message) else {"role": m["role"], "content": m["content"]} for m in messages]
    if not items:
        return None
    return (go_json([JsonObject(d.items()) for d in items]) + "\n").encode("utf-8")


def text_layers(request: CreateRequest) -> list[tuple[str, bytes]]:
    """The template, system and license layers of a create, as (media type, bytes) in the order
    Ollama adds them: template (if set), system (if set and not empty), one per license."""
    out = []
    if request.template:
        out.append(("application/vnd.ollama.image.template", request.template.encode("utf-8")))
    if request.system:
        out.append(("application/vnd.ollama.image.system", request.system.encode("utf-8")))
    out += [("application/vnd.ollama.image.license", lic.encode("utf-8")) for lic in request.licenses if lic]
    return out
