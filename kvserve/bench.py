"""``kvserve bench MODEL``: engine speed and memory, printed as one JSON object.

Figures (llama-server's conventions): prefill tok/s for a 512-token prompt;
single-stream decode tok/s over decode steps (generated tokens minus one, the
first comes from the prefill); aggregate decode tok/s with 4 and 16 concurrent
sequences generating 128 tokens each; time to first token for a 1,500-token
prompt; peak RSS in MiB. All greedy with ignore_eos, so every run generates
exactly the asked number of tokens.

``decode_path`` says which path ran the decode steps: "native" (the native decode step,
:mod:`kvserve.models.decode_native`, the default where it can run: the bench waits for its
first build), "compile" (``--compile``) or "eager" (with ``native_reason``, why not native).
"""

from __future__ import annotations

import json
import resource
import time

import torch

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore, create_engine_core
from kvserve.engine.request import Request, SamplingParams
from kvserve.models.build import describe_dtypes


def _prompt(core: EngineCore, n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    nv = core.model_config.n_vocab
    return torch.randint(100, min(nv, 20000), (n,), generator=g).tolist()


def _run(core: EngineCore, prompts: list[list[int]], n_predict: int) -> dict:
    """Run prompts to completion; return wall time, first-token times and decode-phase timing."""
    p = SamplingParams(temperature=0.0, n_predict=n_predict, ignore_eos=True)
    reqs = [Request(f"b{i}-{time.monotonic_ns()}", pr, p) for i, pr in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    first_token: dict[str, float] = {}
    done = 0
    while done < len(reqs):
        for out in core.step():
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter()
            if out.finished:
                done += 1
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "first": first_token}


def run_bench(core: EngineCore, compile_mode: str = "eager") -> dict:
    """Measure the figures above on ``core``; returns a JSON-able dict."""
    _run(core, [_prompt(core, 64, 0)], 8)  # warm-up
    # prefill: 512-token prompt, 1 token generated (prompt time only)
    r = _run(core, [_prompt(core, 512, 1)], 1)
    prefill_s = list(r["first"].values())[0] - r["t0"]
    # single stream decode
    n = 128
    r = _run(core, [_prompt(core, 16, 2)], n)
    first = list(r["first"].values())[0]
    single = (n - 1) / (r["t1"] - first)
    agg = {}
    for b in (4, 16):
        r = _run(core, [_prompt(core, 16, 10 + i) for i in range(b)], n)
        start = max(r["first"].values())
        agg[b] = b * (n - 1) / (r["t1"] - start)
    r = _run(core, [_prompt(core, 1500, 3)], 1)
    ttft = list(r["first"].values())[0] - r["t0"]
    return {
        "model": core.model_info.name,
        "ftype": core.model_info.ftype,
        "prefill_tokens_per_s_512": round(512 / prefill_s, 1),
        "decode_tokens_per_s_1_stream": round(single, 1),
        "decode_tokens_per_s_aggregate_4": round(agg[4], 1),
        "decode_tokens_per_s_aggregate_16": round(agg[16], 1),
        "ttft_ms_1500_prompt": round(ttft * 1e3, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "weight_dtype": describe_dtypes(core.model),
        "kv_dtype": core.config.kv_dtype,
        "max_num_batched_tokens": core.config.max_num_batched_tokens,
        "mode": compile_mode,
    }


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvserve bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cpu-kernel", default="auto", choices=["auto", "int8", "int4", "dense"])
    ap.add_argument("--small-batch-rows", type=int, default=16)
    ap.add_argument("--large-batch-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("--compile", action="store_true",
                    help="measure with the decode step compiled (waits for the compile; reports compile_s)")
    ap.add_argument("--native-kernels", action="store_true",
                    help="with --compile: kvserve's own 4-bit kernel in place of torch's int4 kernel")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = EngineConfig(n_ctx=4096, n_parallel=16, kv_unified=True, threads=a.threads, kv_dtype=a.cache_type_k,
                       dtype=a.dtype, cpu_kernel=a.cpu_kernel, small_batch_rows=a.small_batch_rows,
                       large_batch_dtype=a.large_batch_dtype, max_num_batched_tokens=a.batch_size,
                       compile=a.compile, native_kernels=a.native_kernels)
    core = create_engine_core(a.model, cfg)
    load_s = time.perf_counter() - t0
    compile_s = None
    native = core.runner.native
    native_wait_s = None
    if native is not None and not native.ready and native.reason is None:
        t1 = time.perf_counter()
        native.wait()  # a first build (~40-60 s), or the weight packing after a cached one (~2 s)
        native_wait_s = round(time.perf_counter() - t1, 1)
    if a.compile:
        comp = core.runner.compiled
        if not comp.wait():
            print(json.dumps({"error": f"compile failed: {comp.error}"}))
            return 1
        compile_s = round(comp.seconds, 1)
    res = run_bench(core, "compile" if a.compile else "eager")
    res["load_s"] = round(load_s, 2)
    if native is not None and native.ready:
        res["decode_path"] = "native"
        res["native_head"] = native.native_head
    else:
        res["decode_path"] = "compile" if a.compile else "eager"
        if not a.compile:
            res["native_reason"] = native.reason if native is not None else "not asked for (weights, dtype or flags)"
    if native_wait_s is not None:
        res["native_build_wait_s"] = native_wait_s
    if compile_s is not None:
        from kvserve.models import q4_kernel

        res["compile_s"] = compile_s
        res["native_q4_kernel"] = q4_kernel.READY and core.model.layers[0].w_gate_up.q4w is not None
    print(json.dumps(res))
    return 0
