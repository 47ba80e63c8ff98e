"""A validating GGUF (v2/v3) reader over a read-only numpy memmap.

Layout: magic "GGUF", u32 version, u64 tensor count, u64 KV count, the KV pairs, the
tensor infos, padding to ``general.alignment``, then tensor data. Every count, length and
offset is checked against the bytes left in the file *before* anything is allocated, so a
malformed or hostile file fails fast with a CheckpointError instead of a huge allocation.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CheckpointError
from .gguf_quants import GGML_TYPES, dequantize, ggml_type

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal; bound the recursion

# GGUF value type id -> struct format (scalars only)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
               10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (the contiguous dim) first
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / torch order: dims reversed, so the contiguous dim is last."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id].name


class _Cursor:
    """Sequential little-endian reads with a bounds check on every read."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.pos, self.end, self.path = buf, 0, buf.size, path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what} (at byte {self.pos})")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > self.end:
            raise self.fail(f"truncated file: {what} needs {nbytes} bytes, {self.end - self.pos} left")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        self.need(length, what)
        raw = self.buf[self.pos:self.pos + length].tobytes()
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None


class GGUFFile:
    """Parsed GGUF metadata + tensor index; tensor bytes stay memory-mapped until read."""

    def __init__(self, path: str):
        self.path = path
        size = _file_size(path)
        if size < 24:
            raise CheckpointError(f"{path}: {size} bytes is too small for a GGUF header")
        try:
            self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        except OSError as e:  # a directory, no permission
            raise CheckpointError(f"{path}: cannot read GGUF file ({e.strerror})") from None
        cur = _Cursor(self._buf, path)
        self.version, num_tensors, num_kv = _read_header(cur)
        self.metadata: dict[str, Any] = _read_metadata(cur, num_kv)
        self.alignment = _alignment(self.metadata, path)
        infos = [_read_tensor_info(cur) for _ in range(num_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = _place_tensors(infos, self.data_offset, self.alignment, size, path)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident set (after loading: every
        weight has been copied out, and a later read faults pages back in from the file)."""
        mapping = getattr(self._buf, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def release_tensor(self, name: str) -> None:
        """release_pages for one tensor's bytes, once they are copied out."""
        self.release_bytes(self.raw(name))

    def release_bytes(self, view: np.ndarray) -> None:
        """release_pages for the whole pages inside ``view`` (a contiguous view of the map,
        as ``raw`` returns; anything else is ignored): loading then holds about one piece
        of the file at a time instead of all of it."""
        mapping = getattr(self._buf, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        offset = view.__array_interface__["data"][0] - self._buf.__array_interface__["data"][0]
        if not (view.flags.c_contiguous and 0 <= offset and offset + view.nbytes <= self._buf.nbytes):
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes: a read-only uint8 view into the memmap."""
        info = self.tensors[name]
        return self._buf[info.offset:info.offset + info.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """A new float32 array in numpy order (dims reversed)."""
        info = self.tensors[name]
        try:
            return dequantize(self.raw(name), info.type_id, info.shape)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read GGUF file ({e.strerror})") from None


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    magic = cur.buf[:4].tobytes()
    if magic != GGUF_MAGIC:
        raise cur.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in (2, 3):
        hint = " (big-endian file?)" if version > 0xFFFF else ""
        raise cur.fail(f"unsupported GGUF version {version}{hint}; supported: 2, 3")
    num_tensors = cur.scalar("<Q", "tensor count")
    num_kv = cur.scalar("<Q", "metadata count")
    left = cur.end - cur.pos
    # Cheapest possible entries: a KV is >= 8 (key len) + 4 (type) + 1 bytes, a tensor info
    # >= 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes. Counts beyond that are lies.
    if num_kv * 13 > left:
        raise cur.fail(f"metadata count {num_kv} cannot fit in the {left} bytes left")
    if num_tensors * 24 > left:
        raise cur.fail(f"tensor count {num_tensors} cannot fit in the {left} bytes left")
    return version, num_tensors, num_kv


def _read_metadata(cur: _Cursor, num_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string("metadata key")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        type_id = cur.scalar("<I", f"type of {key!r}")
        metadata[key] = _read_value(cur, type_id, key, depth=0)
    return metadata


def _read_value(cur: _Cursor, type_id: int, key: str, depth: int) -> Any:
    if type_id in _SCALARS:
        return cur.scalar(_SCALARS[type_id], f"value of {key!r}")
    if type_id == _STRING:
        return cur.string(f"value of {key!r}")
    if type_id == _ARRAY and depth < MAX_ARRAY_DEPTH:
        return _read_array(cur, key, depth)
    raise cur.fail(f"metadata {key!r} has bad value type {type_id}")


def _read_array(cur: _Cursor, key: str, depth: int) -> list:
    elem_type = cur.scalar("<I", f"array type of {key!r}")
    count = cur.scalar("<Q", f"array length of {key!r}")
    if elem_type in _NP_SCALARS:
        dtype = np.dtype(_NP_SCALARS[elem_type])
        cur.need(count * dtype.itemsize, f"array {key!r} of {count} items")
        values = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos)
        cur.pos += count * dtype.itemsize
        return (values != 0).tolist() if elem_type == 7 else values.tolist()
    # Strings take >= 8 bytes, nested arrays >= 12: bound the count before looping.
    cur.need(count * 8, f"array {key!r} of {count} items")
    if elem_type == _STRING:
        return _read_string_array(cur, count, key)
    return [_read_value(cur, elem_type, key, depth + 1) for _ in range(count)]


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    """A string array (vocabularies: 100k+ entries) without per-item method calls; same
    checks as ``_Cursor.string``."""
    view, pos, end = memoryview(cur.buf), cur.pos, cur.end
    out = []
    try:
        for _ in range(count):
            if pos + 8 > end:
                break
            length = int.from_bytes(view[pos:pos + 8], "little")
            pos += 8
            if length > end - pos:
                break
            out.append(str(view[pos:pos + length], "utf-8"))
            pos += length
    except UnicodeDecodeError:
        cur.pos = pos
        raise cur.fail(f"item {len(out)} of array {key!r} is not valid UTF-8") from None
    cur.pos = pos
    if len(out) < count:
        raise cur.fail(f"truncated file: array {key!r} ends after {len(out)} of {count} strings")
    return out


def _alignment(metadata: dict[str, Any], path: str) -> int:
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{path}: general.alignment {align!r} is not a positive power of two")
    return align


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("tensor name")
    num_dims = cur.scalar("<I", f"dim count of tensor {name!r}")
    if not 1 <= num_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {num_dims} dims (1..{MAX_DIMS} allowed)")
    dims = tuple(cur.scalar("<Q", f"dims of tensor {name!r}") for _ in range(num_dims))
    type_id = cur.scalar("<I", f"type of tensor {name!r}")
    offset = cur.scalar("<Q", f"offset of tensor {name!r}")
    return name, dims, type_id, offset


def _place_tensors(infos, data_offset: int, alignment: int, file_size: int, path: str) -> dict[str, TensorInfo]:
    """Validate each tensor's type, dims, size and placement; reject duplicates and overlaps."""
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, rel_offset in infos:
        where = f"{path}: tensor {name!r}"
        if name in tensors:
            raise CheckpointError(f"{where}: duplicate tensor name")
        if type_id not in GGML_TYPES:
            raise CheckpointError(f"{where}: unknown ggml type id {type_id}")
        t = ggml_type(type_id)
        if any(d <= 0 for d in dims):
            raise CheckpointError(f"{where}: bad dims {dims}")
        if dims[0] % t.block_size:
            raise CheckpointError(f"{where}: row length {dims[0]} is not a multiple of the {t.name} block size {t.block_size}")
        num_values = 1
        for d in dims:  # Python ints: no overflow, and stop early once past the file
            num_values *= d
            if num_values > file_size * t.block_size:
                raise CheckpointError(f"{where}: dims {dims} are larger than the file")
        nbytes = num_values // t.block_size * t.type_size
        if rel_offset % alignment:
            raise CheckpointError(f"{where}: offset {rel_offset} is not aligned to {alignment}")
        start = data_offset + rel_offset
        if start + nbytes > file_size:
            raise CheckpointError(f"{where}: data [{start}, {start + nbytes}) runs past the end of the file ({file_size} bytes)")
        tensors[name] = TensorInfo(name, dims, type_id, start, nbytes)
    _check_overlaps(tensors, path)
    return tensors


def _check_overlaps(tensors: dict[str, TensorInfo], path: str) -> None:
    spans = sorted(tensors.values(), key=lambda t: t.offset)
    for prev, nxt in zip(spans, spans[1:]):
        if nxt.offset < prev.offset + prev.nbytes:
            raise CheckpointError(f"{path}: tensors {prev.name!r} and {nxt.name!r} overlap")
