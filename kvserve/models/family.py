"""Model families: one record per family, and every architecture table derived from them.

A :class:`Family` says everything kvserve knows about a family of checkpoints: its GGUF
``general.architecture`` names (with the older names Ollama's store keeps) and HF
``architectures`` names, how to read its config from GGUF metadata and from ``config.json``, how
its HF tensors are named in kvserve's (llama.cpp's GGUF) names and which tensors it requires, the
module class that runs it, its KV layout per layer (:class:`KVSpec`), whether kvserve's native
decode step (kvserve.models.decode_native, a llama layer in C++) applies, and its task
("generate", "embed" or "score"). The loaders read files and ask this module what the file is;
the registry, the model manager, the start-up checks and the embedding runner ask it too.

The families: ``llama`` (llama, mistral, qwen2; llama 3's RoPE factors, tied embeddings, optional
biases), ``qwen3`` (kvserve.models.qwen3: q/k norm), ``qwen3moe`` (kvserve.models.moe: experts),
``gemma2`` / ``gemma3`` (kvserve.models.gemma: their own block, sliding-window layers), ``phi3``
(kvserve.models.phi3: fused tensors cut at load, LongRoPE, partial rotary), ``mistral3``
(kvserve.models.mistral3: YaRN and a query temperature), ``gpt-oss`` (kvserve.models.gpt_oss:
attention sinks, windows, a biased MoE; Ollama's older ``gptoss`` files too), ``bert``
(kvserve.models.bert_config / bert: an encoder) and ``nomic-bert`` (kvserve.models.nomic_bert: the
BERT encoder with rotary positions and a SwiGLU FFN).

Adding a family:

1. write its module (``kvserve/models/<name>.py``): a config reader for GGUF metadata
   (``(metadata, path, shapes) -> config``; :func:`llama_config_from_gguf` reads llama.cpp's common
   keys) and one for config.json (``(config_json, path) -> config``; :func:`llama_config_from_hf`),
   the HF tensor names, the tensors it requires, a ``prepare`` turning the file's layout into the
   module's, and, where the llama block (kvserve.models.llama) cannot be switched to it by config
   flags (q/k norm, biases, experts), a module composing the shared pieces (Linear, RMSNorm, RoPE
   tables, the KV cache reads), as kvserve.models.gemma does;
2. add one :class:`Family` record to :data:`FAMILIES` below, with its KV spec per layer and whether
   the native decode step applies (the llama block, with qwen3's q/k norm and qwen3moe's experts
   where the file keeps them as GGUF blocks; :func:`_native_llama_block`). Nothing else names
   architectures; tests/unit/test_families.py compares each family with transformers.

An option a family cannot run (a rope scaling type it lacks, a missing tensor) is refused at load
with a :class:`~kvserve.loaders.weights.ModelLoadError` naming the key or the tensor.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from kvserve.loaders.weights import ModelConfig, ModelLoadError, Weight, interleave_qk

TASKS = ("generate", "embed", "score")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV cache one layer keeps (vLLM's FullAttentionSpec / SlidingWindowSpec).

    Attributes:
        kind: "full" (every earlier token), "sliding" (the last ``window`` tokens) or "none"
            (an encoder: no cache).
        window: tokens a query sees, itself included ("sliding" only).
    """

    kind: str
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("full", "sliding", "none"):
            raise ValueError(f"unknown KV spec kind {self.kind!r}")
        if (self.kind == "sliding") != (self.window > 0):
            raise ValueError(f"KV spec {self.kind!r} with window {self.window}")


FULL = KVSpec("full")
NO_KV = KVSpec("none")


@dataclass(frozen=True, slots=True)
class Family:
    """One model family (see the module docstring).

    Attributes:
        name: the family's name ("llama", "bert").
        gguf_archs: GGUF ``general.architecture`` values it reads (older names Ollama's store
            keeps included).
        hf_archs: HF ``architectures`` values -> the task of that class ("generate", "embed",
            "score").
        task: the family's task when nothing more specific says otherwise.
        module: "package.module:Class" of the torch module (imported when first built).
        config_from_gguf: ``(metadata, path, shapes | None) -> config``; ``shapes`` maps tensor
            names to torch shapes when the tensor table is at hand (sizes the file decides).
        config_from_hf: ``(config_json, path) -> config``.
        hf_tensor_name: ``(hf_name, config) -> kvserve name | None`` (None: a tensor not used).
        required_tensors: ``(config, weights) -> names`` the module needs, in order.
        kv_spec: ``config -> per-layer KVSpec`` (tuple, one per layer).
        native_decode: ``config -> bool``: kvserve's native decode step (a llama layer in C++,
            with optional per-head q/k RMSNorm and a softmax top-k mixture of experts:
            kvserve.models.decode_native) computes this model exactly (it has no other
            operations); False for every model of a family it does not implement.
        hf_model_types: config.json ``model_type`` values that name the family when
            ``architectures`` is absent.
        finish_hf: ``(config, shapes) -> None``: sizes an HF directory's tensors decide.
        prepare: ``(config, weights, fmt) -> None``: turns the weights as read ("gguf" / "hf")
            into the module's layout, in place.
        packed_weights: the module takes 4-bit packed weights (else the loader hands it float32).
        score_tensor: a GGUF tensor whose presence makes the model a cross-encoder ("score").
    """

    name: str
    gguf_archs: tuple[str, ...]
    hf_archs: dict[str, str]
    task: str
    module: str
    config_from_gguf: Callable[[dict, str, dict | None], Any]
    config_from_hf: Callable[[dict, str], Any]
    hf_tensor_name: Callable[[str, Any], str | None]
    required_tensors: Callable[[Any, dict], list[str]]
    kv_spec: Callable[[Any], tuple[KVSpec, ...]]
    native_decode: Callable[[Any], bool] = field(default=lambda config: False)
    hf_model_types: tuple[str, ...] = ()
    finish_hf: Callable[[Any, dict], None] = field(default=lambda config, shapes: None)
    prepare: Callable[[Any, dict, str], None] = field(default=lambda config, weights, fmt: None)
    packed_weights: bool = True
    score_tensor: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS or any(t not in TASKS for t in self.hf_archs.values()):
            raise ValueError(f"family {self.name}: unknown task")

    def module_class(self) -> type:
        """The torch module class (imported now)."""
        mod, _, cls = self.module.partition(":")
        return getattr(importlib.import_module(mod), cls)


# -- the llama block: llama, mistral, qwen2 --------------------------------------------------------

#: the llama block's per-layer tensors (kvserve / llama.cpp names), all required
LLAMA_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)

#: HF (transformers) per-layer names of the llama block -> kvserve's
LLAMA_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}

#: GGUF architectures of the llama block whose Q/K rows are in the NEOX (half-split) layout:
#: llama.cpp's converter permutes llama's and mistral's to interleaved pairs, not qwen2's
LLAMA_NEOX_GGUF = ("qwen2",)

#: GGUF architectures of the llama block with q/k/v biases
LLAMA_QKV_BIAS = ("qwen2",)


def llama_hf_tensor_name(name: str, config: Any = None, layer_names: dict = LLAMA_HF_LAYER_NAMES) -> str | None:
    """Map an HF tensor name of a llama-block model to kvserve's (GGUF) name; None for tensors
    not used."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name.startswith("model.layers."):
        idx, _, sub = name[len("model.layers."):].partition(".")
        if sub in layer_names:
            return f"blk.{idx}.{layer_names[sub]}"
    return None


#: RoPE scaling types the llama block computes (kvserve.models.llama.rope_inv_freq and
#: rope_attention_factor); "none" / "default" mean none
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


def gguf_yarn(get: Callable, arch: str, path: str) -> dict:
    """YaRN's scaling dict from llama.cpp's ``{arch}.rope.scaling.*`` keys (``get(key, default,
    required=False)``): ``yarn_beta_fast`` / ``yarn_beta_slow`` (32 / 1), ``attn_factor`` (times
    YaRN's 0.1 ln(factor) + 1, as llama.cpp's ``rope_yarn``).

    ``yarn_log_multiplier`` m (Ministral 3's ``mscale_all_dim``, which llama.cpp's converter writes)
    makes that mscale a ratio, ``(0.1 ln(factor) + 1) / (0.1 m ln(factor) + 1)``: llama.cpp's
    llama_context (``mscale`` taken as 1), transformers' ``get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim)``.

    Raises ModelLoadError: no ``original_context_length``."""
    log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0, required=False) or 0.0)
    orig = int(get("rope.scaling.original_context_length", 0, required=False) or 0)
    if not orig:
        raise ModelLoadError(f"{path}: missing GGUF key '{arch}.rope.scaling.original_context_length' (YaRN)")
    factor = float(get("rope.scaling.factor", 1.0, required=False))
    sc = {"type": "yarn", "factor": factor, "original_context_length": orig,
          "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
          "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0, required=False))}
    attn = float(get("rope.scaling.attn_factor", 1.0, required=False) or 1.0)

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if attn != 1.0 or log_mul:
        sc["attention_factor"] = attn * mscale(1.0) / (mscale(log_mul) if log_mul else 1.0)
    return sc


def llama_config_from_gguf(md: dict, path: str, shapes: dict | None = None, **extra) -> ModelConfig:
    """A ModelConfig from ``{arch}.*`` GGUF metadata (llama.cpp's keys); ModelLoadError naming a
    missing key or a RoPE scaling type kvserve does not compute. ``shapes`` (tensor name -> torch
    shape): no ``output.weight`` means tied embeddings, ``token_embd.weight``'s rows are the
    vocabulary, and the biases llama.cpp loads when present (``attn_{q,k,v,output}.bias``,
    ``ffn_{gate,up,down}.bias``) are switched on by the first layer's. ``extra``: ModelConfig
    fields a family sets (qwen3: ``qk_norm=True``)."""
    arch = md.get("general.architecture")

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in md and md[full] is not None:
            return md[full]
        if required and default is None:
            raise ModelLoadError(f"{path}: missing GGUF key '{full}'")
        return default

    tokens = md.get("tokenizer.ggml.tokens") or []
    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = get("attention.head_count_kv", n_head, required=False)
    if isinstance(n_head_kv, list):
        n_head_kv = n_head_kv[0]
    head_dim = int(get("attention.key_length", n_embd // n_head, required=False))
    scaling = None
    stype = get("rope.scaling.type", "", required=False)
    if stype and stype != "none":
        if stype not in ROPE_SCALING_TYPES:
            raise ModelLoadError(f"{path}: GGUF key '{arch}.rope.scaling.type' is {stype!r}: kvserve computes "
                                 f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
        scaling = gguf_yarn(get, arch, path) if stype == "yarn" else {
            "type": stype,
            "factor": float(get("rope.scaling.factor", 1.0, required=False)),
            "original_context_length": int(get("rope.scaling.original_context_length", 0, required=False)),
        }
    ff = get("feed_forward_length")
    if isinstance(ff, list):
        ff = ff[0]
    config = ModelConfig(
        arch=arch,
        n_layer=int(get("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(n_head_kv),
        n_ff=int(ff),
        n_vocab=int(get("vocab_size", len(tokens), required=False) or len(tokens)),
        head_dim=head_dim,
        n_ctx_train=int(get("context_length")),
        rope_freq_base=float(get("rope.freq_base", 10000.0, required=False)),
        rope_scaling=scaling,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
        qkv_bias=arch in LLAMA_QKV_BIAS,
        **extra,
    )
    if shapes is not None:
        if "output.weight" not in shapes:
            config.tie_embeddings = True
        if "token_embd.weight" in shapes:
            config.n_vocab = shapes["token_embd.weight"][0]
        factors = shapes.get("rope_freqs.weight")
        if factors is not None and tuple(factors) != (head_dim // 2,):
            raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' has shape {list(factors)}, expected "
                                 f"[{head_dim // 2}] (head_dim / 2)")
        config.qkv_bias = config.qkv_bias or "blk.0.attn_q.bias" in shapes
        config.attn_bias = "blk.0.attn_output.bias" in shapes
        config.mlp_bias = "blk.0.ffn_up.bias" in shapes
    return config


def hf_rope(cfg: dict, path: str) -> tuple[float, dict | None]:
    """(RoPE theta, scaling dict or None) of a config.json: ``rope_theta`` and ``rope_scaling``, or
    transformers 5's ``rope_parameters`` (which holds both).

    Raises ModelLoadError: a scaling type kvserve does not compute (the key is named)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get("rope_scaling") or params)
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    stype = rope.get("rope_type", rope.get("type"))
    if stype in (None, "default", "none") or not rope:
        return theta, None
    if stype not in ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{path}: config.json {key}.rope_type is {stype!r}: kvserve computes "
                             f"{', '.join(ROPE_SCALING_TYPES)} (or default)")
    rope["type"] = stype
    # transformers gives a top-level original_max_position_embeddings priority, else max_position_embeddings
    orig = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if orig:
        rope["original_context_length"] = orig
    if stype == "yarn":
        rope["original_context_length"] = int(orig or cfg.get("max_position_embeddings") or 0)
        if not rope["original_context_length"]:
            raise ModelLoadError(f"{path}: config.json {key} (yarn) needs original_max_position_embeddings")
        if rope.get("factor") is None:
            rope["factor"] = float(cfg["max_position_embeddings"]) / rope["original_context_length"]
    return theta, rope


def llama_config_from_hf(cfg: dict, path: str, arch: str | None = None, **extra) -> ModelConfig:
    """A ModelConfig from a llama-block config.json (transformers' keys); ModelLoadError naming a
    missing key or a RoPE scaling type kvserve does not compute. ``arch``: the GGUF name to record
    (default: from ``architectures``); ``extra``: ModelConfig fields a family sets."""
    if arch is None:
        arch = _HF_GGUF_NAMES.get(next((a for a in cfg.get("architectures") or [] if a in _HF_GGUF_NAMES), ""),
                                  "llama")
    try:
        n_embd = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        theta, scaling = hf_rope(cfg, path)
        attention_bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            arch=arch,
            n_layer=int(cfg["num_hidden_layers"]),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
            n_ff=int(cfg["intermediate_size"]),
            n_vocab=int(cfg["vocab_size"]),
            head_dim=int(cfg.get("head_dim") or n_embd // n_head),
            n_ctx_train=int(cfg.get("max_position_embeddings", 2048)),
            rope_freq_base=theta,
            rope_scaling=scaling,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch in LLAMA_QKV_BIAS or attention_bias,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            **extra,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config.json lacks {e.args[0]!r}") from None


#: HF class -> the GGUF name a llama-block config records (MistralForCausalLM runs as llama)
_HF_GGUF_NAMES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def llama_required_tensors(config: ModelConfig, weights: dict | None = None) -> list[str]:
    """The tensors a llama-block model of ``config`` needs, in order (the biases and q/k norms its
    flags switch on); ``output.weight`` is optional (tied embeddings without it), and so is
    ``rope_freqs.weight`` (llama 3's per-dimension RoPE factors)."""
    needed = ["token_embd.weight", "output_norm.weight"]
    for i in range(config.n_layer):
        needed += [f"blk.{i}.{n}" for n in LLAMA_LAYER_TENSORS]
        if config.qkv_bias:
            needed += [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
        if config.attn_bias:
            needed.append(f"blk.{i}.attn_output.bias")
        if config.mlp_bias:
            needed += [f"blk.{i}.ffn_{x}.bias" for x in ("gate", "up", "down")]
        if config.qk_norm:
            needed += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
    return needed


def llama_finish_hf(config: ModelConfig, shapes: dict) -> None:
    """No ``lm_head.weight`` in the directory: the head is the embedding (tied)."""
    if "output.weight" not in shapes:
        config.tie_embeddings = True


def llama_prepare(config: ModelConfig, weights: dict[str, Weight], fmt: str) -> None:
    """Q/K rows to interleaved pairs (the model's RoPE layout) where the file has them half-split:
    every HF directory, and GGUF architectures of :data:`LLAMA_NEOX_GGUF`."""
    if fmt == "hf" or config.arch in LLAMA_NEOX_GGUF:
        interleave_qk(config, weights)


def all_full(config: Any) -> tuple[KVSpec, ...]:
    """Every layer keeps full-attention KV."""
    return (FULL,) * config.n_layer


def no_kv(config: Any) -> tuple[KVSpec, ...]:
    """An encoder: no layer keeps KV."""
    return (NO_KV,) * config.n_layer


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported when first called (a family module may import this one)."""
    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)
    call.__name__ = name
    return call


# -- BERT ------------------------------------------------------------------------------------------

def _bert(name: str) -> Callable:
    """A function of kvserve.models.bert_config, imported when first called."""
    return _lazy("kvserve.models.bert_config", name)


# -- the records -----------------------------------------------------------------------------------

def _native_llama_block(config, qk_norm: bool = False) -> bool:
    """Whether kvserve's native decode step (decode_cpu.cpp's llama layer: q|k|v biases allowed, no
    output or MLP biases, no YaRN magnitude) computes ``config``'s layers; ``qk_norm``: the family's
    per-head q/k RMSNorm is one the step runs (qwen3, qwen3moe)."""
    return not (config.attn_bias or config.mlp_bias or (config.qk_norm and not qk_norm)
                or (config.rope_scaling or {}).get("type") == "yarn")


LLAMA = Family(
    name="llama",
    gguf_archs=("llama", "mistral", "qwen2"),
    hf_archs={"LlamaForCausalLM": "generate", "MistralForCausalLM": "generate", "Qwen2ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.llama:LlamaModel",
    config_from_gguf=llama_config_from_gguf,
    config_from_hf=llama_config_from_hf,
    hf_tensor_name=llama_hf_tensor_name,
    required_tensors=llama_required_tensors,
    kv_spec=all_full,
    native_decode=lambda config: _native_llama_block(config),
    finish_hf=llama_finish_hf,
    prepare=llama_prepare,
)

QWEN3 = Family(
    name="qwen3",
    gguf_archs=("qwen3",),
    hf_archs={"Qwen3ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.llama:LlamaModel",
    config_from_gguf=_lazy("kvserve.models.qwen3", "config_from_gguf"),
    config_from_hf=_lazy("kvserve.models.qwen3", "config_from_hf"),
    hf_tensor_name=llama_hf_tensor_name,
    required_tensors=llama_required_tensors,
    kv_spec=all_full,
    # the native step's layer with qwen3's per-head q/k norm (Decoder.set_qk_norm)
    native_decode=lambda config: _native_llama_block(config, qk_norm=True),
    finish_hf=llama_finish_hf,
    prepare=_lazy("kvserve.models.qwen3", "prepare"),
)

QWEN3MOE = Family(
    name="qwen3moe",
    gguf_archs=("qwen3moe",),
    hf_archs={"Qwen3MoeForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.llama:LlamaModel",
    config_from_gguf=_lazy("kvserve.models.moe", "config_from_gguf"),
    config_from_hf=_lazy("kvserve.models.moe", "config_from_hf"),
    hf_tensor_name=_lazy("kvserve.models.moe", "hf_tensor_name"),
    required_tensors=_lazy("kvserve.models.moe", "required_tensors"),
    kv_spec=all_full,
    # and the router + top-k experts on the file's blocks (Decoder.set_moe; decode_native.experts_reason)
    native_decode=lambda config: _native_llama_block(config, qk_norm=True),
    finish_hf=llama_finish_hf,
    prepare=_lazy("kvserve.models.moe", "prepare"),
)


def _gemma(name: str) -> Callable:
    """A function of kvserve.models.gemma, imported when first called."""
    return _lazy("kvserve.models.gemma", name)


GEMMA2 = Family(
    name="gemma2",
    gguf_archs=("gemma2",),
    hf_archs={"Gemma2ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.gemma:GemmaModel",
    config_from_gguf=_gemma("config_from_gguf"),
    config_from_hf=_gemma("config_from_hf"),
    hf_tensor_name=_gemma("hf_tensor_name"),
    required_tensors=_gemma("required_tensors"),
    kv_spec=_gemma("kv_spec"),
    native_decode=lambda config: False,  # the native step is a llama layer
    finish_hf=llama_finish_hf,
    prepare=_gemma("prepare"),
)

GEMMA3 = Family(
    name="gemma3",
    gguf_archs=("gemma3",),
    hf_archs={"Gemma3ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.gemma:GemmaModel",
    config_from_gguf=_gemma("config_from_gguf"),
    config_from_hf=_gemma("config_from_hf"),
    hf_tensor_name=_gemma("hf_tensor_name"),
    required_tensors=_gemma("required_tensors"),
    kv_spec=_gemma("kv_spec"),
    native_decode=lambda config: False,
    hf_model_types=("gemma3_text",),
    finish_hf=llama_finish_hf,
    prepare=_gemma("prepare"),
)

BERT = Family(
    name="bert",
    gguf_archs=("bert",),
    hf_archs={"BertModel": "embed", "BertForMaskedLM": "embed", "BertForPreTraining": "embed",
              "BertForSequenceClassification": "score"},
    task="embed",
    module="kvserve.models.bert:BertModel",
    config_from_gguf=_bert("config_from_gguf"),
    config_from_hf=_bert("config_from_hf"),
    hf_tensor_name=_bert("hf_tensor_name"),
    required_tensors=_bert("required_tensors"),
    kv_spec=no_kv,
    hf_model_types=("bert",),
    finish_hf=_bert("finish"),
    packed_weights=False,
    score_tensor="cls.output.weight",
)

def _phi3(name: str) -> Callable:
    """A function of kvserve.models.phi3, imported when first called."""
    return _lazy("kvserve.models.phi3", name)


PHI3 = Family(
    name="phi3",
    gguf_archs=("phi3",),
    hf_archs={"Phi3ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.phi3:Phi3Model",
    config_from_gguf=_phi3("config_from_gguf"),
    config_from_hf=_phi3("config_from_hf"),
    hf_tensor_name=_phi3("hf_tensor_name"),
    required_tensors=_phi3("required_tensors"),
    kv_spec=_phi3("kv_spec"),
    native_decode=lambda config: False,  # the native step has no partial rotary / LongRoPE magnitude / window
    finish_hf=llama_finish_hf,
    prepare=_phi3("prepare"),
)


def _mistral3(name: str) -> Callable:
    """A function of kvserve.models.mistral3, imported when first called."""
    return _lazy("kvserve.models.mistral3", name)


MISTRAL3 = Family(
    name="mistral3",
    gguf_archs=("mistral3",),
    hf_archs={"Ministral3ForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.mistral3:Mistral3Model",
    config_from_gguf=_mistral3("config_from_gguf"),
    config_from_hf=_mistral3("config_from_hf"),
    hf_tensor_name=llama_hf_tensor_name,
    required_tensors=llama_required_tensors,
    kv_spec=all_full,
    native_decode=lambda config: False,  # the native step has no query temperature
    hf_model_types=("ministral3",),
    finish_hf=llama_finish_hf,
    prepare=llama_prepare,
)


def _nomic(name: str) -> Callable:
    """A function of kvserve.models.nomic_bert, imported when first called."""
    return _lazy("kvserve.models.nomic_bert", name)


NOMIC_BERT = Family(
    name="nomic-bert",
    gguf_archs=("nomic-bert",),
    hf_archs={"NomicBertModel": "embed"},
    task="embed",
    module="kvserve.models.bert:BertModel",
    config_from_gguf=_nomic("config_from_gguf"),
    config_from_hf=_nomic("config_from_hf"),
    hf_tensor_name=_nomic("hf_tensor_name"),
    required_tensors=_nomic("required_tensors"),
    kv_spec=no_kv,
    hf_model_types=("nomic_bert",),
    finish_hf=_nomic("finish"),
    packed_weights=False,
)


def _gpt_oss(name: str) -> Callable:
    """A function of kvserve.models.gpt_oss, imported when first called."""
    return _lazy("kvserve.models.gpt_oss", name)


GPT_OSS = Family(
    name="gpt-oss",
    gguf_archs=("gpt-oss", "gptoss"),  # gptoss: the name Ollama's converter wrote (its loader renames it)
    hf_archs={"GptOssForCausalLM": "generate"},
    task="generate",
    module="kvserve.models.gpt_oss:GptOssModel",
    config_from_gguf=_gpt_oss("config_from_gguf"),
    config_from_hf=_gpt_oss("config_from_hf"),
    hf_tensor_name=_gpt_oss("hf_tensor_name"),
    required_tensors=_gpt_oss("required_tensors"),
    kv_spec=_gpt_oss("kv_spec"),
    native_decode=lambda config: False,  # sinks, windows, biased experts: not the native llama layer
    hf_model_types=("gpt_oss",),
    finish_hf=llama_finish_hf,
    prepare=_gpt_oss("prepare"),
)

#: every family kvserve runs, in the order error messages list them
FAMILIES: tuple[Family, ...] = (LLAMA, QWEN3, QWEN3MOE, GEMMA2, GEMMA3, PHI3, MISTRAL3, GPT_OSS, BERT,
                                   NOMIC_BERT)

#: architecture names of encoders kvserve has no family for yet, with the task they would have:
#: the model manager sends them to the embedding runner, which reports them as unsupported
#: there (not as a generative model that fails to load)
KNOWN_ENCODERS_WITHOUT_FAMILY = {
    "XLMRobertaForSequenceClassification": "score",
    "RobertaModel": "embed", "XLMRobertaModel": "embed",
}


# -- derived tables --------------------------------------------------------------------------------

def _gguf_table() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in FAMILIES:
        for a in fam.gguf_archs:
            assert a not in out, f"GGUF architecture {a} in two families"
            out[a] = fam
    return out


def _hf_table() -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in FAMILIES:
        for a in fam.hf_archs:
            assert a not in out, f"HF architecture {a} in two families"
            out[a] = fam
    return out


#: GGUF ``general.architecture`` -> Family
GGUF_ARCHS: dict[str, Family] = _gguf_table()
#: HF ``architectures`` -> Family
HF_ARCHS: dict[str, Family] = _hf_table()
#: every architecture name (GGUF and HF) -> its task
ARCH_TASKS: dict[str, str] = {**{a: f.task for a, f in GGUF_ARCHS.items()},
                              **{a: t for f in FAMILIES for a, t in f.hf_archs.items()}}
#: every encoder name -> task: the families' and :data:`KNOWN_ENCODERS_WITHOUT_FAMILY`
ENCODER_TASKS: dict[str, str] = {**{a: t for a, t in ARCH_TASKS.items() if t != "generate"},
                                 **KNOWN_ENCODERS_WITHOUT_FAMILY}


def known_families(hf: bool = False) -> str:
    """The families kvserve runs with their architecture names, for error messages:
    "llama (llama, mistral, qwen2), bert (bert)"; ``hf``: with the HF class names instead."""
    return ", ".join(f"{f.name} ({', '.join(f.hf_archs if hf else f.gguf_archs)})" for f in FAMILIES)


def family_of(arch: str) -> Family:
    """The family of a loaded config's ``arch`` (a GGUF architecture name).

    Raises:
        ModelLoadError: an architecture no family reads.
    """
    fam = GGUF_ARCHS.get(arch)
    if fam is None:
        raise ModelLoadError(f"unknown model architecture '{arch}' (kvserve knows the families {known_families()})")
    return fam


def gguf_family(md: dict, path: str) -> Family:
    """The family of a GGUF file from its metadata.

    Raises:
        ModelLoadError: no ``general.architecture``, or one no family reads (the message names
            the families kvserve knows).
    """
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF has no general.architecture")
    fam = GGUF_ARCHS.get(arch)
    if fam is None:
        raise ModelLoadError(f"{path}: unknown model architecture '{arch}' "
                             f"(kvserve knows the families {known_families()})")
    return fam


def hf_family(cfg: dict, path: str) -> Family:
    """The family of an HF directory from its config.json (``architectures``, else ``model_type``).

    Raises:
        ModelLoadError: an architecture no family reads (the message names the HF classes kvserve
            knows).
    """
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in HF_ARCHS:
            return HF_ARCHS[a]
    if not archs:
        for fam in FAMILIES:
            if cfg.get("model_type") in fam.hf_model_types:
                return fam
    raise ModelLoadError(
        f"{path}: unknown model architecture {archs or cfg.get('model_type')!r} "
        f"(kvserve knows the families {known_families(hf=True)})"
    )


def hf_task(cfg: dict, path: str) -> str:
    """The task of an HF directory's config.json (its class's, else its family's).

    Raises ModelLoadError: an architecture no family reads."""
    fam = hf_family(cfg, path)
    for a in cfg.get("architectures") or []:
        if a in fam.hf_archs:
            return fam.hf_archs[a]
    return fam.task


def gguf_task(md: dict, tensor_names, path: str) -> str:
    """The task of a GGUF file from its metadata and tensor names; "generate" for an
    architecture no family reads (the loader reports it)."""
    fam = GGUF_ARCHS.get(md.get("general.architecture"))
    if fam is None:
        return "generate"
    if fam.score_tensor is not None and fam.score_tensor in set(tensor_names):
        return "score"
    return fam.task


def read_gguf_config(md: dict, path: str, shapes: dict | None = None):
    """The config of a GGUF file from its metadata (and tensor shapes, when given), by its family.

    Raises ModelLoadError: unknown architecture, missing key, an option the family lacks."""
    return gguf_family(md, path).config_from_gguf(md, path, shapes)


def read_hf_config(cfg: dict, path: str):
    """The config of an HF directory from its config.json, by its family.

    Raises ModelLoadError: unknown architecture, missing key, an option the family lacks."""
    return hf_family(cfg, path).config_from_hf(cfg, path)
