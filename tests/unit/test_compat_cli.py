"""``kvserve run`` as Ollama's: flags after the model, --verbose in process, an embedding model said to
be one (issue 32, build 4). No server answers (test_cli's fixtures)."""

from __future__ import annotations

import re

from test_cli import no_server, run, store, write  # noqa: F401 - fixtures (no_server is autouse)


def test_run_takes_flags_after_the_model(tiny_gguf, capsys):
    plain = run(capsys, "run", tiny_gguf, "Hello", "-n", "6")
    assert plain[0] == 0
    rc, out, err = run(capsys, "run", tiny_gguf, "--verbose", "-n", "6", "Hello")
    assert (rc, out) == (0, plain[1])  # the same answer: "Hello" was the prompt, not an error
    lines = err.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [
        "total duration", "load duration", "prompt eval count", "prompt eval duration", "prompt eval rate",
        "eval count", "eval duration", "eval rate"], err
    assert re.fullmatch(r"eval count: +6 token\(s\)", lines[5]), lines[5]
    assert run(capsys, "run", tiny_gguf, "Hel", "--verbose", "lo", "-n", "6")[0] == 0  # words around a flag


def test_embedding_model_says_what_it_is(tmp_path, capsys):
    from embed_conftest import write_tiny_bert
    from test_bert import write_bert_gguf

    bert = write_bert_gguf(write_tiny_bert(tmp_path / "bert"), tmp_path / "bert.gguf")  # as Ollama's all-minilm
    assert run(capsys, "create", "emb", "-f", write(tmp_path / "Modelfile", f"FROM {bert}\n"))[0] == 0
    msg = ("does not support generate: it is an embedding model; serve it with `kvserve serve` and use "
           "/api/embed or /v1/embeddings\n")
    assert run(capsys, "run", "emb", "hello") == (1, "", f'Error: "emb" {msg}')
    assert run(capsys, "run", str(bert), "hello") == (1, "", f'Error: "{bert}" {msg}')
    rc, out, _ = run(capsys, "show", "emb")
    assert rc == 0 and "  Capabilities\n    embedding    \n\n" in out and "completion" not in out

