"""Slot files: one slot's tokens and KV rows on disk (``/slots/{id}?action=save|restore``).

Format, version 1 (all integers little-endian)::

    offset  size  field
    0       6     magic            b"KVSLOT"
    6       2     version          u16, 1
    8       16    model            blake2b-128 fingerprint of the model (see ``model_fingerprint``)
    24      4     n_tokens         u32, tokens saved (N)
    28      1     kv_dtype         u8: 0 = f32, 1 = f16, 2 = bf16 (the cache's dtype, stored as is)
    29      1     reserved         0
    30      2     n_layer          u16 (L)
    32      2     n_head_kv        u16 (H)
    34      2     head_dim         u16 (D)
    36      4     reserved         0
    40      4*N   token ids        int32[N], position order
    ...           per layer l = 0..L-1: K rows [N, H, D] then V rows [N, H, D] in kv_dtype

So a file is exactly ``40 + 4 N + 2 L N H D sizeof(kv_dtype)`` bytes. K rows
are stored after RoPE (as the cache holds them), at positions 0..N-1.

Files are opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` and must be regular
files (checked with ``fstat`` on the open descriptor): a symlink, FIFO, device
or directory in the slot folder is refused with a :class:`SlotFileError`, and
a FIFO cannot block the open. Reading and writing are plain blocking file I/O:
the server runs them in a worker thread, never on the engine thread.

Restoring checks everything before touching the cache: magic, version, model
fingerprint (same model: config, tensor data size, file type, a sample of the
token embedding), dtype and
dimensions, and the exact file size. Any mismatch raises
:class:`SlotFileError` (a ``ValueError``: HTTP 400 in the faces) with a
message that says what differs; a file is never half-applied.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import stat
import struct
import uuid
from dataclasses import dataclass

import torch

MAGIC = b"KVSLOT"
VERSION = 1
HEADER = struct.Struct("<6sH16sIBBHHHI")  # 40 bytes
assert HEADER.size == 40

DTYPE_CODES = {"f32": 0, "f16": 1, "bf16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


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
    """The decoded header of a slot file."""

    fingerprint: bytes
    n_tokens: int
    kv_dtype: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    version: int = VERSION

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.version, self.fingerprint, self.n_tokens, DTYPE_CODES[self.kv_dtype], 0,
                           self.n_layer, self.n_head_kv, self.head_dim, 0)

    def file_size(self) -> int:
        """Expected total file size in bytes."""
        row = self.n_head_kv * self.head_dim * DTYPE_BYTES[self.kv_dtype]
        return HEADER.size + 4 * self.n_tokens + 2 * self.n_layer * self.n_tokens * row


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
        layers: per layer (K [N, H, D], V [N, H, D]) in the header's dtype.

    Raises:
        SlotFileError: ``path`` exists and is not a regular file (symlink, FIFO,
            directory...), or the write failed.
    """
    if len(token_ids) != header.n_tokens or len(layers) != header.n_layer:
        raise SlotFileError("slot file: token or layer count does not match the header")
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
            for chunk in (header.pack(), struct.pack(f"<{len(token_ids)}i", *token_ids)):
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
                   head_dim: int) -> tuple[SlotHeader, list[int], list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Read and validate a slot file against the running model.

    Blocking file I/O: call it off the engine thread. The file is opened without
    following a symlink and must be a regular file.

    Returns:
        (header, token ids, per layer (K [N, H, D], V [N, H, D]) CPU tensors in
        ``kv_dtype``, bytes read).

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
        magic, version, fp, n_tok, code, _, nl, nh, hd, _ = HEADER.unpack(head)
        if magic != MAGIC:
            raise SlotFileError("not a slot file (bad magic)")
        if version != VERSION:
            raise SlotFileError(f"unsupported slot file version {version} (this server reads version {VERSION})")
        if fp != fingerprint:
            raise SlotFileError("slot file was saved with a different model")
        if code not in DTYPE_NAMES:
            raise SlotFileError(f"slot file has an unknown KV dtype code {code}")
        hdr = SlotHeader(fp, n_tok, DTYPE_NAMES[code], nl, nh, hd, version)
        if hdr.kv_dtype != kv_dtype:
            raise SlotFileError(f"slot file KV dtype {hdr.kv_dtype} differs from the cache's {kv_dtype}")
        if (nl, nh, hd) != (n_layer, n_head_kv, head_dim):
            raise SlotFileError(f"slot file KV shape (n_layer {nl}, n_head_kv {nh}, head_dim {hd}) differs from "
                                f"the model's ({n_layer}, {n_head_kv}, {head_dim})")
        if size != hdr.file_size():
            raise SlotFileError(f"slot file is corrupt: {size} bytes, expected {hdr.file_size()} for {n_tok} tokens")
        raw = f.read(size - HEADER.size)
        if len(raw) != size - HEADER.size:  # the file changed while being read
            raise SlotFileError(f"slot file is corrupt: {HEADER.size + len(raw)} bytes, expected {size}")
    tok = list(struct.unpack_from(f"<{n_tok}i", raw, 0))
    dt = TORCH_DTYPES[kv_dtype]
    row = nh * hd * DTYPE_BYTES[kv_dtype]
    off = 4 * n_tok
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    layers = []
    for _ in range(nl):
        kv = []
        for _ in range(2):
            nb = n_tok * row
            kv.append(buf[off: off + nb].view(dt).view(n_tok, nh, hd))
            off += nb
        layers.append((kv[0], kv[1]))
    return hdr, tok, layers, size
