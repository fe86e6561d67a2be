"""GGUF loader: metadata, tensors and tokenizer through the ``gguf`` package.

The file's ``general.architecture`` names its family (kvserve.models.family): the family reads
the config from the metadata, names the tensors it requires and turns the weights into its
module's layout; this module only reads the file.

Quantized tensors: matrices of the types the GGUF block kernels multiply (F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4: :data:`RAW_TYPES`) keep
the file's bytes (``Weight.raw``, a view of the mapping), stacked expert tensors [E, out, in]
of those types too (a MoE module multiplies each expert's rows: idle experts are never read);
where those kernels cannot be built (``kvserve.models.ggml_kernel.enabled``) Q4_0 and Q4_1
matrices are unpacked for torch's int4 kernel instead; every other type the ``gguf`` package
can dequantize becomes float32 at load.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.loaders import file_cache
from kvserve.loaders.weights import (
    LoadedModel,
    ModelInfo,
    ModelLoadError,
    Weight,
    check_finite,
    check_tensors,
)

# llama.cpp's llama_model_ftype_name texts, by general.file_type.
_FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium",
    18: "Q6_K", 32: "BF16",
}


log = logging.getLogger("kvserve.loaders")

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format (numbers) ; 8 = string, 9 = array
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
             7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(slots=True)
class TensorInfo:
    """One tensor's header entry: name, GGUF shape (innermost first), ggml type, absolute data offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated GGUF header (file ends at byte {len(self.buf)})")

    def scalar(self, vtype: int):
        fmt = _SCALAR_FMT[vtype]
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar(10)
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype = self.scalar(4)
            count = self.scalar(10)
            if etype == 8:
                return [self.string() for _ in range(count)]
            if etype in _NP_DTYPE:
                dt = np.dtype(_NP_DTYPE[etype])
                self.need(count * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR_FMT:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.scalar(vtype)


#: the last header read: ((path, device, inode, size, mtime_ns, ctime_ns), metadata, tensors). A
#: model load reads its file's header several times (the model manager's task probe, vLLM's
#: start-up checks, the loader); on SmolLM2 a read is 0.1-0.2 s of start-up, most of it the 49k
#: vocabulary strings
_LAST_HEADER: tuple | None = None
_HEADER_LOCK = threading.Lock()


def read_gguf_header(path: str) -> tuple[dict, list[TensorInfo]]:
    """Parse a GGUF file's metadata and tensor table.

    We parse the header ourselves because gguf.GGUFReader builds a numpy view
    per vocabulary string and takes ~5 s on a 49k-token vocabulary; tensor
    data is still decoded with the ``gguf`` package. The last file's header is
    remembered by path, device, inode, size, modification and change time: a
    caller gets its own dict and list (shared values: treat them as read-only);
    across processes it is kept in the file cache under ``$KVSERVE_HOME/cache``
    (:mod:`kvserve.loaders.file_cache`, the same identity).

    Returns (metadata: key -> Python value, tensors). Raises ModelLoadError on a
    bad magic, unsupported version or a truncated file.
    """
    global _LAST_HEADER
    # the inode, device and change time too: a same-size copy that kept the modification time
    # (cp -p, rsync -a, tar) or a coarse file-system clock must not hand out the old header
    key = tuple(file_cache.identity(path))
    with _HEADER_LOCK:
        last = _LAST_HEADER
    if last is not None and last[0] == key:
        return dict(last[1]), list(last[2])
    md, infos = _cached_header(path, list(key))
    with _HEADER_LOCK:
        _LAST_HEADER = (key, md, infos)
    return dict(md), list(infos)


_HEADER_KIND = "gguf-header"


_FINITE_KIND = "gguf-finite"


def _check_finite_cached(weights: dict[str, Weight], path: str) -> None:
    """:func:`check_finite` once per file: a pass is kept in the file cache (keyed on the file's identity,
    :mod:`kvserve.loaders.file_cache`), so a later start of the same file skips the scan (it touches every
    page of the file: ~0.2 s for a 1B Q4_K_M file, ~1 s for an 8B one). A changed file has another identity
    and is scanned again; a failure is never kept (the error is raised each time). Raises ModelLoadError."""
    try:
        ident = file_cache.identity(path)
    except OSError:
        ident = None
    if ident is not None and file_cache.load(_FINITE_KIND, ident) is True:
        return
    check_finite(weights, path)
    if ident is not None:
        file_cache.store(_FINITE_KIND, ident, True)


def _cached_header(path: str, ident: list) -> tuple[dict, list[TensorInfo]]:
    """The header from the file cache (:mod:`kvserve.loaders.file_cache`, keyed on the file's
    identity), else parsed and stored there: ~30 ms instead of 0.5-1 s for a 49k vocabulary."""
    doc = file_cache.load(_HEADER_KIND, ident)
    if doc is not None:
        try:
            return doc["metadata"], [TensorInfo(n, tuple(s), t, o, b) for n, s, t, o, b in doc["tensors"]]
        except (KeyError, TypeError, ValueError):  # a malformed entry: parsed again and replaced
            pass
    md, infos = _read_gguf_header(path)
    file_cache.store(_HEADER_KIND, ident, {"metadata": md, "tensors": [[t.name, list(t.shape), t.ggml_type, t.offset,
                                                                         t.n_bytes] for t in infos]})
    return md, infos


def _read_gguf_header(path: str) -> tuple[dict, list[TensorInfo]]:
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            raise ModelLoadError(f"{path}: not a GGUF file (only {size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    cur.need(4)
    if bytes(buf[0:4]) != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {bytes(buf[0:4])!r})")
    cur.pos = 4
    version = cur.scalar(4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    md: dict = {"GGUF.version": version}
    for _ in range(n_kv):
        key = cur.string()
        md[key] = cur.value(cur.scalar(4))
    import gguf

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar(4)
        shape = tuple(cur.scalar(10) for _ in range(n_dims))
        gtype = cur.scalar(4)
        offset = cur.scalar(10)
        try:
            qtype = gguf.GGMLQuantizationType.MXFP4 if gtype == OLLAMA_MXFP4 else gguf.GGMLQuantizationType(gtype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path}: tensor '{name}' has unknown ggml type {gtype}") from None
        n_el = 1
        for d in shape:
            n_el *= d
        infos.append(TensorInfo(name, shape, gtype, offset, n_el // block * type_size))
    align = int(md.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    for t in infos:
        t.offset += data_start
        if t.offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF: tensor '{t.name}' needs bytes up to {t.offset + t.n_bytes}, file has {size}"
            )
    return md, infos


def tensor_shapes(infos: list[TensorInfo]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> torch shape (GGUF lists the innermost dimension first)."""
    return {t.name: tuple(int(x) for x in reversed(t.shape)) for t in infos}


def _q4_blocks(raw: np.ndarray, rows: int, cols: int, kind: str) -> Weight:
    """Unpack GGUF Q4_0 / Q4_1 blocks (32 weights each) into nibbles and scales; the blocks
    themselves (``raw``'s bytes, not copied) stay as ``Weight.q4_raw``.

    Q4_0 block: d (f16), 16 bytes; Q4_1 block: d (f16), m (f16), 16 bytes.
    Byte j holds weight j in its low nibble and weight j+16 in its high nibble.
    """
    nb = cols // 32
    bsize = 18 if kind == "Q4_0" else 20
    blocks = np.asarray(raw).reshape(rows, nb, bsize)
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)[:, :, 0]
    if kind == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)[:, :, 0]
        qs = blocks[:, :, 4:]
        zero = m + 8.0 * d
    else:
        qs = blocks[:, :, 2:]
        zero = np.zeros_like(d)
    q = np.empty((rows, nb, 32), dtype=np.uint8)
    q[:, :, :16] = qs & 0x0F
    q[:, :, 16:] = qs >> 4
    return Weight((rows, cols), q4=q.reshape(rows, cols), q4_scale=d, q4_zero=zero, source_type=kind,
                  q4_raw=blocks.reshape(rows, nb * bsize))


def _q8_0_dense(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of ``shape`` from GGUF Q8_0 blocks (d f16, then 32 int8: ``w = d * q``).

    The same products as ``gguf.quants.dequantize`` (bit for bit), in one float32 buffer: that
    routine splits the rows into groups and took ~0.45 s of a SmolLM2 start-up for its 49152 x 576
    embedding, this ~0.1 s."""
    blocks = np.asarray(raw).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    w = blocks[:, 2:].view(np.int8).astype(np.float32)
    w *= d
    return w.reshape(shape)


#: the ggml type number Ollama's gpt-oss converter (architecture ``gptoss``) gave its MXFP4 tensors: the
#: checkpoint's blocks as they are (a scale byte, then 16 bytes holding elements 2k and 2k+1 in the low
#: and high nibble of byte k), which Ollama's loader reorders into ggml's MXFP4 (type 39: byte j holds
#: elements j and j + 16) before use; :func:`ollama_mxfp4_to_ggml` does the same
OLLAMA_MXFP4 = 4


def ollama_mxfp4_to_ggml(data: np.ndarray) -> np.ndarray:
    """uint8 blocks of 17 bytes in Ollama's ``gptoss`` MXFP4 order -> a new array in ggml's MXFP4 order
    (the same scale byte; nibbles regrouped), the same length."""
    blocks = np.asarray(data).reshape(-1, 17)
    out = blocks.copy()
    a, c = blocks[:, 1:9], blocks[:, 9:17]
    out[:, 1:17:2] = (a & 0x0F) | (c << 4)
    out[:, 2:17:2] = (a >> 4) | (c & 0xF0)
    return out.reshape(-1)


#: matrices of these ggml types stay as the file stores them (Weight.raw, a view of the mapping)
#: for the block kernels (kvserve.models.ggml_kernel.TYPES)
RAW_TYPES = frozenset({"F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                       "IQ4_NL", "IQ4_XS", "MXFP4"})


def _block_kernels() -> bool:
    from kvserve.models import ggml_kernel

    return ggml_kernel.enabled()


def _tensor_to_weight(t: TensorInfo, raw: np.ndarray) -> Weight:
    """One tensor's Weight: matrices of :data:`RAW_TYPES` kept as their bytes in the file
    (``Weight.raw``, no copy; Q4_0/Q4_1 unpacked to nibbles and scales where the block kernels
    cannot be built), anything else
    float32. Raises ModelLoadError naming the tensor and type when its byte size disagrees with
    its type and shape (rows that are not whole blocks) or the type cannot be read."""
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))  # torch layout
    data = raw[t.offset: t.offset + t.n_bytes]
    if t.ggml_type == OLLAMA_MXFP4:  # a copy in ggml's order (not the file's pages)
        qtype, data = gguf.GGMLQuantizationType.MXFP4, ollama_mxfp4_to_ggml(data)
    else:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block or len(data) != t.n_elements // block * type_size:
        raise ModelLoadError(f"tensor '{t.name}' of type {qtype.name}: shape {list(t.shape)} is not whole "
                             f"{block}-value blocks of {type_size} bytes ({len(data)} bytes in the file)")
    if qtype.name in ("Q4_0", "Q4_1") and len(shape) == 2 and not _block_kernels():
        return _q4_blocks(data, shape[0], shape[1], qtype.name)
    if qtype.name in RAW_TYPES and len(shape) in (2, 3):  # a matrix, or stacked experts [E, out, in]
        return Weight(shape, raw=data.reshape(*shape[:-1], shape[-1] // block * type_size), source_type=qtype.name)
    if qtype == gguf.GGMLQuantizationType.Q8_0 and shape and shape[-1] % 32 == 0:
        return Weight(shape, dense=_q8_0_dense(data, shape), source_type=qtype.name)
    if qtype == gguf.GGMLQuantizationType.F32:
        arr = data.view(np.float32).copy()  # writable: torch refuses read-only memory
    elif qtype == gguf.GGMLQuantizationType.F16:
        arr = data.view(np.float16).astype(np.float32)
    else:
        data = data.reshape(-1, gguf.quants.quant_shape_to_byte_shape((shape[-1],), qtype)[0]) if len(shape) > 1 else data
        try:
            arr = gguf.quants.dequantize(data, qtype)
        except NotImplementedError as e:
            raise ModelLoadError(f"tensor '{t.name}': quantization type {qtype.name} is not supported") from e
    return Weight(shape, dense=np.ascontiguousarray(arr.reshape(shape), dtype=np.float32), source_type=qtype.name)


#: how load_gguf holds a file's tensor bytes (:func:`set_weight_memory`): "auto" (the default: "read"
#: where the kernel grants transparent huge pages to memory that asks for them, else "mmap"), "read" or
#: "mmap"; KVSERVE_MMAP=1 / 0 overrides the default ("mmap" / "read")
_WEIGHT_MEMORY = "auto"


def set_weight_memory(mode: str) -> None:
    """How the next :func:`load_gguf` calls hold the tensor bytes (llama-server's ``--mmap`` / ``--no-mmap``).

    Args:
        mode: "read": the file is read (not mapped) into private anonymous memory that asks for
            transparent huge pages (``MADV_HUGEPAGE``): decode reads the weights through 2 MiB pages
            instead of 4 KiB ones (fewer TLB misses: a one-stream decode is memory-bound, and on this
            project's 2-core VM the same bytes read ~1.6x faster through huge pages), at the cost of a
            private copy (the page cache keeps the file too, but reclaimably; resident memory is the
            same as a mapped file's touched pages) and the read at start-up (~0.3 s per GB from the
            page cache). llama-server's ``--no-mmap``.
            "mmap": views of the file's read-only mapping (4 KiB page-cache pages; a second process or a
            reload shares them). llama-server's default ``--mmap``.
            "auto": "read" where /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise",
            else "mmap" (without huge pages the copy buys nothing).

    Raises:
        ValueError: another mode.
    """
    global _WEIGHT_MEMORY
    if mode not in ("auto", "read", "mmap"):
        raise ValueError(f"weight memory must be auto, read or mmap, not {mode!r}")
    _WEIGHT_MEMORY = mode


def _weight_memory() -> str:
    """The mode :func:`load_gguf` uses now: "read" or "mmap" (see :func:`set_weight_memory`)."""
    from kvserve.loaders.weight_read import weight_memory_mode

    return weight_memory_mode(_WEIGHT_MEMORY)


def _load_weight_memory(packed: bool, infos: list[TensorInfo]) -> str:
    """How one :func:`load_gguf` call holds its file's bytes, decided once per load: "read" (the
    weights kept as the file stores them, ``packed``, and the mode now is "read": see
    :func:`set_weight_memory`) or "mmap" (the file's read-only mapping)."""
    return "read" if packed and infos and _weight_memory() == "read" else "mmap"


def _weight_bytes(path: str, infos: list[TensorInfo], packed: bool) -> np.ndarray:
    """The file's bytes as uint8 [file size], indexed by file offset: the file's read-only mapping, or
    (mode "read", see :func:`set_weight_memory`, and ``packed``: weights kept as the file stores
    them) private anonymous memory, 2 MiB-aligned and advised MADV_HUGEPAGE, holding the tensor data
    (from the first tensor's offset to the end; the header's pages take no memory), read with
    ``preadv`` (:class:`kvserve.loaders.weight_read.WeightRead`; the file's pages are in the page
    cache but not in this process's resident set). A read that ``kvserve serve`` began before its
    imports (:func:`kvserve.loaders.weight_read.prefetch`) is taken over and finished here."""
    r = _start_read(path, infos) if _load_weight_memory(packed, infos) == "read" else None
    if r is None:
        return _file_map(path)
    return _finish_read(r, infos)


def _file_map(path: str) -> np.ndarray:
    """The file's read-only mapping, uint8 [file size] (recorded for weight_read.give_back)."""
    from kvserve.loaders import weight_read

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    weight_read.register_file_view(raw, path, "mmap")
    return raw


def _start_read(path: str, infos: list[TensorInfo]):
    """The :class:`~kvserve.loaders.weight_read.WeightRead` of ``path``'s tensor data: the prefetch
    ``kvserve serve`` began, else a new one (nothing read yet); None when the memory cannot be had
    (the caller maps the file instead)."""
    from kvserve.loaders import weight_read

    r = weight_read.claim(path)
    if r is not None:
        log.debug("weight read of %s: taking over the prefetch", path)
        return r
    try:
        return weight_read.WeightRead(path, min(t.offset for t in infos))
    except OSError:
        return None


def _finish_read(r, infos: list[TensorInfo]) -> np.ndarray:
    """Read what is left of ``r`` on this thread and up to 3 more (4 readers at most, one per CPU, the
    threads already reading counted as one), wait for all of it; the bytes as uint8 [file size].

    Raises:
        ModelLoadError: the file's identity (size, modification and change times) differs from when
            the read began (it was written in place meanwhile)."""
    r.finish(max(1, min(4, os.cpu_count() or 1) - 1))
    if r.changed():  # written in place during the read: the bytes may mix two files
        r.close()
        raise ModelLoadError(f"{r.path}: the file changed while its weights were read (written in place "
                             "during the load); load it again once it is complete")
    buf = np.frombuffer(r.result(min(t.offset for t in infos)), dtype=np.uint8)
    from kvserve.loaders import weight_read

    weight_read.register_file_view(buf, r.path, "read", r.ident)
    log.debug("weight read of %s: %.3f s", r.path, r.read_s)
    return buf


def load_gguf(path: str | os.PathLike) -> LoadedModel:
    """Load a GGUF model file of any family kvserve knows (kvserve.models.family).

    Returns a LoadedModel whose weights use GGUF tensor names, in the layout the family's
    module takes (llama: Q/K rows in interleaved-pair RoPE order, see kvserve.loaders.weights).

    Raises:
        FileNotFoundError: no such file.
        ModelLoadError: not a GGUF / truncated, unknown architecture, missing
            tensor or key, unsupported quantization or tokenizer.
    """
    from kvserve.models.family import gguf_family

    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    md, infos = read_gguf_header(path)
    family = gguf_family(md, path)
    config = family.config_from_gguf(md, path, tensor_shapes(infos))
    size = sum(t.n_bytes for t in infos)
    n_params = sum(t.n_elements for t in infos)
    # the weights' read (in the kernel: preadv releases the GIL) on a thread of its own while this one
    # builds the tokenizer (Python and the tokenizers library: the GIL); a tokenizer that fails is
    # reported after the tensors' checks, as when the two ran one after the other
    mode = _load_weight_memory(family.packed_weights, infos)
    reading = _start_read(path, infos) if mode == "read" else None
    if reading is not None:
        threading.Thread(target=reading.work, name="weight-read", daemon=True).start()
    tok_error: BaseException | None = None
    try:
        tokenizer, info = _tokenizer_and_info(md, path, config, config.arch, n_params, size, 2)
    except Exception as e:  # noqa: BLE001 - raised below, after the weights' own errors
        tok_error = e
    if reading is not None:  # this thread (and more, with more CPUs) reads what is left, then waits
        raw = _finish_read(reading, infos)
    else:  # mode "mmap", or the private memory could not be had (_start_read said so once)
        raw = _file_map(path)
    weights: dict[str, Weight] = {}
    for t in infos:
        try:
            w = _tensor_to_weight(t, raw)
        except ValueError as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{path}: tensor '{t.name}' is truncated or malformed: {e}") from e
        if not family.packed_weights:  # float32 for a module without a 4-bit path
            w = Weight(w.shape, dense=w.to_dense(), source_type=w.source_type)
        weights[t.name] = w
    check_tensors(family.required_tensors(config, weights), weights, path)
    _check_finite_cached(weights, path)
    family.prepare(config, weights, "gguf")
    if tok_error is not None:
        raise tok_error
    template = md.get("tokenizer.chat_template") if family.task == "generate" else None
    return LoadedModel(config, info, weights, tokenizer, template,
                       weight_memory="read" if reading is not None else "mmap")


def _tokenizer_and_info(md: dict, path: str, config, arch: str, n_params: int, size: int,
                        default_vocab_type: int) -> tuple:
    """The tokenizer and ModelInfo of a GGUF file (llama and BERT loaders alike).

    Raises:
        ModelLoadError: the tokenizer cannot be built from the metadata.
    """
    from kvserve.loaders.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_gguf(md)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build tokenizer: {e}") from e
    ftype = _FTYPE_NAMES.get(int(md.get("general.file_type", -1) or -1), "unknown")
    if md.get("general.file_type") is None:
        ftype = "unknown"
    info = ModelInfo(
        path=path,
        name=str(md.get("general.name") or Path(path).stem),
        format="gguf",
        arch=arch,
        ftype=ftype,
        n_params=n_params,
        size=size,
        n_vocab=config.n_vocab,
        n_ctx_train=config.n_ctx_train,
        n_embd=config.n_embd,
        vocab_type=getattr(tokenizer, "vocab_type", default_vocab_type),
        quantization_level=ftype.split(" ")[0] if ftype != "all F32" else "F32",
        metadata={k: v for k, v in md.items() if not k.startswith("tokenizer.ggml.")},
    )
    return tokenizer, info
