"""Bounded fuzz of the model-file readers (issue 23, hostile inputs at scale).

Over 10,000 distinct hostile files -- GGUF and safetensors headers built field by field with
lying counts, lengths, dims, types and offsets, each also cut at every field boundary, plus
seeded byte-level mutations of valid files -- are read the way a user's load reads them
(open, config, every tensor dequantized / read eagerly and lazily, the GGUF tokenizer). Each
must load or raise CheckpointError: any other exception is a reader bug. Each must finish
within a CPU-time bound (no hang), and its traced peak allocation must stay within a bound
linear in its own size (no "2^40 elements" believed before it is checked against the file).

Run with ``-s`` to see case counts and times. Everything is seeded (hypothesis with
``derandomize``, ``random.Random`` with fixed seeds), so CI reads the same files every run.
"""
import gc
import hashlib
import json
import os
import random
import struct
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models.test_gguf_malformed import every_type_gguf, tiny_llama_gguf
from tests.models.test_loader_hostile import traced_peak
from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint
from tokenmill.models.loader.gguf_quants import GGML_TYPES
from tokenmill.models.loader.gguf_reader import GGUFFile

# Dequantizing random bytes makes NaN and inf, as a corrupt real file would: not the point here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
# Python objects cost more than the bytes they are parsed from (a 13-byte KV becomes a dict
# entry and a str; a Q2_K block's 84 bytes dequantize through ~3 KB of float32 temporaries),
# so the bound is linear in the file with a generous factor. A lie believed before it is
# checked costs gigabytes, far past it.
ALLOC_FACTOR, ALLOC_SLACK = 64, 256 << 10
MAX_EXPANSION = 16  # float32 bytes per stored byte at most: Q2_K holds 256 values in 84 bytes
CPU_LIMIT_S = 1.0  # per file; thread CPU time, so other processes on the box do not count
EDGES = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
         2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]


# -- the harness: one case = one distinct file, read end to end ----------------------------------

class Harness:
    """Writes each distinct file to one path, reads it, checks outcome, CPU time and peak."""

    def __init__(self, directory, name: str, read):
        self.dir, self.path, self.read = directory, os.path.join(directory, name), read
        self.seen: set[bytes] = set()
        self.stages = Counter()  # how deep the files got: the fuzz is only as good as that
        self.max_cpu = self.max_bound_used = 0.0
        self.start = time.perf_counter()

    def run(self, blob: bytes, label: str) -> None:
        digest = hashlib.blake2b(blob, digest_size=16).digest()
        if digest in self.seen:
            return  # only distinct files are read and counted
        self.seen.add(digest)
        if os.path.exists(self.path):
            os.unlink(self.path)  # a new inode: a reader's old memmap keeps the old bytes
        with open(self.path, "wb") as f:
            f.write(blob)
        gc.disable()  # a collection of the whole test session's heap is not this file's cost
        cpu = time.thread_time()
        try:
            with traced_peak() as peak:
                self._read_checked(len(blob))
        except Exception as e:  # name the case and keep its bytes to replay it
            with open(os.path.join(self.dir, "failing_case.bin"), "wb") as f:
                f.write(blob)
            raise AssertionError(f"{label}: {type(e).__name__}: {e} (bytes in {self.dir}/failing_case.bin)") from e
        finally:
            gc.enable()
        cpu, bound = time.thread_time() - cpu, ALLOC_FACTOR * len(blob) + ALLOC_SLACK
        self.max_cpu, self.max_bound_used = max(self.max_cpu, cpu), max(self.max_bound_used, peak[0] / bound)
        assert cpu < CPU_LIMIT_S, f"{label}: {cpu:.2f} s of CPU on a {len(blob)}-byte file"
        assert peak[0] <= bound, f"{label}: {peak[0]} bytes allocated reading a {len(blob)}-byte file"

    def _read_checked(self, size: int) -> None:
        try:
            for produced in self.read(self.path, self.stages):
                assert produced <= MAX_EXPANSION * size, f"a {produced}-byte tensor out of a {size}-byte file"
        except CheckpointError as e:
            assert str(e)
            return
        self.stages["parsed"] += 1

    def report(self, what: str, minimum: int) -> None:
        stages = ", ".join(f"{n} {stage}" for stage, n in sorted(self.stages.items()))
        print(f"\n{what}: {len(self.seen)} distinct files ({stages}) in {time.perf_counter() - self.start:.1f} s; "
              f"max CPU per file {self.max_cpu * 1e3:.1f} ms, max peak allocation {self.max_bound_used:.0%} "
              f"of the bound ({ALLOC_FACTOR} x file + {ALLOC_SLACK >> 10} KiB)")
        assert len(self.seen) >= minimum


def _nbytes(t) -> int:
    if not isinstance(t, torch.Tensor):
        t = t.materialize()  # LazyTensor: read it now, as a model loader would
    return t.numel() * t.element_size()


def read_gguf(path: str, stages: Counter):
    """Every stage a user's load runs, yielding the bytes of each array made. A file that
    parses and dequantizes counts as parsed; the later stages may still refuse it (most
    fuzzed files hold no model or no tokenizer), but only with a CheckpointError."""
    gguf = GGUFFile(path)
    for name in gguf.tensors:
        yield gguf.dequantize(name).nbytes
    try:
        ckpt = open_checkpoint(path)
        for lazy in (False, True):
            for _, t in ckpt.iter_tensors(lazy=lazy):
                yield _nbytes(t)
        stages["model loaded"] += 1
    except CheckpointError:
        pass
    try:
        load_tokenizer(path)
        stages["tokenizer built"] += 1
    except CheckpointError:
        pass


def read_safetensors(path: str, stages: Counter):
    ckpt = open_checkpoint(os.path.dirname(path))
    yield ckpt.weight_bytes()
    for lazy in (False, True):
        for _, t in ckpt.iter_tensors(lazy=lazy):
            yield _nbytes(t)


def harness(kind: str, tmp_path) -> Harness:
    if kind == "gguf":
        return Harness(str(tmp_path), "case.gguf", read_gguf)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1, "vocab_size": 4}))
    return Harness(str(tmp_path), "model.safetensors", read_safetensors)


# -- GGUF built field by field --------------------------------------------------------------------

class Blob:
    """Bytes written field by field; ``marks`` are the field boundaries (truncation points)."""

    def __init__(self):
        self.buf, self.marks = bytearray(), []

    def put(self, raw: bytes) -> None:
        self.buf += raw
        self.marks.append(len(self.buf))

    def u32(self, v: int) -> None:
        self.put(struct.pack("<I", v % 2**32))

    def u64(self, v: int) -> None:
        self.put(struct.pack("<Q", v % 2**64))


# Strategies built once: hypothesis validates each new one, which costs more than a draw.
# It also draws small integers and first choices most, so honest values come first.
MODE, NEAR, ANY_U64, EDGE = st.integers(0, 39), st.integers(-3, 3), st.integers(0, 2**64 - 1), st.sampled_from(EDGES)
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VALUE_TYPES = st.sampled_from([*_SCALAR_SIZE, 8, 8, 9, 9, 13, 2**32 - 1])
GGUF_KEYS = ["general.architecture", "general.alignment", "llama.block_count", "llama.embedding_length",
             "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id"]
GGUF_TEXT = st.sampled_from(GGUF_KEYS).map(str.encode) | st.text(max_size=6).map(str.encode)
BYTES6, ODDS, SMALL, SEED = st.binary(max_size=6), st.integers(0, 15), st.integers(0, 3), st.integers(0, 2**32)
SCALAR_BYTES = {size: EDGE.map(lambda v, size=size: (v % 256**size).to_bytes(size, "little"))
                | st.binary(min_size=size, max_size=size) for size in (1, 2, 4, 8)}
TENSOR_TYPE = st.sampled_from([*sorted(GGML_TYPES), 4, 16, 31, 2**32 - 1])
JUNK8, BLOCKS, DIMS = st.binary(max_size=8), st.integers(1, 2), st.lists(st.integers(1, 3), max_size=2)
ALIGNMENT, VERSION = st.sampled_from([32, 32, 32, 1, 64]), st.sampled_from([3] * 8 + [2, 1, 3 << 24])
MAGIC = st.sampled_from([b"GGUF"] * 30 + [b"GGUX", b"\0" * 4])


def lie(draw, honest: int) -> int:
    """Mostly ``honest`` (a file has many fields: one lie in it is enough); else an edge
    value, off by a little, or anything. Shrinks to honest."""
    mode = draw(MODE)
    if mode < 37:
        return honest
    if mode == 37:
        return draw(EDGE)
    return honest + draw(NEAR) if mode == 38 else draw(ANY_U64)


def put_string(draw, b: Blob, text: bytes) -> None:
    b.u64(lie(draw, len(text)))
    b.put(text)


def gguf_text(draw) -> bytes:
    """A key, a name or a string value: text mostly, raw bytes (maybe not UTF-8) at times."""
    return draw(BYTES6) if draw(ODDS) == 15 else draw(GGUF_TEXT)


def put_value(draw, b: Blob, type_id: int, depth: int) -> None:
    if type_id in _SCALAR_SIZE:
        b.put(draw(SCALAR_BYTES[_SCALAR_SIZE[type_id]]))
    elif type_id == 8:
        put_string(draw, b, gguf_text(draw))
    elif type_id == 9 and depth < 6:  # the reader allows 4 levels
        elem, count = draw(VALUE_TYPES), draw(SMALL)
        b.u32(elem)
        b.u64(lie(draw, count))
        for _ in range(count):
            put_value(draw, b, elem, depth + 1)
    else:
        b.put(draw(JUNK8))


def put_tensor_infos(draw, b: Blob, alignment: int) -> tuple[int, int]:
    """Tensor infos whose honest sizes fit the data they claim: (count, data size)."""
    offset, count = 0, draw(SMALL)
    for _ in range(count):
        type_id = draw(TENSOR_TYPE)
        t = GGML_TYPES.get(type_id, GGML_TYPES[0])
        dims = [t.block_size * draw(BLOCKS)] + draw(DIMS)
        put_string(draw, b, gguf_text(draw))
        b.u32(lie(draw, len(dims)))
        for d in dims:
            b.u64(lie(draw, d))
        b.u32(type_id)
        b.u64(lie(draw, offset))
        nbytes = int(np.prod(dims)) // t.block_size * t.type_size
        offset += -(-nbytes // alignment) * alignment
    return count, offset


@st.composite
def gguf_files(draw) -> tuple[bytes, list[int], int]:
    """(file, field boundaries, end of the header)"""
    kvs, tensors, alignment = Blob(), Blob(), draw(ALIGNMENT)
    num_kv = draw(SMALL)
    for _ in range(num_kv):
        put_string(draw, kvs, gguf_text(draw))
        type_id = draw(VALUE_TYPES)
        kvs.u32(type_id)
        put_value(draw, kvs, type_id, 0)
    if alignment != 32:
        put_string(draw, kvs, b"general.alignment")
        kvs.u32(4)
        kvs.u32(lie(draw, alignment))
        num_kv += 1
    num_tensors, data_size = put_tensor_infos(draw, tensors, alignment)
    b = Blob()
    b.put(draw(MAGIC))
    b.u32(draw(VERSION))
    b.u64(lie(draw, num_tensors))
    b.u64(lie(draw, num_kv))
    for part in (kvs, tensors):
        b.marks += [len(b.buf) + m for m in part.marks]
        b.buf += part.buf
    b.put(b"\0" * (-len(b.buf) % alignment))
    header_end = len(b.buf)
    b.put(random.Random(draw(SEED)).randbytes(lie(draw, data_size) % 4096))
    return bytes(b.buf), b.marks, header_end


# -- safetensors built field by field -------------------------------------------------------------

ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
JSON_JUNK = st.sampled_from([None, True, -1, 1.5, "4", [], {}, [-1], [2**64], [1.5], ["4"], [True], 2**70, 1e308])
BAD_FIELD = {
    "dtype": st.sampled_from(["F33", "f32", "", "F4", "F6_E2M3", "F8_E8M0", "C64", *ST_DTYPES]) | JSON_JUNK,
    "shape": st.lists(st.sampled_from(EDGES + [-1, -2**63, 2**64]) | st.integers(0, 4), max_size=5) | JSON_JUNK,
    "data_offsets": st.lists(st.sampled_from(EDGES + [-1, -16, 2**64]) | st.integers(0, 64), max_size=3) | JSON_JUNK,
}
ST_DTYPE, ST_SHAPE, MODE16 = st.sampled_from(sorted(ST_DTYPES)), st.lists(st.integers(0, 3), max_size=3), st.integers(0, 15)
ENTRIES, ST_NAME = st.integers(1, 4), st.sampled_from(["w", "model.norm.weight", "__metadata__"]) | st.text(max_size=4)
ST_METADATA = st.sampled_from([{"format": "pt"}] * 4 + [{"a": 1}, [], "x", {"a": {"b": 1}}])
ST_RAW_HEADER = st.sampled_from([b" " * 8, b"[]", b"null", b"1", b'"x"', b"[" * 5000 + b"]" * 5000,
                                 b'{"w": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"a": 1e999}'])
ST_TRAILER, ONE_BYTE = st.sampled_from([b"   ", b"\0", b"}", b"garbage"]), st.binary(min_size=1, max_size=1)


def st_entry(draw, offset: int) -> tuple[dict, int]:
    """One tensor entry, honest (fits ``offset`` onwards) unless a field is drawn to lie."""
    dtype, shape = draw(ST_DTYPE), draw(ST_SHAPE)
    nbytes = int(np.prod(shape)) * ST_DTYPES[dtype]
    entry = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
    mode = draw(MODE16)
    if mode in (1, 2, 3):
        field = sorted(BAD_FIELD)[mode - 1]
        entry[field] = draw(BAD_FIELD[field])
    elif mode == 4:
        del entry[draw(st.sampled_from(sorted(entry)))]
    elif mode == 5:
        entry["data_offsets"] = [lie(draw, offset), lie(draw, offset + nbytes)]
    return entry, offset + nbytes


def st_header(draw) -> tuple[bytes, list[int]]:
    """JSON header bytes and where each tensor it claims ends."""
    header, ends = {}, [0]
    if draw(SMALL) == 0:
        header["__metadata__"] = draw(ST_METADATA)
    for _ in range(draw(ENTRIES) if draw(ODDS) else 0):
        header[draw(ST_NAME)], end = st_entry(draw, ends[-1])
        ends.append(end)
    raw = json.dumps(header).encode()
    mode = draw(MODE16)
    if mode == 1:  # one byte in or out: invalid UTF-8, broken syntax
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(ONE_BYTE) + raw[at + draw(st.integers(0, 1)):]
    elif mode == 2:
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif mode == 3:
        raw = draw(ST_RAW_HEADER)
    elif mode == 4:
        raw += draw(ST_TRAILER)
    return raw, ends


@st.composite
def safetensors_files(draw) -> tuple[bytes, list[int], int]:
    """(file, field boundaries, end of the header)"""
    b = Blob()
    raw, ends = st_header(draw)
    b.u64(lie(draw, len(raw)))
    b.put(raw)
    data = random.Random(draw(SEED)).randbytes(lie(draw, ends[-1]) % 4096)
    for start, end in zip(ends, ends[1:]):
        b.put(data[start:end])
    b.put(data[ends[-1]:])
    return bytes(b.buf), b.marks, 8 + len(raw)


# -- structure-aware fuzz: each example is a file, its truncations and a few header bytes set -------

# JSON syntax, digits, a sign, invalid UTF-8, small and large length bytes
HEADER_BYTES = list(b'",:[]{}-019e \xc3\xff\x00\x01\x02\x08\x10\x20\x40\x7f\x80')


def run_variants(h: Harness, blob: bytes, marks: list[int], header_end: int, flips: int, seed: int) -> None:
    h.run(blob, "whole file")
    for cut in marks:
        h.run(blob[:cut], f"cut at byte {cut}")
    rng = random.Random(seed)  # not drawn by hypothesis: its draws repeat, these need not
    for _ in range(flips):
        at, value = rng.randrange(min(header_end, len(blob)) or 1), rng.choice(HEADER_BYTES)
        h.run(blob[:at] + bytes([value]) + blob[at + 1:], f"byte {at} set to {value}")


# ~13 distinct GGUF files per example (they have more fields) and ~6.5 safetensors ones
@pytest.mark.parametrize("kind,files,examples,flips,minimum", [("gguf", gguf_files, 450, 2, 5000),
                                                               ("safetensors", safetensors_files, 850, 6, 5000)],
                         ids=["gguf", "safetensors"])
def test_fuzz_headers(tmp_path, kind, files, examples, flips, minimum):
    h = harness(kind, tmp_path)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=files(), seed=SEED)
    def fuzz(case, seed):
        run_variants(h, *case, flips, seed)

    fuzz()
    h.report(f"{kind} headers built field by field", minimum)


# -- byte-level mutation of valid files, header bytes first -----------------------------------------

def every_dtype_safetensors(rng: random.Random) -> tuple[bytes, int]:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for i, (dtype, size) in enumerate(sorted(ST_DTYPES.items())):
        shape = [[], [3], [2, 2], [1, 2, 2]][i % 4]
        nbytes = int(np.prod(shape)) * size
        header[f"model.t{i}.weight"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + rng.randbytes(offset), 8 + len(raw)


INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 2**15, 2**16 - 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]
JSON_NUMBERS = [-1, 0, 3, 2**31, 2**40, 2**63, 2**64 - 1, 2**64, 10**30, "1e400", "-0", "1.5"]


def mutate(rng: random.Random, blob: bytes, header_end: int) -> bytes:
    """1-3 edits, four in five inside the header: set a byte, flip a bit, overwrite a word with
    an edge value, insert, delete, duplicate; swap a JSON number (safetensors), or cut."""
    out = bytearray(blob)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange((min(header_end, len(out)) if rng.random() < 0.8 else len(out)) or 1)
        op = rng.randrange(7) if out[:1] == b"G" or rng.random() < 0.5 else 6
        if op == 0:
            out[at:at + 1] = bytes([rng.choice(INTERESTING) & 0xFF])
        elif op == 1:
            out[at:at + 1] = bytes([(out[at] if at < len(out) else 0) ^ (1 << rng.randrange(8))])
        elif op == 2:
            width = rng.choice([4, 8])
            value = rng.choice(INTERESTING + [len(blob), header_end]) % 2 ** (8 * width)
            out[at:at + width] = value.to_bytes(width, "little")
        elif op == 3:
            out[at:at] = rng.randbytes(rng.randint(1, 16))
        elif op == 4:
            del out[at:at + rng.randint(1, 16)]
        elif op == 5:
            out[at:at] = out[rng.randrange(len(out) or 1):][:rng.randint(1, 32)]
        else:
            out = _json_number(rng, out) if out[:1] != b"G" else out[:rng.randrange(len(out) + 1)]
    return bytes(out)


def _json_number(rng: random.Random, out: bytearray) -> bytearray:
    """Swap one number of a safetensors header for an edge value; fix the length field or not."""
    end = min(8 + int.from_bytes(out[:8], "little"), len(out))
    starts = [i for i in range(8, end) if 48 <= out[i] <= 57 and not 48 <= out[i - 1] <= 57]
    if not starts:
        return out[:rng.randrange(len(out) + 1)]
    at = rng.choice(starts)
    stop = next((i for i in range(at, len(out)) if not 48 <= out[i] <= 57), len(out))
    value = str(rng.choice(JSON_NUMBERS)).encode()
    out[at:stop] = value
    if rng.random() < 0.5:
        out[:8] = struct.pack("<Q", int.from_bytes(out[:8], "little") + len(value) - (stop - at))
    return out


@pytest.mark.parametrize("kind,cases", [("gguf", 2500), ("safetensors", 2500)], ids=["gguf", "safetensors"])
def test_fuzz_mutated_valid_files(tmp_path, kind, cases):
    h, rng = harness(kind, tmp_path), random.Random(23)
    seeds = [tiny_llama_gguf(rng), every_type_gguf(rng)] if kind == "gguf" else [every_dtype_safetensors(rng)]
    for blob, _ in seeds:  # the seeds load whole, so mutations start deep in the reader
        h.run(blob, "seed")
    want = {"parsed": 2, "model loaded": 1, "tokenizer built": 2} if kind == "gguf" else {"parsed": 1}
    assert h.stages == want
    for i in range(cases * 2):  # a mutation may repeat an earlier file: stop at ``cases`` distinct
        if len(h.seen) >= cases + len(seeds):
            break
        h.run(mutate(rng, *rng.choice(seeds)), f"{kind} mutation {i} (random.Random(23))")
    h.report(f"{kind} mutations of valid files", cases)
