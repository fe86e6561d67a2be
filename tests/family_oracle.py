"""llama.cpp as the GGUF oracle of each model family: the cases, the sequences they are asked about,
and the deterministic rebuild of the exact GGUF llama-server ran on.

Each case is a tiny random transformers model (tests/family_models.py; the configs of
tests/unit/test_families.py, the family's options switched on) saved as an HF directory and converted
by llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype f32``; tests/reference/llama_families/
convert_tiny.py changes only the vocabulary step). ``regen.py`` there runs llama-server on that file
and stores its outputs with the file's metadata (every key and value) and the SHA-256 of every tensor.
CI has no llama.cpp: :func:`rebuild` writes the same file again from the fixture's metadata and the
tensors of tests/family_models.py's own writer (which writes llama.cpp's names and layouts; regen.py
checks it writes the converter's bytes, tensor by tensor), and the test checks the digests;
:func:`rebuild_q8_0` does the same for the ``llama-quantize --pure`` Q8_0 copies, :func:`rebuild_q4_k_m` for
the Q4_K_M copies of the wide models (llama-quantize's types, tests/tinymodel.py's blocks).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

import family_models as fmod

SEED = 11
#: case -> (transformers model_type, GGUF architecture, config options); the configs of
#: tests/unit/test_families.py (see the comments there) plus nomic-bert's (tests/unit/test_nomic_bert.py)
CASES = {
    "llama3-rope": ("llama", "llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 16},
                                            rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3moe": ("qwen3_moe", "qwen3moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "gemma2": ("gemma2", "gemma2", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                                        attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", "gemma3", dict(num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=16,
                                             rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                 "factor": 4.0, "rope_theta": 1e6},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}})),
    "mistral3": ("ministral3", "mistral3", dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                                                                 "original_max_position_embeddings": 8,
                                                                 "mscale": 1.0, "mscale_all_dim": 1.0,
                                                                 "llama_4_scaling_beta": 0.5},
                                                max_position_embeddings=512)),
    "phi3-longrope": ("phi3", "phi3", dict(max_position_embeddings=512, original_max_position_embeddings=8,
                                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5,
                                                            "original_max_position_embeddings": 8,
                                                            "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                            "long_factor": [1.0, 4.0, 9.0, 20.0]})),
    # llama.cpp disables phi3's sliding window ("Phi SWA is currently disabled"): kvserve honours it,
    # so the two agree only while a sequence fits in the window (see the test)
    "phi3-window": ("phi3", "phi3", dict(sliding_window=8)),
    # MXFP4 experts as the released checkpoints ship them (the converter repacks the blocks)
    "gpt-oss": ("gpt_oss", "gpt-oss", dict(num_hidden_layers=3, sliding_window=4, num_local_experts=8,
                                           num_experts_per_tok=4, max_position_embeddings=512,
                                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 128,
                                                            "beta_fast": 32.0, "beta_slow": 1.0})),
    "nomic-bert": ("nomic_bert", "nomic-bert", {}),
}
EMBED = ("nomic-bert",)
#: the widths of the Q4_K_M copies' models: K-quant rows are multiples of 256 values (the narrow
#: cases' 64 would leave llama-quantize nothing but fallback types); heads and head_dim unchanged, so
#: attn_output's rows (4 x 16) take llama-quantize's fallback type, as narrow heads do in real files
WIDE = dict(hidden_size=256, intermediate_size=512)


def wide_options(name: str) -> dict:
    """The case's config options with :data:`WIDE`'s widths (qwen3moe: experts of 256 too)."""
    cfg = {**CASES[name][2], **WIDE}
    if "moe_intermediate_size" in cfg:
        cfg["moe_intermediate_size"] = 256
    if CASES[name][0] == "phi3":  # transformers' phi3 takes head_dim = hidden / heads: keep it 16
        cfg["num_attention_heads"] = 16
    return cfg


def build_model(name: str, wide: bool = False):
    """The case's transformers model (experts rounded to MXFP4 values for gpt-oss); ``wide``: with
    :data:`WIDE`'s widths (the Q4_K_M copies)."""
    model_type, _, cfg = CASES[name]
    model = fmod.build(model_type, seed=SEED, **(wide_options(name) if wide else cfg))
    if model_type == "gpt_oss":
        fmod.round_experts_mxfp4(model)
    return model


def save_hf(name: str, path: Path, wide: bool = False) -> Path:
    """The case as the HF directory the converter reads (``wide``: :func:`build_model`'s)."""
    if name == "nomic-bert":
        return _nomic_original_config(fmod.write_tiny_nomic(Path(path), seed=3))
    model = build_model(name, wide)
    return (fmod.save_hf_mxfp4 if name == "gpt-oss" else fmod.save_hf)(model, Path(path))


def _nomic_original_config(path: Path) -> Path:
    """Add nomic's own config keys (the remote-code NomicBertConfig that nomic-embed-text ships, which
    llama.cpp's converter reads: it knows n_positions 8192 with 2048 trained positions) to
    transformers' config.json, and sentence-transformers' mean pooling files."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(n_embd=cfg["hidden_size"], n_head=cfg["num_attention_heads"], n_layer=cfg["num_hidden_layers"],
               n_inner=cfg["intermediate_size"], n_positions=8192, max_trained_positions=2048,
               rotary_emb_base=cfg["rope_parameters"]["rope_theta"], activation_function="swiglu", causal=False,
               qkv_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, rotary_emb_fraction=1.0,
               rotary_emb_interleaved=False, rotary_emb_scale_base=None, layer_norm_epsilon=cfg["layer_norm_eps"])
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    # sentence-transformers' mean pooling, as nomic-embed-text ships it (the converter's pooling_type)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": cfg["hidden_size"],
                                                                "pooling_mode_mean_tokens": True}))
    return path


def save_gguf_ours(name: str, path: Path, hf: Path | None = None, wide: bool = False) -> Path:
    """The case through tests/family_models.py's GGUF writer (the tensors :func:`rebuild` takes)."""
    if name == "nomic-bert":
        return fmod.write_nomic_gguf(hf or fmod.write_tiny_nomic(Path(path).with_suffix(".hf"), seed=3), Path(path))
    arch = CASES[name][1]
    return fmod.save_gguf(build_model(name, wide), Path(path), arch, expert_type="MXFP4" if arch == "gpt-oss" else "F32")


def tensor_digests(path) -> dict[str, str]:
    """{tensor name: "TYPE SHAPE sha256"} in file order."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: f"{t.tensor_type.name} {list(map(int, t.shape))} "
                    f"{hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()}" for t in r.tensors}


def metadata(path) -> list[list]:
    """Every key of a GGUF but ``general.architecture`` as [key, value type, array item type or None,
    value] (JSON: float32 values are exact as float64)."""
    import gguf

    out = []
    for f in gguf.GGUFReader(str(path)).fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[1]).name if vtype == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        out.append([f.name, vtype.name, sub, value])
    return out


def write_like(path: Path, arch: str, fields: list[list], source: Path, order=None) -> Path:
    """A GGUF of ``arch`` with the metadata ``fields`` (as :func:`metadata` lists them) and the tensors
    of the GGUF ``source`` (in ``order``, a list of names, or the source's), bytes unchanged."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(source)).tensors}
    w = gguf.GGUFWriter(str(path), arch)
    for key, vtype, sub, value in fields:
        w.add_key_value(key, value, gguf.GGUFValueType[vtype], None if sub is None else gguf.GGUFValueType[sub])
    for name in order or list(tensors):
        t = tensors[name]
        raw = gguf.GGMLQuantizationType(t.tensor_type)
        data = np.ascontiguousarray(t.data)
        if raw in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data.reshape(list(reversed([int(n) for n in t.shape]))))  # GGUFReader: ggml order
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def rebuild(fixture: dict, path: Path) -> Path:
    """The GGUF llama-server ran on: the fixture's metadata, the tensors of :func:`save_gguf_ours`
    in the fixture's order. Raises AssertionError where a tensor's digest differs from the fixture's."""
    path = Path(path)
    ours = save_gguf_ours(fixture["case"], path.with_suffix(".ours.gguf"), wide=fixture.get("wide", False))
    write_like(path, fixture["arch"], fixture["metadata"], ours, list(fixture["tensors"]))
    got = tensor_digests(path)
    assert got == fixture["tensors"], [k for k in fixture["tensors"] if got.get(k) != fixture["tensors"][k]]
    return path


#: the causal cases also checked as ``llama-quantize --pure`` Q8_0 copies and Q4_K_M copies of their wide
#: models (gpt-oss: see :data:`F32_EXPERTS`; nomic-bert: the embedding cases stay F32)
QUANTIZED = ("llama3-rope", "qwen3", "qwen3moe", "gemma2", "gemma3", "mistral3", "phi3-longrope")
#: cases whose own file keeps MXFP4 experts, which llama-quantize refuses to requantize: their Q8_0 copy
#: is made from the same model with F32 experts (the converter's output from an HF directory whose
#: experts are plain tensors, :func:`save_gguf_f32_experts`)
F32_EXPERTS = ("gpt-oss",)
#: every case with a Q8_0 copy (``fixture["q8_0"]``)
Q8_0_CASES = QUANTIZED + F32_EXPERTS


def save_hf_f32_experts(name: str, path: Path) -> Path:
    """The case's HF directory with its experts as plain float32 tensors (``mlp.experts.gate_up_proj``
    ...: the converter writes them as F32 with ``--outtype f32``), the same values as :func:`save_hf`'s
    MXFP4 blocks (:func:`build_model` rounds them to MXFP4 values)."""
    return fmod.save_hf(build_model(name), Path(path))


def save_gguf_f32_experts(name: str, path: Path) -> Path:
    """:func:`save_hf_f32_experts`'s model through tests/family_models.py's writer with F32 experts:
    the converter's tensors (regen.py checks it), the source of the Q8_0 copy of an
    :data:`F32_EXPERTS` case."""
    return fmod.save_gguf(build_model(name), Path(path), CASES[name][1], expert_type="F32")


def q8_0_source(name: str, f32: Path, tmp: Path) -> Path:
    """The F32 file a case's Q8_0 copy was quantized from: ``f32`` (the case's rebuilt file), or for
    an :data:`F32_EXPERTS` case the same model with F32 experts, written into ``tmp``."""
    if name in F32_EXPERTS:
        return save_gguf_f32_experts(name, Path(tmp) / f"{name}.f32-experts.gguf")
    return Path(f32)


def rebuild_q8_0(run: dict, f32: Path, path: Path) -> Path:
    """The Q8_0 copy llama-quantize made of the F32 file ``f32``: :func:`rebuild_quantized` (the
    ``gguf`` package's Q8_0 blocks are llama-quantize's bytes)."""
    return rebuild_quantized(run, f32, path)


def rebuild_quantized(run: dict, f32: Path, path: Path, check: bool = True) -> Path:
    """A quantized copy of the F32 file ``f32`` (:func:`rebuild`): the run's metadata, each tensor in
    the type the run records for it, its blocks made by tests/tinymodel.py's ``quantize`` (the
    ``gguf`` package's for Q8_0, Q5_0 ...; its own min/max packer for Q4_K and Q6_K, which the
    ``gguf`` package cannot write), the F32 ones as they are. Raises AssertionError where a digest
    differs from the run's."""
    import gguf

    import tinymodel

    src = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    w = gguf.GGUFWriter(str(path), run["arch"])
    for key, vtype, sub, value in run["metadata"]:
        w.add_key_value(key, value, gguf.GGUFValueType[vtype], None if sub is None else gguf.GGUFValueType[sub])
    for name, digest in run["tensors"].items():
        t = src[name]
        data = np.ascontiguousarray(t.data).reshape(list(reversed([int(n) for n in t.shape])))
        qtype = digest.split()[0]
        if qtype != "F32":
            q = tinymodel.quantize(data, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if check:
        got = tensor_digests(path)
        assert got == run["tensors"], [k for k in run["tensors"] if got.get(k) != run["tensors"][k]]
    return Path(path)


def rebuild_q4_k_m(run: dict, tmp: Path) -> Path:
    """The Q4_K_M copy of a case's wide model (``fixture["q4_k_m"]``): the wide F32 file
    (:func:`rebuild` of the run's ``f32`` part), then :func:`rebuild_quantized` with the types
    llama-quantize chose for Q4_K_M."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    f32 = rebuild({"case": run["case"], "arch": run["arch"], "wide": True, **run["f32"]}, tmp / f"{run['case']}.wide.gguf")
    return rebuild_quantized(run, f32, tmp / f"{run['case']}.q4_k_m.gguf")


def sequences() -> list[list[int]]:
    """4 fixed sequences of 72 ids (3..300: no control tokens), the teacher-forced positions."""
    rng = np.random.default_rng(3030)
    return [rng.integers(3, 301, 72).tolist() for _ in range(4)]


def prompts() -> list[list[int]]:
    """The greedy prompts: the sequences' first 8 ids and two short ones."""
    return [s[:8] for s in sequences()] + [[40, 41, 42], [100, 7, 7, 7, 7, 9]]


def fixture_path(reference: Path, name: str) -> Path:
    return Path(reference) / f"{name}.json"


def load_fixture(reference: Path, name: str) -> dict:
    return json.loads(fixture_path(reference, name).read_text())
