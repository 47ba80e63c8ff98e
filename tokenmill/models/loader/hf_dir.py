"""Hugging Face model directories: config.json + (sharded) safetensors + tokenizer.json.

Only data files are read. Code shipped in a model directory (``auto_map`` / remote code)
is never imported or run; a config that needs it simply names an architecture the model
registry does not know.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

from tokenmill.layers.lazy import LazyTensor, safetensors_reader

from ...tokenizer import Tokenizer
from .errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20  # a config or index larger than this is not a config


def read_json(path: str) -> Any:
    try:
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: file too large for a JSON config")
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        # ValueError: bad JSON, bad UTF-8, an integer of over 4300 digits; RecursionError:
        # arrays nested thousands deep
        raise CheckpointError(f"{path}: cannot read JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _json_dict(path: str, required: bool = True) -> dict[str, Any]:
    if not os.path.isfile(path):
        if required:
            raise CheckpointError(f"{path}: missing")
        return {}
    value = read_json(path)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def hf_config(directory: str) -> dict[str, Any]:
    """config.json, with the keys the engine relies on filled in from HF's defaults."""
    config = _json_dict(os.path.join(directory, "config.json"))
    _fill_defaults(config, directory)
    return config


def _fill_defaults(config: dict[str, Any], directory: str) -> None:
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{directory}/config.json: {key!r} must be a positive integer")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    # transformers 5 folds rope_theta / rope_scaling into rope_parameters.
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", rope)
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("rope_scaling", None)
    scaling = config["rope_scaling"]
    if isinstance(scaling, dict) and scaling.get("original_max_position_embeddings") is None \
            and scaling.get("rope_type", scaling.get("type")) in ("yarn", "llama3"):
        # As in HF: the checkpoint's context is the "original" one. Pinned here because the
        # runner later overwrites max_position_embeddings with the served max_model_len.
        config["rope_scaling"] = {**scaling, "original_max_position_embeddings": config.get("max_position_embeddings", 2048)}
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("tie_word_embeddings", False)
    config.setdefault("attention_bias", False)
    config.setdefault("mlp_bias", False)
    config.setdefault("max_position_embeddings", 2048)
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)


def safetensors_files(directory: str) -> list[str]:
    """The weight files: the shards named by the index, else the single file."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _json_dict(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        for name in weight_map.values():
            # Shards must sit in the directory itself: no paths, no "..".
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(f"{index_path}: bad shard file name {name!r}")
        names = sorted(set(weight_map.values()))
        files = [os.path.join(directory, n) for n in names]
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        files = [os.path.join(directory, SINGLE_FILE)]
    else:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CheckpointError(f"{directory}: missing weight file(s) {', '.join(map(os.path.basename, missing))}")
    return files


def data_bytes(path: str) -> int:
    """Bytes of tensor data in a safetensors file (file size minus the JSON header)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e.strerror})") from None
    if len(head) < 8:
        raise CheckpointError(f"{path}: truncated safetensors header")
    (header_len,) = struct.unpack("<Q", head)
    if 8 + header_len > size:
        raise CheckpointError(f"{path}: safetensors header length {header_len} exceeds the file size {size}")
    return size - 8 - header_len


def iter_safetensors(files: list[str], lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for every tensor of every file; duplicates across shards fail.
    ``lazy``: yield LazyTensors (read when a loader materialises its piece) instead."""
    seen: set[str] = set()
    for path in files:
        data_bytes(path)  # cheap header sanity check before the library maps the file
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name in seen:
                        raise CheckpointError(f"{path}: tensor {name!r} appears in more than one shard")
                    seen.add(name)
                    if lazy:
                        yield name, _lazy(f.get_slice(name))
                        continue
                    tensor = f.get_tensor(name)
                    # Integer tensors (GPTQ / AWQ packed weights, g_idx) keep their bits.
                    yield name, tensor.to(torch.float32) if tensor.is_floating_point() else tensor
        except CheckpointError:
            raise
        except Exception as e:  # SafetensorError and friends: bad header, offsets, dtypes
            raise CheckpointError(f"{path}: invalid safetensors file ({e})") from None


def _lazy(handle) -> LazyTensor:
    dtype = getattr(torch, _SAFETENSORS_DTYPES.get(handle.get_dtype(), "float32"))
    shape = tuple(handle.get_shape())
    return LazyTensor(safetensors_reader(handle), shape, dtype)


# safetensors dtype names -> torch names (floats are widened to float32 when read)
_SAFETENSORS_DTYPES = {"I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32",
                       "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn"}


def _chat_template(directory: str, tok_config: dict[str, Any]) -> Optional[str]:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        if os.path.getsize(jinja_path) > MAX_JSON_BYTES:
            raise CheckpointError(f"{jinja_path}: file too large for a chat template")
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja_path}: cannot read chat template ({e})") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _token_id(backend, value: Any) -> Optional[int]:
    """A special token from tokenizer_config: a string, or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return backend.token_to_id(value) if isinstance(value, str) else None


def _eos_ids(directory: str, backend, tok_config: dict[str, Any], config: dict[str, Any]) -> list[int]:
    """Every EOS id: generation_config may list several; the primary one comes first."""
    ids: list[int] = []
    primary = _token_id(backend, tok_config.get("eos_token"))
    gen = _json_dict(os.path.join(directory, "generation_config.json"), required=False)
    for source in (primary, gen.get("eos_token_id"), config.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids


def hf_tokenizer(directory: str) -> Tokenizer:
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    from tokenizers import Tokenizer as BackendTokenizer

    try:
        backend = BackendTokenizer.from_file(path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
    tok_config = _json_dict(os.path.join(directory, "tokenizer_config.json"), required=False)
    config = _json_dict(os.path.join(directory, "config.json"), required=False)
    bos = _token_id(backend, tok_config.get("bos_token"))
    if bos is None and isinstance(config.get("bos_token_id"), int):
        bos = config["bos_token_id"]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=_eos_ids(directory, backend, tok_config, config),
        pad_token_id=_token_id(backend, tok_config.get("pad_token")),
        unk_token_id=_token_id(backend, tok_config.get("unk_token")),
        add_bos_token=bool(tok_config.get("add_bos_token", False)),
        add_eos_token=bool(tok_config.get("add_eos_token", False)),
        chat_template=_chat_template(directory, tok_config),
        clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
    )
