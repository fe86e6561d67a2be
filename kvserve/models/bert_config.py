"""The BERT family's record pieces: its config (from GGUF ``bert.*`` metadata or config.json with
sentence-transformers' modules), its tensor names (llama.cpp's) and which are required.

Light on imports (no torch): the loaders and the model manager read configs through
:mod:`kvserve.models.family` before any module is built; :mod:`kvserve.models.bert` builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.loaders.weights import ModelLoadError, Weight

#: HF ``hidden_act`` names the FFN runs (see kvserve.models.bert.ACTIVATIONS)
ACTIVATION_NAMES = ("gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")

#: pooling modes an encoder's own config may name (see kvserve.engine.pooling)
POOLING_MODES = ("none", "mean", "cls", "last", "rank")

#: the architectures :class:`BertConfig` describes (kvserve.models.bert runs both)
ENCODER_ARCHS = ("bert", "nomic-bert")

#: GGUF ``{arch}.pooling_type`` (llama.cpp ``enum llama_pooling_type``) -> kvserve pooling
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


@dataclass(slots=True)
class BertConfig:
    """Hyper-parameters of one BERT-family encoder.

    Attributes:
        arch: "bert".
        n_layer, n_embd, n_head, n_ff, n_vocab: sizes (counts).
        n_ctx_train: position embeddings (tokens): the longest input.
        n_token_types: rows of ``token_types.weight`` (0: the model has none).
        norm_eps: LayerNorm epsilon.
        activation: FFN activation, one of :data:`ACTIVATION_NAMES`.
        n_labels: classifier outputs (0: an embedding model; >0: a cross-encoder, task "score").
        pooling: the model's own pooling ("mean", "cls", "last", "none", "rank") from
            sentence-transformers' 1_Pooling or GGUF ``bert.pooling_type``; None when it says none.
        normalize: the model's own ``--embd-normalize`` value (2 with a sentence-transformers
            Normalize module, -1 with a modules.json without one); None when it says nothing.
        pad_token_id: id of ``[PAD]`` (padding only; masked out).
        rope_base: rotary position base (nomic-bert: NEOX half-split rotary on q and k, no
            ``position_embd``); 0.0: learned absolute positions (BERT).
        gated_ffn: the FFN is ``down(act(gate(x)) * up(x))`` (nomic-bert's SwiGLU), not
            ``down(act(up(x)))``.
    """

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    n_token_types: int = 2
    norm_eps: float = 1e-12
    activation: str = "gelu"
    n_labels: int = 0
    pooling: str | None = None
    normalize: int | None = None
    pad_token_id: int = 0
    rope_base: float = 0.0
    gated_ffn: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ENCODER_ARCHS:
            raise ModelLoadError(f"unknown encoder architecture '{self.arch}' (supported: {', '.join(ENCODER_ARCHS)})")
        if self.n_head <= 0 or self.n_embd % self.n_head:
            raise ModelLoadError(f"bad head count: n_embd={self.n_embd}, n_head={self.n_head}")
        if self.activation not in ACTIVATION_NAMES:
            raise ModelLoadError(f"unsupported hidden_act '{self.activation}' "
                                 f"(supported: {', '.join(ACTIVATION_NAMES)})")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ModelLoadError(f"unsupported pooling '{self.pooling}' (supported: {', '.join(POOLING_MODES)})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def task(self) -> str:
        """"score" for a cross-encoder (classifier head), else "embed"."""
        return "score" if self.n_labels > 0 else "embed"


# -- config readers ------------------------------------------------------------------------------

def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> BertConfig:
    """A BertConfig from ``bert.*`` GGUF metadata; ModelLoadError on missing keys.

    Keys: block_count, embedding_length, attention.head_count, feed_forward_length,
    context_length, attention.layer_norm_epsilon, pooling_type (optional),
    ``tokenizer.ggml.token_type_count`` (optional). The FFN activation is GELU (exact),
    what BERT checkpoints use; GGUF does not record it. ``shapes`` (tensor name -> torch shape,
    when the tensor table is at hand): a ``cls.output.weight`` makes a cross-encoder (its rows
    are the labels), no ``token_types.weight`` means no token types, ``token_embd.weight``'s
    rows are the vocabulary.
    """
    shapes = shapes or {}

    def get(key, default=None):
        v = md.get(f"bert.{key}")
        if v is None:
            if default is None:
                raise ModelLoadError(f"{path}: missing GGUF key 'bert.{key}'")
            return default
        return v[0] if isinstance(v, list) else v

    if md.get("bert.attention.causal"):
        raise ModelLoadError(f"{path}: a causal BERT (bert.attention.causal) is not supported")
    head = shapes.get("cls.output.weight")
    n_labels = (head[0] if len(head) == 2 else 1) if head is not None else 0
    pooling = GGUF_POOLING.get(int(get("pooling_type", -1)))
    if n_labels:
        pooling = "rank"
    elif pooling == "rank":
        pooling = None
    config = BertConfig(
        arch="bert",
        n_layer=int(get("block_count")),
        n_embd=int(get("embedding_length")),
        n_head=int(get("attention.head_count")),
        n_ff=int(get("feed_forward_length")),
        n_vocab=len(md.get("tokenizer.ggml.tokens") or []),
        n_ctx_train=int(get("context_length")),
        n_token_types=int(md.get("tokenizer.ggml.token_type_count", 2) or 0),
        norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        n_labels=n_labels,
        pooling=pooling,
        pad_token_id=int(md.get("tokenizer.ggml.padding_token_id", 0) or 0),
    )
    if shapes:
        finish_gguf(config, shapes)
    return config


def sentence_transformers_defaults(d: Path) -> tuple[str | None, int | None]:
    """(pooling, normalize) from a sentence-transformers folder's modules.json; (None, None) without one.

    The Pooling module's config (``pooling_mode_*`` flags or ``pooling_mode``) gives
    "mean", "cls" or "last"; a Normalize module gives normalize 2 (Euclidean), its absence -1.

    Raises:
        ModelLoadError: a module kvserve does not run (Dense, max or sqrt-length pooling,
            several pooling modes at once, ...): its vectors would differ from the model's.
    """
    mpath = d / "modules.json"
    if not mpath.is_file():
        return None, None
    try:
        modules = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{mpath}: invalid JSON: {e}") from e
    pooling, normalize = None, -1
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = 2
            continue
        if kind != "Pooling":
            raise ModelLoadError(f"{mpath}: sentence-transformers module {m.get('type')!r} is not supported "
                                 "(supported: Transformer, Pooling, Normalize)")
        pooling = _st_pooling(d / str(m.get("path", "")) / "config.json")
    return pooling, normalize


#: sentence-transformers 1_Pooling flags -> kvserve pooling
_ST_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": None,
    "pooling_mode_mean_sqrt_len_tokens": None,
    "pooling_mode_weightedmean_tokens": None,
}


def _st_pooling(pcfg_path: Path) -> str:
    pcfg = json.loads(pcfg_path.read_text()) if pcfg_path.is_file() else {}
    modes = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v is True]
    if isinstance(pcfg.get("pooling_mode"), str):
        modes = ["pooling_mode_" + {"mean": "mean_tokens", "cls": "cls_token", "lasttoken": "lasttoken",
                                    "max": "max_tokens"}.get(pcfg["pooling_mode"], pcfg["pooling_mode"])]
    if len(modes) != 1 or _ST_POOLING.get(modes[0]) is None:
        raise ModelLoadError(f"{pcfg_path}: pooling {modes or 'none'} is not supported "
                             "(one of pooling_mode_mean_tokens, pooling_mode_cls_token, pooling_mode_lasttoken)")
    return _ST_POOLING[modes[0]]


def config_from_hf(cfg: dict, path: str) -> BertConfig:
    """A BertConfig from config.json (+ sentence-transformers modules.json); ModelLoadError on gaps."""
    d = Path(path)
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"{d}: position_embedding_type {kind!r} is not supported (absolute)")
    if cfg.get("is_decoder"):
        raise ModelLoadError(f"{d}: a BERT decoder (is_decoder) is not supported")
    archs = cfg.get("architectures") or []
    n_labels = 0
    if "BertForSequenceClassification" in archs:
        n_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    pooling, normalize = sentence_transformers_defaults(d)
    try:
        return BertConfig(
            arch="bert",
            n_layer=int(cfg["num_hidden_layers"]),
            n_embd=int(cfg["hidden_size"]),
            n_head=int(cfg["num_attention_heads"]),
            n_ff=int(cfg["intermediate_size"]),
            n_vocab=int(cfg["vocab_size"]),
            n_ctx_train=int(cfg.get("max_position_embeddings", 512)),
            n_token_types=int(cfg.get("type_vocab_size", 2)),
            norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            activation=str(cfg.get("hidden_act", "gelu")),
            n_labels=n_labels,
            pooling="rank" if n_labels else pooling,
            normalize=normalize,
            pad_token_id=int(cfg.get("pad_token_id") or 0),
        )
    except KeyError as e:
        raise ModelLoadError(f"{d}: config.json lacks {e.args[0]!r}") from None


def finish(config: BertConfig, shapes: dict) -> None:
    """Sizes the tensors decide (tensor name -> shape): no ``token_types.weight``, no token types;
    a cross-encoder's labels are ``cls.output.weight``'s rows; GGUF's vocabulary is
    ``token_embd.weight``'s rows."""
    if "token_types.weight" not in shapes:
        config.n_token_types = 0
    head = shapes.get("cls.output.weight")
    if config.n_labels and head is not None and len(head) == 2:
        config.n_labels = head[0]


def finish_gguf(config: BertConfig, shapes: dict) -> None:
    """:func:`finish` for a GGUF file, whose vocabulary is ``token_embd.weight``'s rows."""
    if "token_embd.weight" in shapes:
        config.n_vocab = shapes["token_embd.weight"][0]
    finish(config, shapes)


# -- tensor names --------------------------------------------------------------------------------

_LAYER_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}

_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
    "pooler.dense": "cls",
    "classifier": "cls.output",
}


def hf_name(name: str) -> str | None:
    """Map an HF BERT tensor name (``bert.`` prefix optional) to llama.cpp's; None when unused."""
    if name.startswith("bert."):
        name = name[5:]
    base, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if leaf not in ("weight", "bias"):
        return None
    if base in _NAMES:
        return f"{_NAMES[base]}.{leaf}"
    if base.startswith("encoder.layer."):
        idx, _, sub = base[len("encoder.layer."):].partition(".")
        if sub in _LAYER_NAMES and idx.isdigit():
            return f"blk.{idx}.{_LAYER_NAMES[sub]}.{leaf}"
    return None


def hf_tensor_name(name: str, config: BertConfig) -> str | None:
    """:func:`hf_name`, without the pooler and classifier of an embedding model (sentence-transformers
    never runs them)."""
    g = hf_name(name)
    if g is None or g.startswith("cls") and not config.n_labels:
        return None
    return g


LAYER_TENSORS = (
    "attn_output.weight", "attn_output.bias", "attn_output_norm.weight", "attn_output_norm.bias",
    "ffn_up.weight", "ffn_up.bias", "ffn_down.weight", "ffn_down.bias",
    "layer_output_norm.weight", "layer_output_norm.bias",
)


def required_tensors(config: BertConfig, weights: dict[str, Weight]) -> list[str]:
    """The tensors a BERT of ``config`` needs, in order (fused ``attn_qkv`` where the file has it)."""
    needed = ["token_embd.weight", "position_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"]
    if config.n_token_types:
        needed.append("token_types.weight")
    for i in range(config.n_layer):
        p = f"blk.{i}."
        if p + "attn_qkv.weight" not in weights:
            needed += [p + f"attn_{x}.{y}" for x in "qkv" for y in ("weight", "bias")]
        needed += [p + n for n in LAYER_TENSORS]
    if config.n_labels:
        needed += ["cls.output.weight"]
    return needed
