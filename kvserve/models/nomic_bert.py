"""The nomic-bert family's record pieces (nomic-embed-text): config readers and tensor names.

nomic-bert is a BERT encoder (post-norm LayerNorm, bidirectional attention, token type
embeddings) with three changes, all run by kvserve.models.bert.BertModel through
:class:`~kvserve.models.bert_config.BertConfig` flags: rotary positions (NEOX half-split, base
``rope_base``, no learned position table), a SwiGLU FFN (``down(silu(gate(x)) * up(x))``) and
no biases on its projections. Vectors are mean-pooled (GGUF ``nomic-bert.pooling_type`` 1); the
``search_query:`` / ``search_document:`` prefixes are the client's, as with Ollama.

Files read:

- GGUF written by llama.cpp's converter (``general.architecture = nomic-bert``): fused
  ``blk.N.attn_qkv.weight``, ``ffn_up`` (nomic's ``fc11``), ``ffn_gate`` (``fc12``),
  ``ffn_down`` (``fc2``), ``nomic-bert.rope.freq_base``.
- HF directories of transformers' ``NomicBertModel`` (``layers.N.self_attn.{q,k,v,o}_proj``,
  ``mlp.{gate,up,down}_proj``, ``post_attention_layernorm``, ``post_mlp_layernorm``) and of
  nomic-ai's original remote-code checkpoints (``encoder.layers.N.attn.Wqkv``, ``mlp.fc11/fc12/fc2``,
  ``norm1``, ``norm2``, ``emb_ln``; GPT-2 style config keys ``n_embd``, ``n_inner``,
  ``rotary_emb_base``...).

Options kvserve does not compute (partial or interleaved rotary, pre-norm blocks, scaled or
dynamic RoPE, a causal encoder, experts) are refused at load naming the key.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.loaders.weights import ModelLoadError, Weight
from kvserve.models.bert_config import GGUF_POOLING, BertConfig, sentence_transformers_defaults

#: nomic's original ``activation_function`` -> the HF ``hidden_act`` the gate runs
_GATED_ACTS = {"swiglu": "silu", "geglu": "gelu", "silu": "silu", "swish": "silu", "gelu": "gelu"}


def config_from_gguf(md: dict, path: str, shapes: dict | None = None) -> BertConfig:
    """A nomic-bert BertConfig from ``nomic-bert.*`` GGUF metadata (llama.cpp's keys).

    Raises:
        ModelLoadError: a missing key (named), a causal encoder, experts (nomic-bert-moe).
    """
    shapes = shapes or {}

    def get(key, default=None):
        v = md.get(f"nomic-bert.{key}")
        if v is None:
            if default is None:
                raise ModelLoadError(f"{path}: missing GGUF key 'nomic-bert.{key}'")
            return default
        return v[0] if isinstance(v, list) else v

    if md.get("nomic-bert.attention.causal"):
        raise ModelLoadError(f"{path}: GGUF key 'nomic-bert.attention.causal' is true: kvserve runs nomic-bert "
                             "as a bidirectional encoder only")
    if int(get("expert_count", 0) or 0):
        raise ModelLoadError(f"{path}: GGUF key 'nomic-bert.expert_count' is {get('expert_count')}: kvserve "
                             "runs the dense nomic-bert only")
    pooling = GGUF_POOLING.get(int(get("pooling_type", -1)))
    config = BertConfig(
        arch="nomic-bert",
        n_layer=int(get("block_count")),
        n_embd=int(get("embedding_length")),
        n_head=int(get("attention.head_count")),
        n_ff=int(get("feed_forward_length")),
        n_vocab=len(md.get("tokenizer.ggml.tokens") or []),
        n_ctx_train=int(get("context_length")),
        n_token_types=int(md.get("tokenizer.ggml.token_type_count", 2) or 0),
        norm_eps=float(get("attention.layer_norm_epsilon", 1e-12)),
        activation="silu",
        pooling=None if pooling == "rank" else pooling,
        pad_token_id=int(md.get("tokenizer.ggml.padding_token_id", 0) or 0),
        rope_base=float(get("rope.freq_base", 1000.0)),
        gated_ffn=True,
    )
    if shapes:
        finish(config, shapes)
        if "token_embd.weight" in shapes:
            config.n_vocab = shapes["token_embd.weight"][0]
    return config


def _refuse(d: Path, key: str, value, why: str) -> None:
    raise ModelLoadError(f"{d}: config.json {key} is {value!r}: {why}")


def _check_hf(cfg: dict, d: Path) -> None:
    """Refuse the options of nomic's config that kvserve does not compute, naming the key."""
    if float(cfg.get("rotary_emb_fraction", 1.0) or 0.0) != 1.0:
        _refuse(d, "rotary_emb_fraction", cfg["rotary_emb_fraction"], "kvserve rotates whole heads (1.0)")
    if cfg.get("rotary_emb_interleaved"):
        _refuse(d, "rotary_emb_interleaved", True, "kvserve runs the half-split rotary (false)")
    if cfg.get("prenorm"):
        _refuse(d, "prenorm", True, "kvserve runs nomic-bert's post-norm block (false)")
    if cfg.get("rotary_scaling_factor") not in (None, 1, 1.0):
        _refuse(d, "rotary_scaling_factor", cfg["rotary_scaling_factor"], "kvserve computes unscaled rotary (null)")
    if cfg.get("causal") or cfg.get("is_decoder"):
        _refuse(d, "causal" if cfg.get("causal") else "is_decoder", True, "kvserve runs a bidirectional encoder")
    if int(cfg.get("num_experts", 0) or 0):
        _refuse(d, "num_experts", cfg["num_experts"], "kvserve runs the dense nomic-bert only")
    if cfg.get("use_rms_norm"):
        _refuse(d, "use_rms_norm", True, "kvserve runs nomic-bert's LayerNorm")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rtype not in ("default", None):
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        _refuse(d, f"{key}.rope_type", rtype, "kvserve computes default rotary for nomic-bert")


def config_from_hf(cfg: dict, path: str) -> BertConfig:
    """A nomic-bert BertConfig from config.json: transformers' NomicBertConfig keys or nomic's
    original GPT-2 style ones (+ sentence-transformers' modules.json for pooling/normalize).

    Raises:
        ModelLoadError: a missing key, or an option kvserve does not compute (the key named).
    """
    d = Path(path)
    _check_hf(cfg, d)

    def first(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ModelLoadError(f"{d}: config.json lacks {keys[0]!r}")
        return default

    act = str(first("hidden_act", "activation_function", default="silu"))
    if act not in _GATED_ACTS:
        _refuse(d, "hidden_act" if "hidden_act" in cfg else "activation_function", act,
                f"kvserve's gated FFN runs {', '.join(sorted(_GATED_ACTS))}")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    pooling, normalize = sentence_transformers_defaults(d)
    n_embd = int(first("hidden_size", "n_embd"))
    return BertConfig(
        arch="nomic-bert",
        n_layer=int(first("num_hidden_layers", "n_layer")),
        n_embd=n_embd,
        n_head=int(first("num_attention_heads", "n_head")),
        n_ff=int(first("intermediate_size", "n_inner", default=4 * n_embd)),
        n_vocab=int(first("vocab_size")),
        n_ctx_train=int(first("max_position_embeddings", "n_positions", default=2048)),
        n_token_types=int(first("type_vocab_size", default=2)),
        norm_eps=float(first("layer_norm_eps", "layer_norm_epsilon", default=1e-12)),
        activation=_GATED_ACTS[act],
        pooling=pooling,
        normalize=normalize,
        pad_token_id=int(cfg.get("pad_token_id") or 0),
        rope_base=float(rope.get("rope_theta") or cfg.get("rope_theta") or cfg.get("rotary_emb_base") or 1000.0),
        gated_ffn=True,
    )


def finish(config: BertConfig, shapes: dict) -> None:
    """Sizes the tensors decide: the FFN width is ``ffn_up``'s rows (nomic's original code rounds
    ``n_inner`` up to a multiple of 256); no ``token_types.weight``, no token types."""
    if "token_types.weight" not in shapes:
        config.n_token_types = 0
    up = shapes.get("blk.0.ffn_up.weight")
    if up is not None:
        config.n_ff = up[0]


#: HF per-layer names (transformers' and nomic's original) -> llama.cpp's
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "attn_output_norm",
    "mlp.up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate", "mlp.down_proj": "ffn_down",
    "post_mlp_layernorm": "layer_output_norm",
    "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate", "mlp.fc2": "ffn_down", "norm2": "layer_output_norm",
}

_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "emb_ln": "token_embd_norm",
}


def hf_tensor_name(name: str, config: BertConfig | None = None) -> str | None:
    """An HF nomic-bert tensor name (``model.`` / ``bert.`` / ``nomic_bert.`` prefix optional) ->
    llama.cpp's; None for tensors not used (heads, buffers)."""
    for prefix in ("model.", "bert.", "nomic_bert."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    base, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return None
    if base in _NAMES:
        return f"{_NAMES[base]}.{leaf}"
    for layers in ("layers.", "encoder.layers."):
        if base.startswith(layers):
            idx, _, sub = base[len(layers):].partition(".")
            if sub in _LAYER_NAMES and idx.isdigit():
                return f"blk.{idx}.{_LAYER_NAMES[sub]}.{leaf}"
    return None


def required_tensors(config: BertConfig, weights: dict[str, Weight]) -> list[str]:
    """The tensors a nomic-bert of ``config`` needs, in order (fused ``attn_qkv`` or separate
    ``attn_q/k/v``, as the file has them; biases are optional)."""
    needed = ["token_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"]
    if config.n_token_types:
        needed.append("token_types.weight")
    for i in range(config.n_layer):
        p = f"blk.{i}."
        needed += [p + "attn_qkv.weight"] if p + "attn_qkv.weight" in weights else [p + f"attn_{x}.weight"
                                                                                     for x in "qkv"]
        needed += [p + n for n in ("attn_output.weight", "attn_output_norm.weight", "attn_output_norm.bias",
                                   "ffn_up.weight", "ffn_gate.weight", "ffn_down.weight",
                                   "layer_output_norm.weight", "layer_output_norm.bias")]
    return needed
