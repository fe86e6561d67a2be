"""vLLM's start-up checks and messages (002 Examples 2, 3, 4 and 6; issue #15 item 4).

Models: a header-only HF directory with Llama 3.1 8B's config (32 layers, 8 KV heads of 128,
max_position_embeddings 131072, 128 KiB of f16 KV per token: the examples' exact numbers; the
checks refuse it before any weight is read), tiny random models for starts that succeed
(2 layers, 2 KV heads of 16: 256 bytes per token, so the examples' budgets divided by 512 give
the examples' token counts and concurrency), and HF directories with a quantization_config.

The start-up path is run in process (``load_runner`` with ``parse_args``' ServerArgs), and for
one case of each example as a ``kvserve serve`` process (its exit status and log).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.engine.kv_budget import (
    KVCacheMemoryError,
    cuda_budget_bytes,
    plan_engine_pool,
    plan_pool,
)
from kvserve.loaders.weights import ModelLoadError
from kvserve.serving.args import parse_args
from kvserve.serving.manager import ModelSpec
from kvserve.serving.chat_runner import load_runner
from kvserve.serving.startup_checks import (
    LONG_MAX_MODEL_LEN_WARNING,
    StartupCheckError,
    batch_warning,
    read_header,
    resolve_dtype,
)

REPO = Path(__file__).resolve().parents[2]
MIB, GIB = 1 << 20, 1 << 30

EX2_LEN_ERROR = ("User-specified max_model_len (200000) is greater than the derived max_model_len "
                 "(max_position_embeddings=131072 or model_max_length=None in model's config.json). To allow "
                 "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
                 "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
                 "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses "
                 "absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA array "
                 "out-of-bounds error.")
EX2_KV_ERROR = ("To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
                "which is larger than the available KV cache memory (5.26 GiB). Based on the available memory, the "
                "estimated maximum model length is 43056.")
EX4_ERROR = "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)."
EX4_WARNING = ("max_num_batched_tokens (8192) exceeds max_num_seqs * max_model_len (4096). This may lead to "
               "unexpected behavior.")
EX6_MISMATCH = ("Quantization method specified in the model config (awq) does not match the quantization method "
                "specified in the `quantization` argument (gptq).")
EX3_DEFAULT = "KV cache size: 43,056 tokens, Maximum concurrency for 32,768 tokens per request: 1.31x"

#: Example 2/3's budget at --gpu-memory-utilization 0.92 and 0.80 (24,564 MiB card; 15,316 MiB of
#: weights + 400 MiB other in use, 1,500 MiB activation peak)
EX3_AT_92 = int(24_564 * MIB * 0.92) - 17_216 * MIB
EX3_AT_80 = int(24_564 * MIB * 0.80) - 17_216 * MIB
#: the tiny models' KV bytes per token (2 layers x 2 KV heads x 16 x (K+V) x 2 bytes) over Llama 3.1 8B's
SCALE = 131072 // 256


def _llama8b_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "vocab_size": 128256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


@pytest.fixture(scope="module")
def llama8b_dir(tmp_path_factory) -> str:
    """config.json of Llama 3.1 8B and an empty weights file: detection (kvserve.loaders.detect) sees an HF
    safetensors folder, and a start that passes every check would fail reading the weights."""
    d = tmp_path_factory.mktemp("llama8b")
    (d / "config.json").write_text(json.dumps(_llama8b_config()))
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


def _quant_dir(root: Path, name: str, quant: dict | None, torch_dtype: str = "float16") -> str:
    cfg = dict(_llama8b_config(), torch_dtype=torch_dtype)
    if quant is not None:
        cfg["quantization_config"] = quant
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"")  # see llama8b_dir
    return str(d)


@pytest.fixture(scope="module")
def tiny_long_gguf(tmp_path_factory) -> str:
    """The tiny random GGUF with a 131072-token training context (256 bytes of f16 KV per token)."""
    import tinymodel

    return str(tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("tinylong") / "tiny.gguf", ctx=131072))


def _start(argv: list[str], path: str, env: dict | None = None):
    """The start-up path in process: parse_args, then load_runner (a Runner; close it)."""
    args = parse_args(["-m", path, "--device", "cpu", "--cache-ram", "0", *argv], environ=env or {})
    return load_runner(args, ModelSpec("m", path), "test")


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


# -- Example 2: --max-model-len against the model, and the KV memory check ---------------------

def test_max_model_len_above_the_model_is_vllms_error(llama8b_dir):
    with pytest.raises(StartupCheckError) as e:
        _start(["--max-model-len", "200000"], llama8b_dir)
    assert str(e.value) == EX2_LEN_ERROR


def test_max_model_len_forms_parse():
    got = [parse_args(["--max-model-len", v], environ={}).max_model_len
           for v in ("32768", "32k", "32K", "1m", "auto", "-1")]
    assert got == [32768, 32000, 32768, 1000000, 0, 0]


def test_allow_long_max_model_len_warns_and_grows_the_context(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--max-model-len", "1024"], tiny_gguf, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    try:
        assert runner.engine.n_ctx_slot == 1024
    finally:
        runner.close()
    assert ("User-specified max_model_len (1024) is greater than the derived max_model_len "
            f"(llama.context_length=512 in the model's GGUF metadata). {LONG_MAX_MODEL_LEN_WARNING}") in _messages(caplog)


def test_gguf_max_model_len_error_names_context_length(tiny_gguf):
    with pytest.raises(StartupCheckError) as e:
        _start(["--max-model-len", "1024"], tiny_gguf)
    assert str(e.value).startswith("User-specified max_model_len (1024) is greater than the derived max_model_len "
                                   "(llama.context_length=512 in the model's GGUF metadata). To allow overriding "
                                   "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")


def test_ctx_size_above_the_model_keeps_llama_servers_warning(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["-c", "1024", "-np", "1"], tiny_gguf)
    try:
        assert runner.engine.n_ctx_slot == 1024
    finally:
        runner.close()
    assert "n_ctx_seq (1024) > n_ctx_train (512) -- possible training context overflow" in _messages(caplog)


def test_kv_budget_below_one_request_is_vllms_error(llama8b_dir):
    with pytest.raises(KVCacheMemoryError) as e:  # the default max_model_len: the model's 131072
        _start(["--kv-cache-memory-bytes", "5383M"], llama8b_dir)
    assert str(e.value) == (EX2_KV_ERROR + " Try increasing `kv_cache_memory_bytes` or decreasing `max_model_len` "
                            "when initializing the engine.")


def test_example2_arithmetic_at_gpu_memory_utilization_092():
    # the 24 GB card of Example 2: 2 MiB per 16-token block, the CUDA budget rule
    budget = cuda_budget_bytes(0.92, 24_564 * MIB, 24_564 * MIB - 15_716 * MIB, 1_500 * MIB)
    assert budget == EX3_AT_92
    with pytest.raises(KVCacheMemoryError) as e:
        plan_pool(n_ctx=131072, n_ctx_slot=131072, n_slots=4, block_size=16, block_bytes=2 * MIB,
                  budget_bytes=budget, source="--gpu-memory-utilization")
    assert str(e.value) == (EX2_KV_ERROR + " Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
                            "when initializing the engine.")


# -- Example 3: the KV budget and its log lines ---------------------------------------------------

def test_example3_lines_for_the_three_settings():
    def plan(budget):
        return plan_pool(n_ctx=131072, n_ctx_slot=32768, n_slots=4, block_size=16, block_bytes=2 * MIB,
                         budget_bytes=budget, source="--kv-cache-memory-bytes")

    assert plan(EX3_AT_92).lines("cuda") == [
        "Available KV cache memory: 5.26 GiB",
        "GPU KV cache size: 43,056 tokens, Maximum concurrency for 32,768 tokens per request: 1.31x"]
    assert plan(4 * GIB).lines("cuda") == [
        "Available KV cache memory: 4.0 GiB",
        "GPU KV cache size: 32,768 tokens, Maximum concurrency for 32,768 tokens per request: 1.00x"]
    with pytest.raises(KVCacheMemoryError) as e:  # 0.80: 19,472 tokens, 0.59x: vLLM refuses to start
        plan(EX3_AT_80)
    assert str(e.value).startswith(
        "To serve at least one request with the model's max seq len (32768), (4.0 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (2.38 GiB). Based on the available memory, the estimated maximum "
        "model length is 19472.")


def test_example3_at_080_refuses_the_8b_model_at_32k(llama8b_dir):
    with pytest.raises(KVCacheMemoryError) as e:
        _start(["--kv-cache-memory-bytes", str(EX3_AT_80), "--max-model-len", "32768"], llama8b_dir)
    assert "(4.0 GiB KV cache is needed, which is larger than the available KV cache memory (2.38 GiB). Based on " \
           "the available memory, the estimated maximum model length is 19472." in str(e.value)


def test_kv_cache_memory_bytes_sizes_the_pool(tiny_long_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--kv-cache-memory-bytes", str(EX3_AT_92 // SCALE), "--max-model-len", "32768"], tiny_long_gguf)
    try:
        core = runner.engine.core
        assert core.pool.active_blocks == 2691
        assert core.kv.num_blocks == 1 + 2691  # the null block; no host tier (--cache-ram 0)
        assert core.n_ctx_slot == 32768
    finally:
        runner.close()
    msgs = _messages(caplog)
    assert "Available KV cache memory: 0.01 GiB" in msgs
    assert "CPU " + EX3_DEFAULT in msgs


def test_kv_cache_memory_bytes_4g_scaled_is_one_full_request(tiny_long_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "32K"], tiny_long_gguf)
    runner.close()
    assert "CPU KV cache size: 32,768 tokens, Maximum concurrency for 32,768 tokens per request: 1.00x" in \
        _messages(caplog)


def test_vllm_cpu_kvcache_space_is_the_cpu_budget(tiny_long_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--max-model-len", "32768"], tiny_long_gguf, env={"VLLM_CPU_KVCACHE_SPACE": "0.01"})
    try:
        assert runner.engine.core.pool.active_blocks == int(0.01 * GIB) // 4096 == 2621
    finally:
        runner.close()
    assert "CPU KV cache size: 41,936 tokens, Maximum concurrency for 32,768 tokens per request: 1.28x" in \
        _messages(caplog)


def test_vllm_cpu_kvcache_space_bad_value_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([], environ={"VLLM_CPU_KVCACHE_SPACE": "lots"})
    assert e.value.code == 2
    assert 'error while handling environment variable "VLLM_CPU_KVCACHE_SPACE"' in capsys.readouterr().err


def test_without_a_budget_the_pool_is_llama_servers_and_logged(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["-c", "512", "-np", "2"], tiny_gguf)  # 512 tokens in 32 blocks + one per slot
    try:
        assert runner.engine.core.pool.active_blocks == 32 + 2
        assert runner.engine.core.pool.budget_bytes is None
    finally:
        runner.close()
    msgs = _messages(caplog)
    assert "CPU KV cache size: 544 tokens, Maximum concurrency for 256 tokens per request: 2.12x" in msgs
    assert not any(m.startswith("Available KV cache memory") for m in msgs)


def test_num_gpu_blocks_override_sets_the_pool(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--num-gpu-blocks-override", "100"], tiny_gguf)
    try:
        assert runner.engine.core.kv.num_blocks == 1 + 100
    finally:
        runner.close()
    msgs = _messages(caplog)
    assert "Overriding num_gpu_blocks=36 with num_gpu_blocks_override=100" in msgs
    assert "CPU KV cache size: 1,600 tokens, Maximum concurrency for 512 tokens per request: 3.12x" in msgs


def test_num_gpu_blocks_override_below_one_request_is_refused(tiny_gguf):
    with pytest.raises(KVCacheMemoryError) as e:
        _start(["--num-gpu-blocks-override", "10"], tiny_gguf)
    assert str(e.value) == ("To serve at least one request with the model's max seq len (512), (0.0 GiB KV cache is "
                            "needed, which is larger than the available KV cache memory (0.0 GiB). Based on the "
                            "available memory, the estimated maximum model length is 160. Try increasing "
                            "`num_gpu_blocks_override` or decreasing `max_model_len` when initializing the engine.")


def test_gpu_memory_utilization_budget_on_cuda_from_free_memory():
    from kvserve.config import EngineConfig
    from kvserve.loaders.weights import ModelConfig

    cfg = EngineConfig(gpu_memory_utilization=0.92, max_num_batched_tokens=2048, n_parallel=4)
    mc = ModelConfig("llama", 32, 4096, 32, 8, 14336, 128256, 128, 131072)
    activation = 4 * (2048 * (8 * 4096 + 3 * 14336) + 4 * 128256)
    used = 15_716 * MIB
    plan = plan_engine_pool(cfg, mc, n_ctx=131072, n_ctx_slot=32768, n_slots=4, block_bytes=2 * MIB,
                            device_type="cuda", mem_get_info=lambda: (24_564 * MIB - used, 24_564 * MIB))
    assert plan.budget_bytes == int(24_564 * MIB * 0.92) - used - activation
    assert plan.active_blocks == plan.budget_bytes // (2 * MIB) == 3144  # below 4 x 2048: not capped
    assert plan.capped_from is None
    one = plan_engine_pool(cfg, mc, n_ctx=131072, n_ctx_slot=32768, n_slots=1, block_bytes=2 * MIB,
                           device_type="cuda", mem_get_info=lambda: (24_564 * MIB - used, 24_564 * MIB))
    assert (one.active_blocks, one.capped_from) == (2048, 3145)  # one sequence uses 2048 blocks at most
    assert plan.source == "--gpu-memory-utilization"
    cpu = plan_engine_pool(cfg, mc, n_ctx=131072, n_ctx_slot=32768, n_slots=1, block_bytes=2 * MIB,
                           device_type="cpu")  # no effect on the CPU: llama-server's sizing
    assert (cpu.budget_bytes, cpu.active_blocks) == (None, 8192 + 1)


def test_gpu_memory_utilization_on_cpu_says_it_has_no_effect(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    _start(["--gpu-memory-utilization", "0.5"], tiny_gguf).close()
    assert ("flag --gpu-memory-utilization: no effect on the CPU: the KV budget there is --kv-cache-memory-bytes or "
            "VLLM_CPU_KVCACHE_SPACE (GiB)") in _messages(caplog)


def test_kv_cache_memory_bytes_forms():
    got = [parse_args(["--kv-cache-memory-bytes", v], environ={}).kv_cache_memory_bytes
           for v in ("4G", "4GiB", "4GB", "4g", "512MiB", "4294967296")]
    assert got == [4 * GIB, 4 * GIB, 4 * 10**9, 4 * 10**9, 512 * MIB, 4 * GIB]


# -- Example 4: --max-num-seqs and --max-num-batched-tokens ---------------------------------------

def test_batched_tokens_below_seqs_is_vllms_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--max-num-batched-tokens", "256", "--max-num-seqs", "512"], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: {EX4_ERROR}\n")


def test_batched_tokens_above_seqs_times_len_warns(tiny_long_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["--max-model-len", "4096", "--max-num-seqs", "1", "--max-num-batched-tokens", "8192"],
                    tiny_long_gguf)
    runner.close()
    assert EX4_WARNING in _messages(caplog)


def test_batch_warning_default_pair_passes():
    assert batch_warning(2048, 256, 32768) is None
    assert batch_warning(8192, 1, 4096) == EX4_WARNING


def test_llama_server_batch_flags_are_not_checked():
    args = parse_args(["-b", "2", "-np", "4"], environ={})  # llama-server's -b below -np: as before
    assert (args.batch_size, args.parallel, args.vllm_batch_limits) == (2, 4, False)


# -- Example 6: quantization_config, -q and --dtype ------------------------------------------------

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def test_quantization_mismatch_is_vllms_error(tmp_path):
    path = _quant_dir(tmp_path, "awq", AWQ)
    with pytest.raises(StartupCheckError) as e:
        _start(["-q", "gptq"], path)
    assert str(e.value) == EX6_MISMATCH


def test_quantized_checkpoint_kvserve_cannot_run_is_named(tmp_path):
    cases = [({"quant_method": "bitsandbytes", "load_in_4bit": True},
              "the model's config.json has a quantization_config (quant_method 'bitsandbytes'), which kvserve cannot "
              "run (it runs awq, gptq, compressed-tensors, fp8 checkpoints and GGUF files)"),
             (dict(AWQ, version="gemv"), "AWQ checkpoint with version 'gemv' (gemm) is not supported"),
             ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ checkpoint with bits 3 (4 or 8) is not "
              "supported")]
    for i, (quant, text) in enumerate(cases):
        path = _quant_dir(tmp_path, f"q{i}", quant)
        with pytest.raises(StartupCheckError) as e:
            _start([], path)
        assert str(e.value) == f"{path}: {text}"


def test_quantized_checkpoint_kvserve_runs_passes_the_checks(tmp_path, caplog):
    """An AWQ config passes the quantization check (with -q awq and its kernel variant too) and
    start-up goes on to read the weights, which this directory lacks."""
    path = _quant_dir(tmp_path, "awq", AWQ)
    caplog.set_level(logging.INFO)
    for argv in ([], ["-q", "awq"], ["-q", "awq_marlin"]):
        with pytest.raises(ModelLoadError) as e:
            _start(argv, path)
        assert not isinstance(e.value, StartupCheckError)
        assert "quantization: awq (from config.json), weights AWQ-INT4" in _messages(caplog)


def test_gguf_is_method_gguf(tiny_gguf):
    with pytest.raises(StartupCheckError) as e:
        _start(["-q", "awq"], tiny_gguf)
    assert str(e.value) == ("Quantization method specified in the model config (gguf) does not match the "
                            "quantization method specified in the `quantization` argument (awq).")
    _start(["-q", "gguf"], tiny_gguf).close()


def test_online_quantization_warns_and_serves_as_stored(tmp_path, caplog):
    import tinymodel

    path = str(tinymodel.write_tiny_hf_dir(tmp_path / "bf16", torch_dtype="bfloat16"))
    caplog.set_level(logging.INFO)
    _start(["-q", "fp8"], path).close()
    msgs = _messages(caplog)
    assert ("flag -q fp8: ignored, not available in kvserve: weights are not quantized while loading; they are "
            "served as stored (bfloat16 safetensors)") in msgs
    assert "Upcasting torch.bfloat16 to torch.float32." in msgs  # --dtype auto on the CPU computes in float32
    with pytest.raises(StartupCheckError) as e:
        _start(["-q", "awq"], path)
    assert str(e.value).startswith("-q awq: the model's config.json has no quantization_config: its weights are not "
                                   "awq-quantized")


def test_unknown_quantization_name_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["-q", "int3"], environ={})
    assert e.value.code == 2
    assert "Unknown quantization method: int3. Must be one of ['awq', " in capsys.readouterr().err


@pytest.mark.parametrize(("torch_dtype", "device", "expected"), [
    ("float16", "cuda", ("float16", [])),
    ("float32", "cuda", ("float16", [(logging.INFO, "Downcasting torch.float32 to torch.float16.")])),
    ("bfloat16", "cuda", ("bfloat16", [])),
    ("bfloat16", "cpu", ("auto", [(logging.INFO, "Upcasting torch.bfloat16 to torch.float32.")])),
    ("float32", "cpu", ("auto", [])),
])
def test_dtype_auto_rule(tmp_path, torch_dtype, device, expected):
    h = read_header(_quant_dir(tmp_path, torch_dtype, None, torch_dtype))
    assert resolve_dtype("auto", h, device) == expected


def test_explicit_dtype_gets_vllms_casting_line(tmp_path, tiny_gguf):
    h = read_header(_quant_dir(tmp_path, "bf", None, "bfloat16"))
    assert resolve_dtype("float16", h, "cuda") == ("float16", [(logging.WARNING, ("Casting torch.bfloat16 to "
                                                                                 "torch.float16."))])
    assert resolve_dtype("auto", read_header(tiny_gguf), "cuda") == ("auto", [])  # GGUF: kvserve's bfloat16


# -- the server process: one case per example ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``kvserve serve`` that must exit by itself (a failed start-up); its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "VLLM_"))}
    env.update(PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "kvserve", "serve", "--port", str(_free_port()), "--device", "cpu",
                           *argv], check=False, capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def test_server_refuses_example2_and_6(llama8b_dir, tmp_path):
    r = _serve(["-m", llama8b_dir, "--max-model-len", "200000"])
    assert r.returncode == 1
    assert EX2_LEN_ERROR in r.stderr and "Traceback" not in r.stderr
    r = _serve(["-m", llama8b_dir, "--kv-cache-memory-bytes", "5383M"])
    assert r.returncode == 1
    assert EX2_KV_ERROR in r.stderr and "Traceback" not in r.stderr
    r = _serve(["-m", _quant_dir(tmp_path, "awq", AWQ), "-q", "gptq"])
    assert r.returncode == 1
    assert EX6_MISMATCH in r.stderr and "Traceback" not in r.stderr


def test_server_refuses_example4():
    r = _serve(["--max-num-batched-tokens", "256", "--max-num-seqs", "512"])
    assert r.returncode == 2
    assert r.stderr.endswith(f"error: {EX4_ERROR}\n")


def test_server_serves_with_example3s_budget(tiny_long_gguf, tmp_path):
    import httpx

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "VLLM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", tiny_long_gguf, "--port", str(port),
                                 "--device", "cpu", "--cache-ram", "0", "--max-model-len", "32768",
                                 "--kv-cache-memory-bytes", str(EX3_AT_92 // SCALE)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        import time

        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        text = log.read_text(errors="replace")
        assert "Available KV cache memory: 0.01 GiB" in text
        assert "CPU " + EX3_DEFAULT in text
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 15)
            proc.wait(timeout=30)


def test_memory_estimate_counts_the_kv_budget(tiny_long_gguf):
    from kvserve.serving.chat_runner import estimate_runner_memory

    spec = ModelSpec("m", tiny_long_gguf)
    plain = estimate_runner_memory(parse_args(["-m", tiny_long_gguf, "--device", "cpu"], environ={}), spec)
    assert plain.kv == 131072 * 256  # n_ctx tokens of 256 bytes
    args = parse_args(["-m", tiny_long_gguf, "--device", "cpu", "--kv-cache-memory-bytes", "8MiB"], environ={})
    assert estimate_runner_memory(args, spec).kv == 8 * MIB
    args = parse_args(["-m", tiny_long_gguf, "--num-gpu-blocks-override", "100"], environ={})
    assert estimate_runner_memory(args, spec).kv == 100 * 4096


def test_max_num_seqs_shares_one_pool_as_vllm():
    cfg = parse_args(["--max-num-seqs", "4"], environ={}).engine_config()
    assert (cfg.n_slots, cfg.unified, cfg.n_ctx_slot(131072)) == (4, True, 131072)
    cfg = parse_args(["-np", "4"], environ={}).engine_config()  # llama-server's -np splits -c
    assert (cfg.n_slots, cfg.unified, cfg.n_ctx_slot(131072)) == (4, False, 32768)
    cfg = parse_args(["--max-num-seqs", "4", "--no-kv-unified"], environ={}).engine_config()
    assert cfg.unified is False


def test_engine_core_sizes_its_pool_from_cuda_free_memory(monkeypatch, caplog):
    """The engine's wiring of --gpu-memory-utilization (no GPU here: the device's memory is faked)."""
    import torch

    from kvserve.engine.fake import fake_engine_core

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * MIB, 100 * MIB))
    caplog.set_level(logging.INFO)
    core = fake_engine_core(n_ctx=256, n_parallel=2, device="cuda", gpu_memory_utilization=0.5)
    mc = core.model_config  # the activation estimate: 128 rows (n_ctx_slot) and a row of logits per slot
    act = 4 * (128 * (8 * mc.n_embd + 3 * mc.n_ff) + 2 * mc.n_vocab)
    budget = 50 * MIB - 40 * MIB - act
    assert core.pool.budget_bytes == budget
    assert budget // core.block_bytes == 20391
    assert core.kv.num_blocks == 1 + 2 * 8  # capped: 2 sequences of 128 tokens (8 blocks each)
    assert f"Available KV cache memory: {round(budget / GIB, 2)} GiB" in _messages(caplog)
    assert ("--gpu-memory-utilization: the budget holds 20,391 blocks; the KV cache is capped at 16 blocks "
            "(2 sequences of 128 tokens, the most the server runs at once; more blocks would cost memory and "
            "start-up time and never be used)") in _messages(caplog)
    assert "GPU KV cache size: 256 tokens, Maximum concurrency for 128 tokens per request: 2.00x" in _messages(caplog)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * MIB, 100 * MIB))
    with pytest.raises(KVCacheMemoryError) as e:  # nothing left: vLLM's other message
        fake_engine_core(n_ctx=256, n_parallel=2, device="cuda", gpu_memory_utilization=0.5)
    assert str(e.value) == ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                            "initializing the engine.")


# -- kvserve's limits on a budget: the cap to what the slots use, MemAvailable on the CPU ------------

def test_kv_cache_size_is_blocks_times_block_size():
    """Example 3's figures: tokens = blocks x block_size, concurrency = tokens / max_model_len (also
    when max_model_len is not a multiple of the block size)."""
    plan = plan_pool(n_ctx=1, n_ctx_slot=1, n_slots=64, block_size=16, block_bytes=1024, budget_bytes=36 * 1024,
                     source="--kv-cache-memory-bytes")
    assert (plan.active_blocks, plan.tokens, plan.concurrency) == (36, 576, 576.0)
    assert plan.lines("cpu")[-1] == "CPU KV cache size: 576 tokens, Maximum concurrency for 1 tokens per request: 576.00x"
    plan = plan_pool(n_ctx=1000, n_ctx_slot=1000, n_slots=4, block_size=16, block_bytes=1024,
                     budget_bytes=100 * 1024, source="--kv-cache-memory-bytes")
    assert plan.lines("cuda")[-1] == ("GPU KV cache size: 1,600 tokens, Maximum concurrency for 1,000 tokens per "
                                      "request: 1.60x")


def test_a_budget_larger_than_the_slots_use_is_capped():
    plan = plan_pool(n_ctx=512, n_ctx_slot=256, n_slots=2, block_size=16, block_bytes=4096,
                     budget_bytes=20 * GIB, source="--kv-cache-memory-bytes")
    assert (plan.active_blocks, plan.capped_from, plan.tokens) == (32, 5242880, 512)
    assert plan.lines("cpu") == [
        ("--kv-cache-memory-bytes: the budget holds 5,242,880 blocks; the KV cache is capped at 32 blocks "
         "(2 sequences of 256 tokens, the most the server runs at once; more blocks would cost memory and start-up "
         "time and never be used)"),
        "Available KV cache memory: 20.0 GiB",
        "CPU KV cache size: 512 tokens, Maximum concurrency for 256 tokens per request: 2.00x"]


def test_a_cpu_budget_above_mem_available_is_refused():
    from kvserve.config import EngineConfig
    from kvserve.loaders.weights import ModelConfig

    mc = ModelConfig("llama", 2, 64, 4, 2, 128, 301, 16, 512)
    cfg = EngineConfig(kv_cache_memory_bytes=20 * GIB, n_parallel=2, n_ctx=512)
    with pytest.raises(KVCacheMemoryError) as e:
        plan_engine_pool(cfg, mc, n_ctx=512, n_ctx_slot=256, n_slots=2, block_bytes=4096, device_type="cpu",
                         mem_available=lambda: 8 * GIB)
    assert str(e.value) == ("--kv-cache-memory-bytes: the KV cache budget (20.0 GiB) is larger than the memory "
                            "available on this machine (8.0 GiB MemAvailable); on the CPU the KV cache is host "
                            "memory. Try decreasing it (one request of 256 tokens needs 0.06 MiB).")
    # on CUDA the device's memory is not MemAvailable's
    plan = plan_engine_pool(cfg, mc, n_ctx=512, n_ctx_slot=256, n_slots=2, block_bytes=4096, device_type="cuda",
                            mem_available=lambda: 8 * GIB)
    assert plan.active_blocks == 32


def test_a_huge_budget_on_the_tiny_model_starts_capped_and_counts_the_pool(tiny_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["-c", "512", "-np", "2", "--kv-cache-memory-bytes", "1G"], tiny_gguf)
    try:
        core = runner.engine.core
        assert (core.pool.active_blocks, core.kv.num_blocks) == (32, 1 + 32)
        assert runner.measured_bytes >= 32 * core.block_bytes
    finally:
        runner.close()
    msgs = _messages(caplog)
    assert any(m.startswith("--kv-cache-memory-bytes: the budget holds ") and "capped at 32 blocks" in m for m in msgs)
    assert "CPU KV cache size: 512 tokens, Maximum concurrency for 256 tokens per request: 2.00x" in msgs


def test_known_kv_budget_is_capped_as_the_pool_is(tiny_gguf):
    from kvserve.serving.chat_runner import model_shape
    from kvserve.serving.startup_checks import known_kv_budget

    cfg = parse_args(["-c", "512", "-np", "2", "--kv-cache-memory-bytes", "1G"], environ={}).engine_config()
    mc = model_shape(tiny_gguf)[0]
    block_bytes = 16 * 2 * mc.n_layer * mc.n_head_kv * mc.head_dim * 2  # f16 K and V
    assert known_kv_budget(cfg, mc) == 32 * block_bytes


def test_the_batch_warning_names_the_max_num_seqs_typed(tiny_long_gguf, caplog):
    caplog.set_level(logging.INFO)
    runner = _start(["-np", "1", "--max-model-len", "4096", "--max-num-seqs", "3",
                     "--max-num-batched-tokens", "16384"], tiny_long_gguf)
    runner.close()
    assert ("max_num_batched_tokens (16384) exceeds max_num_seqs * max_model_len (12288). This may lead to "
            "unexpected behavior.") in _messages(caplog)


# -- KVSERVE_MMAP ------------------------------------------------------------------------------

_MMAP_ACCEPTED = "accepted: 1, true, on, yes = --mmap; 0, false, off, no = --no-mmap; auto or empty = the default"


@pytest.mark.parametrize("text", ["1", "TRUE", " on ", "Yes", "0", "false", "OFF", "no", "", "  ", "auto", "Auto"])
def test_kvserve_mmap_values_the_loader_reads_pass(text, monkeypatch):
    """Every accepted value means what kvserve.loaders.gguf makes of it (mmap / read / the default)."""
    from kvserve.loaders import gguf, weight_read

    from kvserve.serving.startup_checks import MMAP_OFF, MMAP_ON, mmap_env_error

    assert mmap_env_error({"KVSERVE_MMAP": text}) is None
    monkeypatch.setattr(gguf, "_WEIGHT_MEMORY", "auto")
    # the default's test of huge pages is weight_read.thp_available (gguf._weight_memory asks
    # weight_read.weight_memory_mode, which calls it directly): patched there, or the machine's answer counts
    monkeypatch.setattr(weight_read, "thp_available", lambda: None)
    monkeypatch.setenv("KVSERVE_MMAP", text)
    low = text.strip().lower()
    assert gguf._weight_memory() == ("mmap" if low in MMAP_ON else "read" if low in MMAP_OFF else "mmap")
    monkeypatch.setattr(weight_read, "thp_available", lambda: True)
    assert gguf._weight_memory() == ("mmap" if low in MMAP_ON else "read")


@pytest.mark.parametrize("text", ["2", "ture", "mmap", "read", "enabled", "-1"])
def test_kvserve_mmap_typo_is_one_line_naming_variable_value_and_accepted(text):
    from kvserve.serving.startup_checks import mmap_env_error

    assert mmap_env_error({"KVSERVE_MMAP": text}) == (
        f'error while handling environment variable "KVSERVE_MMAP": invalid value {text!r} ({_MMAP_ACCEPTED})')
    assert mmap_env_error({}) is None


def test_server_with_a_kvserve_mmap_typo_stops_with_exit_1(tiny_gguf, tmp_path):
    """Before: the server started, holding the weights as the default mode picked. Now it stops
    before serving; a flag that picks the mode wins over the variable (then the next start-up check,
    a bad AIP_HTTP_PORT, is the one that stops it)."""
    env = {"KVSERVE_MMAP": "ture", "KVSERVE_HOME": str(tmp_path)}
    out = _serve(["-m", tiny_gguf], env, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]
    line = f'error while handling environment variable "KVSERVE_MMAP": invalid value \'ture\' ({_MMAP_ACCEPTED})'
    errors = [ln for ln in out.stderr.splitlines() if "KVSERVE_MMAP" in ln]
    assert len(errors) == 1 and errors[0].endswith(line), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    gcp = {**env, "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "x"}
    for flag in ("--no-mmap", "--mmap"):
        out = _serve(["-m", tiny_gguf, flag], gcp, timeout=60)
        assert out.returncode == 1 and "KVSERVE_MMAP" not in out.stderr, out.stderr[-2000:]
        assert "AIP_HTTP_PORT must be a port number" in out.stderr


def test_kvserve_mmap_a_very_long_value_is_shown_cut_and_control_characters_escaped():
    """Before: the whole value went into the one line (a 100 000-character variable, a 100 000-
    character log line)."""
    from kvserve.serving.startup_checks import mmap_env_error

    assert mmap_env_error({"KVSERVE_MMAP": "y" * 100000}) == (
        f'error while handling environment variable "KVSERVE_MMAP": invalid value {"y" * 64!r}... '
        f"(100000 characters) ({_MMAP_ACCEPTED})")
    assert mmap_env_error({"KVSERVE_MMAP": "\x1b[2J1"}) == (
        f'error while handling environment variable "KVSERVE_MMAP": invalid value \'\\x1b[2J1\' ({_MMAP_ACCEPTED})')
    assert mmap_env_error({"KVSERVE_MMAP": "\u00a0on\t"}) is None  # spaces of any kind around, as the loader strips them
