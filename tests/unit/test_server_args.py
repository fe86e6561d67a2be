"""kvserve serve flags: llama-server names, vLLM names, clean errors."""

import pytest

from kvserve.serving.args import parse_args


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "--port", port])
    assert e.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "--no-such-flag"])
    assert e.value.code == 2


def test_llama_and_vllm_names_fill_the_engine_config():
    a = parse_args(["m.gguf", "-c", "4096", "-np", "2", "-ctk", "f32", "--cache-ram", "0",
                    "--max-num-batched-tokens", "512"])
    cfg = a.engine_config()
    assert (cfg.n_ctx, cfg.n_parallel, cfg.kv_dtype, cfg.cache_ram, cfg.max_num_batched_tokens) == \
        (4096, 2, "f32", 0, 512)


def test_speed_flags_reach_the_engine_config():
    cfg = parse_args(["m.gguf"]).engine_config()
    assert (cfg.compile, cfg.native_kernels, cfg.large_batch_dtype) == (False, False, "auto")
    cfg = parse_args(["m.gguf", "--compile", "--large-batch-dtype", "float32"]).engine_config()
    assert (cfg.compile, cfg.native_kernels, cfg.large_batch_dtype) == (True, False, "float32")
    cfg = parse_args(["m.gguf", "--compile", "--native-kernels"]).engine_config()
    assert (cfg.compile, cfg.native_kernels) == (True, True)


@pytest.mark.parametrize("value", ["-1", "-3"])
def test_negative_threads_mean_all_cores(value):
    """llama.cpp's -t: a value <= 0 becomes the hardware's thread count (torch refused -3 with a traceback)."""
    import os

    import torch

    before = torch.get_num_threads()
    try:
        assert parse_args(["m", "-t", value]).engine_config().apply_threads() == (os.cpu_count() or 1)
        assert torch.get_num_threads() == (os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)
