"""Fill-in-the-middle prompts: llama-server's ``/infill`` and ``suffix`` on ``/v1/completions``.

A vocabulary serves FIM when it has a prefix, a suffix and a middle token; they are found by
their text, as llama.cpp's vocabulary loader finds them (llama-vocab.cpp: ``<|fim_prefix|>``
(Qwen), ``<fim_prefix>`` (StarCoder, Granite, SmolLM), ``<｜fim▁begin｜>`` (DeepSeek), ``<PRE>`` /
``▁<PRE>`` (CodeLlama), ``<|code_prefix|>`` (GLM-4.5), ...), with the optional repository and
file-separator tokens of the repo-level pattern.

:func:`fim_prompt` lays out the tokens as llama-server's ``format_prompt_infill`` does::

    [FIM_REP]myproject\\n [FIM_SEP]name\\n extra ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

(``--spm-infill``: the suffix part before the prefix part). The prefix keeps its last
``3/4 * n_batch`` tokens, the suffix its first ``n_batch/4 - 2 - len(prompt)``, and the extra
chunks fill what is left of the context (``n_ctx - n_batch - 2 * n_predict``), their tail kept.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FimTokens", "fim_prompt", "fim_tokens", "missing_text"]

FIM_PRE = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>")
FIM_SUF = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>")
FIM_MID = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>")
FIM_REP = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP = ("<|file_sep|>",)
#: llama-server's separator between extra chunks when the vocabulary has no file separator
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    """The FIM token ids of a vocabulary (None where it has none)."""

    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None
    sep: int | None

    @property
    def missing(self) -> list[str]:
        """llama-server's clauses for the required tokens the vocabulary lacks (empty: FIM works)."""
        return [f"{what} token is missing." for what, tid in
                (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tid is None]


def _first(tok, texts: tuple[str, ...]) -> int | None:
    for t in texts:
        tid = tok.token_to_id(t)
        if tid is not None:
            return tid
    return None


def fim_tokens(tok) -> FimTokens:
    """The FIM tokens of ``tok`` (a :class:`kvserve.loaders.tokenizer.Tokenizer`), by text."""
    cached = getattr(tok, "_kvserve_fim", None)
    if isinstance(cached, FimTokens):
        return cached
    found = FimTokens(_first(tok, FIM_PRE), _first(tok, FIM_SUF), _first(tok, FIM_MID), _first(tok, FIM_REP),
                      _first(tok, FIM_SEP))
    try:
        tok._kvserve_fim = found  # the vocabulary never changes: look the texts up once
    except AttributeError:  # a tokenizer with __slots__
        pass
    return found


def missing_text(fim: FimTokens) -> str:
    """``prefix token is missing. suffix token is missing. `` (llama-server's wording, each
    clause followed by a space)."""
    return "".join(m + " " for m in fim.missing)


def fim_prompt(tok, fim: FimTokens, prefix: list[int], suffix: list[int], *, prompt: list[int] = (),
               extra: list[tuple[str, str]] = (), n_batch: int = 2048, n_predict: int = -1, n_ctx: int = 4096,
               spm_infill: bool = False) -> list[int]:
    """The token ids of one FIM request (see the module docstring for the layout).

    Args:
        tok: the tokenizer (``encode``, ``add_bos``, ``bos_token_id``).
        fim: its FIM tokens; pre, suf and mid must be set.
        prefix, suffix: the code before and after the hole, as token ids.
        prompt: ids placed after the prefix (llama-server's ``prompt`` of ``/infill``).
        extra: ``(filename, text)`` chunks of other files (``input_extra``).
        n_batch, n_predict, n_ctx: the budgets that bound each part (tokens).
        spm_infill: suffix before prefix (``--spm-infill``).
    """
    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special=False, parse_special=False)

    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep] + enc("myproject\n")
    for filename, text in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep] + enc(filename + "\n")
        else:
            extra_ids += enc(_CHUNK_SEPARATOR)
        extra_ids += enc(text)
    if fim.sep is not None:
        extra_ids += [fim.sep] + enc("filename\n")
    prompt = list(prompt)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    pre = [fim.pre] + list(prefix[len(prefix) - n_prefix:]) + prompt
    suf = [fim.suf] + list(suffix[:n_suffix])
    first, last = (suf, pre) if spm_infill else (pre, suf)
    if getattr(tok, "add_bos", False) and tok.bos_token_id is not None:
        first = [tok.bos_token_id] + first
    tail = extra_ids[len(extra_ids) - n_extra:] if n_extra else []
    return tail + first + last + [fim.mid]
