"""llama-server's LoRA flags: --lora (comma-separated, repeatable), --lora-scaled (FNAME:SCALE,... and the
older FNAME SCALE), --lora-init-without-apply, and vLLM's --max-loras / --max-lora-rank."""

import pytest

from kvserve.serving.args import parse_args


def test_lora_flags_in_order_with_scales():
    a = parse_args(["-m", "m.gguf", "--lora", "a.gguf", "--lora", "b.gguf,c", "--lora-scaled", "d.gguf", "0.5",
                    "--lora-scaled", "e:0.25,f:-2", "--max-loras", "4", "--max-lora-rank", "64"], environ={})
    assert a.lora == ["a.gguf", "b.gguf", "c"]
    assert a.lora_scaled == [("d.gguf", 0.5), ("e", 0.25), ("f", -2.0)]
    assert a.lora_adapters() == (("a.gguf", 1.0), ("b.gguf", 1.0), ("c", 1.0), ("d.gguf", 0.5), ("e", 0.25),
                                 ("f", -2.0))
    assert (a.max_loras, a.max_lora_rank, a.model) == (4, 64, "m.gguf")


def test_lora_ids_follow_the_command_line_order_across_both_flags():
    """llama-server numbers adapters in the order given, --lora and --lora-scaled together."""
    a = parse_args(["--lora-scaled", "s1.gguf", "0.5", "--lora", "a.gguf,b.gguf", "--lora-scaled", "s2:2,s3:-1",
                    "--lora", "c.gguf", "m.gguf"], environ={})
    assert a.lora_adapters() == (("s1.gguf", 0.5), ("a.gguf", 1.0), ("b.gguf", 1.0), ("s2", 2.0), ("s3", -1.0),
                                 ("c.gguf", 1.0))
    assert a.lora == ["a.gguf", "b.gguf", "c.gguf"] and a.lora_scaled == [("s1.gguf", 0.5), ("s2", 2.0), ("s3", -1.0)]
    a = parse_args(["--lora-scaled", "y:3", "--lora", "x", "--lora-init-without-apply"], environ={})
    assert a.lora_adapters() == (("y", 0.0), ("x", 0.0))


def test_defaults_and_init_without_apply():
    a = parse_args([], environ={})
    assert (a.lora, a.lora_scaled, a.lora_init_without_apply, a.max_loras, a.max_lora_rank) == ([], [], False,
                                                                                                None, None)
    assert a.lora_adapters() == ()
    a = parse_args(["--lora", "x", "--lora-scaled", "y:3", "--lora-init-without-apply"], environ={})
    assert a.lora_adapters() == (("x", 0.0), ("y", 0.0))


def test_two_word_form_leaves_a_model_path_alone():
    a = parse_args(["--lora-scaled", "d.gguf:0.5", "model.gguf"], environ={})
    assert a.lora_scaled == [("d.gguf", 0.5)] and a.model == "model.gguf"


@pytest.mark.parametrize("words,message", [
    (["--lora-scaled", "x"], "error: invalid --lora-scaled 'x': lora-scaled format: FNAME:SCALE"),
    (["--lora-scaled", "x:nan"], "error: invalid --lora-scaled 'x:nan': the scale must be a finite number in "
                                 "[-1000, 1000]"),
    (["--lora-scaled", "x:1e308"], "error: invalid --lora-scaled 'x:1e308': the scale must be a finite number in "
                                   "[-1000, 1000]"),
    (["--lora-scaled", "x:big"], "error: invalid --lora-scaled 'x:big': the scale 'big' is not a number (format: "
                                 "FNAME:SCALE)"),
    (["--max-loras", "0"], "error: invalid --max-loras 0: >= 1"),
    (["--max-lora-rank", "0"], "error: invalid --max-lora-rank 0: one of 1, 8, 16, 32, 64, 128, 256, 320, 512 "
                               "(vLLM's values)"),
])
def test_bad_values_exit_2(words, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(words, environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(message)


def test_lora_dtype_reaches_the_registry():
    """vLLM's ``--lora-dtype`` (auto, float16, bfloat16, float32): parsed, and set on the engine's
    LoraRegistry by chat_runner.load_adapters before any adapter loads (auto: the model's compute dtype)."""
    import torch

    from kvserve.lora.registry import LoraRegistry
    from kvserve.serving.chat_runner import load_adapters

    class Model:
        compute_dtype = torch.float32

    class Core:
        class runner:
            lora = LoraRegistry(Model())

    class Spec:
        adapters = []

    assert parse_args([], environ={}).lora_dtype == "auto"
    assert Core.runner.lora.dtype == torch.float32
    for word, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                       ("auto", torch.float32)):
        load_adapters(Core, parse_args(["--lora-dtype", word], environ={}), Spec)
        assert (Core.runner.lora.lora_dtype, Core.runner.lora.dtype) == (word, want)
    with pytest.raises(SystemExit) as e:
        parse_args(["--lora-dtype", "int8"], environ={})
    assert e.value.code == 2
