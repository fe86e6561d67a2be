"""Tokenizer: text <-> token ids, built on HF ``tokenizers`` and configured from GGUF or HF files.

The HF ``tokenizers`` library does the BPE work (merges, byte-level mapping, pre-tokenizer
regex split, special-token matching); this module only *configures* it so that results match
llama.cpp's ``llama_tokenize`` / ``llama_token_to_piece`` for the same GGUF:

* byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the pre-tokenizer regexes are chosen by
  ``tokenizer.ggml.pre`` exactly as llama.cpp's ``llm_tokenizer_bpe`` does (llama-vocab.cpp);
  ``ignore_merges`` is set for the llama3 family, as llama.cpp does.
* SentencePiece-style vocabularies (``tokenizer.ggml.model == "llama"``): a BPE with
  merges derived from the token scores, byte fallback (``<0xXX>`` tokens) and the ``U+2581``
  whitespace escape, plus the llama.cpp space prefix before every raw-text fragment that
  follows a special token (or starts the text).
* control (token_type 3) and unknown (2) tokens are matched in text only when
  ``parse_special`` is true; user-defined tokens (4) are always matched (llama.cpp
  ``tokenizer_st_partition``).

Token pieces (``token_bytes``) are precomputed once into ``list[bytes]`` tables so the
detokenizer can call them per generated token.

Also here: :func:`read_gguf_metadata`, a metadata-only GGUF reader. ``gguf.GGUFReader``'s
constructor builds one numpy memmap view per array element, which takes ~5 s for a 49k
vocabulary; reading only the key/value section with ``struct`` takes ~0.1 s.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from kvserve.engine.request import ContextSizeExceededError, InvalidRequestError

__all__ = [
    "Tokenizer",
    "TooManyTokensError",
    "UnsupportedTokenizerError",
    "read_gguf_metadata",
    "VOCAB_TYPE_SPM",
    "VOCAB_TYPE_BPE",
    "VOCAB_TYPE_WPM",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

#: llama.cpp ``enum llama_vocab_type`` values.
VOCAB_TYPE_SPM = 1
VOCAB_TYPE_BPE = 2
VOCAB_TYPE_WPM = 3

#: GGUF ``tokenizer.ggml.token_type`` values (llama.cpp ``llama_token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6


class UnsupportedTokenizerError(ValueError):
    """The GGUF/HF tokenizer kind (model or pre-tokenizer) is not supported."""


class TooManyTokensError(ContextSizeExceededError):
    """A prompt that certainly cannot fit ``n_ctx`` tokens, found from its length alone.

    ``n_prompt_tokens`` is a lower bound of its token count (the prompt was not tokenized);
    the message says so. Answered like ContextSizeExceededError (exceed_context_size_error).
    """

    def __init__(self, n_tokens: int, n_ctx: int):
        self.n_prompt_tokens = n_tokens
        self.n_ctx = n_ctx
        self.n_predict = 0
        InvalidRequestError.__init__(
            self, f"request (at least {n_tokens} tokens, bounded from its length without tokenizing it) "
                  f"exceeds the available context size ({n_ctx} tokens), try increasing it")


# --------------------------------------------------------------------------------------
# Pre-tokenizer regexes (facts from llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe).
# Each list is applied in order, every regex splitting the pieces left by the previous one;
# text not matched by a regex stays a piece of its own (llama.cpp unicode_regex_split).
# --------------------------------------------------------------------------------------

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k (gpt-oss, GPT-4o; llama.cpp's "gpt-4o"): llama.cpp's rewrite of tokenizer.json's regex, where
# an upper-case run is ((?=\p{L})[^a-z])* and a lower-case one ((?=\p{L})[^A-Z])+ (so a letter outside
# ASCII counts as both), contractions case-insensitive
_O200K_LETTERS = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
                  r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*")
_O200K_RE = "|".join(x + _CONTRACTIONS + "?" for x in _O200K_LETTERS) + \
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt4o": (_O200K_RE,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3_RE,),
    "gpt2": (_GPT2_RE,),
    "starcoder": (r"\p{N}", _GPT2_RE),
    "qwen2": (_QWEN2_RE,),
    "falcon": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        _GPT2_RE,
        r"[0-9][0-9][0-9]",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "chatglm4": (_LLAMA3_RE,),
}

#: ``tokenizer.ggml.pre`` name -> (regex family, ignore_merges, add_bos default).
#: Names and grouping follow llama.cpp's llama_vocab::impl::load.
_PRE_NAMES: dict[str, tuple[str, bool, bool | None]] = {}
for _n in ("default", ""):
    _PRE_NAMES[_n] = ("default", False, None)
for _n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"):
    _PRE_NAMES[_n] = ("llama3", True, True)
for _n in ("dbrx", "smaug-bpe"):
    _PRE_NAMES[_n] = ("llama3", False, None)
for _n in ("glm4", "chatglm-bpe"):
    _PRE_NAMES[_n] = ("chatglm4", False, None)
for _n in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"):
    _PRE_NAMES[_n] = ("starcoder", False, None)
for _n in (
    "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
    "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
    "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe",
):
    _PRE_NAMES[_n] = ("gpt2", False, None)
for _n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"):
    _PRE_NAMES[_n] = ("qwen2", False, None)
for _n in ("gpt-4o", "llama4", "kanana2", "talkie"):
    _PRE_NAMES[_n] = ("gpt4o", False, None)
_PRE_NAMES["falcon"] = ("falcon", False, None)
_PRE_NAMES["deepseek-coder"] = ("deepseek-coder", False, None)
_PRE_NAMES["tekken"] = ("tekken", True, True)  # not supported: raises below


#: Harmony's tokens that llama.cpp makes user-defined whatever the file says (llama-vocab.cpp): matched
#: in text without parse_special and rendered in output, so gpt-oss's channel markup shows in the text
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

# llama.cpp's end-of-generation detection by token text (llama-vocab.cpp, special_eog_ids).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
})
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>",
)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map (as used by byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _latin1_table() -> dict[int, str]:
    """str.translate table: each byte-level character -> the Latin-1 character of its byte, and
    each other character below U+0100 -> its UTF-8 bytes as Latin-1 characters (so that
    ``.encode("latin-1")`` of the result gives :func:`_byte_level_decode`'s bytes; characters
    from U+0100 up that are not in the byte map make that encode fail)."""
    table = {ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}
    for o in range(0x80, 0x100):
        table.setdefault(o, chr(o).encode("utf-8").decode("latin-1"))
    return table


_TO_LATIN1 = _latin1_table()


def _byte_level_decode(text: str) -> bytes:
    """Map a byte-level BPE token string back to raw bytes (llama.cpp ``llama_decode_text``).

    Characters outside the byte map are kept as their UTF-8 bytes (llama.cpp would emit an
    ``[UNK_BYTE_0x..]`` marker; this never happens for well-formed vocabularies).
    One ``str.translate`` (C speed: a 49k vocabulary in ~15 ms instead of ~300 ms of start-up).
    """
    try:
        return text.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a character above U+00FF outside the byte map: one by one
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is None:
                out += c.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)


def _spm_piece_bytes(text: str, ttype: int) -> bytes:
    """Raw bytes of a SentencePiece token: ``<0xXX>`` byte tokens, ``U+2581`` -> space."""
    if ttype == TOKEN_TYPE_BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("\u2581", " ").encode("utf-8")


# --------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------

_GGUF_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_GGUF_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a GGUF file's key/value metadata (not the tensors) into a plain dict.

    Values become Python objects: ints, floats, bools, ``str`` (UTF-8, invalid bytes
    replaced), and lists of those for arrays. Only the header and the KV section are read
    (memory-mapped), so a 49k-token vocabulary loads in ~0.1 s.

    Raises:
        ValueError: not a GGUF file, unsupported version (only v2/v3 little-endian), or a
            truncated/corrupt KV section.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            return _parse_gguf_kv(buf)
        except (struct.error, IndexError) as e:
            raise ValueError(f"{path}: corrupt GGUF metadata: {e}") from e
        finally:
            buf.release()


def _parse_gguf_kv(buf: memoryview) -> dict[str, Any]:
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (need 2 or 3, little-endian)")
    _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24
    unpack_q = struct.Struct("<Q").unpack_from
    unpack_i = struct.Struct("<I").unpack_from

    def read_str(o: int) -> tuple[str, int]:
        (n,) = unpack_q(buf, o)
        o += 8
        return str(buf[o:o + n], "utf-8", "replace"), o + n

    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key, off = read_str(off)
        (vtype,) = unpack_i(buf, off)
        off += 4
        if vtype == _GGUF_STRING:
            val, off = read_str(off)
        elif vtype == _GGUF_ARRAY:
            (etype,) = unpack_i(buf, off)
            (count,) = unpack_q(buf, off + 4)
            off += 12
            if etype == _GGUF_STRING:
                items = []
                append = items.append
                for _i in range(count):
                    (n,) = unpack_q(buf, off)
                    off += 8
                    append(str(buf[off:off + n], "utf-8", "replace"))
                    off += n
                val = items
            elif etype in _GGUF_NP:
                size = _GGUF_SCALAR[etype][1]
                arr = np.frombuffer(buf, dtype=_GGUF_NP[etype], count=count, offset=off)
                val = arr.astype(bool).tolist() if etype == 7 else arr.tolist()
                off += size * count
            else:
                raise ValueError(f"unsupported GGUF array element type {etype} for key {key}")
        elif vtype in _GGUF_SCALAR:
            fmt, size = _GGUF_SCALAR[vtype]
            (val,) = struct.unpack_from(fmt, buf, off)
            off += size
        else:
            raise ValueError(f"unsupported GGUF value type {vtype} for key {key}")
        out[key] = val
    return out


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


#: characters above which encode() uses the HF library's batch path (see encode)
_LONG_TEXT = 1 << 16
#: one long text is encoded at a time per process: the HF library needs about 200 bytes of
#: working memory per input byte (a 30 MB text peaked near 6 GB), so concurrent long encodes
#: would multiply that; on a few cores they would not finish sooner either
_LONG_ENCODE = threading.Lock()


def _plain_twin(hf: HFTokenizer) -> HFTokenizer:
    """A second HF tokenizer that encodes control-token texts as ordinary text
    (``encode_special_tokens``), sharing ``hf``'s model: the vocabulary and merges are not
    copied (the bindings hand out the same model object; ``from_str(hf.to_str())`` parsed them
    again: ~0.3-0.5 s of start-up for a 49k vocabulary). Its pipeline (normalizer,
    pre-tokenizer, decoder, post-processor) and added tokens, in id order, are ``hf``'s, so
    its JSON is ``hf``'s (tests compare them)."""
    twin = HFTokenizer(hf.model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        value = getattr(hf, part)
        if value is not None:
            setattr(twin, part, value)
    added = hf.get_added_tokens_decoder()
    if added:
        twin.add_tokens([added[i] for i in sorted(added)])
    twin.encode_special_tokens = True
    return twin


def _encode_long(hf: HFTokenizer):
    """``text -> Encoding`` for long texts: the batch encoder, one long text at a time."""

    def enc(text: str):
        with _LONG_ENCODE:
            return hf.encode_batch([text], add_special_tokens=False)[0]

    return enc


class Tokenizer:
    """Text <-> token ids for one model, with llama.cpp semantics.

    Build with :meth:`from_gguf` / :meth:`from_gguf_file` / :meth:`from_hf_dir`. Thread-safe
    for concurrent ``encode``/``decode`` (no mutable state after construction).

    Attributes:
        n_vocab: number of token ids (int).
        bos_token_id / eos_token_id: ids or None when the model has none.
        bos_token / eos_token: their texts ("" when absent), as templates need them.
        add_bos / add_eos: whether ``encode(add_special=True)`` adds BOS / EOS.
        eog_token_ids: end-of-generation ids (eos, eot, eom, FIM pad/rep/sep and
            end-of-turn texts such as ``<|im_end|>``), llama.cpp's ``special_eog_ids``.
        chat_template: Jinja chat template source or None.
        vocab_type: llama.cpp enum, 1 = SPM, 2 = BPE.
        pre: pre-tokenizer name (``tokenizer.ggml.pre``, "" for SPM / HF).
        model: tokenizer model name ("gpt2", "llama", or "hf").
    """

    def __init__(
        self,
        hf: HFTokenizer,
        tokens: list[str],
        token_types: list[int],
        piece_bytes: list[bytes],
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        add_eos: bool,
        extra_eog_ids: Iterable[int] = (),
        chat_template: str | None = None,
        vocab_type: int = VOCAB_TYPE_BPE,
        pre: str = "",
        model: str = "gpt2",
        eot_token_id: int | None = None,
        eom_token_id: int | None = None,
    ):
        """Low-level constructor; prefer the ``from_*`` class methods.

        Args:
            hf: configured HF tokenizer (special tokens as added tokens, ``special=True``
                for control/unknown, ``special=False`` for user-defined).
            tokens: token texts, index = id.
            token_types: GGUF token types (1 normal .. 6 byte), index = id.
            piece_bytes: raw bytes of each token's piece (control tokens: their text).
        """
        self._hf = hf
        # Second instance that splits control tokens like ordinary text (parse_special=False);
        # user-defined tokens (special=False added tokens) are still matched, as in llama.cpp.
        self._hf_plain = _plain_twin(hf)
        self._tokens = tokens
        self.n_vocab: int = len(tokens)
        self._types = token_types
        self._control = bytearray(
            1 if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) else 0 for t in token_types
        )
        self._bytes_special: list[bytes] = piece_bytes
        self._bytes_plain: list[bytes] = [
            b"" if c else b for b, c in zip(piece_bytes, self._control)
        ]
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.bos_token: str = tokens[bos_token_id] if bos_token_id is not None else ""
        self.eos_token: str = tokens[eos_token_id] if eos_token_id is not None else ""
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.add_eos = bool(add_eos) and eos_token_id is not None
        self.chat_template = chat_template
        self.vocab_type = vocab_type
        self.pre = pre
        self.model = model
        self.eot_token_id = eot_token_id
        self.eom_token_id = eom_token_id
        self.eog_token_ids: frozenset[int] = self._find_eog(extra_eog_ids)
        self.max_token_bytes: int | None = self._max_token_bytes()

    # ---------------------------------------------------------------- construction

    def _find_eog(self, extra: Iterable[int]) -> frozenset[int]:
        """llama.cpp's special_eog_ids: FIM pad/rep/sep, end-of-turn texts, eos/eot/eom."""
        text_to_id: dict[str, int] = {}
        special_ids = [i for i, c in enumerate(self._control) if c] + [
            i for i, t in enumerate(self._types) if t == TOKEN_TYPE_USER_DEFINED
        ]
        for i in special_ids:
            text_to_id.setdefault(self._tokens[i], i)
        # Also look at normal tokens with these texts (llama.cpp overrides their type).
        wanted = _EOG_TEXTS | set(_FIM_PAD_TEXTS) | set(_FIM_REP_TEXTS) | set(_FIM_SEP_TEXTS)
        if any(w not in text_to_id for w in wanted):
            for i, t in enumerate(self._tokens):
                if t in wanted:
                    text_to_id.setdefault(t, i)
        eog: set[int] = set(int(i) for i in extra)
        for group in (_FIM_PAD_TEXTS, _FIM_REP_TEXTS, _FIM_SEP_TEXTS):
            for t in group:
                if t in text_to_id:
                    eog.add(text_to_id[t])
                    break
        for t in _EOG_TEXTS:
            if t in text_to_id:
                i = text_to_id[t]
                eog.add(i)
                if not self._control[i] and self._types[i] != TOKEN_TYPE_USER_DEFINED:
                    # llama.cpp overrides such a token's type to CONTROL (renders no text).
                    self._control[i] = 1
                    self._bytes_plain[i] = b""
        if self.eot_token_id is None:
            for t in _EOT_TEXTS:
                if t in text_to_id:
                    self.eot_token_id = text_to_id[t]
                    break
        for i in (self.eos_token_id, self.eot_token_id, self.eom_token_id):
            if i is not None:
                eog.add(i)
        # llama.cpp workaround: with <|return|> and <|call|> (gpt-oss), <|end|> is not EOG.
        if "<|end|>" in text_to_id and (
            ("<|return|>" in text_to_id and "<|call|>" in text_to_id)
            or ("<|calls|>" in text_to_id and "<|flush|>" in text_to_id)
        ):
            eog.discard(text_to_id["<|end|>"])
        return frozenset(eog)

    def _max_token_bytes(self) -> int | None:
        """The longest piece in bytes, when it bounds how much text one token can cover.

        That holds for GGUF vocabularies (HF tokenizer.json pipelines may normalize or fuse
        unknown text: None) in which no character can vanish into an unknown token:
        SentencePiece with all 256 ``<0xXX>`` byte-fallback tokens; byte-level BPE with every
        continuation byte 0x80-0xBF (then each multi-byte character keeps at least one byte).
        A byte-level vocabulary may lack some ASCII bytes (SmolLM2 lacks 0x04, 0x06, ...):
        such characters give no token and are not counted (``_dropped``). Then a text of
        C counted characters (<= C UTF-8 bytes) has at least C / max_token_bytes tokens.
        """
        self._dropped: tuple[str, ...] = ()
        if self.model == "gpt2":
            vocab = set(self._tokens)
            complete = all(_BYTE_TO_CHAR[b] in vocab for b in range(0x80, 0xC0))
            self._dropped = tuple(chr(b) for b in range(0x80) if _BYTE_TO_CHAR[b] not in vocab)
        elif self.model == "llama":
            vocab = {t for t, ty in zip(self._tokens, self._types) if ty == TOKEN_TYPE_BYTE}
            complete = all(f"<0x{b:02X}>" in vocab for b in range(256))
        else:
            complete = False
        return (max(map(len, self._bytes_special), default=0) or None) if complete else None

    def check_fits(self, prompt: str | list, n_ctx: int) -> None:
        """Refuse, in O(len) and without tokenizing, a prompt that cannot have fewer than ``n_ctx`` tokens.

        Args:
            prompt: a text, or a list of texts and token ids (each non-string item counts as
                one token), as llama-server's mixed prompts.
            n_ctx: the context size; the engine accepts prompts of at most ``n_ctx - 1`` tokens.

        Raises:
            TooManyTokensError: the lower bound ``ids + ceil(chars / max_token_bytes)`` is at
                least ``n_ctx`` (ContextSizeExceededError with the exact count for token ids only). Never raised when ``max_token_bytes`` is None (no bound known);
                the engine still refuses an overlong prompt after tokenizing.
        """
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        n_ids = 0 if isinstance(prompt, str) else len(prompt) - len(texts)
        low = n_ids
        if self.max_token_bytes and n_ids < n_ctx:
            n_chars = sum(len(t) for t in texts)
            if n_chars // self.max_token_bytes + n_ids >= n_ctx:  # worth counting what vanishes
                n_chars -= sum(t.count(c) for t in texts for c in self._dropped)
            low += -(-n_chars // self.max_token_bytes)
        if low >= n_ctx:
            raise TooManyTokensError(low, n_ctx) if texts else ContextSizeExceededError(low, n_ctx)

    @classmethod
    def from_gguf_file(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build from a GGUF file's metadata (read with :func:`read_gguf_metadata`).

        Raises:
            ValueError: unreadable GGUF; UnsupportedTokenizerError: see :meth:`from_gguf`.
        """
        return cls.from_gguf(read_gguf_metadata(path))

    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> Python value, e.g. :func:`read_gguf_metadata`).

        Uses ``tokenizer.ggml.{model,pre,tokens,token_type,merges,scores,bos_token_id,
        eos_token_id,eot_token_id,eom_token_id,add_bos_token,add_eos_token,add_space_prefix}``
        and ``tokenizer.chat_template``. Defaults follow llama.cpp: BPE add_bos false unless
        the pre-tokenizer family sets it (llama3), SPM add_bos true / add_space_prefix true.

        Raises:
            UnsupportedTokenizerError: tokenizer model other than "gpt2"/"llama", or an unknown
                ``tokenizer.ggml.pre`` value.
            ValueError: missing tokens list.
        """
        model = str(fields.get("tokenizer.ggml.model", "gpt2"))
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        tokens = [str(t) for t in tokens]
        n = len(tokens)
        types = fields.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [TOKEN_TYPE_NORMAL] * n
        if len(types) < n:
            types += [TOKEN_TYPE_NORMAL] * (n - len(types))
        present = set(tokens)
        # llama.cpp's o200k_harmony workaround: <|end|> (no longer end of generation there) is user-defined too
        harmony_end = "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present
                                                 or {"<|calls|>", "<|flush|>"} <= present)
        for i, t in enumerate(tokens):  # llama.cpp's "quick hack for gpt-oss, always render these tokens"
            if t in _ALWAYS_USER_DEFINED or (harmony_end and t == "<|end|>"):
                types[i] = TOKEN_TYPE_USER_DEFINED

        def opt_id(key: str) -> int | None:
            v = fields.get(key)
            if v is None:
                return None
            v = int(v)
            return v if 0 <= v < n else None

        bos = opt_id("tokenizer.ggml.bos_token_id")
        eos = opt_id("tokenizer.ggml.eos_token_id")
        eot = opt_id("tokenizer.ggml.eot_token_id")
        eom = opt_id("tokenizer.ggml.eom_token_id")
        extra_eog = [
            i for i in (opt_id("tokenizer.ggml.fim_pad_token_id"), opt_id("tokenizer.ggml.fim_rep_token_id"),
                        opt_id("tokenizer.ggml.fim_sep_token_id")) if i is not None
        ]
        template = fields.get("tokenizer.chat_template")

        if model == "gpt2":
            pre = str(fields.get("tokenizer.ggml.pre", "default"))
            fam = _PRE_NAMES.get(pre)
            if fam is None or fam[0] not in _PRE_REGEXES:
                raise UnsupportedTokenizerError(
                    f"unsupported pre-tokenizer type {pre!r} (tokenizer.ggml.pre); supported: "
                    + ", ".join(sorted(k for k, v in _PRE_NAMES.items() if k and v[0] in _PRE_REGEXES))
                )
            family, ignore_merges, add_bos_default = fam
            add_bos = bool(fields.get("tokenizer.ggml.add_bos_token",
                                      add_bos_default if add_bos_default is not None else False))
            add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
            merges = fields.get("tokenizer.ggml.merges") or []
            hf, piece_bytes = _cached_bpe(tokens, types, merges, _PRE_REGEXES[family], ignore_merges)
            return cls(
                hf, tokens, types, piece_bytes, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos,
                add_eos=add_eos, extra_eog_ids=extra_eog, chat_template=template,
                vocab_type=VOCAB_TYPE_BPE, pre=pre, model=model, eot_token_id=eot, eom_token_id=eom,
            )
        if model == "llama":
            scores = fields.get("tokenizer.ggml.scores")
            scores = [float(s) for s in scores] if scores is not None else [0.0] * n
            add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
            add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", True))
            add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
            unk = opt_id("tokenizer.ggml.unknown_token_id")
            hf, piece_bytes = _build_spm(tokens, types, scores, add_space_prefix, unk)
            return cls(
                hf, tokens, types, piece_bytes, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos,
                add_eos=add_eos, extra_eog_ids=extra_eog, chat_template=template,
                vocab_type=VOCAB_TYPE_SPM, pre="", model=model, eot_token_id=eot, eom_token_id=eom,
            )
        if model == "bert":
            # WordPiece (llama.cpp's WPM): [CLS] text [SEP]; CLS is the BOS, SEP ends the input. llama.cpp
            # adds both whenever special tokens are asked for, whatever add_bos_token / add_sep_token say
            # (its converter writes add_sep_token false for nomic-bert; llama-server's /tokenize still ends
            # with [SEP]: tests/unit/test_llama_families.py)
            def named(text: str) -> int | None:
                return next((i for i, t in enumerate(tokens) if t == text), None)

            cls_id = bos if bos is not None else opt_id("tokenizer.ggml.cls_token_id")
            sep_id = opt_id("tokenizer.ggml.seperator_token_id")
            cls_id = cls_id if cls_id is not None else named("[CLS]")
            sep_id = sep_id if sep_id is not None else (eos if eos is not None else named("[SEP]"))
            unk = opt_id("tokenizer.ggml.unknown_token_id")
            hf, piece_bytes = _build_wpm(tokens, types, unk if unk is not None else named("[UNK]"))
            return cls(
                hf, tokens, types, piece_bytes, bos_token_id=cls_id, eos_token_id=sep_id,
                add_bos=True, add_eos=True,
                extra_eog_ids=extra_eog, chat_template=template, vocab_type=VOCAB_TYPE_WPM, pre="", model=model,
            )
        raise UnsupportedTokenizerError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: 'gpt2' "
            "(byte-level BPE), 'llama' (SentencePiece) and 'bert' (WordPiece)"
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build from an HF model directory: ``tokenizer.json`` plus optional
        ``tokenizer_config.json`` (bos/eos/add_bos_token/add_eos_token/chat_template),
        ``chat_template.jinja`` and ``generation_config.json`` (extra eos ids -> EOG).

        Added tokens with ``special: true`` behave as control tokens, the others as
        user-defined tokens. BOS/EOS are added by us (HF's post-processor is not used);
        when ``add_bos_token`` is absent it is detected from the post-processor.

        Raises:
            FileNotFoundError: no tokenizer.json.
        """
        d = Path(path)
        hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").exists():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        gen: dict[str, Any] = {}
        if (d / "generation_config.json").exists():
            gen = json.loads((d / "generation_config.json").read_text(encoding="utf-8"))
        spec = json.loads(hf.to_str())

        vocab = hf.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1 if vocab else 0
        tokens = [""] * n
        for t, i in vocab.items():
            tokens[i] = t
        types = [TOKEN_TYPE_NORMAL] * n
        added = hf.get_added_tokens_decoder()
        for i, at in added.items():
            types[i] = TOKEN_TYPE_CONTROL if at.special else TOKEN_TYPE_USER_DEFINED

        def is_byte_level(node: Any) -> bool:
            return isinstance(node, dict) and (
                node.get("type") == "ByteLevel" or any(is_byte_level(x) for x in node.get("pretokenizers", []) or [])
                or any(is_byte_level(x) for x in node.get("decoders", []) or [])
            )

        byte_level = is_byte_level(spec.get("pre_tokenizer")) or is_byte_level(spec.get("decoder"))
        piece_bytes: list[bytes] = []
        for i, t in enumerate(tokens):
            if types[i] != TOKEN_TYPE_NORMAL:
                piece_bytes.append(t.encode("utf-8"))
            elif byte_level:
                piece_bytes.append(_byte_level_decode(t))
            else:
                is_byte = len(t) == 6 and t.startswith("<0x") and t.endswith(">")
                if is_byte:
                    types[i] = TOKEN_TYPE_BYTE
                piece_bytes.append(_spm_piece_bytes(t, types[i]))

        def tok_text(v: Any) -> str | None:
            if isinstance(v, dict):
                v = v.get("content")
            return v if isinstance(v, str) else None

        def tok_id(v: Any) -> int | None:
            t = tok_text(v)
            return vocab.get(t) if t is not None else None

        bos = tok_id(cfg.get("bos_token"))
        eos = tok_id(cfg.get("eos_token"))
        wordpiece = (spec.get("model") or {}).get("type") == "WordPiece"
        if wordpiece:
            # BERT: [CLS] text [SEP] (tokenizer_config's cls_token / sep_token), as HF's
            # post-processor and llama.cpp's WPM vocabulary (CLS as BOS, SEP added) do
            if bos is None:
                bos = tok_id(cfg.get("cls_token") or "[CLS]")
            if eos is None:
                eos = tok_id(cfg.get("sep_token") or "[SEP]")
            cfg.setdefault("add_bos_token", bos is not None)
            cfg.setdefault("add_eos_token", eos is not None)
            for i, t in enumerate(tokens):
                if types[i] == TOKEN_TYPE_NORMAL:
                    piece_bytes[i] = t[2:].encode("utf-8") if t.startswith("##") else (" " + t).encode("utf-8")
        extra: list[int] = []
        g = gen.get("eos_token_id")
        if isinstance(g, int):
            extra.append(g)
        elif isinstance(g, list):
            extra.extend(int(x) for x in g)
        if eos is None and extra:
            eos = extra[0]
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        probe = hf.encode("", add_special_tokens=True).ids
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        add_eos = cfg.get("add_eos_token")
        if add_eos is None:
            add_eos = eos is not None and bool(probe) and probe[-1] == eos and not (add_bos and len(probe) == 1)
        template = cfg.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        # Use our own BOS/EOS handling.
        hf.no_truncation()
        hf.no_padding()
        return cls(
            hf, tokens, types, piece_bytes, bos_token_id=bos, eos_token_id=eos, add_bos=bool(add_bos),
            add_eos=bool(add_eos), extra_eog_ids=extra, chat_template=template,
            vocab_type=VOCAB_TYPE_WPM if wordpiece else VOCAB_TYPE_BPE if byte_level else VOCAB_TYPE_SPM, pre="",
            model="hf",
        )

    # ---------------------------------------------------------------- API

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Tokenize ``text`` into ids (llama.cpp ``llama_tokenize``).

        Args:
            text: input text.
            add_special: prepend BOS when ``add_bos`` and append EOS when ``add_eos``.
            parse_special: when True, control-token texts such as ``<|im_start|>`` become
                their token; when False they are tokenized as ordinary text. User-defined
                tokens are matched either way (as llama.cpp does).

        Returns:
            list[int] of token ids.

        Texts above 64 Ki characters are encoded one at a time per process (other threads
        wait), so their working memory (about 200 bytes per input byte) is not multiplied.
        """
        hf = self._hf if parse_special else self._hf_plain
        # A long text goes through encode_batch: the HF library's single encode converts byte
        # offsets to char offsets while holding the GIL (30 MB: 80 s in which no other thread,
        # the server's event loop included, runs) and is 4x slower on non-ASCII text.
        enc = (lambda t: hf.encode(t, add_special_tokens=False)) if len(text) <= _LONG_TEXT else _encode_long(hf)
        try:
            ids = enc(text).ids if text else []
        except TypeError:  # lone surrogates (JSON "\ud800", undecodable stdin): U+FFFD, as a decoder would
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = enc(text).ids
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self.add_eos:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def encode_batch(self, texts: list[str], add_special: bool = False, parse_special: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in the HF library)."""
        hf = self._hf if parse_special else self._hf_plain
        texts = [t.encode("utf-16", "surrogatepass").decode("utf-16", "replace") for t in texts]
        encs = hf.encode_batch(texts, add_special_tokens=False)
        out = []
        for t, e in zip(texts, encs):
            ids = e.ids if t else []
            if add_special:
                if self.add_bos:
                    ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
                if self.add_eos:
                    ids.append(self.eos_token_id)  # type: ignore[arg-type]
            out.append(ids)
        return out

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token's piece (llama.cpp ``llama_token_to_piece``).

        Control and unknown tokens give their text when ``special`` is True, else ``b""``;
        user-defined tokens always give their text; byte tokens (``<0xXX>``) give one byte.
        O(1) table lookup.

        Raises:
            IndexError: id outside ``[0, n_vocab)``.
        """
        if token_id < 0:
            raise IndexError(f"token id {token_id} out of range [0, {self.n_vocab})")
        return (self._bytes_special if special else self._bytes_plain)[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Detokenize: concatenated piece bytes, decoded as UTF-8 (invalid -> U+FFFD).

        Follows llama-server ``/detokenize`` (concatenation of ``common_token_to_piece`` with
        special=true): no space clean-up, no leading-space strip. ``skip_special`` drops
        control/unknown tokens.

        Raises:
            IndexError: an id outside the vocabulary.
        """
        table = self._bytes_plain if skip_special else self._bytes_special
        ids = list(ids)
        if ids and min(ids) < 0:
            raise IndexError(f"token id {min(ids)} out of range [0, {self.n_vocab})")
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str | list[int]:
        """Piece for ``/tokenize`` ``with_pieces``: text when the bytes are valid UTF-8 alone,
        else the list of byte values (llama-server behaviour)."""
        b = self.token_bytes(token_id, special=True)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return list(b)

    def token_text(self, token_id: int) -> str:
        """The vocabulary's stored text for a token (byte-level/escaped form)."""
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose stored vocabulary text is ``text``, or None."""
        return self._hf.token_to_id(text)

    def is_control(self, token_id: int) -> bool:
        """True for control (and unknown) tokens: they render as text only with special=True."""
        return bool(self._control[token_id]) if 0 <= token_id < self.n_vocab else False

    def is_eog(self, token_id: int) -> bool:
        """True when the token ends generation (``eog_token_ids``)."""
        return token_id in self.eog_token_ids

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id}, eog={sorted(self.eog_token_ids)})")


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    out = []
    for t, ty in zip(tokens, types):
        if not t:
            continue
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            out.append(AddedToken(t, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False))
        elif ty == TOKEN_TYPE_USER_DEFINED:
            out.append(AddedToken(t, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False))
    return out


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    # llama.cpp's token_to_id keeps the last id for duplicate texts.
    return {t: i for i, t in enumerate(tokens)}


_BPE_KIND = "bpe-tokenizer"


def _bpe_key(tokens: list[str], types: list[int], merges: list[str], regexes: tuple[str, ...],
             ignore_merges: bool) -> list:
    """A file-cache identity (:func:`kvserve.loaders.file_cache.identity`'s shape) naming every input of
    :func:`_build_bpe` by its SHA-256 (with the builder's own bytecode and the tokenizers version): equal
    inputs, whatever file they came from, share one entry."""
    import hashlib

    import tokenizers

    h = hashlib.sha256()
    h.update(_builder_digest(_build_bpe))  # an edit of the builder (or another tokenizers version) misses old entries
    for part in (json.dumps([len(tokens), len(types), len(merges), list(regexes), ignore_merges,
                             tokenizers.__version__]),
                 "\x00".join(tokens), ",".join(map(str, types)), "\x00".join(merges)):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x01")
    return ["bpe:" + h.hexdigest(), 0, 0, 0, 0, 0]


def _builder_digest(fn) -> bytes:
    """SHA-256 of a function's bytecode, names and constants (what an edit of its body changes),
    the same in every process: nested code objects (a comprehension's) are digested by their
    contents, not their ``repr`` (which holds their address), and a frozenset constant (``x in
    ("a", "b")``) by its members in sorted order (its iteration order follows the per-process
    string hash seed)."""
    import hashlib

    h = hashlib.sha256()
    _digest_code(fn.__code__, h)
    return h.digest()


def _digest_code(code, h) -> None:
    import types

    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames)).encode("utf-8", "surrogatepass"))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            h.update(b"\x02")
            _digest_code(c, h)
            h.update(b"\x03")
        else:
            text = repr(sorted(map(repr, c))) if isinstance(c, frozenset) else repr(c)
            h.update(text.encode("utf-8", "surrogatepass") + b"\x01")


def _cached_bpe(
    tokens: list[str], types: list[int], merges: list[str], regexes: tuple[str, ...], ignore_merges: bool
) -> tuple[HFTokenizer, list[bytes]]:
    """:func:`_build_bpe` through the file cache under ``$KVSERVE_HOME/cache``
    (:mod:`kvserve.loaders.file_cache`): the built tokenizer's JSON and the pieces' bytes, keyed on a
    digest of every input (:func:`_bpe_key`). Reading them back skips the merge filtering, the
    pieces' byte-level decoding and part of the BPE build (~0.3 s of ~0.7 s for a 49k vocabulary). An
    entry that cannot be read or rebuilt is ignored (built again and rewritten)."""
    from kvserve.loaders import file_cache

    key = _bpe_key(tokens, types, merges, regexes, ignore_merges)
    doc = file_cache.load(_BPE_KIND, key)
    if isinstance(doc, dict):
        try:
            pieces = [p.encode("latin-1") for p in doc["pieces"]]
            if len(pieces) == len(tokens):
                return HFTokenizer.from_str(doc["hf"]), pieces
        except Exception:  # noqa: BLE001 - a corrupt or foreign entry: rebuilt below
            pass
    hf, pieces = _build_bpe(tokens, types, merges, regexes, ignore_merges)
    file_cache.store(_BPE_KIND, key, {"hf": hf.to_str(), "pieces": [p.decode("latin-1") for p in pieces]})
    return hf, pieces


def _build_bpe(
    tokens: list[str], types: list[int], merges: list[str], regexes: tuple[str, ...], ignore_merges: bool
) -> tuple[HFTokenizer, list[bytes]]:
    """Byte-level BPE configured like llama.cpp's llm_tokenizer_bpe for the given regexes."""
    vocab = _vocab_dict(tokens)
    pairs: list[tuple[str, str]] = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            # Tokens never contain a plain space in byte-level vocabularies; be lenient anyway.
            i = m.find(" ", 1)
            if i <= 0:
                continue
            parts = [m[:i], m[i + 1:]]
        a, b = parts
        if a in vocab and b in vocab and (a + b) in vocab:
            pairs.append((a, b))
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    hf = HFTokenizer(bpe)
    pres = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    pres.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(pres)
    hf.decoder = decoders.ByteLevel()
    added = _added_tokens(tokens, types)
    if added:
        hf.add_tokens(added)
    piece_bytes = [
        t.encode("utf-8") if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED)
        else (b"" if ty in (TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE) else _byte_level_decode(t))
        for t, ty in zip(tokens, types)
    ]
    return hf, piece_bytes


def _build_wpm(tokens: list[str], types: list[int], unk: int | None) -> tuple[HFTokenizer, list[bytes]]:
    """A GGUF WordPiece vocabulary (llama.cpp's WPM) as an HF WordPiece tokenizer.

    llama.cpp's converter stores a word-initial piece with the U+2581 phantom space
    (``"\u2581hello"``) and a continuation without it (``"ing"`` for HF's ``"##ing"``); the
    HF vocabulary is rebuilt from that. Text is lowercased and split on whitespace and
    punctuation (BertNormalizer + BertPreTokenizer), as llama.cpp's WPM preprocessing does.
    Pieces: a word-initial token renders with a leading space, a continuation without.
    """
    vocab: dict[str, int] = {}
    piece_bytes: list[bytes] = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED) or (t.startswith("[") and t.endswith("]")):
            key, piece = t, t.encode("utf-8")
        elif t.startswith("\u2581"):
            key, piece = t[1:], (" " + t[1:]).encode("utf-8")
        else:
            key, piece = "##" + t, t.encode("utf-8")
        if key:
            vocab.setdefault(key, i)
        piece_bytes.append(b"" if ty == TOKEN_TYPE_UNUSED else piece)
    unk_text = tokens[unk] if unk is not None else "[UNK]"
    hf = HFTokenizer(models.WordPiece(vocab=vocab, unk_token=unk_text, max_input_chars_per_word=100))
    hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                               lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    added = _added_tokens(tokens, types)
    if added:
        hf.add_tokens(added)
    return hf, piece_bytes


def _build_spm(
    tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool, unk: int | None
) -> tuple[HFTokenizer, list[bytes]]:
    """SentencePiece-style vocabulary as an HF BPE with score-ranked merges and byte fallback.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the
    vocabulary token with the highest score; an HF BPE whose merges are ranked by that score
    performs the same merges. Whitespace is escaped to U+2581 and, like llama.cpp, a space is
    prefixed to every raw-text fragment that starts the text or follows a special token.
    """
    vocab = _vocab_dict(tokens)
    mergeable = {
        t: i for t, i in vocab.items() if types[i] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)
    }
    cand: list[tuple[float, int, str, str]] = []
    for t, i in mergeable.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in mergeable and b in mergeable:
                cand.append((-scores[i], i, a, b))
    cand.sort()
    pairs = [(a, b) for _s, _i, a, b in cand]
    unk_text = tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab=vocab, merges=pairs, unk_token=unk_text, fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(bpe)
    norms = []
    if add_space_prefix:
        norms.append(normalizers.Prepend("\u2581"))
    norms.append(normalizers.Replace(" ", "\u2581"))
    hf.normalizer = normalizers.Sequence(norms)
    added = _added_tokens(tokens, types)
    if added:
        hf.add_tokens(added)
    piece_bytes = []
    for t, ty in zip(tokens, types):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
            piece_bytes.append(t.encode("utf-8"))
        elif ty == TOKEN_TYPE_UNUSED:
            piece_bytes.append(b"")
        else:
            piece_bytes.append(_spm_piece_bytes(t, ty))
    return hf, piece_bytes
