"""``kvserve serve`` command line: llama-server's flag names (short and long) and vLLM's.

Every flag, its spellings, environment variables, default, check (the error text) and
ServerArgs value is one row of :data:`kvserve.serving.flags.FLAGS`; this module turns a command
line (and the environment) into :class:`ServerArgs` in four steps: the values (command line,
else environment, else default: :func:`_values`), the table's checks and effects of the flags
given (:func:`_check_given`, in command-line order: the first bad flag is the one reported), the
fields named as a flag (:func:`_table_fields`), and the rules that join several flags (one short
function each: the model, slots, manager, device, HTTP, chat, sampling, speculative decoding).
An unknown flag is an error (exit 2), abbreviations are not accepted, and llama-server's short
flags (``-ngl``, ``-md``, ``-tb``, ``-cb``...) are never split.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.request import SEED_RANDOM, InvalidRequestError, SamplingParams
from kvserve.engine.spec_decode import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    SpecConfig,
)
from kvserve.serving import flags as ft

DEFAULT_MODEL = "smollm2"


@dataclass
class ServerArgs:
    """Parsed ``kvserve serve`` arguments (names as llama-server's long flags)."""

    model: str = DEFAULT_MODEL
    model_given: bool = False
    alias: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int = 0
    parallel: int = -1
    threads: int = 0
    compile: bool = False
    native_kernels: bool = False
    large_batch_dtype: str = "auto"
    batch_size: int = 2048
    ubatch_size: int = 512
    n_predict: int = -1
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int = SEED_RANDOM
    api_keys: list[str] = field(default_factory=list)
    metrics: bool = False
    slots: bool = True
    slots_text: bool = False  # --slots given explicitly: GET /slots also shows requests' text params
    props: bool = False
    slot_save_path: str | None = None
    cache_ram: int | None = None  # None: --cache-ram not given (EngineConfig sizes the tier)
    cache_reuse: int = 0
    slot_prompt_similarity: float = 0.10
    jinja: bool = True
    chat_template: str | None = None
    chat_template_file: str | None = None
    cache_type_k: str = "f16"  # K's KV cache type (-ctk, or --kv-cache-dtype fp8 -> fp8_e4m3)
    cache_type_v: str = "f16"  # V's own type (-ctv; llama-server's default f16 whatever -ctk is)
    sse_ping_interval: float = 30.0
    cors_origins: list[str] = field(default_factory=lambda: ["*"])
    cors_methods: str = "GET, POST, DELETE, OPTIONS"  # --cors-methods / vLLM --allowed-methods
    cors_headers: str = "*"  # --cors-headers / vLLM --allowed-headers
    cors_credentials: bool = True  # --cors-credentials (llama-server's default) / vLLM --allow-credentials
    log_verbosity: int = 3
    embeddings: bool = False
    pooling: str | None = None  # --pooling for embeddings: none/mean/cls/last; None: the model's own
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int = 0
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    trust_request_chat_template: bool = False
    reasoning_format: str = "auto"
    reasoning_parser: str | None = None
    reasoning_budget: int = -1
    reasoning: str | None = None  # --reasoning on|off: enable_thinking for every request
    chat_template_kwargs: dict = field(default_factory=dict)
    max_logprobs: int = 20  # vLLM --max-logprobs: top candidates per token a request may ask for; -1 = vocab size
    max_request_bytes: int = 32 * 1024 * 1024  # --max-request-bytes: larger bodies get 413
    max_batch_inputs: int = 2048  # --max-batch-inputs: items of one embedding/rerank/score/completion batch
    max_input_bytes: int = 2 << 20  # --max-input-bytes: text of one embedding/rerank/score/tokenize request
    shutdown_timeout: float = 5.0  # --shutdown-timeout: seconds in-flight requests get after SIGTERM
    header_timeout: float = 30.0  # --header-timeout: seconds a connection has to send a request head
    limit_concurrency: int = 4096  # --limit-concurrency: open connections at most (newer ones are closed)
    pull_max_blob_size: int = 0  # --pull-max-blob-size: bytes a pulled blob may declare (0: free disk space only)
    pull_timeout: float = 12 * 3600.0  # --pull-timeout: seconds a whole /api/pull may take (0: none)
    keep_alive: float = 300.0  # --keep-alive seconds (math.inf: forever); Ollama's default 5m
    max_loaded_models: int = 3  # --max-loaded-models (OLLAMA_MAX_LOADED_MODELS)
    max_memory: int | None = None  # --max-memory in bytes: cap on all loaded models together
    max_queue: int = 512  # --max-queue: requests waiting for a model at once (OLLAMA_MAX_QUEUE)
    preload: bool = True  # --no-preload: start with no model loaded
    allow_model_paths: bool = False  # --allow-model-paths: requests may name model files on the server
    remote: list = field(default_factory=list)  # --remote: kvserve.remote.RemoteSpec of each remote model
    engine: list = field(default_factory=list)  # --engine: kvserve.supervisor.EngineSpec of each supervised engine
    engine_start_timeout: float = 600.0  # --engine-start-timeout: seconds to a healthy /health
    models_dir: str | None = None  # --models-dir: the store (Ollama layout); None: $OLLAMA_MODELS, $KVSERVE_HOME/models
    cache_ram_share: int | None = None  # set by the server: models sharing the host prompt-cache budget
    webui: bool = True  # --no-webui/--no-ui: GET / answers "Ollama is running" to browsers too
    ui_mcp_proxy: bool = False  # --ui-mcp-proxy: serve llama-server's /cors-proxy (kvserve/faces/cors_proxy.py)
    tools: list[str] = field(default_factory=list)  # --tools: built-in server tools (names or all; kvserve.tools)
    tools_runtime: str | None = None  # --tools-runtime: docker-container:ID / podman-container:ID
    tools_confine: bool = False  # --tools-confine: absolute tool paths stay inside x-tool-cwd too
    mcp_servers_config: str | None = None  # --mcp-servers-config FILE: MCP servers (kvserve.tools.mcp)
    mcp_servers_json: str | None = None  # --mcp-servers-json JSON: the same, inline
    # -- added with the flag table (kvserve/serving/flags.py)
    path: str | None = None  # --path: directory of static files served at / (llama-server)
    offline: bool = False  # --offline / HF_HUB_OFFLINE: nothing is pulled at start-up
    kv_unified: bool | None = None  # -kvu/--no-kv-unified (None: on with -np auto)
    mmap: bool | None = None  # --mmap/--no-mmap: GGUF weights mapped / read into huge pages (None: auto)
    block_size: int = 16  # --block-size: tokens per KV block (vLLM)
    sampling: dict = field(default_factory=dict)  # other SamplingParams defaults (--presence-penalty, ...)
    chat_template_content_format: str = "auto"  # vLLM: auto | string | openai
    ssl_key_file: str | None = None  # --ssl-key-file/--ssl-keyfile: HTTPS through uvicorn
    ssl_cert_file: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    ssl_ciphers: str | None = None
    root_path: str = ""  # --root-path (vLLM): uvicorn's root_path (a proxy strips it)
    api_prefix: str = ""  # --api-prefix (llama-server): routes served under it too (kvserve.faces.paths)
    timeout: float | None = None  # -to/--timeout: keep-alive timeout of an idle connection (s)
    uvicorn_log_level: str | None = None  # --uvicorn-log-level (None: warning)
    log_file: str | None = None  # --log-file: the log also goes to this file
    log_disable: bool = False  # --log-disable: no log output
    sleep_idle_seconds: float = -1.0  # --sleep-idle-seconds: unload the -m model after N idle s (-1 never)
    tags: list[str] = field(default_factory=list)  # --tags (llama-server; informational)
    hosts: list[str] = field(default_factory=list)  # --host a,b: every address listened on (host: the first)
    # vLLM flags kept for the parts of #15 that use them (start-up checks, KV dtype, generation config)
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization when given (CUDA's KV budget)
    kv_cache_memory_bytes: int | None = None  # --kv-cache-memory-bytes (bytes)
    num_gpu_blocks_override: int | None = None  # --num-gpu-blocks-override (KV pool blocks)
    cpu_kvcache_space_bytes: int | None = None  # VLLM_CPU_KVCACHE_SPACE (GiB) in bytes: the CPU's KV budget
    allow_long_max_model_len: bool = False  # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: --max-model-len may exceed the model's
    vllm_batch_limits: bool = False  # --max-num-seqs/--max-num-batched-tokens given: vLLM's checks apply
    max_num_seqs: int | None = None  # --max-num-seqs as typed (vLLM's checks name it; -np wins for the slots)
    kv_cache_dtype: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    # vLLM's LoRA serving (kvserve.serving.lora_modules): adapters as model names
    enable_lora: bool = False  # --enable-lora (--lora-modules implies it)
    lora_modules: list = field(default_factory=list)  # --lora-modules: LoraModulePath items
    max_cpu_loras: int = 1  # --max-cpu-loras: vLLM adapters in memory per model (LRU); default --max-loras
    # speculative decoding (--spec-type ngram, --draft-max/--draft-min, --speculative-config)
    spec: SpecConfig = field(default_factory=SpecConfig)
    # LoRA (kvserve.lora): llama-server's --lora paths and --lora-scaled (path, scale) pairs of the -m model,
    # --lora-init-without-apply (every global scale 0), vLLM's limits (None: no limit)
    lora: list[str] = field(default_factory=list)
    lora_scaled: list[tuple[str, float]] = field(default_factory=list)
    # both as (path, scale) pairs in command-line order (llama-server's adapter ids); empty: --lora's first
    lora_in_order: list[tuple[str, float]] = field(default_factory=list)
    lora_init_without_apply: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_dtype: str = "auto"  # vLLM's --lora-dtype: the adapters' A/B dtype (auto: the model's)
    # what parsing found: log lines for flags without effect or not available ((logging level, text)),
    # and how each flag was given (dest -> "--flag" or "ENV_NAME")
    flag_notes: list = field(default_factory=list)
    flags_given: dict = field(default_factory=dict)

    @property
    def vllm_tools(self) -> bool:
        """Tool calling follows vLLM's rules (``--tool-call-parser``/``--enable-auto-tool-choice`` given,
        or ``--no-jinja``): ``tool_choice: "auto"`` needs both flags. Otherwise llama-server's: with
        ``--jinja`` (the default) the parser is detected from the chat template and auto is on."""
        return self.tool_call_parser is not None or self.enable_auto_tool_choice or not self.jinja

    def served_names(self) -> list[str]:
        """Names the model answers to: ``-a``/``--served-model-name``, else the model spec."""
        return list(self.alias) if self.alias else [self.model]

    def lora_adapters(self) -> tuple[tuple[str, float], ...]:
        """The start-up model's LoRA adapters, ``(path, global scale)``, their ids in order: ``--lora``
        paths (scale 1) and ``--lora-scaled`` pairs in command-line order, as llama-server numbers them
        (``lora_in_order``; a ServerArgs built without it: ``--lora``'s first); every scale 0 with
        ``--lora-init-without-apply`` (llama-server's)."""
        pairs = list(self.lora_in_order) or [(p, 1.0) for p in self.lora] + list(self.lora_scaled)
        if self.lora_init_without_apply:
            pairs = [(p, 0.0) for p, _ in pairs]
        return tuple(pairs)

    def default_sampling_params(self) -> SamplingParams:
        """Server-wide sampling defaults from ``--temp``, ``--top-k``, ``-n``..."""
        sp = SamplingParams(n_predict=self.n_predict, temperature=self.temp, top_k=max(self.top_k, 0),
                            top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                            seed=self.seed, n_cache_reuse=max(self.cache_reuse, 0),
                            spec_n_max=self.spec.num_speculative_tokens if self.spec.enabled else None,
                            spec_n_min=self.spec.min_tokens if self.spec.enabled else 0,
                            spec_p_min=self.spec.draft_p_min)
        return dataclasses.replace(sp, **self.sampling) if self.sampling else sp

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these flags describe."""
        return EngineConfig(
            n_ctx=self.ctx_size,
            n_parallel=self.parallel,
            kv_dtype=self.cache_type_k,
            kv_dtype_v=self.cache_type_v,
            max_num_batched_tokens=self.batch_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            threads=self.threads,
            compile=self.compile,
            native_kernels=self.native_kernels,
            large_batch_dtype=self.large_batch_dtype,
            device=self.device,
            cache_ram=self.cache_ram,
            kv_unified=self.kv_unified,
            block_size=self.block_size,
            spec=self.spec,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_kv_cache_memory_bytes=self.cpu_kvcache_space_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``kvserve serve`` (generated from the flag table; see
    :func:`kvserve.serving.flags.build_parser`)."""
    return ft.build_parser()


class _Exit(Exception):
    """Internal: a usage error (exit status 2): its text after the usage, or alone when it is a
    :class:`kvserve.serving.flags.Plain` text."""


@dataclass
class _Parsed:
    """Where the flags' values came from, as :func:`parse_args` found them.

    Attributes:
        v: dest -> final value (command line, else environment, else the table's default).
        given: dest -> the spelling or environment variable that gave it (flags not given: absent).
        how: dest -> how it was given, for messages (``-ngl 99``, ``LLAMA_ARG_X=1``; secrets ``***``).
        negative: dest -> whether a negative spelling (``--no-x``) gave it.
        env: the environment.
        notes: (logging level, text) lines for the log, in the order found.
    """

    v: dict[str, Any]
    given: dict[str, str]
    how: dict[str, str] = field(default_factory=dict)
    negative: dict[str, bool] = field(default_factory=dict)
    env: Any = None
    notes: list = field(default_factory=list)
    #: (dest, word) of every repeatable flag given on the command line, in order
    appended: list = field(default_factory=list)


def parse_args(argv: list[str], environ: dict | None = None) -> ServerArgs:
    """Parse ``kvserve serve`` arguments (and the environment variables the flag table names).

    ``-h``/``--help`` prints every flag and exits 0; ``--version`` and ``--list-devices`` print
    and exit 0. A usage error (an unknown flag, a bad value, a refused flag) prints the usage and
    an ``error:`` line to stderr and exits 2.

    Args:
        argv: the words after ``kvserve serve``.
        environ: the environment (default ``os.environ``).
    """
    p = ft.build_parser()
    ns = _command_line(p, argv)
    s = _values(p, ns, os.environ if environ is None else environ)
    try:
        return _build(p, s)
    except _Exit as e:
        if isinstance(e.args[0], ft.Plain):
            p.exit(2, f"{e.args[0]}\n")
        p.error(str(e))


def _command_line(p, argv: list[str]) -> argparse.Namespace:
    """The namespace of the command line (``--config`` file first); ``--help`` prints and exits."""
    argv = ft.join_lora_scaled(ft.dashed_names(list(argv)))
    try:
        argv = _with_config(argv)
    except (OSError, ValueError) as e:
        p.error(str(e))
    ns = p.parse_args(ft.fill_optional_values(argv))
    if ns.help:
        sys.stdout.write(ft.help_text())
        p.exit(0)
    return ns


def _values(p, ns: argparse.Namespace, env) -> _Parsed:
    """Each flag's value: the command line's, else its first set environment variable's, else
    the default. A bad environment value exits 2 (except :data:`~kvserve.serving.flags.LENIENT_ENV`)."""
    s = _Parsed({"model_pos": getattr(ns, "model_pos", None)}, dict(getattr(ns, "_given", {})), env=env,
                appended=list(getattr(ns, "_appended", [])))
    for f in ft.FLAGS:
        if hasattr(ns, f.dest):
            value, opt = getattr(ns, f.dest), s.given[f.dest]
            s.negative[f.dest] = opt in f.neg
            s.how[f.dest] = opt if f.kind == "bool" else f"{opt} {'***' if f.dest in _SECRET else _shown(value)}"
        elif (found := _from_env(p, f, env)) is not None:
            opt, value = found
            s.given[f.dest] = opt
            s.negative[f.dest] = f.kind == "bool" and value is False and bool(f.neg)
            s.how[f.dest] = f"{opt}={'***' if f.dest in _SECRET else env[opt]}"
        else:
            value = f.default
        s.v[f.dest] = value
    return s


def _from_env(p, flag, env) -> tuple[str, Any] | None:
    """``(variable, value)`` of the flag's first non-empty environment variable, or None."""
    name = next((n for n in flag.env if env.get(n, "") != ""), None)
    if name is None:
        return None
    try:
        return name, _env_value(flag, env[name])
    except ValueError as e:
        if name in ft.LENIENT_ENV:
            return None
        p.exit(2, f'error while handling environment variable "{name}": {e}\n')


def _env_value(flag, text: str) -> Any:
    """An environment variable's text as the flag's value (llama-server's rules for booleans)."""
    if flag.kind == "opt":
        low = text.strip().lower()
        if low in ("1", "true", "enabled"):
            low = str(flag.const)
        elif low in ("0", "false", "disabled"):
            low = "off"
        if flag.choices is not None and low not in flag.choices:
            raise ValueError(f"expected one of {', '.join(flag.choices)}, got {text!r}")
        return low
    if flag.kind == "list":
        return [v.strip() for v in text.split(",") if v.strip()]
    if flag.kind == "append":
        return [text]
    value = flag.to_value(text)
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"expected one of {', '.join(flag.choices)}, got {text!r}")
    return value


#: flags whose values never appear in messages or log lines
_SECRET = frozenset({"api_key", "hf_token"})


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _with_config(argv: list[str]) -> list[str]:
    """vLLM's ``--config FILE``: its flags first, so the command line overrides them."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise ValueError("argument --config: expected one argument")
    rest = argv[:i] + argv[i + 2:]
    words = ft.config_file_argv(argv[i + 1])
    if words and not words[0].startswith("-") and any(not w.startswith("-") for w in rest[:1]):
        words = words[1:]  # the command line's positional MODEL wins over the file's model
    return words + rest


def _build(p, s: _Parsed) -> ServerArgs:
    """ServerArgs from the flags' final values: the table's checks and each field's value
    (:attr:`Flag.config <kvserve.serving.flags.Flag.config>`), then the rules that join flags."""
    _print_and_exit(p, s.v)
    _check_given(s)
    _env_address(s)
    fields: dict[str, Any] = {}
    for rule in (_model_fields, _slots_fields, _manager_fields, _device_fields, _http_fields, _chat_fields,
                 _sampling_fields, _spec_fields, _lora_fields):
        fields.update(rule(s))
    args = ServerArgs(**{**_table_fields(s.v), **fields, "flag_notes": s.notes, "flags_given": s.given})
    try:
        args.default_sampling_params()
        args.engine_config()
    except (InvalidRequestError, ValueError) as e:
        raise _Exit(str(e)) from None
    return args


def _print_and_exit(p, v: dict) -> None:
    """``--version`` and ``--list-devices`` print and exit 0."""
    if v["version"]:
        from kvserve.serving.state import build_info

        sys.stdout.write(f"kvserve {build_info()}\n")
        p.exit(0)
    if v["list_devices"]:
        _print_devices()
        p.exit(0)


def _check_given(s: _Parsed) -> None:
    """Each given flag's check (the table's error text) and effect: refused flags exit 2; flags
    without effect or not available add a log line."""
    for dest in s.given:
        f = ft.BY_DEST[dest]
        effect, why = f.effect_for(s.negative.get(dest, False))
        if f.check is not None and s.v[dest] is not None:
            problem = f.check(s.v[dest])
            if problem:
                raise _Exit(problem)
        if effect == ft.REFUSE:
            raise _Exit(f"{s.how[dest]}: not supported by kvserve: {why}")
        if dest == "gpu_layers" and str(s.v[dest]) == "0":
            continue  # -ngl 0: the CPU (_device_fields)
        if effect == ft.NONE:
            s.notes.append((logging.INFO, f"flag {s.how[dest]}: no effect here: {why}"))
        elif effect == ft.WARN:
            s.notes.append((logging.WARNING, f"flag {s.how[dest]}: ignored, not available in kvserve: {why}"))


_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerArgs))


def _table_fields(v: dict) -> dict[str, Any]:
    """The ServerArgs fields named as a flag's dest: its value, through the flag's ``config``."""
    return {f.dest: f.config(v[f.dest]) if f.config else v[f.dest] for f in ft.FLAGS if f.dest in _FIELDS}


def _env_address(s: _Parsed) -> None:
    """The listening address from ``$KVSERVE_HOST``, else ``$OLLAMA_HOST`` (Ollama's forms; a port
    left out is 8080, resp. Ollama's 11434), the variables ``kvserve``'s other commands find the
    server by, when neither ``--host`` nor ``--port`` (nor ``LLAMA_ARG_HOST``/``LLAMA_ARG_PORT``)
    is given. Precedence: flag, then llama-server's variable, then these. The address gets the
    flags' checks."""
    from kvserve.ollama.client import KVSERVE_DEFAULT_PORT, OLLAMA_DEFAULT_PORT, listen_address
    if "host" in s.given or "port" in s.given:
        return
    for name, port in (("KVSERVE_HOST", KVSERVE_DEFAULT_PORT), ("OLLAMA_HOST", OLLAMA_DEFAULT_PORT)):
        text = s.env.get(name, "").strip()
        if text:
            host, s.v["port"] = listen_address(text, port)
            s.v["host"] = [host]
            s.given["host"] = s.given["port"] = name
            s.notes.append((logging.INFO, f"listening address from {name}={text}"))
            problem = ft.BY_DEST["port"].check(s.v["port"]) or ft.BY_DEST["host"].check(s.v["host"])
            if problem:
                raise _Exit(problem)
            return


def _model_fields(s: _Parsed) -> dict[str, Any]:
    """The model (``-m``, positional MODEL or ``-hf``; given once), its API names, the API keys and how
    its GGUF weights are held (``--mmap`` / ``--no-mmap``, else llama-server's ``-lm``)."""
    v = s.v
    model = v["model"]
    if model and v["model_pos"] and model != v["model_pos"]:
        raise _Exit("give the model once: positional MODEL or -m/--model")
    model = model or v["model_pos"]
    if v["hf_repo"]:
        if model:
            raise _Exit("give the model once: -hf/--hf-repo or MODEL/-m")
        model = _hf_model(v["hf_repo"])
    keys = [k.strip() for item in v["api_key"] or [] for k in item.split(",") if k.strip()]
    if v["api_key_file"]:
        keys += ft.read_keys(v["api_key_file"])
    alias = list(v["served_model_name"] or [])
    if v["alias"]:
        # llama-server keeps its aliases in a std::set: the alphabetically first is the model's id
        alias = sorted(dict.fromkeys(x.strip() for x in v["alias"].split(",") if x.strip())) + alias
    mmap = v["mmap"]
    if mmap is None and v["load_mode"]:  # llama-server's -lm: how GGUF weights are held (--mmap / --no-mmap)
        modes = {"auto": None, "mmap": True, "mmap+mlock": True, "none": False, "mlock": False, "dio": False}
        if v["load_mode"] not in modes:
            raise _Exit(f'error while handling argument "-lm": invalid value {v["load_mode"]!r} '
                        f'(auto, none, mmap, mlock, mmap+mlock or dio)')
        mmap = modes[v["load_mode"]]
    return {"model": model or DEFAULT_MODEL, "model_given": bool(model), "alias": alias, "api_keys": keys,
            "mmap": mmap}


def _hf_model(repo: str) -> str:
    """``-hf user/model[:quant]`` -> the store name ``hf.co/user/model[:quant]``."""
    repo = re.sub(r"^(https?://)?(huggingface\.co|hf\.co)/", "", repo.strip())
    return f"hf.co/{repo}"


def _slots_fields(s: _Parsed) -> dict[str, Any]:
    """Slots, the step's token budget and the KV pool: ``-np`` else vLLM's ``--max-num-seqs``
    (vLLM's batch check when given; sequences then share one pool), ``-b`` else
    ``--max-num-batched-tokens``; ``OLLAMA_CONTEXT_LENGTH`` is each slot's context."""
    v, given = s.v, s.given
    parallel = v["parallel"] if v["parallel"] is not None else (
        v["max_num_seqs"] if v["max_num_seqs"] is not None else -1)
    batch = v["batch_size"] or v["max_num_batched_tokens"] or 2048
    vllm_batch = "max_num_seqs" in given or "max_num_batched_tokens" in given
    if vllm_batch:  # vLLM's SchedulerConfig check (002 Example 4)
        from kvserve.serving.startup_checks import batch_error

        seqs = v["max_num_seqs"] if "max_num_seqs" in given else parallel  # the value the user typed
        problem = batch_error(batch, 4 if seqs == -1 else seqs)
        if problem:
            raise _Exit(problem)
    cpu_kv_bytes = _cpu_kvcache_space(s.env)
    kv_unified = v["kv_unified"]
    if kv_unified is None and "max_num_seqs" in given and v["parallel"] is None:
        kv_unified = True  # vLLM's sequences share one pool and each may use max_model_len
    ctx_size = v["ctx_size"]
    if given.get("ctx_size") == "OLLAMA_CONTEXT_LENGTH" and parallel > 1 and not kv_unified:
        # Ollama's context length is each sequence's (num_ctx); -c is the total the slots split
        ctx_size *= parallel
        s.notes.append((logging.INFO, f"OLLAMA_CONTEXT_LENGTH={s.env['OLLAMA_CONTEXT_LENGTH'].strip()} tokens a "
                                      f"sequence, as Ollama: -c {ctx_size} for {parallel} slots"))
    return {"parallel": parallel, "batch_size": batch, "ctx_size": ctx_size, "kv_unified": kv_unified,
            "cpu_kvcache_space_bytes": cpu_kv_bytes, "vllm_batch_limits": vllm_batch,
            "max_num_seqs": v["max_num_seqs"] if "max_num_seqs" in given else None,
            "allow_long_max_model_len": s.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower()
            in ("1", "true"),
            "gpu_memory_utilization": v["gpu_memory_utilization"] if "gpu_memory_utilization" in given else None}


def _cpu_kvcache_space(env) -> int | None:
    """vLLM's ``VLLM_CPU_KVCACHE_SPACE``: the CPU's KV cache budget in GiB (a number; unset, empty
    or 0: none) -> bytes. A bad value exits 2 as a bad environment variable does."""
    text = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not text:
        return None
    try:
        gib = float(text)
        if not math.isfinite(gib) or gib < 0:
            raise ValueError
    except ValueError:
        raise _Exit(ft.Plain(f'error while handling environment variable "VLLM_CPU_KVCACHE_SPACE": expected a '
                             f'number of GiB, got {text!r}')) from None
    return int(gib * (1 << 30)) or None


def _manager_fields(s: _Parsed) -> dict[str, Any]:
    """Models loaded at once: ``--max-loaded-models`` (0: 3), else llama-server's ``--models-max``
    (0: no limit)."""
    from kvserve.serving.manager import DEFAULT_MAX_LOADED

    v = s.v
    max_loaded = v["max_loaded_models"]
    if "max_loaded_models" not in s.given and v["models_max"] is not None:
        if v["models_max"] < 0:
            raise _Exit(f"invalid --models-max {v['models_max']}: 0 (no limit) or more")
        max_loaded = v["models_max"] or 1 << 20  # llama-server: 0 = no limit
    return {"max_loaded_models": max_loaded or DEFAULT_MAX_LOADED}


def _device_fields(s: _Parsed) -> dict[str, Any]:
    """The device (``-ngl 0`` is the CPU unless ``--device`` is given), KV types, compiling,
    embeddings mode, log verbosity."""
    v = s.v
    device = ft.device_name(v["device"])
    if str(v["gpu_layers"]) == "0" and "device" not in s.given:
        device = "cpu"
        s.notes.append((logging.INFO, f"flag {s.how['gpu_layers']}: the model runs on the CPU (as --device cpu)"))
    kv_k, kv_v = _kv_types(v, s.given)
    embeddings = v["embedding"] or v["task"] in ("embed", "embedding") or v["runner"] == "pooling" \
        or v["convert"] == "embed"
    return {"device": device, "cache_type_k": kv_k, "cache_type_v": kv_v, "embeddings": embeddings,
            "compile": v["compile"] and not v["enforce_eager"],
            "log_verbosity": max(v["log_verbosity"], 5) if v["verbose"] else v["log_verbosity"]}


def _http_fields(s: _Parsed) -> dict[str, Any]:
    """Listening addresses, TLS (key and certificate together) and CORS."""
    if (s.v["ssl_key_file"] is None) != (s.v["ssl_cert_file"] is None):
        raise _Exit("--ssl-key-file and --ssl-cert-file go together: give both for HTTPS")
    origins, methods, headers, credentials = _cors(s.v, s.given, s.notes)
    hosts = ft.host_list(s.v["host"])  # repeated --host (llama-server), each comma-separated
    return {"host": hosts[0], "hosts": hosts, "cors_origins": origins, "cors_methods": methods,
            "cors_headers": headers, "cors_credentials": credentials}


def _chat_fields(s: _Parsed) -> dict[str, Any]:
    """Tool choice (vLLM: ``--enable-auto-tool-choice`` needs a parser), template variables and
    ``--reasoning``."""
    if s.v["enable_auto_tool_choice"] and not s.v["tool_call_parser"]:
        # vLLM's startup check (validate_parsed_serve_args)
        raise _Exit(ft.Plain("error: --enable-auto-tool-choice requires --tool-call-parser"))
    return {"slots_text": s.given.get("slots") == "--slots",
            "chat_template_kwargs": _template_kwargs(s.v),
            "reasoning": None if s.v["reasoning"] in (None, "auto") else s.v["reasoning"]}


def _lora_fields(s: _Parsed) -> dict[str, Any]:
    """vLLM's LoRA flags: ``--lora-modules`` words (``name=path`` or JSON; vLLM's texts for a bad
    one; they imply ``--enable-lora``); with ``--enable-lora`` vLLM's defaults ``--max-loras 1`` and
    ``--max-lora-rank 16``, else no limits (llama-server's ``--lora``); ``--max-cpu-loras`` (default
    ``--max-loras``; vLLM's check that it is not smaller)."""
    from kvserve.serving.lora_modules import parse_lora_modules

    v = s.v
    try:
        modules = parse_lora_modules(v["lora_modules"] or [])
    except ValueError as e:
        raise _Exit(str(e)) from None
    enable = bool(v["enable_lora"] or modules)
    max_loras, max_rank = v["max_loras"], v["max_lora_rank"]
    if enable:
        max_loras = 1 if max_loras is None else max_loras
        max_rank = 16 if max_rank is None else max_rank
    max_cpu = v["max_cpu_loras"] if v["max_cpu_loras"] is not None else (max_loras or 1)
    if max_loras is not None and max_cpu < max_loras:
        raise _Exit(f"max_cpu_loras ({max_cpu}) must be >= max_loras ({max_loras})")
    return {"lora_modules": modules, "enable_lora": enable, "max_loras": max_loras, "max_lora_rank": max_rank,
            "max_cpu_loras": max_cpu, "lora_in_order": _lora_in_order(s)}


def _lora_in_order(s: _Parsed) -> list[tuple[str, float]]:
    """``--lora`` (scale 1) and ``--lora-scaled`` adapters as (path, scale) pairs in command-line order:
    llama-server gives adapter ids in that order across both flags. Values from the environment (not
    in the command line's record) follow, ``--lora``'s first."""
    words = {"lora": [], "lora_scaled": []}
    order = []
    for dest, word in s.appended:
        if dest in words:
            words[dest].append(word)
            order.append((dest, word))
    out = []
    for dest, word in order:
        out += [(p, 1.0) for p in ft.lora_paths([word])] if dest == "lora" else ft.lora_scaled([word])
    if s.v["lora"] and not words["lora"]:
        out += [(p, 1.0) for p in ft.lora_paths(s.v["lora"])]
    if s.v["lora_scaled"] and not words["lora_scaled"]:
        out += ft.lora_scaled(s.v["lora_scaled"])
    return out


def _cors(v: dict, given: dict, notes: list) -> tuple[list[str], str, str, bool]:
    """``(origins, methods, headers, credentials)`` of the CORS answers (:mod:`kvserve.faces.auth`).

    llama-server's ``--cors-*`` flags win; vLLM's ``--allowed-origins/--allowed-methods/
    --allowed-headers/--allow-credentials`` apply when their llama-server twin is not given.
    As llama-server, ``--tools`` without an explicit origin list limits CORS to ``localhost``
    (the tools read, write and run things on this machine). An explicitly empty list (``--cors-origins ''``, ``--allowed-origins '[]'``)
    allows no origin: no CORS headers are sent (vLLM's CORSMiddleware with no origins)."""
    origins = [o.strip() for o in v["cors_origins"].split(",") if o.strip()]
    explicit = "cors_origins" in given  # an explicitly empty list allows no cross-origin page
    if "cors_origins" not in given:
        if v["allowed_origins"] is not None:
            origins = [o.strip() for o in v["allowed_origins"] if str(o).strip()]
            explicit = True
        elif v.get("tools"):
            origins = ["localhost"]
            notes.append((logging.WARNING, "server tools are enabled (--tools): CORS is limited to localhost "
                                           "origins; use --cors-origins to change it"))
    methods, headers = v["cors_methods"], v["cors_headers"]
    if "cors_methods" not in given and v["allowed_methods"]:
        methods = ", ".join(v["allowed_methods"])
    if "cors_headers" not in given and v["allowed_headers"]:
        headers = ", ".join(v["allowed_headers"])
    credentials = bool(v["cors_credentials"])
    if "cors_credentials" not in given and v["allow_credentials"]:
        credentials = True
    return origins if origins or explicit else ["*"], methods, headers, credentials


def _kv_types(v: dict, given: dict) -> tuple[str, str]:
    """(K, V) cache types from -ctk/-ctv and vLLM's --kv-cache-dtype: bfloat16 -> bf16, fp8 ->
    fp8_e4m3, fp8_e5m2 for both halves, except a half whose -ctk/-ctv is given (it wins)."""
    kv_k, kv_v = v["cache_type_k"], v["cache_type_v"]
    vllm = {"bfloat16": "bf16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
    t = vllm.get(v["kv_cache_dtype"])
    if t is not None:
        kv_k = kv_k if "cache_type_k" in given else t
        kv_v = kv_v if "cache_type_v" in given else t
    return kv_k, kv_v


def _spec_fields(s: _Parsed) -> dict[str, Any]:
    return {"spec": _spec_config(s.v, s.given, s.how, s.notes)}


def _spec_config(v: dict, given: dict, how: dict, notes: list) -> SpecConfig:
    """Speculative decoding from vLLM's ``--speculative-config`` (method ngram; vLLM's defaults:
    prompt_lookup_min/max 5 when neither is given, the other one's value when one is) or
    llama-server's ``--spec-type ngram`` (K = ``--draft-max``, else ``--spec-ngram-size-m``,
    else 16; n-gram length ``--spec-ngram-size-n`` exactly, else kvserve's 4 down to 2).
    ``--draft-min`` applies to both. A draft model: ``-md`` (K = ``--draft-max``, else 16) or
    vLLM's ``{"model": X, "num_speculative_tokens": K}`` (method "draft_model" or none), with
    ``--draft-p-min`` (default 0.0). Off otherwise (the draft-size flags then log that they
    do nothing)."""
    cfg = v["speculative_config"]
    n_min = v["draft_min"] or 0
    p_min = v["draft_p_min"] if v.get("draft_p_min") is not None else 0.0
    if cfg is not None and (cfg.get("method") == "draft_model" or (cfg.get("method") is None and "model" in cfg)):
        return SpecConfig("draft_model", cfg["num_speculative_tokens"], n_min, draft_model=cfg["model"],
                          draft_p_min=p_min)
    if v.get("model_draft"):
        if v["spec_type"] in ("ngram", "ngram-simple"):
            notes.append((logging.INFO, f"flag {how['spec_type']}: the draft model (-md) is used for speculation"))
        k = v["draft"] if v["draft"] is not None else DEFAULT_NUM_SPECULATIVE_TOKENS
        return SpecConfig("draft_model", k, n_min, draft_model=v["model_draft"], draft_p_min=p_min)
    if cfg is not None:
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        return SpecConfig("ngram", cfg["num_speculative_tokens"], n_min, hi, lo)
    if v["spec_type"] in ("ngram", "ngram-simple"):
        k = v["draft"] if v["draft"] is not None else (v["spec_ngram_size_m"] or DEFAULT_NUM_SPECULATIVE_TOKENS)
        n = v["spec_ngram_size_n"]
        hi, lo = (n, n) if n else (DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN)
        return SpecConfig("ngram", k, n_min, hi, lo)
    for dest in ("draft", "draft_min", "draft_p_min", "spec_ngram_size_n", "spec_ngram_size_m"):
        if dest in given:
            notes.append((logging.INFO, (f"flag {how[dest]}: no effect here: speculative decoding is off "
                                         "(--spec-type ngram or -md turns it on)")))
    return SpecConfig()


def _template_kwargs(v: dict) -> dict:
    """``--default-chat-template-kwargs`` (vLLM) under ``--chat-template-kwargs`` (llama-server)."""
    from kvserve.chat.template import RESERVED_VARIABLES

    tkw = {**(v["default_chat_template_kwargs"] or {}), **(v["chat_template_kwargs"] or {})}
    if set(tkw) & RESERVED_VARIABLES:
        raise _Exit(f"invalid --chat-template-kwargs: {sorted(set(tkw) & RESERVED_VARIABLES)} are set by each "
                    "request")
    return tkw


def _sampling_fields(s: _Parsed) -> dict[str, Any]:
    """Server-wide sampling defaults: ``--temp``/``--top-k``/``-n``... under
    ``--override-generation-config``, and the other SamplingParams defaults (``sampling``)."""
    v = s.v
    overrides = v["override_generation_config"] or {}
    for key, value in overrides.items():
        if key in ft.GEN_KEYS and ft.is_number(value):
            dest = {"n_predict": "predict"}.get(ft.GEN_KEYS[key], ft.GEN_KEYS[key])
            if dest in s.given:
                s.notes.append((logging.INFO, (f"flag --override-generation-config: {key} = "
                                               f"{ft.generation_value(key, value)!r} wins over {s.given[dest]} "
                                               f"{v[dest]!r}")))
        elif not (key in ft.GEN_SAMPLING and isinstance(value, (int, float))):
            s.notes.append((logging.WARNING, (f"flag --override-generation-config: key {key!r} ignored: kvserve "
                            f"takes {', '.join(sorted(set(ft.GEN_KEYS) | ft.GEN_SAMPLING))} (numbers)")))
    gen = ft.generation_overrides(overrides)
    fields = {name: gen.get(name, v[name]) for name in ("temp", "top_k", "top_p", "min_p", "repeat_penalty")}
    return {**fields, "n_predict": gen.get("n_predict", v["predict"]), "sampling": _sampling(v)}


#: flags whose value is a SamplingParams default of the same meaning (dest -> SamplingParams field)
_SAMPLING_FLAGS = {"presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repeat_last_n": "repeat_last_n", "typical": "typical_p", "top_nsigma": "top_n_sigma",
                   "xtc_probability": "xtc_probability", "xtc_threshold": "xtc_threshold",
                   "dry_multiplier": "dry_multiplier", "dry_base": "dry_base",
                   "dry_allowed_length": "dry_allowed_length", "dry_penalty_last_n": "dry_penalty_last_n"}


def _sampling(v: dict) -> dict[str, Any]:
    """SamplingParams defaults beyond temp/top-k/...: the sampling flags given, and
    ``--override-generation-config``'s presence and frequency penalties."""
    s: dict[str, Any] = {name: v[dest] for dest, name in _SAMPLING_FLAGS.items() if v[dest] is not None}
    if v["dry_sequence_breaker"]:
        s["dry_sequence_breakers"] = () if v["dry_sequence_breaker"] == ["none"] else tuple(v["dry_sequence_breaker"])
    if v["samplers"]:
        s["samplers"] = ft.samplers(v["samplers"])
    if v["ignore_eos"]:
        s["ignore_eos"] = True
    if v["logit_bias"]:
        s["logit_bias"] = ft.logit_bias(v["logit_bias"])
    if not v["cache_prompt"] or not v["enable_prefix_caching"]:
        s["cache_prompt"] = False
    for key, value in (v["override_generation_config"] or {}).items():
        if key not in ft.GEN_KEYS and key in ft.GEN_SAMPLING and isinstance(value, (int, float)):
            s[key] = float(value)
    return s


def _print_devices() -> None:
    """``--list-devices``: the devices kvserve can run on."""
    import torch

    print("Available devices:")
    print("  cpu")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}")
