"""Slot files: one slot's tokens and KV rows on disk (``/slots/{id}?action=save|restore``).

Format, version 2, 3 or 4 (all integers little-endian)::

    offset  size  field
    0       6     magic            b"KVSLOT"
    6       2     version          u16, 2 (every layer holds every token) or 3
    8       16    model            blake2b-128 fingerprint of the model (see ``model_fingerprint``)
    24      4     n_tokens         u32, tokens saved (N)
    28      1     kv_dtype         u8, K's cache type: 0 = f32, 1 = f16, 2 = bf16, 3 = q8_0,
                                   4 = q4_0, 5 = fp8_e4m3, 6 = fp8_e5m2
    29      1     kv_dtype_v       u8, V's cache type (same codes)
    30      2     n_layer          u16 (L)
    32      2     n_head_kv        u16 (H)
    34      2     head_dim         u16 (D)
    36      4     meta length      u32 M: bytes of the metadata (version 4; 0 before)
    40      4*N   token ids        int32[N], position order
    (v3, v4) 4*L  first rows       u32[L]: per layer, the position F_l of its first saved row
                                   (0 for full attention; a sliding-window layer keeps only
                                   its window's rows, F_l <= N)
    (v4)    M     metadata         UTF-8 JSON object, spaces after it to a multiple of 4 bytes: ``cache_salt`` (the KV's vLLM cache_salt or
                                   null) and ``lora`` (the LoRA adapters it was computed under:
                                   ``[{"name", "path", "scale", "fingerprint"}]``, see
                                   :func:`adapter_fingerprint`)
    ...           per layer l = 0..L-1: K rows then V rows, each N - F_l rows (positions
                  F_l..N-1; version 2: F_l = 0) of H heads in the cache's stored form: D
                  values of a float type, or a quantized type's bytes (q8_0: D/32 blocks
                  of 34 bytes, q4_0: 18 bytes, llama.cpp's block layout; fp8: D bytes);
                  see kvserve.engine.kv_quant

So a version 2 file is exactly ``40 + 4 N + L N H (row(K) + row(V))`` bytes, with row(t) =
D * (4 | 2 | 34/32 | 18/32 | 1) bytes for f32 | f16/bf16 | q8_0 | q4_0 | fp8: the
quantized form is saved as the cache holds it and restored bit for bit; a version 3
file is ``40 + 4 N + 4 L + sum_l (N - F_l) H (row(K) + row(V))`` bytes. K rows
are stored after RoPE (as the cache holds them). Version 2 is written whenever every
F_l is 0 (every model without sliding-window layer groups), so such files stay readable
by servers that know versions 1 and 2 only. Version 4 is written when the KV was computed
under a ``cache_salt`` or LoRA adapters (seed 002: the prefix cache's key covers both): a restore
indexes it under the same key, never as base or unsalted KV. Version 1 files (byte 29 reserved, V
in K's type) are still read.

Files are opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` and must be regular
files (checked with ``fstat`` on the open descriptor): a symlink, FIFO, device
or directory in the slot folder is refused with a :class:`SlotFileError`, and
a FIFO cannot block the open. Reading and writing are plain blocking file I/O:
the server runs them in a worker thread, never on the engine thread.

Restoring checks everything before touching the cache: magic, version, model
fingerprint (same model: config, tensor data size, file type, a sample of the
token embedding), the K and V cache types (a file saved with another
``-ctk``/``-ctv`` is refused: its rows are another encoding), dimensions, and the
exact file size. Any mismatch raises
:class:`SlotFileError` (a ``ValueError``: HTTP 400 in the faces) with a
message that says what differs; a file is never half-applied.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import stat
import struct
import uuid
from dataclasses import dataclass

import torch

from kvserve.engine.kv_quant import canonical_kv_type, kv_row_bytes, stored_row_shape

MAGIC = b"KVSLOT"
VERSION = 2
#: the version of a file whose layers start at different positions (sliding-window layer groups)
VERSION_LAYER_FIRST = 3
#: the version of a file with metadata (the KV's cache_salt / LoRA adapters)
VERSION_META = 4
#: versions this code reads (1: V in K's type, byte 29 reserved; 3: per-layer first rows; 4: metadata)
READ_VERSIONS = (1, 2, 3, 4)
#: the most metadata bytes a file may hold
MAX_META = 1 << 20
HEADER = struct.Struct("<6sH16sIBBHHHI")  # 40 bytes
assert HEADER.size == 40

DTYPE_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "fp8_e4m3": 5, "fp8_e5m2": 6}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


class SlotFileError(ValueError):
    """A slot file that cannot be written or restored (bad name, other model, corrupt...)."""


def model_fingerprint(config, info, weight_sample: bytes = b"") -> bytes:
    """16-byte blake2b over the ModelConfig fields, the tensor data size (bytes), file type,
    parameter count and a sample of the weights.

    Args:
        config: the model's ModelConfig (dataclass).
        info: its ModelInfo (``size``, ``ftype``, ``n_params`` are used).
        weight_sample: bytes that differ between checkpoints of one shape (the engine
            passes 32 rows of the token embedding rounded to bfloat16, the same on
            every device).
    """
    fields = dataclasses.asdict(config)
    text = repr(sorted(fields.items())) + f"|size={info.size}|ftype={info.ftype}|n_params={info.n_params}"
    return hashlib.blake2b(text.encode() + b"|" + weight_sample, digest_size=16).digest()


@dataclass(slots=True)
class SlotHeader:
    """The decoded header of a slot file.

    ``kv_dtype`` / ``kv_dtype_v``: K's and V's cache types (kvserve.engine.kv_quant names;
    ``kv_dtype_v`` None = K's type). Names are canonicalized ("fp8" -> "fp8_e4m3").
    ``layer_first``: per layer, the position of its first saved row (empty: 0 for every layer);
    a nonzero one makes the header version 3. ``meta``: the KV's ``cache_salt`` and LoRA adapters
    (see the module docstring; empty: none), which make it version 4."""

    fingerprint: bytes
    n_tokens: int
    kv_dtype: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    version: int = VERSION
    kv_dtype_v: str | None = None
    layer_first: tuple[int, ...] = ()
    meta: dict = dataclasses.field(default_factory=dict)
    #: the metadata's bytes in the file (made from ``meta`` when empty)
    meta_raw: bytes = b""

    def __post_init__(self) -> None:
        self.kv_dtype = canonical_kv_type(self.kv_dtype)
        self.kv_dtype_v = canonical_kv_type(self.kv_dtype_v or self.kv_dtype)
        self.layer_first = tuple(self.layer_first) or (0,) * self.n_layer
        if any(self.layer_first):
            self.version = max(self.version, VERSION_LAYER_FIRST)
        if self.meta:
            self.version = max(self.version, VERSION_META)
            if not self.meta_raw:
                raw = json.dumps(self.meta, sort_keys=True, separators=(",", ":")).encode()
                self.meta_raw = raw + b" " * (-len(raw) % 4)  # the rows stay 4-byte aligned

    def meta_bytes(self) -> bytes:
        """The metadata's bytes (version 4), b"" before."""
        return self.meta_raw if self.version >= VERSION_META else b""

    def rows(self, layer: int) -> int:
        """Rows saved for ``layer`` (its positions layer_first[layer]..n_tokens-1)."""
        return self.n_tokens - self.layer_first[layer]

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.version, self.fingerprint, self.n_tokens, DTYPE_CODES[self.kv_dtype],
                           DTYPE_CODES[self.kv_dtype_v], self.n_layer, self.n_head_kv, self.head_dim,
                           len(self.meta_bytes()))

    def row_bytes(self) -> tuple[int, int]:
        """Bytes of one token's K row and V row in one layer (H heads of D values, stored form)."""
        n = self.n_head_kv * self.head_dim
        return kv_row_bytes(n, self.kv_dtype), kv_row_bytes(n, self.kv_dtype_v)

    def prefix_size(self) -> int:
        """Bytes before the first layer's rows: the header, the token ids, version 3's first rows,
        version 4's metadata."""
        return (HEADER.size + 4 * self.n_tokens + (4 * self.n_layer if self.version >= VERSION_LAYER_FIRST else 0)
                + len(self.meta_bytes()))

    def file_size(self) -> int:
        """Expected total file size in bytes."""
        return self.prefix_size() + sum(self.rows(i) for i in range(self.n_layer)) * sum(self.row_bytes())


def adapter_fingerprint(adapter) -> str:
    """Hex blake2b-128 of a LoRA adapter's weights (``kvserve.lora.LoraAdapter``): every module's name,
    factor and A and B as float32, so a slot file names the adapter its KV was computed under by
    content, whatever its id, name or path in the server that restores it."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(adapter.modules):
        m = adapter.modules[name]
        h.update(name.encode() + b"\x00" + struct.pack("<d", float(m.scale)))
        for t in (m.a, m.b):
            h.update(struct.pack("<2I", *t.shape))
            h.update(_bytes(t.float()))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


def _open(path: str, flags: int) -> int:
    """``os.open`` without following a symlink and without blocking on a FIFO; SlotFileError
    for a symlink or anything that is not a regular file (FileNotFoundError passes through)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SlotFileError("slot file is a symbolic link: refused (links are not followed)") from None
        if e.errno == errno.EISDIR:
            raise SlotFileError("slot file is a directory, not a regular file: refused") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SlotFileError(f"slot file is {_kind(mode)}, not a regular file: refused")
    os.set_blocking(fd, True)
    return fd


def write_slot_file(path: str, header: SlotHeader, token_ids: list[int],
                    layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Write a slot file atomically (a new temp file + rename). Returns bytes written.

    Blocking file I/O: call it off the engine thread.

    Args:
        token_ids: N token ids.
        layers: per layer (K, V) ``header.rows(layer)`` rows each (N, or those of positions
            ``layer_first``..N-1) in the header's types' stored form (ModelRunner.read_rows: [rows, H, D]
            of a float type, uint8 [rows, H, row bytes] of a quantized one).

    Raises:
        SlotFileError: ``path`` exists and is not a regular file (symlink, FIFO,
            directory...), or the write failed.
    """
    if len(token_ids) != header.n_tokens or len(layers) != header.n_layer:
        raise SlotFileError("slot file: token or layer count does not match the header")
    if any(k.shape[0] != header.rows(i) or v.shape[0] != header.rows(i) for i, (k, v) in enumerate(layers)):
        raise SlotFileError("slot file: a layer's row count does not match the header")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise SlotFileError(f"failed to write slot file: {e.strerror or e}") from e
    if mode is not None and not stat.S_ISREG(mode):
        raise SlotFileError(f"slot file exists and is {_kind(mode)}, not a regular file: refused")
    tmp = f"{path}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
    n = 0
    try:
        with os.fdopen(_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            chunks = [header.pack(), struct.pack(f"<{len(token_ids)}i", *token_ids)]
            if header.version >= VERSION_LAYER_FIRST:
                chunks.append(struct.pack(f"<{header.n_layer}I", *header.layer_first))
            chunks.append(header.meta_bytes())
            for chunk in chunks:
                f.write(chunk)
                n += len(chunk)
            for k, v in layers:
                for t in (k, v):
                    b = _bytes(t)
                    f.write(b)
                    n += len(b)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise SlotFileError(f"failed to write slot file: {e.strerror or e}") from e
    return n


def read_slot_file(path: str, *, fingerprint: bytes, kv_dtype: str, n_layer: int, n_head_kv: int,
                   head_dim: int, kv_dtype_v: str | None = None,
                   ) -> tuple[SlotHeader, list[int], list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Read and validate a slot file against the running model.

    Blocking file I/O: call it off the engine thread. The file is opened without
    following a symlink and must be a regular file.

    Args:
        kv_dtype, kv_dtype_v: the cache's K and V types (V None = K's); the file's must equal them.

    Returns:
        (header, token ids, per layer (K, V) CPU tensors in their stored form (as
        ModelRunner.write_rows takes them: [rows, H, D] of a float type, uint8 [rows, H, row
        bytes] of a quantized one; ``header.rows(layer)`` rows: the last ones of the N positions),
        bytes read).

    Raises:
        FileNotFoundError: no such file.
        SlotFileError: anything else wrong (not a regular file, magic, version, model,
            dtype, dims, size).
    """
    with os.fdopen(_open(path, os.O_RDONLY), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise SlotFileError(f"not a slot file: {size} bytes is shorter than the {HEADER.size}-byte header")
        magic, version, fp, n_tok, code, code_v, nl, nh, hd, meta_len = HEADER.unpack(head)
        if magic != MAGIC:
            raise SlotFileError("not a slot file (bad magic)")
        if version not in READ_VERSIONS:
            raise SlotFileError(f"unsupported slot file version {version} (this server reads versions "
                                f"{', '.join(map(str, READ_VERSIONS))})")
        if fp != fingerprint:
            raise SlotFileError("slot file was saved with a different model")
        code_v = code if version == 1 else code_v
        for c in (code, code_v):
            if c not in DTYPE_NAMES:
                raise SlotFileError(f"slot file has an unknown KV dtype code {c}")
        hdr = SlotHeader(fp, n_tok, DTYPE_NAMES[code], nl, nh, hd, version, DTYPE_NAMES[code_v])
        if version >= VERSION_META:
            if not 0 < meta_len <= MAX_META or meta_len % 4:
                raise SlotFileError(f"slot file is corrupt: {meta_len} bytes of metadata (a multiple of 4, "
                                    f"at most {MAX_META})")
            hdr.meta_raw = bytes(meta_len)  # its size until it is read with the token ids
        want = (canonical_kv_type(kv_dtype), canonical_kv_type(kv_dtype_v or kv_dtype))
        if (hdr.kv_dtype, hdr.kv_dtype_v) != want:
            raise SlotFileError(f"slot file KV dtype (K {hdr.kv_dtype}, V {hdr.kv_dtype_v}) differs from the "
                                f"cache's (K {want[0]}, V {want[1]}): restore it into a server started with "
                                f"-ctk {hdr.kv_dtype} -ctv {hdr.kv_dtype_v}")
        if (nl, nh, hd) != (n_layer, n_head_kv, head_dim):
            raise SlotFileError(f"slot file KV shape (n_layer {nl}, n_head_kv {nh}, head_dim {hd}) differs from "
                                f"the model's ({n_layer}, {n_head_kv}, {head_dim})")
        if version < VERSION_LAYER_FIRST and size != hdr.file_size():
            raise SlotFileError(f"slot file is corrupt: {size} bytes, expected {hdr.file_size()} for {n_tok} tokens")
        if size < hdr.prefix_size():  # version 3: the layers' first rows (so the size) are in the body
            raise SlotFileError(f"slot file is corrupt: {size} bytes, expected at least {hdr.prefix_size()} for "
                                f"{n_tok} tokens")
        # the token ids (and version 3's first rows, which fix the size) first: the body is
        # allocated and read only once the file's size is the one the header promises
        pre = f.read(hdr.prefix_size() - HEADER.size)
        if len(pre) != hdr.prefix_size() - HEADER.size:  # the file changed while being read
            raise SlotFileError(f"slot file is corrupt: {HEADER.size + len(pre)} bytes, expected {size}")
        if version >= VERSION_LAYER_FIRST:
            first = struct.unpack_from(f"<{nl}I", pre, 4 * n_tok)
            if any(x > n_tok for x in first):
                raise SlotFileError(f"slot file is corrupt: a layer's first row is past its {n_tok} tokens")
            hdr = dataclasses.replace(hdr, layer_first=first)
        if version >= VERSION_META:
            end = hdr.prefix_size() - HEADER.size
            hdr.meta_raw = bytes(pre[end - meta_len:end])
            try:
                hdr.meta = json.loads(hdr.meta_raw.decode("utf-8"))
            except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
                hdr.meta = None
            if not isinstance(hdr.meta, dict):
                raise SlotFileError("slot file is corrupt: its metadata is not a JSON object")
        if size != hdr.file_size():
            raise SlotFileError(f"slot file is corrupt: {size} bytes, expected {hdr.file_size()} for {n_tok} tokens")
        raw = bytearray(size - HEADER.size)
        raw[:len(pre)] = pre
        got = len(pre) + (f.readinto(memoryview(raw)[len(pre):]) if size > hdr.prefix_size() else 0)
        if got != size - HEADER.size:  # the file changed while being read
            raise SlotFileError(f"slot file is corrupt: {HEADER.size + got} bytes, expected {size}")
    tok = list(struct.unpack_from(f"<{n_tok}i", raw, 0))
    forms = [stored_row_shape(t, nh, hd) for t in (hdr.kv_dtype, hdr.kv_dtype_v)]
    off = hdr.prefix_size() - HEADER.size
    buf = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    layers = []
    for i in range(nl):
        kv = []
        n = hdr.rows(i)
        for (dt, shape), row in zip(forms, hdr.row_bytes()):
            nb = n * row
            kv.append(buf[off: off + nb].view(dt).view(n, *shape))
            off += nb
        layers.append((kv[0], kv[1]))
    return hdr, tok, layers, size
