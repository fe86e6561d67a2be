"""Regenerate llama.cpp's outputs for every GGUF type (the fixtures of tests/unit/test_llama_numerics.py).

Run from the repository root, with llama.cpp built from the llama-cpp-python sdist
(``benchmarks/build_llama_server.sh`` builds llama-server and llama-quantize)::

    python tests/reference/llama_numerics/regen.py \\
        --bin /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin

What it does, all of it deterministic:

1. writes the F32 model of tests/numerics_model.py (seeded random weights, llama shape);
2. quantizes it with ``llama-quantize --pure F32-FILE OUT TYPE`` for every type of :data:`TYPES`
   (``--pure``: every 2-D tensor in that type, output and token embeddings included) and without
   ``--pure`` for llama-quantize's mixes Q4_K_M and Q5_K_M. MXFP4 is llama-quantize's ``MXFP4_MOE``,
   which with ``--pure`` writes every tensor MXFP4 (without it, only MoE experts). No type needed
   an importance matrix at this size (IQ4_NL and IQ4_XS do not; the IQ1/IQ2/IQ3 types would);
3. checks that the ``gguf`` package writes the same bytes for the types of
   ``numerics_model.REBUILT`` (the tests rebuild those files); the others' files are stored here;
4. starts llama-server on each file twice, with the flags of :data:`RUNS` (127.0.0.1, a free port,
   ``-t 2 -np 1 -c 1024``; "default": every other flag at its default, a float16 KV cache and flash
   attention ``auto``; "f32kv": ``-ctk f32 -ctv f32 -fa off``, attention in float32 as kvserve's
   ``-ctk f32`` computes it, so only the matrix products on the packed weights differ), stopped by
   pid, and records for each run
   * teacher-forced next-token distributions: for each sequence of :data:`SEQUENCES` and each prefix
     length n in [``PREFIX``, len), ``/completion`` with the token-id prompt ``seq[:n]``, ``n_predict``
     1, ``n_probs`` :data:`N_PROBS`, ``cache_prompt`` true (so llama.cpp evaluates one new token per
     request, its decode path): the top ids and their log-probabilities (softmax of the raw logits;
     see :data:`FORCED`);
   * greedy continuations: ``n_predict`` :data:`N_GREEDY`, ``temperature`` 0, ``ignore_eos`` true,
     ``return_tokens`` true, for each prompt of :data:`PROMPTS`;
5. writes ``TYPE.json`` per type (and ``TYPE.gguf`` for the stored files) into this directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import numerics_model  # noqa: E402

#: fixture name -> (llama-quantize type, --pure)
TYPES = {t: (t, True) for t in ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")}
TYPES["MXFP4"] = ("MXFP4_MOE", True)
TYPES["Q4_K_M"] = ("Q4_K_M", False)
TYPES["Q5_K_M"] = ("Q5_K_M", False)
N_PROBS = 5
PREFIX = 4  # the shortest teacher-forced prompt
N_GREEDY = 40
#: the token each teacher-forced request is made to pick (logit_bias; ASCII "a"): llama-server leaves a
#: token's probabilities out of its response while the text so far ends in an incomplete UTF-8
#: character, which a byte token of this vocabulary often is; n_probs reports the raw logits' softmax,
#: before logit_bias, so forcing the sampled token changes nothing reported
FORCED = 3 + ord("a")


def _sequences() -> list[list[int]]:
    """4 fixed token sequences of 104 ids (3..300: no control tokens): 400 teacher-forced positions."""
    rng = np.random.default_rng(2929)
    return [rng.integers(3, 301, 104).tolist() for _ in range(4)]


SEQUENCES = _sequences()
PROMPTS = [s[:8] for s in SEQUENCES] + [[40, 41, 42], [100, 7, 7, 7, 7, 9]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: run name -> llama-server flags beyond ``-t 2 -np 1 -c 1024``
RUNS = {"default": [], "f32kv": ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]}
FLAGS = ["-t", "2", "-np", "1", "-c", "1024"]


class Server:
    """llama-server on one file, started on a free loopback port and stopped by pid."""

    def __init__(self, binary: Path, model: Path, extra: list[str] = ()):
        self.port = _free_port()
        self.flags = [*FLAGS, *extra, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(model.with_suffix(".log"), "w")
        self.proc = subprocess.Popen([str(binary), "-m", str(model), *self.flags], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        import httpx

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

    def completion(self, **body) -> dict:
        r = self.http.post("/completion", json=body)
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


def _top(step: dict) -> tuple[list[int], list[float]]:
    top = step["top_logprobs"]
    return [t["id"] for t in top], [round(t["logprob"], 5) for t in top]


def record(server: Server) -> dict:
    """The teacher-forced distributions and greedy continuations (see the module docstring)."""
    forced = []
    for seq in SEQUENCES:
        ids, lps = [], []
        for n in range(PREFIX, len(seq)):
            out = server.completion(prompt=seq[:n], n_predict=1, n_probs=N_PROBS, cache_prompt=True,
                                    temperature=0, logit_bias=[[FORCED, 1000.0]])
            i, lp = _top(out["completion_probabilities"][0])
            ids.append(i)
            lps.append(lp)
        forced.append({"tokens": seq, "start": PREFIX, "top_ids": ids, "top_logprobs": lps})
    greedy = []
    for p in PROMPTS:
        out = server.completion(prompt=p, n_predict=N_GREEDY, cache_prompt=False, temperature=0, ignore_eos=True,
                                return_tokens=True)
        if len(out["tokens"]) != N_GREEDY:
            raise RuntimeError(f"{len(out['tokens'])} greedy tokens, not {N_GREEDY}")
        greedy.append({"prompt": p, "tokens": out["tokens"]})
    return {"teacher_forced": forced, "greedy": greedy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, type=Path, help="folder holding llama-server and llama-quantize")
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--types", nargs="*", default=list(TYPES))
    a = ap.parse_args()
    version = subprocess.run([str(a.bin / "llama-server"), "--version"], capture_output=True, text=True)
    version = " ".join((version.stdout + version.stderr).split())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = numerics_model.write_gguf(tmp / "f32.gguf")
        for name in a.types:
            qtype, pure = TYPES[name]
            dst = tmp / f"{name}.gguf"
            cmd = [str(a.bin / "llama-quantize"), *(["--pure"] if pure else []), str(src), str(dst), qtype, "2"]
            subprocess.run(cmd, check=True, capture_output=True)
            digests = numerics_model.tensor_digests(dst)
            rebuilt = name in numerics_model.REBUILT
            if rebuilt:
                mine = numerics_model.tensor_digests(numerics_model.write_gguf(tmp / f"py-{name}.gguf", name))
                if mine != digests:
                    raise SystemExit(f"{name}: the gguf package no longer writes llama-quantize's bytes; "
                                     "store the file (drop it from numerics_model.REBUILT)")
            t0 = time.time()
            runs = {}
            for run, extra in RUNS.items():
                server = Server(a.bin / "llama-server", dst, extra)
                try:
                    runs[run] = {"flags": FLAGS + extra, **record(server)}
                finally:
                    server.stop()
            fixture = {"type": name, "quantize": " ".join(["llama-quantize", *cmd[1:2 if pure else 1], "F32", "OUT",
                                                           qtype]),
                       "file": None if rebuilt else f"{name}.gguf", "llama_server": version, "n_probs": N_PROBS,
                       "tensors": digests, "runs": runs}
            (a.out / f"{name}.json").write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
            if not rebuilt:
                shutil.copyfile(dst, a.out / f"{name}.gguf")
            elif (a.out / f"{name}.gguf").exists():
                os.remove(a.out / f"{name}.gguf")
            print(json.dumps({"type": name, "stored_file": not rebuilt, "bytes": dst.stat().st_size,
                              "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
