"""Command lines and environments for the ``kvserve serve`` parsing guard (test_args_golden.py).

:func:`cases` lists (argv, environ) pairs: every spelling of every flag in the table with a
value, a bad value and boundary values, every environment variable with good and bad texts,
and hand-written combinations (precedence between flags and variables, cross-flag rules).
:func:`outcome` runs :func:`kvserve.serving.args.parse_args` on one and returns what it did:
exit status, stdout, stderr, and the ServerArgs fields that differ from ``parse_args([])``'s.
Paths are written ``{TMP}`` (a directory made by :func:`make_tmp`).

Regenerate the recorded outcomes (only when a change of behaviour is meant):
``python tests/unit/args_cases.py > tests/unit/args_golden.json`` (one case a line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

BOOL_TEXTS = ("1", "off", "maybe", "")


def make_tmp() -> str:
    """A directory with the files the cases name: a key/cert/CA file, a key list, a chat template,
    a YAML config and a sub-directory for slot files."""
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-args-"))
    for name in ("key.pem", "cert.pem", "ca.pem"):
        (tmp / name).write_text("x\n")
    (tmp / "keys.txt").write_text("# comment\nk1\n\nk2\n")
    (tmp / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp / "bad.jinja").write_text("{% for m in messages %}")
    (tmp / "cfg.yaml").write_text("port: 9001\nmax_num_seqs: 8\nenable_prefix_caching: false\n"
                                  "api_key: [a, b]\nserved_model_name: [x, y]\nspeculative_config:\n"
                                  "  method: ngram\n  num_speculative_tokens: 3\n")
    (tmp / "badcfg.yaml").write_text("no_such_flag: 1\n")
    (tmp / "slots").mkdir()
    return str(tmp)


def _sample(f) -> list[str]:
    if f.kind == "bool":
        return []
    if f.choices:
        return [f.choices[0]]
    return {"int": ["3"], "float": ["0.5"], "list": ["a", "b"]}.get(f.kind, ["x"])


def _bad_and_edges(f) -> list[list[str]]:
    if f.kind == "int":
        return [["abc"], ["-5"], ["-1"], ["0"], ["100000"], ["4k"]]
    if f.kind == "float":
        return [["abc"], ["-1"], ["0"], ["1.5"], ["nan"]]
    if f.choices:
        return [["bogus"], *[[c] for c in f.choices[1:]]]
    if f.kind in ("str", "append", "opt"):
        return [["-x"], [""], ["auto"], ["{}"], ['{"a": 1}'], ["1"]]
    return []


def _table_cases(ft) -> list[tuple[list[str], dict]]:
    out: list[tuple[list[str], dict]] = []
    for f in ft.FLAGS:
        for name in f.names:
            out.append(([name, *_sample(f)], {}))
            if name.startswith("--") and "-" in name[2:]:
                out.append(([name.replace("-", "_").replace("__", "--", 1), *_sample(f)], {}))
        for name in f.neg:
            out.append(([name], {}))
        if f.kind == "bool":
            out.append(([f.names[0], "extra-positional"], {}))
        else:
            out.append(([f.names[0]], {}))  # no value
            if f.kind != "list":
                out.append(([f"{f.names[-1]}={_sample(f)[0]}"], {}))
            for vals in _bad_and_edges(f):
                out.append(([f.names[0], *vals], {}))
        for env in f.env:
            texts = BOOL_TEXTS if f.kind in ("bool", "opt") else ()
            texts += tuple(x for xs in _bad_and_edges(f)[:3] for x in xs) + tuple(_sample(f)[:1])
            for text in dict.fromkeys(texts):
                out.append(([], {env: text}))
            if f.kind != "bool":
                out.append(([f.names[0], *_sample(f)], {env: "7"}))  # the flag wins over the variable
    return out


_HAND: list[tuple[str, dict]] = [
    # the model
    ("", {}), ("m1", {}), ("-m m1 m1", {}), ("-m m1 m2", {}), ("-hf user/model:Q4_K_M", {}),
    ("-hf https://huggingface.co/u/m", {}), ("-hf u/m -m x", {}), ("m1 -fa", {}), ("-fa m1", {}), ("-fa off m1", {}),
    ("-rea m1", {}), ("-O3", {}), ("-O 3", {}), ("-ngl99", {}), ("-n gl", {}), ("-xyz", {}), ("--mod m", {}),
    ("-a b,a,b --served-model-name c d", {}), ("--served-model-name c", {}), ("-a ,", {}),
    ("", {"LLAMA_ARG_MODEL": "envm"}), ("m1", {"LLAMA_ARG_MODEL": "envm"}),
    # host and port precedence
    ("", {"OLLAMA_HOST": "0.0.0.0:11434"}), ("", {"OLLAMA_HOST": "0.0.0.0"}), ("", {"OLLAMA_HOST": ":9000"}),
    ("", {"OLLAMA_HOST": "[::]"}), ("", {"OLLAMA_HOST": "http://h:1234"}), ("", {"OLLAMA_HOST": "h:99999"}),
    ("", {"OLLAMA_HOST": "h:abc"}), ("", {"KVSERVE_HOST": "1.2.3.4:5", "OLLAMA_HOST": "6.7.8.9:10"}),
    ("", {"KVSERVE_HOST": "1.2.3.4"}), ("--port 1", {"OLLAMA_HOST": "h:2"}), ("--host a", {"OLLAMA_HOST": "h:2"}),
    ("", {"LLAMA_ARG_PORT": "3", "OLLAMA_HOST": "h:2"}), ("", {"LLAMA_ARG_HOST": "x", "KVSERVE_HOST": "h:2"}),
    ("", {"OLLAMA_HOST": "  "}), ("--port 65536", {}), ("--port -1", {}), ("--port 0", {}), ("--port 65535", {}),
    ("--host a,b --host c,a", {}), ("--host ,", {}), ("--host /tmp/x.sock", {}), ("--host a.sock", {}),
    ("", {"LLAMA_ARG_HOST": "a,b"}),
    # slots, context, batching
    ("-np 0", {}), ("-np -2", {}), ("-np 2", {}), ("-np -1", {}), ("--max-num-seqs 4", {}),
    ("--max-num-seqs 4 -np 2", {}), ("--max-num-seqs 4 --max-num-batched-tokens 2", {}),
    ("--max-num-batched-tokens 2", {}), ("--max-num-batched-tokens 3 -np 4", {}), ("-b 2 --max-num-seqs 4", {}),
    ("--max-num-batched-tokens 8k", {}), ("-b 0", {}), ("-b 0 --max-num-batched-tokens 100", {}),
    ("-np 4 --max-num-batched-tokens 2", {}), ("--max-num-seqs 0", {}), ("--max-num-seqs 4 -kvu", {}),
    ("--max-num-seqs 4 --no-kv-unified", {}),
    ("", {"OLLAMA_NUM_PARALLEL": "3", "OLLAMA_CONTEXT_LENGTH": "4096"}),
    ("", {"OLLAMA_NUM_PARALLEL": "3", "OLLAMA_CONTEXT_LENGTH": " 4096 "}),
    ("-kvu", {"OLLAMA_NUM_PARALLEL": "3", "OLLAMA_CONTEXT_LENGTH": "4096"}),
    ("-c 100", {"OLLAMA_NUM_PARALLEL": "3", "OLLAMA_CONTEXT_LENGTH": "4096"}),
    ("-np 2", {"OLLAMA_CONTEXT_LENGTH": "4096"}), ("", {"OLLAMA_CONTEXT_LENGTH": "4096"}),
    ("", {"LLAMA_ARG_CTX_SIZE": "10", "OLLAMA_CONTEXT_LENGTH": "4096", "OLLAMA_NUM_PARALLEL": "2"}),
    ("", {"LLAMA_ARG_N_PARALLEL": "2", "OLLAMA_NUM_PARALLEL": "5"}),
    ("--max-model-len 32k", {}), ("--max-model-len 32K", {}), ("--max-model-len auto", {}),
    ("--max-model-len -1", {}), ("--max-model-len 1.5K", {}), ("--max-model-len 25.6k", {}),
    ("", {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}), ("", {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "true"}),
    ("", {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "yes"}),
    ("", {"VLLM_CPU_KVCACHE_SPACE": "4"}), ("", {"VLLM_CPU_KVCACHE_SPACE": "0.5"}),
    ("", {"VLLM_CPU_KVCACHE_SPACE": "0"}), ("", {"VLLM_CPU_KVCACHE_SPACE": "-1"}),
    ("", {"VLLM_CPU_KVCACHE_SPACE": "abc"}), ("", {"VLLM_CPU_KVCACHE_SPACE": "inf"}),
    ("--kv-cache-memory-bytes 4G", {}), ("--kv-cache-memory-bytes 4GiB", {}), ("--kv-cache-memory-bytes 4gb", {}),
    ("--kv-cache-memory-bytes 0", {}), ("--gpu-memory-utilization 0.5", {}), ("--gpu-memory-utilization 1.5", {}),
    # KV types
    ("-ctk q8_0", {}), ("-ctk q4_1", {}), ("-ctv q4_0", {}), ("--kv-cache-dtype fp8", {}),
    ("--kv-cache-dtype fp8 -ctk q8_0", {}), ("--kv-cache-dtype bfloat16 -ctv f32", {}),
    ("--kv-cache-dtype fp8_inc", {}), ("--kv-cache-dtype fp8_ds_mla", {}), ("--kv-cache-dtype fp8_e5m2", {}),
    ("", {"OLLAMA_KV_CACHE_TYPE": "q8_0"}), ("", {"OLLAMA_KV_CACHE_TYPE": "q4_1"}),
    ("", {"LLAMA_ARG_CACHE_TYPE_K": "q4_0", "OLLAMA_KV_CACHE_TYPE": "q8_0"}), ("-ctk bf16", {"OLLAMA_KV_CACHE_TYPE": "q8_0"}),
    # model manager
    ("--keep-alive 10m", {}), ("--keep-alive -1", {}), ("--keep-alive 0", {}), ("--keep-alive 1h30m", {}),
    ("--keep-alive abc", {}), ("--keep-alive 300", {}), ("", {"OLLAMA_KEEP_ALIVE": "24h"}),
    ("", {"OLLAMA_KEEP_ALIVE": "xyz"}), ("", {"KVSERVE_KEEP_ALIVE": "1m", "OLLAMA_KEEP_ALIVE": "2m"}),
    ("--max-loaded-models -1", {}), ("--max-loaded-models 0", {}), ("--max-loaded-models 7", {}),
    ("--models-max 0", {}), ("--models-max 2", {}), ("--models-max -1", {}), ("--models-max 2 --max-loaded-models 5", {}),
    ("", {"OLLAMA_MAX_LOADED_MODELS": "abc"}), ("", {"OLLAMA_MAX_LOADED_MODELS": "4"}),
    ("", {"OLLAMA_MAX_QUEUE": "abc"}), ("", {"OLLAMA_MAX_QUEUE": "0"}), ("--max-queue 0", {}),
    ("--max-memory 8GiB", {}), ("--max-memory 512", {}), ("--max-memory 512MB", {}), ("--max-memory 0", {}),
    ("--max-memory x", {}), ("--max-memory 1.5g", {}), ("", {"KVSERVE_MAX_MEMORY": "2GiB"}),
    ("", {"KVSERVE_MAX_MEMORY": "bad"}),
    # device, dtype, threads
    ("-ngl 0", {}), ("-ngl 0 --device cuda", {}), ("-ngl 99", {}), ("-ngl all", {}), ("-ngl x", {}),
    ("--device none", {}), ("--device CUDA1,CUDA0", {}), ("--device cuda:1", {}), ("-dev cpu", {}),
    ("--dtype half", {}), ("--dtype float", {}), ("--compile --enforce-eager", {}), ("--compile", {}),
    ("", {"LLAMA_ARG_N_GPU_LAYERS": "0"}), ("-tp 2", {}), ("-tp 0", {}), ("-pp 2", {}), ("-dp 2", {}), ("-dp 0", {}),
    # sampling
    ("--temp 0 --top-k -1 --seed -1", {}), ("--seed 5", {}), ("--seed 4294967297", {}), ("--seed -7", {}),
    ("--samplers top_k;temp;top-p", {}), ("--samplers foo", {}), ("--samplers ;", {}),
    ("-l 15043+1 -l 2-inf,3+0.5", {}), ("-l bad", {}), ("-l 1+x", {}),
    ("--dry-sequence-breaker none", {}), ("--dry-sequence-breaker a --dry-sequence-breaker b", {}),
    ("--ignore-eos --no-cache-prompt", {}), ("--no-enable-prefix-caching", {}),
    ("--presence-penalty 0.5 --frequency-penalty 0.2 --typical 0.9 --top-nsigma 1 --xtc-probability 0.1", {}),
    ("--min-p 2", {}), ("--top-p -1", {}), ("--temp nan", {}), ("--repeat-penalty -1", {}),
    ('--override-generation-config {"temperature":0.2,"top_k":5,"max_new_tokens":9,"presence_penalty":1}', {}),
    ('--override-generation-config {"temperature":0.2} --temp 0.5', {}),
    ('--override-generation-config {"temperature":-1}', {}), ('--override-generation-config {"foo":1}', {}),
    ('--override-generation-config {"temperature":"x"}', {}), ('--override-generation-config {"top_p":2}', {}),
    ('--override-generation-config {"temperature":1e999}', {}), ('--override-generation-config [1]', {}),
    ('--override-generation-config {"max_tokens":5} -n 3', {}), ('--override-generation-config {"top_k":true}', {}),
    ("--generation-config vllm", {}), ("--generation-config /nonexistent", {}), ("--generation-config {TMP}", {}),
    # chat templates, tools, reasoning
    ("--chat-template chatml", {}), ("--chat-template {TMP}/t.jinja", {}), ("--chat-template {TMP}/bad.jinja", {}),
    ("--chat-template nosuchname", {}), ("--chat-template {{ x", {}), ("--chat-template {% for %}", {}),
    ("--chat-template {TMP}", {}), ("--chat-template-file {TMP}/t.jinja", {}),
    ('--chat-template-kwargs {"enable_thinking":false}', {}), ('--chat-template-kwargs {"messages":1}', {}),
    ('--default-chat-template-kwargs {"a":1} --chat-template-kwargs {"a":2,"b":3}', {}),
    ('--default-chat-template-kwargs {"tools":1}', {}),
    ("--enable-auto-tool-choice", {}), ("--enable-auto-tool-choice --tool-call-parser hermes", {}),
    ("--tool-call-parser hermes", {}), ("--tool-call-parser nosuch", {}), ("--tool-call-parser mistral", {}),
    ("--reasoning-parser qwen3", {}), ("--reasoning-parser nosuch", {}), ("--reasoning-budget -2", {}),
    ("--reasoning-budget 0", {}), ("-rea off", {}), ("-rea auto", {}), ("--reasoning", {}), ("--no-jinja", {}),
    ("--response-role ''", {}), ("--response-role user", {}), ("--response-role ' '", {}),
    ("--tools all", {}), ("--tools all --cors-origins x", {}), ("--max-logprobs -2", {}), ("--max-logprobs -1", {}),
    # CORS
    ("--cors-origins a,b", {}), ("--cors-origins ''", {}), ("--allowed-origins [\"x\",\"y\"]", {}),
    ("--allowed-origins []", {}), ("--allowed-origins a --cors-origins b", {}), ("--allowed-origins [1]", {}),
    ("--allowed-methods GET,POST --allowed-headers [\"X\"]", {}), ("--allowed-methods GET --cors-methods PUT", {}),
    ("--allow-credentials", {}), ("--no-cors-credentials --allow-credentials", {}), ("--no-cors-credentials", {}),
    ("", {"LLAMA_ARG_CORS_ORIGINS": "e1,e2"}), ("--allowed-origins x", {"LLAMA_ARG_CORS_ORIGINS": "e"}),
    # HTTP
    ("--api-key a,b --api-key c", {}), ("--api-key-file {TMP}/keys.txt --api-key z", {}),
    ("--api-key-file {TMP}/nokeys.txt", {}), ("", {"LLAMA_API_KEY": "k1,k2"}),
    ("", {"VLLM_API_KEY": "v", "LLAMA_API_KEY": "l"}), ("--api-key x", {"VLLM_API_KEY": "v"}),
    ("--ssl-key-file {TMP}/key.pem --ssl-cert-file {TMP}/cert.pem --ssl-ca-certs {TMP}/ca.pem", {}),
    ("--ssl-key-file {TMP}/key.pem", {}), ("--ssl-cert-file {TMP}/cert.pem", {}),
    ("--ssl-keyfile {TMP}/nokey.pem --ssl-certfile {TMP}/cert.pem", {}), ("--ssl-ca-certs {TMP}/none.pem", {}),
    ("--slot-save-path {TMP}/slots", {}), ("--slot-save-path {TMP}/none", {}), ("--slot-save-path {TMP}/key.pem", {}),
    ("--root-path /a/b/", {}), ("--root-path /", {}), ("--api-prefix pfx/", {}), ("--api-prefix /", {}),
    ("--api-prefix /a/b/", {}), ("--tags b,,a", {}), ("--timeout 0", {}), ("--timeout 5", {}), ("-to -1", {}),
    ("--sleep-idle-seconds -2", {}), ("--sleep-idle-seconds -1", {}), ("--sleep-idle-seconds 0", {}),
    ("--shutdown-timeout -3", {}), ("--pull-timeout -1", {}), ("--pull-max-blob-size -5", {}),
    ("--pull-max-blob-size 10G", {}), ("--max-request-bytes 0", {}), ("--max-batch-inputs 0", {}),
    ("--max-input-bytes 0", {}), ("--max-input-bytes 1M", {}), ("--header-timeout 0", {}),
    ("--limit-concurrency 0", {}), ("--slots", {}), ("--no-slots", {}), ("", {"LLAMA_ARG_ENDPOINT_SLOTS": "1"}),
    ("-v", {}), ("-v -lv 7", {}), ("-lv 1", {}), ("--embedding", {}), ("--task embed", {}), ("--runner pooling", {}),
    ("--convert embed", {}), ("--task score", {}), ("--pooling rank", {}), ("--pooling mean", {}),
    # speculative decoding
    ("--spec-type ngram", {}), ("--spec-type ngram --draft-max 5 --draft-min 2", {}), ("--spec-type eagle", {}),
    ("--spec-type ngram --spec-ngram-size-n 3 --spec-ngram-size-m 7", {}), ("--spec-type ngram-simple", {}),
    ("--draft-max 5", {}), ("--draft-min 1 --spec-ngram-size-n 2", {}), ("--draft-max 100000", {}),
    ("--spec-ngram-size-n 0", {}), ("--spec-ngram-size-n 1000", {}), ("--draft-min -1", {}),
    ("--draft-p-min 2", {}), ("-md d.gguf", {}), ("-md d.gguf --draft-max 4 --draft-p-min 0.5", {}),
    ("-md d.gguf --spec-type ngram", {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":3}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":5,"prompt_lookup_max":2}', {}),
    ('--speculative-config {"method":"ngram"}', {}), ('--speculative-config {"num_speculative_tokens":3}', {}),
    ('--speculative-config {}', {}), ('--speculative-config {"method":"eagle","num_speculative_tokens":3}', {}),
    ('--speculative-config {"model":"d.gguf","num_speculative_tokens":4}', {}),
    ('--speculative-config {"method":"draft_model","model":"d.gguf","num_speculative_tokens":4} --draft-min 1', {}),
    ('--speculative-config {"method":"draft_model","model":"d.gguf"}', {}),
    ('--speculative-config {"method":"draft_model","model":"d.gguf","num_speculative_tokens":4,"x":1}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":3,"x":1}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":100000}', {}),
    ('--speculative-config {"method":"ngram","num_speculative_tokens":true}', {}),
    ('--speculative-config [1]', {}), ('--speculative-config notjson', {}),
    # vLLM's LoRA flags (kvserve.serving.lora_modules)
    ("--lora-modules a=/x b=/y --max-loras 2", {}),
    ("--lora-modules '{\"name\":\"a\",\"path\":\"/x\",\"base_model_name\":\"m\"}'", {}),
    ("--lora-modules {bad", {}), ("--lora-modules '{\"name\":\"a\"}'", {}),
    ("--lora-modules '{\"name\":\"a\",\"path\":\"/x\",\"r\":1}'", {}),
    ("--lora-modules a=/x a=/y", {}), ("--lora-modules =/x", {}), ("--enable-lora --max-loras 4 --max-cpu-loras 2", {}),
    ("--lora-dtype bfloat16", {}), ("--lora-dtype float16 --enable-lora", {}), ("--lora-dtype int8", {}),
    ("--max-lora-rank 7", {}), ("--max-lora-rank 64 --max-cpu-loras 3", {}), ("--max-loras 0", {}),
    # refused, not available, no effect; several errors at once
    ("--lora x", {}), ("--lora x --max-queue 0", {}), ("--max-queue 0 --reasoning-budget -5", {}),
    ("--reasoning-budget -5 --max-queue 0", {}), ("-np 0 --port 70000", {}), ("--timeout 0 --lora x", {}),
    ("-tp 2 -ctk q4_1", {}), ("-ngl 5 --mlock --rope-scale 2 --no-cont-batching", {}),
    ("--hf-token secret", {}), ("--api-key secret -hff f", {}), ("-hft", {}), ("--gpt-oss-20b-default", {}),
    # --config, help, version
    ("--config {TMP}/cfg.yaml", {}), ("--config {TMP}/cfg.yaml --port 9002", {}), ("--config {TMP}/badcfg.yaml", {}),
    ("--config {TMP}/none.yaml", {}), ("--config", {}), ("m1 --config {TMP}/cfg.yaml", {}),
    ("--help", {}), ("-h", {}), ("--usage", {}), ("--version", {}),
    ("--version --lora x", {}), ("--", {}), ("-- -x", {}), ("--ctx_size 5 --no_slots", {}), ("--ctx_size=5", {}),
    ("--max_num_seqs=4", {}), ("--unknown-flag", {}), ("--unknown_flag", {}),
]


def cases(tmp: str = "{TMP}") -> list[tuple[list[str], dict]]:
    """Every (argv, environ) pair of the guard, in a stable order."""
    import shlex

    from kvserve.serving import flags as ft

    out = _table_cases(ft)
    out += [(shlex.split(line.replace("{TMP}", tmp)), env) for line, env in _HAND]
    return out


def _plain(obj):
    return json.loads(json.dumps(obj, default=repr))


def outcome(argv: list[str], env: dict, tmp: str, base: dict | None) -> dict:
    """What ``parse_args(argv, env)`` does: ``rc`` (None: returned), ``out``, ``err`` and the
    ServerArgs fields that differ from ``base`` (``parse_args([])``'s), paths as ``{TMP}``."""
    from kvserve.serving.args import parse_args

    out, err = io.StringIO(), io.StringIO()
    rc, fields = None, None
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse's usage lines are as wide as the terminal
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = parse_args([a.replace("{TMP}", tmp) for a in argv], {k: v.replace("{TMP}", tmp)
                                                                        for k, v in env.items()})
            fields = _plain(dataclasses.asdict(args))
        except SystemExit as e:
            rc = e.code
        finally:
            if columns is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = columns
    res: dict = {"argv": argv, "env": env, "rc": rc}
    text_err = err.getvalue()
    if text_err.startswith("usage: "):  # argparse's usage (every flag): its hash, then the error line
        usage, _, rest = text_err.partition("\nerror: ")
        text_err = f"usage-sha256:{hashlib.sha256(usage.encode()).hexdigest()[:16]}\nerror: {rest}"
    text_out = re.sub(r"kvserve \S+\n", "kvserve BUILD\n", out.getvalue())
    if len(text_out) > 2000:
        text_out = "sha256:" + hashlib.sha256(text_out.encode()).hexdigest()
    res["out"], res["err"] = text_out, text_err
    if fields is not None:
        res["args"] = {k: v for k, v in fields.items() if base is None or base.get(k) != v}
    return json.loads(json.dumps(res).replace(tmp, "{TMP}"))


def run_all(tmp: str) -> list[dict]:
    """The outcome of every case; the first is ``parse_args([])``'s whole ServerArgs."""
    first = outcome([], {}, tmp, None)
    base = first["args"]
    return [first] + [outcome(argv, env, tmp, base) for argv, env in cases()]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    rows = run_all(make_tmp())
    sys.stdout.write("[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n")
