"""``kvserve serve`` command line: llama-server's flag names (short and long) and vLLM's.

An unknown flag is an error (exit 2), abbreviations are not accepted.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from kvserve.config import EngineConfig
from kvserve.engine.request import SEED_RANDOM, InvalidRequestError, SamplingParams

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
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    sse_ping_interval: float = 30.0
    cors_origins: list[str] = field(default_factory=lambda: ["*"])
    log_verbosity: int = 3
    embeddings: bool = False
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int = 0
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_format: str = "auto"
    reasoning_parser: str | None = None
    reasoning_budget: int = -1
    reasoning: str | None = None  # --reasoning on|off: enable_thinking for every request
    chat_template_kwargs: dict = field(default_factory=dict)
    max_logprobs: int = 20  # vLLM --max-logprobs: top candidates per token a request may ask for; -1 = vocab size
    max_request_bytes: int = 32 * 1024 * 1024  # --max-request-bytes: larger bodies get 413
    keep_alive: float = 300.0  # --keep-alive seconds (math.inf: forever); Ollama's default 5m
    max_loaded_models: int = 3  # --max-loaded-models (OLLAMA_MAX_LOADED_MODELS)
    max_memory: int | None = None  # --max-memory in bytes: cap on all loaded models together
    max_queue: int = 512  # --max-queue: requests waiting for a model at once (OLLAMA_MAX_QUEUE)
    preload: bool = True  # --no-preload: start with no model loaded
    allow_model_paths: bool = False  # --allow-model-paths: requests may name model files on the server
    models_dir: str | None = None  # --models-dir: the store (Ollama layout); None: $OLLAMA_MODELS, $KVSERVE_HOME/models
    cache_ram_share: int | None = None  # set by the server: models sharing the host prompt-cache budget
    webui: bool = True  # --no-webui/--no-ui: GET / answers "Ollama is running" to browsers too

    @property
    def vllm_tools(self) -> bool:
        """Tool calling follows vLLM's rules (``--tool-call-parser``/``--enable-auto-tool-choice`` given,
        or ``--no-jinja``): ``tool_choice: "auto"`` needs both flags. Otherwise llama-server's: with
        ``--jinja`` (the default) the parser is detected from the chat template and auto is on."""
        return self.tool_call_parser is not None or self.enable_auto_tool_choice or not self.jinja

    def served_names(self) -> list[str]:
        """Names the model answers to: ``-a``/``--served-model-name``, else the model spec."""
        return list(self.alias) if self.alias else [self.model]

    def default_sampling_params(self) -> SamplingParams:
        """Server-wide sampling defaults from ``--temp``, ``--top-k``, ``-n``..."""
        return SamplingParams(n_predict=self.n_predict, temperature=self.temp, top_k=max(self.top_k, 0),
                              top_p=self.top_p, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                              seed=self.seed, n_cache_reuse=max(self.cache_reuse, 0))

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these flags describe."""
        return EngineConfig(
            n_ctx=self.ctx_size,
            n_parallel=self.parallel,
            kv_dtype=self.cache_type_k,
            max_num_batched_tokens=self.batch_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            threads=self.threads,
            compile=self.compile,
            native_kernels=self.native_kernels,
            large_batch_dtype=self.large_batch_dtype,
            device=self.device,
            cache_ram=self.cache_ram,
        )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D401 - argparse hook
        self.print_usage()
        self.exit(2, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``kvserve serve``."""
    p = _Parser(prog="kvserve serve", allow_abbrev=False,
                description="Serve a model over HTTP (llama-server and OpenAI APIs).")
    a = p.add_argument
    a("model_pos", nargs="?", metavar="MODEL", help=f"model name, .gguf path or HF dir (default {DEFAULT_MODEL})")
    a("-m", "--model", help="model name, .gguf path or HF directory")
    a("-a", "--alias", help="model name for the API (comma-separated for several)")
    a("--served-model-name", nargs="+", help="model name(s) for the API (vLLM)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8080)
    a("-c", "--ctx-size", type=int, default=0, help="total context in tokens (0 = the model's)")
    a("--max-model-len", type=int, default=0, help="max context of one sequence (vLLM)")
    a("-np", "--parallel", type=int, default=None, help="slots (-1 = auto: 4, unified KV)")
    a("--max-num-seqs", type=int, default=None, help="slots (vLLM name of -np)")
    a("-t", "--threads", type=int, default=0)
    a("--large-batch-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
      help="dense weight copy for steps above 16 rows (prefill) with --dtype auto on CPU: auto = bfloat16 "
           "where the CPU has native bf16, else float32")
    a("--compile", action="store_true",
      help="torch.compile the decode step in the background (serves eagerly until ready; ~90 s of CPU the "
           "first time, cached in $KVSERVE_HOME/inductor)")
    a("--native-kernels", action="store_true",
      help="with --compile on AVX512-VNNI CPUs: kvserve's own 4-bit kernel (llama.cpp's int8 activation "
           "rounding) in place of torch's int4 kernel for steps of up to 16 rows")
    a("-b", "--batch-size", type=int, default=None, help="tokens per step (= --max-num-batched-tokens)")
    a("-ub", "--ubatch-size", type=int, default=512, help="accepted; one step is one batch here")
    a("--max-num-batched-tokens", type=int, default=None)
    a("-n", "--n-predict", type=int, default=-1)
    a("--temp", type=float, default=0.8)
    a("--top-k", type=int, default=40)
    a("--top-p", type=float, default=0.95)
    a("--min-p", type=float, default=0.05)
    a("--repeat-penalty", type=float, default=1.0)
    a("-s", "--seed", type=int, default=-1)
    a("--api-key", default=None, help="API key(s), comma-separated")
    a("--api-key-file", default=None, help="file with one API key per line")
    a("--metrics", action="store_true")
    a("--slots", dest="slots", action="store_const", const="explicit", default=True)
    a("--no-slots", dest="slots", action="store_false")
    a("--props", action="store_true")
    a("--slot-save-path", default=None, help="existing directory for slot files")
    a("--cache-ram", type=int, default=None,
      help="host prompt cache in MiB (default: min(8192, a quarter of MemAvailable); -1 no limit, 0 off)")
    a("--cache-reuse", type=int, default=0)
    a("--slot-prompt-similarity", "-sps", type=float, default=0.10)
    a("--jinja", dest="jinja", action="store_true", default=True)
    a("--no-jinja", dest="jinja", action="store_false")
    a("--chat-template", default=None)
    a("--chat-template-file", default=None)
    a("-ctk", "--cache-type-k", default="f16", choices=["f16", "f32", "bf16"])
    a("-ctv", "--cache-type-v", default="f16", choices=["f16", "f32", "bf16"])
    a("--sse-ping-interval", type=float, default=30.0, help="seconds between SSE comment pings")
    a("--cors-origins", default="*", help="comma-separated origins, * for all")
    a("-lv", "--log-verbosity", "--verbosity", type=int, default=3)
    a("--embeddings", action="store_true")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    a("--device", default="auto")
    a("--tool-call-parser", default=None, help="tool-call parser (vLLM names: hermes, llama3_json, mistral, pythonic)")
    a("--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto" (vLLM)')
    a("--exclude-tools-when-tool-choice-none", action="store_true",
      help='leave tool definitions out of the prompt when tool_choice is "none" (vLLM)')
    a("--reasoning-format", default="auto", choices=["auto", "none", "deepseek", "deepseek-legacy"],
      help="where thinking goes in chat responses (llama-server): reasoning_content unless none")
    a("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
      help="split thinking into the 'reasoning' field (vLLM)")
    a("--reasoning-budget", type=int, default=-1, help="thinking tokens before </think> is forced (-1: no limit)")
    a("--reasoning", default=None, choices=["on", "off"], help="enable_thinking for every request's template")
    a("--chat-template-kwargs", default=None, help="JSON object passed to every chat template render")
    a("--max-logprobs", type=int, default=20,
      help="most logprobs (n_probs, top_logprobs, logprobs) per token a request may ask for; -1: vocabulary size")
    a("--max-request-bytes", type=int, default=int(os.environ.get("KVSERVE_MAX_REQUEST_BYTES", 32 * 1024 * 1024)),
      help="largest request body in bytes (413 above it; default 32 MiB, env KVSERVE_MAX_REQUEST_BYTES)")
    a("--keep-alive", default=os.environ.get("KVSERVE_KEEP_ALIVE", os.environ.get("OLLAMA_KEEP_ALIVE", "5m")),
      help="how long an idle model stays loaded: seconds or a duration (5m, 1h30m); negative = forever, "
           "0 = unload after each request (default 5m; env KVSERVE_KEEP_ALIVE, OLLAMA_KEEP_ALIVE)")
    a("--max-loaded-models", type=int, default=_env_int("OLLAMA_MAX_LOADED_MODELS", 0),
      help="most models loaded at once (default 3; env OLLAMA_MAX_LOADED_MODELS, 0 = default)")
    a("--max-memory", default=os.environ.get("KVSERVE_MAX_MEMORY"),
      help="cap on the memory of all loaded models together, in MiB or with a unit (8GiB, 4096MiB); "
           "default: what the machine has available")
    a("--max-queue", type=int, default=_env_int("OLLAMA_MAX_QUEUE", 512),
      help="most requests waiting for a model to load or for room at once (503 above; default 512)")
    a("--no-preload", dest="preload", action="store_false",
      help="start with no model loaded (the default model loads on its first request)")
    a("--allow-model-paths", action="store_true",
      help="let requests name a .gguf file or HF directory on the server as their model (off: only -m "
           "and the store's names)")
    a("--models-dir", default=None,
      help="model store in Ollama's layout (manifests/ + blobs/), read and written in place: point it at "
           "~/.ollama/models to serve pulled Ollama models (default: env OLLAMA_MODELS, else "
           "$KVSERVE_HOME/models)")
    a("--webui", dest="webui", action="store_true", default=True,
      help="serve the web chat page at / to browsers (default on)")
    a("--no-webui", "--no-ui", dest="webui", action="store_false", help="no web chat page (llama-server)")
    return p


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


_UNITS = {"": 1 << 20, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_memory(text: str) -> int:
    """``--max-memory``: a number of MiB, or a number with a unit (``8GiB``, ``512MB``) -> bytes.

    Raises:
        ValueError: not such a size, or not positive.
    """
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid --max-memory {text!r}: a number of MiB or a size such as 8GiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"invalid --max-memory {text!r}: must be positive")
    return value


def _read_keys(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


def parse_args(argv: list[str]) -> ServerArgs:
    """Parse ``kvserve serve`` arguments; exits 2 on an unknown flag or a bad value."""
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.model and ns.model_pos and ns.model != ns.model_pos:
        p.error("give the model once: positional MODEL or -m/--model")
    model = ns.model or ns.model_pos
    if ns.slot_save_path is not None and not os.path.isdir(ns.slot_save_path):
        # llama-server's wording (seed Example 1); it exits at once
        p.exit(2, f'error while handling argument "--slot-save-path": not a directory: {ns.slot_save_path}\n')
    keys: list[str] = []
    if ns.api_key:
        keys += [k.strip() for k in ns.api_key.split(",") if k.strip()]
    if ns.api_key_file:
        try:
            keys += _read_keys(ns.api_key_file)
        except OSError as e:
            p.error(f'error while handling argument "--api-key-file": {e}')
    alias = list(ns.served_model_name or [])
    if ns.alias:
        alias = [x.strip() for x in ns.alias.split(",") if x.strip()] + alias
    parallel = ns.parallel if ns.parallel is not None else (ns.max_num_seqs if ns.max_num_seqs is not None else -1)
    batch = ns.batch_size or ns.max_num_batched_tokens or 2048
    if not 0 <= ns.port <= 65535:
        p.error(f"invalid --port value {ns.port}: 0-65535")
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        # vLLM's startup check (validate_parsed_serve_args)
        p.exit(2, "error: --enable-auto-tool-choice requires --tool-call-parser\n")
    if ns.tool_call_parser:
        from kvserve.chat.tool_calls import TOOL_PARSERS

        if ns.tool_call_parser not in TOOL_PARSERS:
            p.error(f"invalid --tool-call-parser {ns.tool_call_parser!r}: choose from {', '.join(sorted(TOOL_PARSERS))}")
    if ns.reasoning_budget < -1:
        p.error(f"invalid --reasoning-budget {ns.reasoning_budget}: -1 (no limit) or >= 0")
    tkw: dict = {}
    if ns.chat_template_kwargs:
        import json

        try:
            tkw = json.loads(ns.chat_template_kwargs)
        except ValueError as e:
            p.error(f"invalid --chat-template-kwargs: {e}")
        if not isinstance(tkw, dict):
            p.error("invalid --chat-template-kwargs: expected a JSON object")
        from kvserve.chat.template import RESERVED_VARIABLES

        if set(tkw) & RESERVED_VARIABLES:
            p.error(f"invalid --chat-template-kwargs: {sorted(set(tkw) & RESERVED_VARIABLES)} are set by each request")
    if ns.max_logprobs < -1:
        p.error(f"invalid --max-logprobs {ns.max_logprobs}: -1 (vocabulary size) or >= 0")
    if ns.max_request_bytes < 1:
        p.error(f"invalid --max-request-bytes {ns.max_request_bytes}: at least 1")
    if parallel == 0 or parallel < -1:
        p.error(f"invalid -np value {parallel}: -1 (auto) or >= 1")
    from kvserve.errors import InvalidInputError
    from kvserve.serving.manager import DEFAULT_MAX_LOADED, parse_keep_alive

    try:
        keep_alive = parse_keep_alive(ns.keep_alive, "--keep-alive")
    except InvalidInputError as e:
        p.error(str(e).replace("Field '--keep-alive'", "invalid --keep-alive"))
    if ns.max_loaded_models < 0:
        p.error(f"invalid --max-loaded-models {ns.max_loaded_models}: 0 (default 3) or more")
    if ns.max_queue < 1:
        p.error(f"invalid --max-queue {ns.max_queue}: at least 1")
    max_memory = None
    if ns.max_memory:
        try:
            max_memory = parse_memory(ns.max_memory)
        except ValueError as e:
            p.error(str(e))
    args = ServerArgs(
        model=model or DEFAULT_MODEL, model_given=bool(model), alias=alias, host=ns.host, port=ns.port,
        ctx_size=ns.ctx_size, parallel=parallel, threads=ns.threads, batch_size=batch, ubatch_size=ns.ubatch_size,
        n_predict=ns.n_predict, temp=ns.temp, top_k=ns.top_k, top_p=ns.top_p, min_p=ns.min_p,
        repeat_penalty=ns.repeat_penalty, seed=SEED_RANDOM if ns.seed < 0 else ns.seed & 0xFFFFFFFF,
        api_keys=keys, metrics=ns.metrics, slots=bool(ns.slots), slots_text=ns.slots == "explicit",
        props=ns.props, slot_save_path=ns.slot_save_path,
        cache_ram=ns.cache_ram, cache_reuse=ns.cache_reuse, slot_prompt_similarity=ns.slot_prompt_similarity,
        jinja=ns.jinja, chat_template=ns.chat_template, chat_template_file=ns.chat_template_file,
        cache_type_k=ns.cache_type_k, cache_type_v=ns.cache_type_v, sse_ping_interval=ns.sse_ping_interval,
        cors_origins=[o.strip() for o in ns.cors_origins.split(",") if o.strip()], log_verbosity=ns.log_verbosity,
        embeddings=ns.embeddings, dtype=ns.dtype, device=ns.device, max_model_len=ns.max_model_len,
        tool_call_parser=ns.tool_call_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        reasoning_format=ns.reasoning_format, reasoning_parser=ns.reasoning_parser,
        reasoning_budget=ns.reasoning_budget, reasoning=ns.reasoning, chat_template_kwargs=tkw,
        max_logprobs=ns.max_logprobs,
        compile=ns.compile, native_kernels=ns.native_kernels, large_batch_dtype=ns.large_batch_dtype,
        max_request_bytes=ns.max_request_bytes, keep_alive=keep_alive,
        max_loaded_models=ns.max_loaded_models or DEFAULT_MAX_LOADED, max_memory=max_memory,
        max_queue=ns.max_queue, preload=ns.preload, allow_model_paths=ns.allow_model_paths,
        models_dir=ns.models_dir, webui=ns.webui,
    )
    try:
        args.default_sampling_params()
        args.engine_config()
    except (InvalidRequestError, ValueError) as e:
        p.error(str(e))
    return args
