"""Hostile checkpoints beyond the basic malformed-file cases: more crafted GGUF and
safetensors files, tensors that do not fit the config, sizes a file claims but cannot hold
(refused before allocating, measured), and regressions the fuzzer (test_fuzz_headers) found.
Every failure must be a typed, readable error (CheckpointError / a ValueError naming the
tensor) raised quickly -- never a crash, hang or huge allocation."""
import json
import os
import random
import struct
import subprocess
import sys
import time
import tracemalloc
from contextlib import contextmanager

import pytest

from tests.models.test_gguf_malformed import _kv, _str, _strings, _tensor, gguf_bytes, tiny_llama_gguf
from tokenmill.models.loader import CheckpointError, load_tokenizer, open_checkpoint
from tokenmill.models.loader.gguf_reader import GGUFFile
from tokenmill.runner.model_loader import build_model


def _write(tmp_path, blob: bytes, name="bad.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


def _u32(key, v):
    return _kv(key, 4, struct.pack("<I", v))


def _gemma_kvs(layers=1, **over):
    """Just enough gemma3 metadata for hf_config; values overridable."""
    vals = {"embedding_length": 8, "block_count": layers, "feed_forward_length": 16,
            "attention.head_count": 1, "attention.sliding_window": 4, "attention.key_length": 8,
            "vocab_size": 4}
    vals.update(over)
    return [_kv("general.architecture", 8, _str("gemma3"))] + [_u32(f"gemma3.{k}", v) for k, v in vals.items()]


GGUF_CASES = {
    "invalid utf-8 tensor name": (lambda: gguf_bytes(tensors=[struct.pack("<Q", 2) + b"\xc3\x28" + struct.pack("<IQIQ", 1, 8, 0, 0)]), "UTF-8"),
    "tensor count lies (more than listed)": (lambda: gguf_bytes(num_tensors=3), None),
    "string array of truncated strings": (lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 8, 3) + _str("a") + struct.pack("<Q", 99))]), "truncated"),
    "alignment is a string": (lambda: gguf_bytes(kvs=[_kv("general.alignment", 8, _str("32"))]), "alignment"),
    "dims product overflows u64": (lambda: gguf_bytes(tensors=[_tensor("w", [2**32, 2**32, 2**32], 0, 0)]), "larger than the file"),
    "q4_k row not whole blocks": (lambda: gguf_bytes(tensors=[_tensor("w", [128], 12, 0)]), "block size"),
    "offset overflow": (lambda: gguf_bytes(tensors=[_tensor("w", [8], 0, 2**64 - 32)]), "past the end"),
    "only a header": (lambda: b"GGUF" + struct.pack("<IQQ", 3, 0, 0), None),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_more_malformed_gguf(tmp_path, case):
    make, message = GGUF_CASES[case]
    start = time.perf_counter()
    try:
        GGUFFile(_write(tmp_path, make()))
    except CheckpointError as e:
        assert message is None or message in str(e)
    else:
        assert message is None  # a file that is merely empty of tensors may parse
    assert time.perf_counter() - start < 1.0


METADATA_CASES = {
    "gemma3 without sliding window": (lambda: [kv for kv in _gemma_kvs() if b"sliding" not in kv], "sliding_window"),
    "gemma3 absurd layer count": (lambda: _gemma_kvs(layers=10**9), "cannot hold"),
    "gemma3 zero heads": (lambda: _gemma_kvs(**{"attention.head_count": 0}), "positive"),
    "gemma3 embedding length as string": (lambda: _gemma_kvs()[:1] + [_kv("gemma3.embedding_length", 8, _str("8"))], "embedding_length"),
    "head count not a multiple of kv heads": (lambda: _gemma_kvs(**{"attention.head_count": 3, "attention.head_count_kv": 2}), "multiple"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_lying_metadata_fails_at_open(tmp_path, case):
    make, message = METADATA_CASES[case]
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(_write(tmp_path, gguf_bytes(kvs=make())))


def _safetensors_dir(tmp_path, header: dict, data: bytes, raw_header: bytes = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1,
                                                      "num_attention_heads": 1, "vocab_size": 4}))
    blob = raw_header if raw_header is not None else json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return str(tmp_path)


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
SAFETENSORS_CASES = {
    "reversed offsets": ({"w": {**F32_4, "data_offsets": [16, 0]}}, b"\0" * 16),
    "gap between tensors": ({"w": F32_4, "v": {**F32_4, "data_offsets": [32, 48]}}, b"\0" * 48),
    "huge shape": ({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, b"\0" * 16),
    "negative dim": ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16),
    "offsets not a list": ({"w": {**F32_4, "data_offsets": "0-16"}}, b"\0" * 16),
    "metadata not strings": ({"__metadata__": {"a": 1}, "w": F32_4}, b"\0" * 16),
    "trailing bytes after data": ({"w": F32_4}, b"\0" * 20),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_more_malformed_safetensors(tmp_path, case):
    header, data = SAFETENSORS_CASES[case]
    with pytest.raises(CheckpointError):
        list(open_checkpoint(_safetensors_dir(tmp_path, header, data)).iter_tensors())


def test_header_length_beyond_file_is_refused_before_reading(tmp_path):
    path = _safetensors_dir(tmp_path, {}, b"", raw_header=b"{}")
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(struct.pack("<Q", 2**40))   # a 1 TB header in a 10-byte file
    with pytest.raises(CheckpointError, match="exceeds the file size"):
        list(open_checkpoint(path).iter_tensors())


def _tiny_llama_checkpoint(tmp_path, mutate):
    """A saved tiny Llama whose state dict ``mutate`` edits before writing."""
    import transformers
    from safetensors.torch import save_file
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    cfg.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    mutate(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    return open_checkpoint(str(tmp_path))


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight"), "model.layers.0.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": s["model.layers.0.self_attn.q_proj.weight"].clone()}),
     "model.layers.0.self_attn.k_proj.weight"),
    (lambda s: s.update({"model.norm.weight": s["model.norm.weight"][:8]}), "model.norm.weight"),
    (lambda s: s.update({"model.layers.7.mlp.up_proj.weight": s["model.layers.0.mlp.up_proj.weight"].clone()}),
     "model.layers.7.mlp.up_proj.weight"),
])
def test_tensors_not_fitting_the_config_name_the_tensor(tmp_path, mutate, message):
    import torch
    ckpt = _tiny_llama_checkpoint(tmp_path, mutate)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        build_model(ckpt, torch.device("cpu"), torch.float32, 64)


@contextmanager
def traced_peak():
    """Peak bytes traced (Python objects and numpy buffers) inside the block, in ``out[0]``."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, out = tracemalloc.get_traced_memory()[0], [0]
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1] - base
        if not was_tracing:
            tracemalloc.stop()


# Sizes a file claims but cannot hold: each is refused before anything that size exists.
# 2^30 float32 values (4 GiB) would still be allocated by a trusting reader on a big machine.
SIZE_LIES = {
    "tensor of 2^40 elements": lambda: gguf_bytes(tensors=[_tensor("w", [2**20, 2**20], 0, 0)]),
    "tensor of 2^30 elements": lambda: gguf_bytes(tensors=[_tensor("w", [2**15, 2**15], 0, 0)]),
    "Q4_K tensor of 2^40 elements": lambda: gguf_bytes(tensors=[_tensor("w", [256, 2**32], 12, 0)]),
    "2^40 tensors": lambda: gguf_bytes(num_tensors=2**40),
    "2^40 metadata pairs": lambda: gguf_bytes(num_kv=2**40),
    "u8 array of 2^40 items": lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 0, 2**40))]),
    "f64 array of 2^40 items": lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 12, 2**40))]),
    "string array of 2^40 items": lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 8, 2**40))]),
    "array of 2^40 arrays": lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQ", 9, 2**40))]),
    "key of 2^40 bytes": lambda: gguf_bytes(kvs=[struct.pack("<Q", 2**40) + b"k" * 64]),
    "string value of 2^40 bytes": lambda: gguf_bytes(kvs=[_kv("k", 8, struct.pack("<Q", 2**40) + b"x" * 64)]),
    "tensor name of 2^40 bytes": lambda: gguf_bytes(tensors=[struct.pack("<Q", 2**40) + b"w" * 64]),
    "2^40-byte string in an array": lambda: gguf_bytes(kvs=[_kv("k", 9, struct.pack("<IQQ", 8, 1, 2**40) + b"x" * 64)]),
}
ST_SIZE_LIES = {
    "safetensors header of 2^40 bytes": (struct.pack("<Q", 2**40), b"{}"),
    "safetensors tensor of 2^40 elements": (None, {"w": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 2**42]}}),
    "safetensors tensor of 2^30 elements": (None, {"w": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}}),
    "safetensors shape of 2^40 over 16 bytes": (None, {"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 16]}}),
}


def _safetensors_lie(tmp_path, case: str) -> str:
    head, header = ST_SIZE_LIES[case]
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = _safetensors_dir(tmp_path, {}, b"\0" * 16, raw_header=raw)
    if head is not None:  # a length field that lies
        with open(os.path.join(path, "model.safetensors"), "r+b") as f:
            f.write(head)
    return path


def _load_everything(path: str) -> None:
    """What a user's load reads: config, every tensor (eager and lazy), the tokenizer."""
    ckpt = open_checkpoint(path)
    for lazy in (False, True):
        for _, t in ckpt.iter_tensors(lazy=lazy):
            if hasattr(t, "materialize"):  # a LazyTensor: read it as a model loader would
                t.materialize()
    if path.endswith(".gguf"):
        load_tokenizer(path)


@pytest.mark.parametrize("case", sorted(SIZE_LIES) + sorted(ST_SIZE_LIES))
def test_size_lies_are_refused_before_allocating(tmp_path, case):
    path = _write(tmp_path, SIZE_LIES[case]()) if case in SIZE_LIES else _safetensors_lie(tmp_path, case)
    with traced_peak() as peak, pytest.raises(CheckpointError):
        _load_everything(path)
    assert peak[0] < 256 << 10, f"{peak[0]} bytes traced for a {case} in a tiny file"


def test_size_lies_are_refused_under_an_address_space_cap(tmp_path):
    """tracemalloc sees Python and numpy, not torch or the safetensors library: read every
    lie again in a process whose address space may grow by 1 GiB at most."""
    paths = []
    for i, case in enumerate(sorted(SIZE_LIES) + sorted(ST_SIZE_LIES)):
        (tmp_path / str(i)).mkdir()
        paths.append(_write(tmp_path / str(i), SIZE_LIES[case]()) if case in SIZE_LIES
                     else _safetensors_lie(tmp_path / str(i), case))
    script = (
        "import resource, sys\n"
        "from tests.models.test_loader_hostile import _load_everything\n"
        "from tokenmill.models.loader import CheckpointError\n"
        "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        _load_everything(path)\n"
        "        print('loaded', path)\n"
        "    except CheckpointError:\n"
        "        print('refused', path)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split().count("refused") == len(paths), out.stdout


# -- regressions the fuzzer and its review found --------------------------------------------

def test_lazy_scalar_safetensors_tensor_reads(tmp_path):
    header = {"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}
    path = _safetensors_dir(tmp_path, header, struct.pack("<f", 2.5))
    (name, lazy), = open_checkpoint(path).iter_tensors(lazy=True)
    assert name == "s" and lazy.materialize().item() == 2.5


@pytest.mark.parametrize("config", [b"[" * 100_000 + b"]" * 100_000, b'{"hidden_size": ' + b"9" * 5000 + b"}",
                                    b"\xff\xfe{}", b'{"hidden_size": true, "num_hidden_layers": 1, '
                                    b'"num_attention_heads": 1, "vocab_size": 4}'])
def test_hostile_config_json(tmp_path, config):
    (tmp_path / "config.json").write_bytes(config)
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(str(tmp_path))


@pytest.mark.parametrize("weight_map", [{"a": ["x"]}, {"a": "x", "b": 1}, {"a": None}])
def test_index_naming_no_file(tmp_path, weight_map):
    _safetensors_dir(tmp_path, {"w": F32_4}, b"\0" * 16)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="bad shard file name"):
        open_checkpoint(str(tmp_path))


def test_chat_template_not_utf8(tmp_path):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ \xff }}")
    with pytest.raises(CheckpointError, match="chat template"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("layer", ["1" * 5000, "\u0661", "01"])
def test_gguf_layer_index_that_is_no_layer(tmp_path, layer):
    """A 5000-digit index (past Python's int parsing), a non-ASCII digit, a leading zero."""
    blob, _ = tiny_llama_gguf(random.Random(0), [(f"blk.{layer}.attn_norm.weight", [32], 0)])
    with pytest.raises(CheckpointError, match="attn_norm"):
        open_checkpoint(_write(tmp_path, blob))


def test_gguf_tokenizer_pre_not_a_string(tmp_path):
    kvs = [_kv("tokenizer.ggml.model", 8, _str("gpt2")), _strings("tokenizer.ggml.tokens", ["a", "b", "ab"]),
           _strings("tokenizer.ggml.merges", ["a b"]), _strings("tokenizer.ggml.pre", ["llama-bpe"])]
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre"):
        load_tokenizer(_write(tmp_path, gguf_bytes(kvs=kvs)))


def test_spm_vocabulary_of_long_pieces(tmp_path):
    """One 600k-character piece took minutes (every cut point sliced and hashed); a
    staircase "a", "aa", "aaa", ... implies merges quadratic in the file: refused."""
    long_piece = [_kv("tokenizer.ggml.model", 8, _str("llama")), _strings("tokenizer.ggml.tokens", ["a", "b", "ab" * 300_000])]
    cpu = time.thread_time()
    assert load_tokenizer(_write(tmp_path, gguf_bytes(kvs=long_piece))).encode("ab") == [0, 1]  # no "ab" piece
    assert time.thread_time() - cpu < 1.0
    staircase = [_kv("tokenizer.ggml.model", 8, _str("llama")), _strings("tokenizer.ggml.tokens", ["a" * i for i in range(1, 1500)])]
    with traced_peak() as peak, pytest.raises(CheckpointError, match="implies more merges"):
        load_tokenizer(_write(tmp_path, gguf_bytes(kvs=staircase)))
    assert peak[0] < 64 * 1500**2
