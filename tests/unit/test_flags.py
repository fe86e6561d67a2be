"""The flag table (kvserve/serving/flags.py) and the parser built from it: every llama-server and
vLLM flag of issue #15 item 2 parses; short flags parse as llama-server's; environment
variables; --help; refused flags and values; --chat-template's three meanings."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from kvserve.chat.builtin_templates import BUILTIN_TEMPLATES, builtin_names
from kvserve.serving import flags as ft
from kvserve.serving.args import parse_args

# issue #15 item 2's list, each with a value where it takes one
ITEM2 = [
    ["--offline"], ["--no-webui"], ["--no-ui"], ["--webui"], ["-ngl", "99"], ["--n-gpu-layers", "99"],
    ["--gpu-layers", "all"], ["-fa"], ["-fa", "on"], ["--flash-attn", "auto"], ["--mlock"], ["--no-mmap"],
    ["-kvu"], ["--kv-unified"], ["-tb", "2"], ["--threads-batch", "2"], ["-cb"], ["--cont-batching"],
    ["--no-cont-batching"], ["--embedding"], ["--embeddings"], ["--reranking"], ["--pooling", "mean"],
    ["-to", "30"], ["--timeout", "30"], ["--threads-http", "4"], ["-v"], ["--verbose"], ["--log-disable"],
    ["--log-file", "LOGFILE"], ["--no-warmup"], ["--sleep-idle-seconds", "60"], ["--tags", "a,b"],
    ["--tools", "all"], ["--context-shift"], ["--keep", "16"], ["--grammar-file", "g.gbnf"], ["--special"],
    ["--presence-penalty", "0.5"], ["--frequency-penalty", "0.5"], ["--rope-freq-base", "10000"],
    ["--rope-scaling", "linear"], ["--ssl-key-file", "KEY", "--ssl-cert-file", "CERT"], ["--path", "."],
    ["--models-dir", "."], ["--no-cache-idle-slots"],
    # vLLM
    ["--dtype", "half"], ["--gpu-memory-utilization", "0.9"], ["--kv-cache-memory-bytes", "4G"],
    ["--enable-prefix-caching"], ["--no-enable-prefix-caching"], ["--enable-chunked-prefill"],
    ["--block-size", "32"], ["--swap-space", "4"], ["--cpu-offload-gb", "0"], ["--kv-cache-dtype", "auto"],
    ["--generation-config", "vllm"], ["--override-generation-config", '{"temperature": 0.5}'],
    ["--quantization", "gguf"], ["-q", "gguf"], ["--trust-remote-code"], ["--tokenizer", "x"],
    ["--revision", "main"], ["--download-dir", "/tmp"], ["--load-format", "auto"], ["-tp", "1"], ["-pp", "1"],
    ["-dp", "1"], ["--enforce-eager"], ["--disable-log-requests"], ["--enable-log-requests"],
    ["--disable-log-stats"], ["--uvicorn-log-level", "info"], ["--response-role", "assistant"],
    ["--max-logprobs", "5"], ["--return-tokens-as-token-ids"], ["--enable-prompt-tokens-details"],
    ["--enable-force-include-usage"], ["--allowed-origins", '["*"]'], ["--root-path", "/api/v1"],
    ["--task", "generate"], ["--runner", "generate"], ["--limit-mm-per-prompt", '{"image": 0}'],
]


@pytest.fixture
def files(tmp_path):
    """Stand-ins for the file flags (the TLS files must exist; their content is read at serve time)."""
    (tmp_path / "key.pem").write_text("k")
    (tmp_path / "cert.pem").write_text("c")
    return {"KEY": str(tmp_path / "key.pem"), "CERT": str(tmp_path / "cert.pem"), "LOGFILE": str(tmp_path / "l")}


@pytest.mark.parametrize("words", ITEM2, ids=lambda w: " ".join(w))
def test_every_item2_flag_parses(words, files):
    args = parse_args(["m.gguf", *[files.get(w, w) for w in words]], environ={})
    assert args.model == "m.gguf"
    dest = ft.BY_NAME[words[0]].dest
    assert dest in args.flags_given  # it was seen as its own flag, not as a cluster of others


def _notes(args) -> list[tuple[int, str]]:
    return list(args.flag_notes)


def test_short_flags_parse_as_llama_server():
    a = parse_args(["-m", "m.gguf", "-ngl", "99", "-md", "d.gguf", "-tb", "2", "-cb", "-c", "512", "-np", "2",
                    "-t", "1", "-n", "7"], environ={})
    assert (a.model, a.ctx_size, a.parallel, a.threads, a.n_predict) == ("m.gguf", 512, 2, 1, 7)
    assert (a.spec.method, a.spec.draft_model, a.spec.num_speculative_tokens) == ("draft_model", "d.gguf", 16)
    assert _notes(a) == [
        (logging.INFO, ("flag -ngl 99: no effect here: every layer runs on the one device kvserve uses (--device); "
                       "-ngl 0 means the CPU")),
        (logging.INFO, "flag -tb 2: no effect here: one torch thread pool (-t) runs prefill and decode"),
        (logging.INFO, "flag -cb: no effect here: continuous batching is always on"),
    ]


def test_hf_repo_is_a_store_name():
    assert parse_args(["-hf", "unsloth/Qwen3-8B-GGUF:Q4_K_M"], environ={}).model == "hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M"
    assert parse_args(["-hfr", "https://huggingface.co/u/r"], environ={}).model == "hf.co/u/r"
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "-hf", "u/r"], environ={})
    assert e.value.code == 2


def test_unknown_short_flag_is_not_split(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["-ngx", "1"], environ={})
    assert e.value.code == 2
    assert "error: unrecognized arguments: -ngx" in capsys.readouterr().err


def test_optional_values_and_positional_model():
    a = parse_args(["-fa", "m.gguf"], environ={})  # -fa takes no model as its value
    assert a.model == "m.gguf"
    assert a.flag_notes[0][1].startswith("flag -fa on: no effect here")
    assert parse_args(["-rea", "off"], environ={}).reasoning == "off"
    assert parse_args(["-rea"], environ={}).reasoning == "on"
    assert parse_args(["--reasoning", "auto"], environ={}).reasoning is None


def test_real_effects():
    a = parse_args(["m.gguf", "-kvu", "--block-size", "32", "--dtype", "half", "--enforce-eager", "--compile",
                    "--max-model-len", "32K", "--presence-penalty", "0.5", "--samplers", "top_k;temperature",
                    "-l", "15043+1", "-l", "2-inf", "--no-enable-prefix-caching", "--allowed-origins",
                    '["http://a"]', "-to", "7", "--root-path", "/v/", "--path", "/srv", "--tags", "x, y",
                    "--sleep-idle-seconds", "5", "--uvicorn-log-level", "info", "-v"], environ={})
    cfg = a.engine_config()
    assert (cfg.kv_unified, cfg.block_size, cfg.dtype, cfg.compile, cfg.max_model_len) == \
        (True, 32, "float16", False, 32768)
    sp = a.default_sampling_params()
    assert (sp.presence_penalty, sp.samplers, sp.logit_bias, sp.cache_prompt) == \
        (0.5, ("top_k", "temperature"), {15043: 1.0, 2: float("-inf")}, False)
    assert (a.cors_origins, a.timeout, a.root_path, a.path, a.tags, a.sleep_idle_seconds) == \
        (["http://a"], 7.0, "/v", "/srv", ["x", "y"], 5.0)
    assert (a.uvicorn_log_level, a.log_verbosity) == ("info", 5)
    assert parse_args(["m.gguf", "-ngl", "0"], environ={}).device == "cpu"
    assert parse_args(["m.gguf", "-dev", "CUDA1"], environ={}).device == "cuda:1"
    assert parse_args(["m.gguf", "--task", "embed"], environ={}).embeddings is True


@pytest.mark.parametrize("text,n", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("1m", 10 ** 6),
                                    ("1M", 1 << 20), ("25.6k", 25600), ("auto", 0), ("-1", 0)])
def test_max_model_len_forms(text, n):
    assert parse_args(["--max-model-len", text], environ={}).max_model_len == n


def test_override_generation_config_sets_the_defaults():
    a = parse_args(["--override-generation-config", ('{"temperature": 0.5, "top_k": 7, "max_new_tokens": 9, '
                    '"repetition_penalty": 1.1, "presence_penalty": 0.2, "bogus": 1}')], environ={})
    sp = a.default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.n_predict, sp.repeat_penalty, sp.presence_penalty) == \
        (0.5, 7, 9, 1.1, 0.2)
    assert a.flag_notes[-1][0] == logging.WARNING and "'bogus' ignored" in a.flag_notes[-1][1]


def test_environment_variables():
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_ENDPOINT_METRICS": "1",
           "LLAMA_ARG_CONT_BATCHING": "false", "LLAMA_ARG_FLASH_ATTN": "on", "VLLM_API_KEY": "k1",
           "LLAMA_ARG_UI": "off", "LLAMA_ARG_KV_UNIFIED": "enabled", "HF_HUB_OFFLINE": "1"}
    a = parse_args(["m.gguf"], environ=env)
    assert (a.ctx_size, a.parallel, a.metrics, a.api_keys, a.webui, a.kv_unified, a.offline) == \
        (1024, 3, True, ["k1"], False, True, True)
    assert (logging.WARNING, ("flag LLAMA_ARG_CONT_BATCHING=false: ignored, not available in kvserve: continuous "
                             "batching cannot be turned off")) in a.flag_notes
    assert (logging.INFO, ("flag LLAMA_ARG_FLASH_ATTN=on: no effect here: attention is torch's "
                          "scaled_dot_product_attention on the paged cache")) in a.flag_notes
    b = parse_args(["m.gguf", "-c", "2048", "--api-key", "k2"], environ=env)  # the command line wins
    assert (b.ctx_size, b.api_keys) == (2048, ["k2"])


def test_bad_environment_value(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([], environ={"LLAMA_ARG_CTX_SIZE": "big"})
    assert e.value.code == 2
    assert 'error while handling environment variable "LLAMA_ARG_CTX_SIZE"' in capsys.readouterr().err
    assert parse_args([], environ={"OLLAMA_MAX_QUEUE": "x"}).max_queue == 512  # Ollama's own: lenient


@pytest.mark.parametrize("words,message", [
    (["-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
    (["-pp", "0"], "--pipeline-parallel-size must be at least 1, got 0"),
    (["--control-vector", "a.gguf"], ("--control-vector a.gguf: not supported by kvserve: control vectors are not "
                                     "available: the model would answer unsteered")),
    (["-ctk", "q4_1"], ("-ctk q4_1: KV cache type q4_1 is not available; kvserve stores K and V as f32, f16, bf16, "
                       "q8_0, q4_0 (or float8 with --kv-cache-dtype fp8)")),
    (["-ctv", "iq4_nl"], ("-ctv iq4_nl: KV cache type iq4_nl is not available; kvserve stores K and V as f32, f16, "
                         "bf16, q8_0, q4_0 (or float8 with --kv-cache-dtype fp8)")),
    (["--kv-cache-dtype", "fp8_inc"], ("--kv-cache-dtype fp8_inc: Intel Gaudi's float8 KV cache (fp8_inc, via Intel "
                                      "Neural Compressor) is not available in kvserve; use auto, bfloat16, fp8, "
                                      "fp8_e4m3 or fp8_e5m2")),
    (["--kv-cache-dtype", "fp8_ds_mla"], ("--kv-cache-dtype fp8_ds_mla: DeepSeek's MLA float8 layout (fp8_ds_mla) is "
                                         "not available in kvserve; use auto, bfloat16, fp8, fp8_e4m3 or fp8_e5m2")),
    (["-mu", "http://x/m.gguf"], ("-mu http://x/m.gguf: not supported by kvserve: kvserve does not download from "
                                 "URLs: kvserve pull NAME, or -m with a .gguf file")),
    (["--ssl-key-file", "/nonexistent.pem"], ('error while handling argument "--ssl-key-file": no such file: '
                                             '/nonexistent.pem')),
])
def test_refused(words, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", *words], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {message}"


def test_help_lists_every_flag_with_its_source(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"], environ={})
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for f in ft.FLAGS:
        head = [i for i, ln in enumerate(lines) if (ln + " ").startswith(f"  {f.spelled} ")]
        assert len(head) == 1, f.spelled
        detail = lines[head[0] + 1]
        assert detail.endswith(f"({f.source})"), f.spelled
        for e_name in f.env:
            assert e_name in detail
    assert "[llama-server]" in out and "[vLLM]" in out and "[llama-server, vLLM]" in out


def test_markdown_table_has_a_row_per_flag():
    md = ft.markdown_table()
    rows = [ln for ln in md.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(ft.FLAGS)
    assert re.search(r"\| `-ngl`, `--gpu-layers`, `--n-gpu-layers` \| llama-server \| `LLAMA_ARG_N_GPU_LAYERS` \| "
                     r"no effect: ", md)


def test_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m.gguf\nmax_model_len: 2048\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                   "port: 9000\n")
    a = parse_args(["--config", str(cfg), "--port", "9001"], environ={})
    assert (a.model, a.max_model_len, a.alias, a.port) == ("m.gguf", 2048, ["a", "b"], 9001)
    assert a.default_sampling_params().cache_prompt is False


# -- --chat-template ---------------------------------------------------------------------

CONV = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]


def _template(args):
    from kvserve.serving.chat_runner import make_template

    tok = SimpleNamespace(bos_token="<s>", eos_token="</s>", chat_template=None)
    return make_template(args, SimpleNamespace(tokenizer=tok, chat_template="{{ 'model own' }}"))


def test_chat_template_builtin_name_renders_its_format():
    t = _template(parse_args(["m.gguf", "--chat-template", "llama3"], environ={}))
    assert t.source == BUILTIN_TEMPLATES["llama3"]
    assert t.render(CONV) == ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user"
                              "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chat_template_file_path(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    t = _template(parse_args(["m.gguf", "--chat-template", str(f)], environ={}))
    assert t.render(CONV) == "[system:S][user:Hi]"


def test_chat_template_inline_text():
    t = _template(parse_args(["m.gguf", "--chat-template", "{{ messages[-1].content }}!"], environ={}))
    assert t.render(CONV) == "Hi!"
    assert _template(parse_args(["m.gguf"], environ={})).render(CONV) == "model own"


def test_chat_template_unknown_name_lists_the_names(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["m.gguf", "--chat-template", "llama-3"], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --chat-template 'llama-3' is not a file, a built-in template name or Jinja text (Jinja contains "
        "'{{' or '{%'); built-in names: " + ", ".join(builtin_names()))


def test_chat_template_content_format_openai():
    src = "{% for m in messages %}{% for p in m.content %}<{{ p.type }}={{ p.text }}>{% endfor %}{% endfor %}"
    t = _template(parse_args(["m.gguf", "--chat-template", src, "--chat-template-content-format", "openai"],
                             environ={}))
    assert t.render(CONV) == "<text=S><text=Hi>"


def test_default_chat_template_kwargs_merge():
    a = parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false, "x": 1}',
                    "--chat-template-kwargs", '{"x": 2}'], environ={})
    assert a.chat_template_kwargs == {"enable_thinking": False, "x": 2}


def test_several_hosts(capsys):
    a = parse_args(["--host", "127.0.0.1,::1"], environ={})
    assert (a.host, a.hosts) == ("127.0.0.1", ["127.0.0.1", "::1"])
    with pytest.raises(SystemExit) as e:
        parse_args(["--host", "/tmp/kv.sock"], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --host /tmp/kv.sock: UNIX sockets are not supported: kvserve listens on TCP addresses")


def test_secrets_stay_out_of_log_lines():
    a = parse_args(["-hft", "hf_secret"], environ={"HF_TOKEN": "hf_other"})
    assert a.flag_notes == [(logging.INFO, ("flag -hft ***: no effect here: kvserve downloads nothing at start-up "
                                           "but the known default models"))]


def test_kv_cache_dtype_bfloat16_is_bf16():
    a = parse_args(["--kv-cache-dtype", "bfloat16"], environ={})
    assert (a.cache_type_k, a.cache_type_v, a.engine_config().kv_dtype) == ("bf16", "bf16", "bf16")
    assert parse_args(["--kv-cache-dtype", "bfloat16", "-ctk", "f32"], environ={}).cache_type_k == "f32"


@pytest.mark.parametrize("words,kv", [
    (["-ctk", "q8_0", "-ctv", "q4_0"], ("q8_0", "q4_0")),
    (["-ctk", "q8_0"], ("q8_0", "f16")),  # llama-server: -ctv keeps its own default
    (["--kv-cache-dtype", "fp8"], ("fp8_e4m3", "fp8_e4m3")),
    (["--kv-cache-dtype", "fp8_e4m3"], ("fp8_e4m3", "fp8_e4m3")),
    (["--kv-cache-dtype", "fp8_e5m2", "-ctv", "q8_0"], ("fp8_e5m2", "q8_0")),
    (["--kv-cache-dtype", "auto", "-ctv", "bf16"], ("f16", "bf16")),
])
def test_kv_cache_types_reach_the_engine(words, kv):
    a = parse_args(words, environ={})
    c = a.engine_config()
    assert (a.cache_type_k, a.cache_type_v) == kv == (c.kv_dtype, c.kv_dtype_v)


def test_docs_flags_md_is_the_generated_table():
    """docs/flags.md is the table's output (regenerate it with ``python -m kvserve.serving.flags --markdown``)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text(encoding="utf-8")
    table = doc[doc.index("| Flag | From |"):]
    assert table.strip() == ft.markdown_table().strip()


@pytest.mark.parametrize(("override", "message"), [
    ('{"max_new_tokens": 0}', "invalid --override-generation-config: max_new_tokens = 0: at least 1 expected"),
    ('{"top_k": 2.7}', "invalid --override-generation-config: top_k = 2.7: an integer expected"),
    ('{"top_k": -5}', "invalid --override-generation-config: top_k = -5: -1 or 0 (off) or at least 1 expected"),
    ('{"temperature": 1e308}', "invalid --override-generation-config: temperature = 1e+308: out of range (float32)"),
    ('{"repetition_penalty": 0}', "invalid --override-generation-config: repetition_penalty = 0: above 0 expected"),
])
def test_override_generation_config_values_are_checked_as_the_models_file(override, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--override-generation-config", override], environ={})
    assert e.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("error: " + message)


def test_the_override_logs_that_it_wins_over_a_flag():
    a = parse_args(["--temp", "0.9", "--override-generation-config", '{"temperature": 0.3}'], environ={})
    assert a.temp == 0.3
    assert (logging.INFO, "flag --override-generation-config: temperature = 0.3 wins over --temp 0.9") in a.flag_notes


@pytest.mark.parametrize(("words", "pooling"), [
    ([], None), (["--pooling", "cls"], "cls"), (["--pooling", "none"], "none"), (["--pooling", "rank"], None),
])
def test_pooling_reaches_server_args(words, pooling):
    assert parse_args(words, environ={}).pooling == pooling
    assert parse_args([], environ={"LLAMA_ARG_POOLING": "last"}).pooling == "last"


def test_alias_list_sorted_as_llama_server_set():
    """llama-server keeps --alias in a std::set: /models' id is the alphabetically first."""
    assert parse_args(["-a", "tinyllama-2,fim,code,fim"], environ={}).alias == ["code", "fim", "tinyllama-2"]
    a = parse_args(["-a", "b,a", "--served-model-name", "z", "y"], environ={})
    assert a.alias == ["a", "b", "z", "y"]


@pytest.mark.parametrize("words, message", [
    (["--max-queue", "0", "--reasoning-budget", "-5"], "error: invalid --max-queue 0: at least 1"),
    (["--reasoning-budget", "-5", "--max-queue", "0"], "error: invalid --reasoning-budget -5: -1 (no limit) or >= 0"),
    (["--timeout", "0", "--lora-scaled", "x"], "error: invalid --timeout 0.0: seconds, > 0"),
    (["--lora-scaled", "x", "--timeout", "0"], "error: invalid --lora-scaled 'x': lora-scaled format: FNAME:SCALE"),
])
def test_the_first_bad_flag_on_the_command_line_is_reported(words, message, capsys):
    """Each flag's check is in the table and runs in command-line order, as llama-server reports
    the first bad argument it reads."""
    with pytest.raises(SystemExit) as e:
        parse_args(words, {})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(message)


def test_an_address_from_ollama_host_gets_the_host_check(capsys):
    """$OLLAMA_HOST's address is checked as --host is (the table's text); its port falls back to
    Ollama's 11434 when out of range, as Ollama's own parsing does."""
    with pytest.raises(SystemExit) as e:
        parse_args([], {"OLLAMA_HOST": "a.sock"})
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("error: --host a.sock: UNIX sockets are not supported: "
                                                        "kvserve listens on TCP addresses")
    assert parse_args([], {"OLLAMA_HOST": "h:99999"}).port == 11434
