"""Tiny random models of the families kvserve runs, built with transformers (the reference forward)
and written twice: as an HF directory (``save_pretrained``) and as a GGUF with llama.cpp's names and
keys (the ``gguf`` package), the same weights in both.

The GGUF follows llama.cpp's ``convert_hf_to_gguf.py``: llama's q/k rows permuted to interleaved
RoPE pairs (``LlamaModel.permute``), qwen2/qwen3 left in the NEOX layout; llama 3's RoPE scaling
written as the ``rope_freqs.weight`` factors (``LlamaModel.generate_extra_tensors``) and not as a
``rope.scaling.type`` key. The tokenizer is tests/tinymodel.py's byte-level BPE (ids 0..300).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

import tinymodel

#: HF per-layer names -> llama.cpp's (the llama block and its variants)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.down_proj.bias": "ffn_down.bias",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3 (fused)
}

#: gemma's per-layer norm names (the 4 norms of its block)
GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}

N_VOCAB = len(tinymodel.tiny_vocab()[0])


def gguf_name(hf: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name of an HF name in a GGUF of ``arch``."""
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    idx, _, sub = hf[len("model.layers."):].partition(".")
    names = {**LAYER_NAMES, **GEMMA_NAMES} if arch.startswith("gemma") else LAYER_NAMES
    return f"blk.{idx}.{names[sub]}"


def build(model_type: str, seed: int = 0, **cfg):
    """A float32 transformers model of ``model_type`` ("llama", "qwen3", ...) with ``cfg`` over small
    defaults, weights drawn from ``seed``: matrices N(0, 0.2), embeddings N(0, 0.05), norms
    1 + N(0, 0.1), biases N(0, 0.05): the layers, not the (tied) embedding, decide the next token, so
    32 greedy tokens are varied (25-30 distinct ids) and no top-2 logit gap is below 1e-3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base.update(copy.deepcopy(cfg))  # transformers writes into the dicts it is given
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and model_type.startswith("gemma"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # gemma's norms multiply by (1 + w)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):  # gpt-oss: sinks that take a visible share of each softmax
                p.copy_(1.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("experts.gate_up_proj") and model_type == "gpt_oss":  # gpt-oss: ~10% of gate/up values past the clamp (7)
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            elif name.endswith("experts.down_proj") and model_type == "gpt_oss":
                p.copy_(0.03 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def save_hf(model, path: Path) -> Path:
    """``save_pretrained`` plus the tiny tokenizer (tokenizer.json, tokenizer_config.json)."""
    path = Path(path)
    model.save_pretrained(str(path))
    tinymodel.hf_tokenizer().save(str(path / "tokenizer.json"))
    tokens = tinymodel.tiny_vocab()[0]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": tokens[0], "eos_token": tokens[0], "unk_token": tokens[0],
        "pad_token": tokens[0], "add_bos_token": False, "add_eos_token": False, "model_max_length": 512,
        "chat_template": tinymodel.CHATML_TEMPLATE}))
    return path


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` for a llama3 ``rope_parameters`` ([head_dim/2] float32)."""
    rp = config.rope_parameters
    base, dim = rp["rope_theta"], config.head_dim
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def save_gguf(model, path: Path, arch: str, expert_type: str = "F32", chat_template: str | None = None) -> Path:
    """The same model as a GGUF of ``general.architecture = arch`` (F32 tensors, llama.cpp's names;
    the experts as ``expert_type`` blocks when asked: "MXFP4" for gpt-oss (see
    :func:`round_experts_mxfp4`), "F16" for qwen3moe)."""
    import gguf

    c = model.config
    path = Path(path)
    tokens, types, merges = tinymodel.tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("kvserve family test model")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    rp = c.rope_parameters.get("full_attention", c.rope_parameters)  # gemma3: one RoPE per layer type
    w.add_rope_dimension_count(int(c.head_dim * rp.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template or tinymodel.CHATML_TEMPLATE)
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        if getattr(c, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if getattr(c, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    elif rp.get("rope_type") == "yarn":  # llama.cpp's converter: the type, factor, original context, betas
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        if rp.get("beta_fast"):
            w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        if rp.get("beta_slow"):
            w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
        if rp.get("llama_4_scaling_beta"):  # mistral3's query temperature
            w.add_attn_temperature_scale(float(rp["llama_4_scaling_beta"]))
        if arch == "mistral3" and rp.get("mscale_all_dim") is not None:  # the converter's Ministral3Model
            w.add_rope_scaling_yarn_log_mul(float(rp["mscale_all_dim"]))
    if arch == "phi3":  # llama.cpp's Phi3MiniModel: 0 for no window
        w.add_sliding_window(int(getattr(c, "sliding_window", None) or 0))
    if rp.get("rope_type") == "longrope":  # llama.cpp's Phi3MiniModel: factor tensors, attn_factor key
        orig = rp.get("original_max_position_embeddings") or c.original_max_position_embeddings
        scale = c.max_position_embeddings / orig
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        w.add_rope_scaling_orig_ctx_len(orig)
    elif rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    if getattr(c, "num_experts_per_tok", None):
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", c.intermediate_size))
    if arch == "gpt-oss":
        w.add_sliding_window(c.sliding_window)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.detach().float().numpy().copy()
        if arch == "gpt-oss":
            for g, arr in gpt_oss_tensors(name, data):
                if expert_type == "MXFP4" and g.endswith("_exps.weight"):
                    w.add_tensor(g, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.MXFP4),
                                 raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                else:
                    w.add_tensor(g, np.ascontiguousarray(arr))
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's fused experts [E, 2I, H]
            p = name[:-len("mlp.experts.gate_up_proj")].replace("model.layers.", "blk.")
            half = data.shape[1] // 2
            ex = np.float16 if expert_type == "F16" else np.float32
            w.add_tensor(p + "ffn_gate_exps.weight", np.ascontiguousarray(data[:, :half], dtype=ex))
            w.add_tensor(p + "ffn_up_exps.weight", np.ascontiguousarray(data[:, half:], dtype=ex))
            continue
        if name.endswith("mlp.experts.down_proj"):
            w.add_tensor(name[:-len("mlp.experts.down_proj")].replace("model.layers.", "blk.") + "ffn_down_exps.weight",
                         np.ascontiguousarray(data, dtype=np.float16 if expert_type == "F16" else np.float32))
            continue
        if name.endswith("mlp.gate.weight"):
            w.add_tensor(name[:-len("mlp.gate.weight")].replace("model.layers.", "blk.") + "ffn_gate_inp.weight", data)
            continue
        g = gguf_name(name, arch)
        if arch.startswith("gemma") and g.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's converter stores gemma's (1 + w)
        if arch in ("llama", "mistral", "mistral3") and g.endswith(("attn_q.weight", "attn_q.bias")):
            data = tinymodel.permute_qk(data, c.num_attention_heads)
        elif arch in ("llama", "mistral", "mistral3") and g.endswith(("attn_k.weight", "attn_k.bias")):
            data = tinymodel.permute_qk(data, c.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GPT_OSS_NAMES = {
    "self_attn.sinks": "attn_sinks.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}


def gpt_oss_tensors(name: str, data: np.ndarray):
    """(llama.cpp name, array) pairs of one transformers gpt-oss tensor, as llama.cpp's converter
    writes an unquantized checkpoint: gate_up [E, H, 2I] transposed and cut into its even (gate) and
    odd (up) rows, down [E, I, H] transposed, the fused bias cut the same way; q/k left NEOX."""
    if not name.startswith("model.layers."):
        return [(gguf_name(name), data)]
    idx, _, sub = name[len("model.layers."):].partition(".")
    p = f"blk.{idx}."
    if sub == "mlp.experts.gate_up_proj":
        t = data.transpose(0, 2, 1)
        return [(p + "ffn_gate_exps.weight", t[:, ::2]), (p + "ffn_up_exps.weight", t[:, 1::2])]
    if sub == "mlp.experts.gate_up_proj_bias":
        return [(p + "ffn_gate_exps.bias", data[:, ::2]), (p + "ffn_up_exps.bias", data[:, 1::2])]
    if sub == "mlp.experts.down_proj":
        return [(p + "ffn_down_exps.weight", data.transpose(0, 2, 1))]
    if sub in GPT_OSS_NAMES:
        return [(p + GPT_OSS_NAMES[sub], data)]
    return [(gguf_name(name), data)]


def round_experts_mxfp4(model) -> None:
    """Replace a transformers gpt-oss model's expert matrices by their MXFP4 values (blocks of 32
    along each GGUF row, the gguf package's quantizer), so a GGUF with MXFP4 experts holds exactly
    the reference's weights."""
    import gguf

    def rt(a: np.ndarray) -> np.ndarray:
        q = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.MXFP4)
        return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(a.shape)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                t = p.detach().float().numpy().transpose(0, 2, 1)  # GGUF rows: [E, out, in]
                p.copy_(torch.from_numpy(np.ascontiguousarray(rt(t).transpose(0, 2, 1))))


def ggml_mxfp4_to_openai(blocks: np.ndarray) -> np.ndarray:
    """ggml MXFP4 blocks (uint8 [..., 17 * n]: byte j of a block holds elements j and j + 16) in the
    checkpoint's order Ollama's ``gptoss`` files keep (byte k holds elements 2k and 2k + 1)."""
    b = np.asarray(blocks).reshape(-1, 17)
    e = np.concatenate([b[:, 1:] & 0x0F, b[:, 1:] >> 4], axis=1)  # [n, 32] element nibbles in order
    out = b.copy()
    out[:, 1:] = e[:, 0::2] | (e[:, 1::2] << 4)
    return out.reshape(blocks.shape)


def save_ollama_gptoss(model, path: Path) -> Path:
    """A transformers gpt-oss model (experts already MXFP4 values: :func:`round_experts_mxfp4`) as
    Ollama's converter wrote it: ``general.architecture = gptoss``, ``gptoss.*`` keys without a
    ``rope.scaling.type`` (YaRN implied), HF-flavoured names (``attn_out``, ``attn_sinks``,
    ``ffn_norm``, ``ffn_gate_inp``), gate and up fused and alternating by row
    (``ffn_gate_up_exps``), the expert matrices as ggml type 4 (MXFP4 blocks in the checkpoint's
    nibble order)."""
    import gguf

    c = model.config
    rp = c.rope_parameters
    tokens, types, merges = tinymodel.tiny_vocab()
    w = gguf.GGUFWriter(str(path), "gptoss")
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("expert_count", c.num_local_experts), ("expert_used_count", c.num_experts_per_tok),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("attention.key_length", c.head_dim),
                       ("attention.value_length", c.head_dim), ("attention.sliding_window", c.sliding_window),
                       ("rope.scaling.original_context_length", rp["original_max_position_embeddings"])):
        w.add_uint32(f"gptoss.{key}", int(value))
    for key, value in (("attention.layer_norm_rms_epsilon", c.rms_norm_eps), ("rope.freq_base", rp["rope_theta"]),
                       ("rope.scaling.factor", rp["factor"])):
        w.add_float32(f"gptoss.{key}", float(value))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    names = {"self_attn.o_proj": "attn_out", "self_attn.sinks": "attn_sinks",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.router": "ffn_gate_inp",
             "mlp.experts.gate_up_proj_bias": "ffn_gate_up_exps.bias",
             "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    packed = []
    for name, t in model.state_dict().items():
        data = t.detach().float().numpy().copy()
        if not name.startswith("model.layers."):
            w.add_tensor(gguf_name(name), data)
            continue
        idx, _, sub = name[len("model.layers."):].partition(".")
        p = f"blk.{idx}."
        if sub in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            rows = np.ascontiguousarray(data.transpose(0, 2, 1))  # [E, out, in]; gate/up alternate by row
            q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)
            g = p + ("ffn_gate_up_exps.weight" if "gate_up" in sub else "ffn_down_exps.weight")
            w.add_tensor(g, ggml_mxfp4_to_openai(q), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            packed.append(g)
            continue
        for hf, ollama in names.items():
            if sub.startswith(hf):
                sub = ollama + sub[len(hf):]
                break
        else:
            sub = LAYER_NAMES.get(sub, sub)
        w.add_tensor(p + sub, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _retype(Path(path), packed, 39, 4)
    return Path(path)


def save_hf_mxfp4(model, path: Path) -> Path:
    """A transformers gpt-oss model (experts already MXFP4 values: :func:`round_experts_mxfp4`) as the
    released checkpoints are: ``quantization_config`` ``{"quant_method": "mxfp4"}``, each expert matrix
    as uint8 ``*_blocks`` [E, out, in / 32, 16] (the checkpoint's nibble order) and e8m0 ``*_scales``
    [E, out, in / 32], gate and up alternating by row."""
    import gguf
    from safetensors.torch import save_file

    path = save_hf(model, path)
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = np.ascontiguousarray(t.detach().float().numpy().transpose(0, 2, 1))  # [E, out, in]
            q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)
            e, out = rows.shape[:2]
            q = ggml_mxfp4_to_openai(q).reshape(e, out, -1, 17)
            state[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(q[..., 1:]))
            state[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
        else:
            state[name] = t.detach().contiguous()
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _retype(path: Path, names: list[str], old: int, new: int) -> None:
    """Rewrite the ggml type of tensors ``names`` in a GGUF's tensor table from ``old`` to ``new``."""
    import struct

    buf = bytearray(path.read_bytes())
    for name in names:
        key = struct.pack("<Q", len(name)) + name.encode()
        pos = buf.index(key) + len(key)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        at = pos + 4 + 8 * n_dims
        assert struct.unpack_from("<I", buf, at)[0] == old
        struct.pack_into("<I", buf, at, new)
    path.write_bytes(bytes(buf))


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(ids), vocab] for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_greedy(model, ids: list[int], n: int, banned=()) -> list[int]:
    """transformers' greedy continuation of ``ids``: ``n`` token ids, never one of ``banned`` (the
    end-of-generation ids ``ignore_eos`` bans, as llama-server does); each step runs the whole
    sequence again: the reference needs no cache."""
    seq = list(ids)
    for _ in range(n):
        logits = reference_logits(model, seq)[-1]
        logits[list(banned)] = float("-inf")
        seq.append(int(logits.argmax()))
    return seq[len(ids):]


def write_tiny_nomic(path: Path, seed: int = 0) -> Path:
    """A random-weight 2-layer transformers NomicBertModel (rope base 1000 as nomic-embed-text) saved
    with the tiny WordPiece tokenizer; weights widened so outputs are far from the init's."""
    from transformers import NomicBertConfig, NomicBertModel

    from embed_conftest import TINY_WORDS, bert_tokenizer_json

    torch.manual_seed(seed)
    cfg = NomicBertConfig(vocab_size=5 + len(TINY_WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    model = NomicBertModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name.lower() or "embed" in name else 0.3))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(bert_tokenizer_json(list(TINY_WORDS))))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]", "do_lower_case": True, "tokenizer_class": "BertTokenizer"}))
    return path


def write_nomic_gguf(src: Path, out: Path) -> Path:
    """The tiny model as llama.cpp's converter writes a nomic-bert: gguf-py's NOMIC_BERT name map over
    the directory's names (transformers 5 saves nomic's original ones: ``encoder.layers.N.attn.Wqkv``,
    ``mlp.fc11``...), mean pooling, rope base, the WordPiece vocabulary with the U+2581 phantom space."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t.startswith("[") and t.endswith("]") else 1 for t in tokens]
    tokens = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t
              for t in tokens]
    n_layer = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "nomic-bert")
    w.add_block_count(n_layer)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_file_type(0)
    w.add_token_type_count(cfg["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(vocab["[CLS]"])
    w.add_sep_token_id(vocab["[SEP]"])
    w.add_pad_token_id(vocab["[PAD]"])
    w.add_unk_token_id(vocab["[UNK]"])
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, n_layer)
    for name, t in load_file(str(src / "model.safetensors")).items():
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
