"""Regenerate llama.cpp's outputs on each model family (the fixtures of tests/unit/test_llama_families.py).

Run from the repository root with the shared venv (transformers, torch, the gguf package) and
llama.cpp from the llama-cpp-python sdist (``benchmarks/build_llama_server.sh`` builds llama-server)::

    python tests/reference/llama_families/regen.py \\
        --llama-cpp /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp

(``--cases gpt-oss --only-q8-0``: remake only that case's Q8_0 part.)

For each case of tests/family_oracle.py, all of it deterministic:

1. builds the tiny random transformers model and saves it as an HF directory;
2. converts it with llama.cpp's ``convert_hf_to_gguf.py --outtype f32 --model-name "kvserve tiny"``
   (through convert_tiny.py here, which changes only the vocabulary step; the neutral name because
   llama.cpp sets token attributes by ``general.name``: a name with "phi3" in it looks up ``</s>``,
   which the tiny vocabulary lacks);
3. checks that tests/family_models.py's own writer gives the converter's tensors byte for byte (the test
   rebuilds the file from them and the metadata recorded here: family_oracle.rebuild);
4. starts llama-server on the file (127.0.0.1, a free port, ``-t 2 -np 1 -c 512 -ctk f32 -ctv f32
   -fa off``: attention in float32, as kvserve's ``-ctk f32``), stopped by pid, and records
   * causal families: teacher-forced next-token distributions (for each sequence and each prefix
     length n in [``PREFIX``, len), ``/completion`` with the token-id prompt ``seq[:n]``, ``n_predict`` 1,
     ``n_probs`` :data:`N_PROBS`: the top ids and log-probabilities of the raw logits' softmax;
     ``cache_prompt`` false, each prompt evaluated whole: with a cached prompt this llama-server gives
     a sliding-window model (gemma2) other logits after a switch to a new sequence: the prefix
     [s1[:4]] then s1[:5] reports ``cache_n`` 1 and a top-1 that the uncached s1[:5] and transformers
     do not give, as if the window layers' cells came from the previous sequence) and
     greedy continuations (``n_predict`` :data:`N_GREEDY`, ``temperature`` 0, ``ignore_eos``) of the
     prompts;
   * nomic-bert (``--embedding``; its GGUF's mean pooling): ``/tokenize`` and ``/embedding`` of
     :data:`TEXTS` (vectors normalized as llama-server does by default);
5. for the cases of ``family_oracle.QUANTIZED``: ``llama-quantize --pure F32 OUT Q8_0`` of the file
   (checked to be what the ``gguf`` package writes, so the test rebuilds it too) and the same outputs
   on it (``q8_0`` in the fixture); and a Q4_K_M copy of the case's wide model (:func:`q4_k_m_run`:
   llama-quantize's types, tests/tinymodel.py's blocks; ``q4_k_m`` in the fixture); for the cases of
   ``family_oracle.F32_EXPERTS`` (gpt-oss: llama-quantize refuses to requantize MXFP4 experts) the
   Q8_0 copy of the same model converted with F32 experts (:func:`f32_experts_q8_run`);
6. writes ``CASE.json``: the converter's metadata and tensor digests, the server's version and flags,
   the outputs.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import family_oracle  # noqa: E402

N_PROBS = 5
PREFIX = 4
N_GREEDY = 32
#: the token each teacher-forced request is made to pick (see tests/reference/llama_numerics/regen.py:
#: llama-server leaves out the probabilities while the text ends in an incomplete UTF-8 character)
FORCED = 3 + ord("a")
FLAGS = ["-t", "2", "-np", "1", "-c", "512", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
TEXTS = ["search_query: the cat sat on the mat.", "what is the red sky?",
         "search_document: rain falls mainly in spain, on the plain! the dog runs and the cat jumps on the mat",
         "dog runs", "the blue sea and the green sun, the moon ... jumping cats"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """llama-server on one file, on a free loopback port, stopped by pid."""

    def __init__(self, binary: Path, model: Path, extra: list[str] = ()):
        import httpx

        self.port = _free_port()
        self.flags = [*FLAGS, *extra]
        self.log = open(model.with_suffix(".log"), "w")
        self.proc = subprocess.Popen([str(binary), "-m", str(model), *self.flags, "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("llama-server did not become healthy in 60 s")

    def post(self, path: str, **body) -> dict:
        r = self.http.post(path, json=body)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def record_causal(server: Server) -> dict:
    forced = []
    for seq in family_oracle.sequences():
        ids, lps = [], []
        for n in range(PREFIX, len(seq)):
            out = server.post("/completion", prompt=seq[:n], n_predict=1, n_probs=N_PROBS, cache_prompt=False,
                              temperature=0, logit_bias=[[FORCED, 1000.0]])
            top = out["completion_probabilities"][0]["top_logprobs"]
            ids.append([t["id"] for t in top])
            lps.append([round(t["logprob"], 6) for t in top])
        forced.append({"tokens": seq, "start": PREFIX, "top_ids": ids, "top_logprobs": lps})
    greedy = []
    for p in family_oracle.prompts():
        out = server.post("/completion", prompt=p, n_predict=N_GREEDY, cache_prompt=False, temperature=0,
                          ignore_eos=True, return_tokens=True)
        if len(out["tokens"]) != N_GREEDY:
            raise RuntimeError(f"{len(out['tokens'])} greedy tokens, not {N_GREEDY}")
        greedy.append({"prompt": p, "tokens": out["tokens"]})
    return {"teacher_forced": forced, "greedy": greedy}


def record_embed(server: Server) -> dict:
    out = []
    for text in TEXTS:
        ids = server.post("/tokenize", content=text, add_special=True)["tokens"]
        emb = server.post("/embedding", content=text)
        (vec,) = emb[0]["embedding"]  # one pooled vector (a list per token without pooling)
        out.append({"text": text, "tokens": ids, "embedding": [round(x, 7) for x in vec]})
    return {"embeddings": out}


def quantized_run(root: Path, f32: Path, arch: str, tmp: Path) -> dict:
    """``llama-quantize --pure F32 OUT Q8_0`` of the converter's file, checked to be what the ``gguf``
    package writes (family_oracle.rebuild_q8_0), and llama-server's outputs on it (same flags)."""
    dst = f32.with_suffix(".q8_0.gguf")
    subprocess.run([str(root / "build" / "bin" / "llama-quantize"), "--pure", str(f32), str(dst), "Q8_0", "2"],
                   check=True, capture_output=True)
    run = {"arch": arch, "quantize": "llama-quantize --pure F32 OUT Q8_0", "metadata": family_oracle.metadata(dst),
           "tensors": family_oracle.tensor_digests(dst)}
    family_oracle.rebuild_q8_0(run, f32, tmp / f"{f32.stem}.q8_0.rebuilt.gguf")
    server = Server(root / "build" / "bin" / "llama-server", dst)
    try:
        run.update(record_causal(server))
    finally:
        server.stop()
    return run


def f32_experts_q8_run(name: str, root: Path, tmp: Path) -> dict:
    """The Q8_0 copy of a case whose file keeps MXFP4 experts (family_oracle.F32_EXPERTS: llama-quantize
    refuses to requantize MXFP4): the same model saved with plain float32 experts, converted with
    ``--outtype f32`` (checked against tests/family_models.py's writer), then :func:`quantized_run`."""
    arch = family_oracle.CASES[name][1]
    hf = family_oracle.save_hf_f32_experts(name, tmp / f"{name}-f32-experts")
    gg = tmp / f"{name}.f32-experts.gguf"
    subprocess.run([sys.executable, str(HERE / "convert_tiny.py"), str(root), "--outtype", "f32", "--model-name",
                    "kvserve tiny", "--outfile", str(gg), str(hf)], check=True, capture_output=True)
    digests = family_oracle.tensor_digests(gg)
    ours = family_oracle.tensor_digests(family_oracle.save_gguf_f32_experts(name, tmp / f"{name}.f32-experts.ours.gguf"))
    if ours != digests:
        bad = sorted(set(ours) ^ set(digests)) + [k for k in digests if k in ours and ours[k] != digests[k]]
        raise SystemExit(f"{name} (F32 experts): tests/family_models.py does not write the converter's tensors: {bad}")
    return quantized_run(root, gg, arch, tmp)


def q4_k_m_run(name: str, root: Path, tmp: Path) -> dict:
    """The case's wide model (family_oracle.WIDE) converted to F32 (checked against
    tests/family_models.py's writer as in :func:`regen`), ``llama-quantize F32 OUT Q4_K_M`` of it for
    the types it picks per tensor (Q4_K, Q6_K, and fallbacks for rows that are not multiples of 256),
    a copy with those types whose blocks tests/tinymodel.py's quantizer makes (the ``gguf`` package
    cannot write K-quants, so CI could not rebuild llama-quantize's own blocks; the types, the
    metadata and the kernels that read them are the same), and llama-server's outputs on that copy."""
    arch = family_oracle.CASES[name][1]
    hf = family_oracle.save_hf(name, tmp / f"{name}-wide", wide=True)
    gg = tmp / f"{name}.wide.gguf"
    subprocess.run([sys.executable, str(HERE / "convert_tiny.py"), str(root), "--outtype", "f32", "--model-name",
                    "kvserve tiny", "--outfile", str(gg), str(hf)], check=True, capture_output=True)
    digests = family_oracle.tensor_digests(gg)
    ours = family_oracle.tensor_digests(family_oracle.save_gguf_ours(name, tmp / f"{name}.wide.ours.gguf", hf, wide=True))
    if ours != digests:
        raise SystemExit(f"{name} (wide): tests/family_models.py does not write the converter's tensors")
    lq = tmp / f"{name}.llama-quantize.q4_k_m.gguf"
    subprocess.run([str(root / "build" / "bin" / "llama-quantize"), str(gg), str(lq), "Q4_K_M", "2"],
                   check=True, capture_output=True)
    types = {k: v.split()[0] for k, v in family_oracle.tensor_digests(lq).items()}
    run = {"case": name, "arch": arch, "quantize": "llama-quantize F32 OUT Q4_K_M (its types; the blocks "
           "by tests/tinymodel.py)", "f32": {"metadata": family_oracle.metadata(gg), "tensors": digests},
           "metadata": family_oracle.metadata(lq),
           "tensors": {k: f"{t} {digests[k].split(' ', 1)[1].rsplit(' ', 1)[0]} ?" for k, t in types.items()}}
    dst = tmp / f"{name}.q4_k_m.gguf"
    family_oracle.rebuild_quantized(run, gg, dst, check=False)
    run["tensors"] = family_oracle.tensor_digests(dst)
    assert {k: v.split()[0] for k, v in run["tensors"].items()} == types
    assert family_oracle.tensor_digests(family_oracle.rebuild_q4_k_m(run, tmp / "rebuilt")) == run["tensors"]
    server = Server(root / "build" / "bin" / "llama-server", dst)
    try:
        run.update(record_causal(server))
    finally:
        server.stop()
    return run


def regen(name: str, root: Path, out: Path, tmp: Path) -> dict:
    hf = family_oracle.save_hf(name, tmp / name)
    gg = tmp / f"{name}.gguf"
    subprocess.run([sys.executable, str(HERE / "convert_tiny.py"), str(root), "--outtype", "f32", "--model-name",
                    "kvserve tiny", "--outfile", str(gg), str(hf)], check=True, capture_output=True)
    digests = family_oracle.tensor_digests(gg)
    ours = family_oracle.tensor_digests(family_oracle.save_gguf_ours(name, tmp / f"{name}.ours.gguf", hf))
    if ours != digests:
        bad = sorted(set(ours) ^ set(digests)) + [k for k in digests if k in ours and ours[k] != digests[k]]
        raise SystemExit(f"{name}: tests/family_models.py does not write the converter's tensors: {bad}")
    arch = family_oracle.CASES[name][1]
    fixture = {"case": name, "arch": arch, "metadata": family_oracle.metadata(gg), "tensors": digests}
    rebuilt = family_oracle.tensor_digests(family_oracle.rebuild(fixture, tmp / f"{name}.rebuilt.gguf"))
    assert rebuilt == digests
    binary = root / "build" / "bin" / "llama-server"
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    embed = name in family_oracle.EMBED
    server = Server(binary, gg, ["--embedding"] if embed else [])
    try:
        outputs = record_embed(server) if embed else record_causal(server)
        log = Path(server.log.name)
    finally:
        server.stop()
    warnings = [line.split(" W ", 1)[-1].strip() for line in log.read_text().splitlines()
                if "disabled" in line.lower()]
    if name in family_oracle.QUANTIZED:
        fixture["q8_0"] = quantized_run(root, gg, arch, tmp)
        fixture["q4_k_m"] = q4_k_m_run(name, root, tmp)
    if name in family_oracle.F32_EXPERTS:
        fixture["q8_0"] = f32_experts_q8_run(name, root, tmp)
    fixture.update(llama_server=" ".join((version.stdout + version.stderr).split()), flags=server.flags,
                   n_probs=N_PROBS, server_warnings=warnings, **outputs)
    family_oracle.fixture_path(out, name).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    return {"case": name, "bytes": gg.stat().st_size, "warnings": warnings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source folder with build/bin")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--cases", nargs="*", default=list(family_oracle.CASES))
    ap.add_argument("--work", type=Path, help="a folder to keep the HF folders, GGUFs and server logs in")
    ap.add_argument("--only-q4-k-m", action="store_true",
                    help="remake only the q4_k_m part of the QUANTIZED cases' existing fixtures")
    ap.add_argument("--only-q8-0", action="store_true",
                    help="remake only the q8_0 part of the Q8_0 cases' existing fixtures")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = a.work or tmp
        for name in a.cases:
            t0 = time.time()
            if a.only_q8_0:
                if name not in family_oracle.Q8_0_CASES:
                    continue
                fixture = family_oracle.load_fixture(a.out, name)
                root, work = a.llama_cpp.resolve(), Path(tmp)
                if name in family_oracle.F32_EXPERTS:
                    fixture["q8_0"] = f32_experts_q8_run(name, root, work)
                else:
                    gg = family_oracle.rebuild(fixture, work / f"{name}.gguf")
                    fixture["q8_0"] = quantized_run(root, gg, fixture["arch"], work)
                family_oracle.fixture_path(a.out, name).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
                print(json.dumps({"case": name, "q8_0": "remade", "seconds": round(time.time() - t0, 1)}), flush=True)
                continue
            if a.only_q4_k_m:
                if name not in family_oracle.QUANTIZED:
                    continue
                fixture = family_oracle.load_fixture(a.out, name)
                fixture["q4_k_m"] = q4_k_m_run(name, a.llama_cpp.resolve(), Path(tmp))
                family_oracle.fixture_path(a.out, name).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
                print(json.dumps({"case": name, "q4_k_m": "remade", "seconds": round(time.time() - t0, 1)}), flush=True)
                continue
            info = regen(name, a.llama_cpp.resolve(), a.out, Path(tmp))
            print(json.dumps({**info, "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
