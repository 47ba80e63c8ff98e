"""Sparse upcycling: a dense Llama checkpoint becomes a Mixtral-format MoE checkpoint.

Every expert of layer i starts as a copy of layer i's dense FFN (gate_proj -> w1,
up_proj -> w3, down_proj -> w2, the names of Mixtral checkpoints on disk) and each layer
gets a new router ``block_sparse_moe.gate`` [num_experts, hidden], drawn N(0, 0.02²).
Mixtral renormalises its top-k routing weights to sum to 1, so with identical experts
(``perturb`` 0) the MoE computes the dense model exactly, whatever the router says.
``perturb`` p multiplies each expert weight element by (1 + p * N(0, 1)), so the experts
differ and can specialise when the model is trained further.

Terms: *total* parameters are every tensor written; *active* parameters are those one token
uses (everything outside the experts, the routers, and top_k of the experts in each layer).

Tensors are streamed: a first pass over the source lists names and shapes without reading
weights, which fixes the safetensors header; a second pass reads one source tensor at a time
and writes each output tensor at its offset. Everything is written into a temp directory
beside OUT that is renamed into place only once complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from tokenmill.models.hub import resolve_model
from tokenmill.models.loader import Checkpoint, GGUFCheckpoint, load_tokenizer, open_checkpoint
from tokenmill.models.loader.hf_dir import hf_tokenizer
from tokenmill.utils.progress import format_bytes

# HF's initializer_range default: router logits start near 0, so routing starts near uniform
# and no expert is starved before training; with identical experts the value is irrelevant.
ROUTER_INIT_STD = 0.02
ROUTER_AUX_LOSS_COEF = 0.001  # Mixtral's default, for whoever trains the result
DTYPES = {"float32": (torch.float32, "F32"), "bfloat16": (torch.bfloat16, "BF16"),
          "float16": (torch.float16, "F16")}
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PROJ_INDEX = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}  # part of each noise seed
_MLP_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
# Dense config fields that mean the same in a Mixtral config.
_CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "rope_theta", "rope_scaling", "attention_dropout", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json", "generation_config.json")


class UpcycleError(ValueError):
    """Bad arguments, an unsupported source model, or an output that cannot be written."""


@dataclass(frozen=True)
class UpcycleConfig:
    """num_experts per layer, top_k of them per token; perturb: relative noise scale of the
    expert copies; seed: of the routers and the noise; dtype: of the written tensors
    ("auto": the source's stored float dtype, float32 for a GGUF's dequantized values);
    force: replace a non-empty output directory."""

    num_experts: int = 8
    top_k: int = 2
    perturb: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    force: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise UpcycleError(f"--experts must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise UpcycleError(f"--top-k must be in [1, {self.num_experts}] (the number of experts), "
                               f"got {self.top_k!r}")
        if not math.isfinite(self.perturb) or self.perturb < 0:
            raise UpcycleError(f"--perturb must be a finite number >= 0, got {self.perturb!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UpcycleError(f"--seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UpcycleError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class UpcycleSummary:
    out: str
    num_layers: int
    num_experts: int
    top_k: int
    total_params: int
    active_params: int
    num_bytes: int
    dtype: str

    def line(self) -> str:
        def _count(n: int) -> str:
            return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return (f"upcycled to {self.out}: {self.num_layers} layers x {self.num_experts} experts, "
                f"top-{self.top_k}; {_count(self.total_params)} params total, "
                f"{_count(self.active_params)} active per token; "
                f"{format_bytes(self.num_bytes)} {self.dtype}")


def upcycle(model: str, out: str, config: UpcycleConfig, cache_dir: Optional[str] = None,
            progress=None) -> UpcycleSummary:
    """Write the Mixtral upcycling of ``model`` (known name, HF directory or .gguf) to ``out``."""
    path = resolve_model(model, cache_dir, progress=progress)
    ckpt = open_checkpoint(path)
    dense = ckpt.hf_config
    _check_source(dense, path)
    _check_out(out, path, config.force)
    dtype = _out_dtype(config, ckpt)
    shapes = _plan(ckpt, config.num_experts)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    num_bytes = sum(math.prod(s) for s in shapes.values()) * DTYPES[dtype][0].itemsize
    free = shutil.disk_usage(parent).free
    if free < num_bytes:
        raise UpcycleError(f"{parent}: {format_bytes(free)} free, the checkpoint needs {format_bytes(num_bytes)}")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.upcycle-", dir=parent)
    try:
        _write_json(tmp, "config.json", mixtral_config(dense, config, dtype))
        _write_tokenizer(ckpt, tmp)  # after config.json, which the tokenizer check reads
        metadata = {"format": "pt", "upcycled_from": os.path.basename(os.path.abspath(path)),
                    "perturb": repr(config.perturb), "seed": str(config.seed),
                    "router_init_std": repr(ROUTER_INIT_STD)}
        with _SafetensorsWriter(os.path.join(tmp, "model.safetensors"), shapes, dtype, metadata) as writer:
            _write_weights(ckpt, writer, config)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a checkpoint is plain shared data
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _summary(out, dense, config, shapes, num_bytes, dtype)


def _check_source(dense: dict[str, Any], path: str) -> None:
    archs = dense.get("architectures") or ["LlamaForCausalLM"]
    if dense.get("model_type") != "llama" or archs != ["LlamaForCausalLM"]:
        raise UpcycleError(f"{path}: upcycling needs a dense Llama-architecture model, this one is "
                           f"{dense.get('model_type')!r} ({', '.join(map(str, archs))})")
    if dense.get("quantization_config"):
        raise UpcycleError(f"{path}: a quantized checkpoint ({dense['quantization_config'].get('quant_method')}); "
                           "upcycling needs float weights (GGUF files are dequantized and are fine)")
    for key in ("attention_bias", "mlp_bias"):
        if dense.get(key):
            raise UpcycleError(f"{path}: {key} is set, and Mixtral has no bias terms")
    if not isinstance(dense.get("intermediate_size"), int):
        raise UpcycleError(f"{path}: config has no integer intermediate_size")


def _check_out(out: str, source: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UpcycleError(f"{out}: exists and is not a directory")
    real_out, real_src = os.path.realpath(out), os.path.realpath(source)
    if real_src == real_out or real_src.startswith(real_out + os.sep):
        raise UpcycleError(f"{out}: is (or holds) the source model {source}; choose another output")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise UpcycleError(f"{out}: exists and is not empty (pass --force to replace it)")


def _out_dtype(config: UpcycleConfig, ckpt: Checkpoint) -> str:
    if config.dtype != "auto":
        return config.dtype
    if isinstance(ckpt, GGUFCheckpoint):
        return "float32"  # dequantized blocks are exact in float32 only
    stored = ckpt.hf_config.get("dtype", ckpt.hf_config.get("torch_dtype"))
    return stored if stored in DTYPES else "float32"


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_EXPERT_NAMES[proj]}.weight"


def router_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate.weight"


def _plan(ckpt: Checkpoint, num_experts: int) -> dict[str, tuple[int, ...]]:
    """Output tensor name -> shape, from the source's names and shapes (weights not read)."""
    dense = ckpt.hf_config
    shapes: dict[str, tuple[int, ...]] = {}
    found: set[tuple[int, str]] = set()
    for name, tensor in ckpt.iter_tensors(lazy=True):
        if not tensor.dtype.is_floating_point:
            raise UpcycleError(f"{ckpt.path}: tensor {name!r} is {tensor.dtype}, not float weights")
        if name == "lm_head.weight" and dense["tie_word_embeddings"]:
            continue  # tied: the head is the embedding, as in the source
        m = _MLP_RE.fullmatch(name)
        if m is None and ".mlp." in name:
            raise UpcycleError(f"{ckpt.path}: unexpected FFN tensor {name!r} for a Llama model")
        if m is None:
            shapes[name] = tuple(tensor.shape)
            continue
        if m[3] == "bias":
            raise UpcycleError(f"{ckpt.path}: {name!r}: Mixtral experts have no bias")
        if int(m[1]) >= dense["num_hidden_layers"]:
            raise UpcycleError(f"{ckpt.path}: {name!r} is past the config's {dense['num_hidden_layers']} layers")
        found.add((int(m[1]), m[2]))
        for e in range(num_experts):
            shapes[expert_name(int(m[1]), e, m[2])] = tuple(tensor.shape)
    for layer in range(dense["num_hidden_layers"]):
        missing = [p for p in _EXPERT_NAMES if (layer, p) not in found]
        if missing:
            raise UpcycleError(f"{ckpt.path}: layer {layer} has no {', '.join(missing)} weight")
        shapes[router_name(layer)] = (num_experts, dense["hidden_size"])
    return shapes


def _generator(*entropy: int) -> torch.Generator:
    # SeedSequence mixes the tuple into independent streams, so one expert's noise depends
    # neither on the order tensors arrive in nor on how many experts there are.
    hi, lo = np.random.SeedSequence(list(entropy)).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(hi) & 0x7FFFFFFF) << 32 | int(lo))


def router_weight(seed: int, layer: int, num_experts: int, hidden: int) -> torch.Tensor:
    """The router of ``layer``: N(0, ROUTER_INIT_STD²) from the stream (seed, 0, layer)."""
    return torch.randn((num_experts, hidden), generator=_generator(seed, 0, layer)) * ROUTER_INIT_STD


def expert_weight(dense: torch.Tensor, perturb: float, seed: int, layer: int, expert: int,
                  proj: str) -> torch.Tensor:
    """``dense`` * (1 + perturb * N(0, 1)) element-wise, the noise from the stream
    (seed, 1, layer, expert, projection); ``dense`` itself when perturb is 0."""
    if perturb == 0:
        return dense
    noise = torch.randn(dense.shape, generator=_generator(seed, 1, layer, expert, _PROJ_INDEX[proj]))
    return dense * (1 + perturb * noise)


def _write_weights(ckpt: Checkpoint, writer: "_SafetensorsWriter", config: UpcycleConfig) -> None:
    dense = ckpt.hf_config
    for name, tensor in ckpt.iter_tensors():  # one dequantized source tensor at a time
        if name == "lm_head.weight" and dense["tie_word_embeddings"]:
            continue
        m = _MLP_RE.fullmatch(name)
        if m is None:
            writer.write(name, tensor)
            continue
        layer, proj = int(m[1]), m[2]
        for e in range(config.num_experts):
            writer.write(expert_name(layer, e, proj),
                         expert_weight(tensor, config.perturb, config.seed, layer, e, proj))
    for layer in range(dense["num_hidden_layers"]):
        writer.write(router_name(layer),
                     router_weight(config.seed, layer, config.num_experts, dense["hidden_size"]))


class _SafetensorsWriter:
    """A safetensors file written one tensor at a time: the header (names, shapes, offsets)
    is fixed up front from the plan, then each tensor lands at its offset in any order."""

    def __init__(self, path: str, shapes: dict[str, tuple[int, ...]], dtype: str, metadata: dict[str, str]):
        self._dtype, code = DTYPES[dtype]
        header: dict[str, Any] = {"__metadata__": metadata}
        self._slots: dict[str, tuple[tuple[int, ...], int]] = {}
        offset = 0
        for name, shape in shapes.items():
            size = math.prod(shape) * self._dtype.itemsize
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._slots[name] = (shape, offset)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data then starts 8-byte aligned, as safetensors writes it
        self._base = 8 + len(raw)
        self._written: set[str] = set()
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shape, offset = self._slots[name]
        if name in self._written or tuple(tensor.shape) != shape:
            raise UpcycleError(f"tensor {name!r} {tuple(tensor.shape)} written twice or not the "
                               f"shape {shape} the first pass saw")
        data = tensor.detach().to(self._dtype).contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._base + offset)
        self._file.write(data.numpy().data)
        self._written.add(name)

    def __enter__(self) -> "_SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        missing = sorted(set(self._slots) - self._written)
        if exc_type is None and missing:
            raise UpcycleError(f"the source gave no tensor for {', '.join(missing[:5])}")


def _rope_parameters(dense: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps rope_theta and any scaling in one dict."""
    if isinstance(dense.get("rope_parameters"), dict):
        return {"rope_theta": dense["rope_theta"], **dense["rope_parameters"]}
    scaling = dense.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind, "rope_theta": dense["rope_theta"]}


def mixtral_config(dense: dict[str, Any], config: UpcycleConfig, dtype: str) -> dict[str, Any]:
    """The Mixtral config.json: the dense model's fields plus the MoE ones (rope also as
    rope_parameters, which transformers 5 reads; rope_theta stays for older readers)."""
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    cfg |= {k: dense[k] for k in _CARRIED if k in dense and (k != "rope_scaling" or dense[k] is not None)}
    return cfg | {
        "rope_parameters": _rope_parameters(dense),
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "sliding_window": None,  # Llama attends to the whole context
        "router_aux_loss_coef": ROUTER_AUX_LOSS_COEF,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "use_cache": True,
        "dtype": dtype,
    }


def _write_tokenizer(ckpt: Checkpoint, out_dir: str) -> None:
    """Copy an HF directory's tokenizer files, or write a GGUF's metadata tokenizer as one;
    a generation_config.json with the EOS ids either way."""
    if isinstance(ckpt, GGUFCheckpoint):
        _tokenizer_from_gguf(ckpt, out_dir)
        return
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(ckpt.path, name)):
            shutil.copy2(os.path.join(ckpt.path, name), os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(out_dir, "generation_config.json")):
        _write_json(out_dir, "generation_config.json",
                    {"bos_token_id": ckpt.hf_config.get("bos_token_id"),
                     "eos_token_id": ckpt.hf_config.get("eos_token_id")})


def _tokenizer_from_gguf(ckpt: GGUFCheckpoint, out_dir: str) -> None:
    tok = load_tokenizer(ckpt.path)
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    probe = tok.encode("")  # what the Tokenizer adds around a text (GGUF backends add nothing)

    def name(i: Optional[int]) -> Optional[str]:
        return None if i is None else tok.backend.id_to_token(i)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_token_id),
              "eos_token": name(tok.eos_token_id), "pad_token": name(tok.pad_token_id),
              "unk_token": name(tok.unk_token_id),
              "add_bos_token": tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id],
              "add_eos_token": tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id],
              "clean_up_tokenization_spaces": False,
              "model_max_length": ckpt.hf_config["max_position_embeddings"],
              "chat_template": tok.chat_template}
    _write_json(out_dir, "tokenizer_config.json", {k: v for k, v in config.items() if v is not None})
    eos = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    _write_json(out_dir, "generation_config.json",
                {"bos_token_id": tok.bos_token_id, "eos_token_id": eos, "pad_token_id": tok.pad_token_id})
    _check_same_tokenizer(tok, hf_tokenizer(out_dir), ckpt.path)


def _check_same_tokenizer(source, written, path: str) -> None:
    """Special tokens are saved by their text and looked up again; a vocabulary with two
    entries of the same text would come back with other ids, so check rather than trust."""
    for field in ("bos_token_id", "eos_token_ids", "pad_token_id", "unk_token_id", "chat_template"):
        if getattr(source, field) != getattr(written, field):
            raise UpcycleError(f"{path}: the written tokenizer's {field} is {getattr(written, field)!r}, "
                               f"the source's {getattr(source, field)!r}")
    probe = "Hello, world! 123 naïve\n"
    if source.encode(probe) != written.encode(probe):
        raise UpcycleError(f"{path}: the written tokenizer encodes text differently from the source's")


def _write_json(out_dir: str, name: str, value: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def _move_into_place(tmp: str, out: str) -> None:
    if os.path.isdir(out) and os.listdir(out):  # --force: the old one goes only once the new one is in
        old = tmp + ".old"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
        return
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)


def _summary(out: str, dense: dict[str, Any], config: UpcycleConfig, shapes: dict[str, tuple[int, ...]],
             num_bytes: int, dtype: str) -> UpcycleSummary:
    total = sum(math.prod(s) for s in shapes.values())
    per_expert = sum(math.prod(shapes[expert_name(0, 0, p)]) for p in _EXPERT_NAMES)
    num_layers = dense["num_hidden_layers"]
    idle = num_layers * (config.num_experts - config.top_k) * per_expert  # experts a token skips
    return UpcycleSummary(out=out, num_layers=num_layers, num_experts=config.num_experts,
                          top_k=config.top_k, total_params=total, active_params=total - idle,
                          num_bytes=num_bytes, dtype=dtype)
