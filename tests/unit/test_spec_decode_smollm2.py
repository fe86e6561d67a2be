"""``--spec-type ngram`` on the real SmolLM2-135M-Instruct Q4_1 in the default mode (int4 decode
kernels): greedy output token-identical to plain decoding at 1 and 4 streams, after a
prefix-cache hit, with a stop string and with n_predict, and drafts actually accepted."""

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.request import Request, SamplingParams
from kvserve.engine import spec_decode
from kvserve.engine.spec_decode import SpecConfig
from kvserve.models.build import load_files

SOURCE = '''def parse_config(path):
    """Read a key=value config file into a dict."""
    result = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result


def write_config(path, values):
    with open(path, "w") as f:
        for key, value in sorted(values.items()):
            f.write(f"{key}={value}\\n")
'''


def _run(core, reqs):
    res = {r.request_id: [[], "", None, None] for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        for o in core.step():
            e = res[o.request_id]
            e[0] += o.new_token_ids
            e[1] += o.text
            if o.finished:
                e[2], e[3] = o.stop_type, o
    return res


@pytest.mark.slow
def test_smollm2_greedy_identical_with_prompt_lookup(smollm2_gguf):
    loaded = load_files(smollm2_gguf)
    spec_cfg = SpecConfig(method="ngram", num_speculative_tokens=15, prompt_lookup_max=4, prompt_lookup_min=2)
    plain = EngineCore(loaded, EngineConfig(n_ctx=4096, n_parallel=4, kv_unified=True, threads=2, cache_ram=64))
    spec = EngineCore(loaded, EngineConfig(n_ctx=4096, n_parallel=4, kv_unified=True, threads=2, cache_ram=64,
                                            spec=spec_cfg))
    tok = plain.tokenizer
    ask = ("<|im_start|>user\nHere is a Python file:\n\n" + SOURCE
           + "\nRepeat the whole file exactly, but rename parse_config to read_config.<|im_end|>\n"
           "<|im_start|>assistant\n")
    prompt = tok.encode(ask, add_special=False)
    others = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special=False)
              for q in ("List the days of the week.", "Count from one to twenty in words.",
                        "Write the alphabet in capitals, with commas.")]

    def both(reqs):
        a = _run(plain, [Request("p" + rid, list(p), SamplingParams(**sp)) for rid, p, sp in reqs])
        b = _run(spec, [Request("s" + rid, list(p), SamplingParams(**sp)) for rid, p, sp in reqs])
        for rid, _, _ in reqs:
            assert a["p" + rid][:3] == b["s" + rid][:3], rid
        return a, b

    # one stream (warms the prefix cache for the next ones)
    a, b = both([("one", prompt, {"n_predict": 110, "temperature": 0})])
    one = b["sone"][3]
    # the file is quoted back (in part: how much depends on the decode path's rounding; 34 of 90
    # drafted tokens accepted on the AVX512 build's group kernel, 41+ before)
    assert len(b["sone"][0]) == 110 and one.timings.draft_n_accepted > 25
    # a prefix-cache hit, n_predict cutting a long accepted run, a stop string
    a, b = both([("hit", prompt, {"n_predict": 71, "temperature": 0})])
    assert b["shit"][3].num_cached_tokens == a["phit"][3].num_cached_tokens > len(prompt) - 16
    assert len(b["shit"][0]) == 71
    stop = a["phit"][1][120:126]
    a, b = both([("stop", prompt, {"n_predict": 110, "temperature": 0, "stop": (stop,)})])
    assert b["sstop"][2] == "word" and b["sstop"][3].stopping_word == stop
    # four concurrent streams
    reqs = [("c0", prompt, {"n_predict": 80, "temperature": 0})] + [
        (f"c{i + 1}", q, {"n_predict": 30, "temperature": 0}) for i, q in enumerate(others)]
    a, b = both(reqs)
    assert b["sc0"][3].timings.draft_n_accepted > 0
    assert spec.kv.num_blocks == plain.kv.num_blocks
    assert spec.kv.num_free_blocks == plain.kv.num_free_blocks and not spec.kv._tables
    assert set(spec.kv._by_hash) == set(plain.kv._by_hash)


@pytest.mark.slow
def test_smollm2_greedy_identical_with_itself_as_draft_model_and_native_verification(smollm2_gguf):
    """-md with SmolLM2 as its own draft: every draft token accepted, output token-identical; where
    the native decode step runs (AVX512-VNNI CPUs) the verification rows ran in it."""
    import time

    loaded = load_files(smollm2_gguf)
    base = {"n_ctx": 2048, "n_parallel": 2, "kv_unified": True, "threads": 2, "cache_ram": 0}
    plain = EngineCore(loaded, EngineConfig(**base))
    spec = EngineCore(loaded, EngineConfig(**base, spec=SpecConfig(method="draft_model", draft_model=smollm2_gguf,
                                                                   num_speculative_tokens=4)))
    spec.spec.adaptive = False  # the policy would not draft with a draft as large as the target
    for r in (plain.runner, spec.runner, spec.draft.runner):  # the native steps loaded, if they can be
        t0 = time.monotonic()
        while r.native is not None and r.native.reason is None and not r.native.ready and time.monotonic() - t0 < 300:
            time.sleep(0.5)
    tok = plain.tokenizer
    prompt = tok.encode("<|im_start|>user\nHere is a Python file:\n\n" + SOURCE + "\nRepeat it exactly.<|im_end|>\n"
                        "<|im_start|>assistant\n", add_special=False)
    a = _run(plain, [Request("p", list(prompt), SamplingParams(n_predict=40, temperature=0))])["p"]
    b = _run(spec, [Request("s", list(prompt), SamplingParams(n_predict=40, temperature=0))])["s"]
    assert a[:3] == b[:3] and len(b[0]) == 40
    t = b[3].timings
    assert t.draft_n > 0 and t.draft_n_accepted == t.draft_n
    nat = spec.runner.native
    if nat is not None and nat.ready:
        assert nat.calls > 0 and spec.spec.base_rows == spec_decode.STEP_BASE_ROWS_NATIVE[nat.isa]
    assert spec.spec.draft_cost == pytest.approx(1.0)
