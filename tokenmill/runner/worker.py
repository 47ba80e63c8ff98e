"""One rank of a model: its shard of the weights, its KV heads, its ModelRunner.

``RankWorker`` is the same object in-process (tensor_parallel_size 1, no process group) and
inside a spawned worker process (``worker_process_main``) or a Ray actor, where it answers
msgpack messages: every rank executes every step (the layers' collectives pair them up),
and every rank samples the same tokens from the same gathered logits, so each keeps its own
request state in step; only rank 0's output goes back to the engine.
"""
from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.distributed import serial
from tokenmill.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group

logger = logging.getLogger("tokenmill.worker")


@serial.register
@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part of the model (sent msgpack-encoded)."""

    model_path: str
    dtype: str                    # torch dtype name, resolved by the engine
    kv_dtype: str
    max_model_len: int
    quantization: Optional[str]
    quant_activations: str
    cpu_weight_prepack: bool
    cpu_kernels: bool
    attention_backend: str
    torch_compile: bool
    seed: int
    device: str = "auto"          # ModelConfig.device
    enforce_eager: bool = False   # no CUDA graphs
    max_num_seqs: int = 64        # the largest decode batch a CUDA graph is captured for
    load_format: str = "auto"     # "dummy": random weights
    cpu_gemm_dtype: str = "float32"   # ModelConfig.cpu_gemm_dtype
    cpu_isa: str = "native"           # ModelConfig.cpu_isa
    huge_pages: bool = True           # ModelConfig.huge_pages
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    num_threads: int = 1
    collective_timeout_s: float = 120.0
    shm_collectives: bool = True
    expert_parallel: bool = False
    # Speculative decoding runs on rank 0 only (drafts reach every rank through the
    # scheduler); with TP > 1 only collective-free proposers (ngram) are allowed.
    speculative: Optional[SpeculativeConfig] = None
    cache_dir: Optional[str] = None
    fault_injection: tuple = ()   # FaultRule, tests only (tokenmill.runner.faults)


@serial.register
@dataclass(frozen=True)
class StepFailure:
    """A rank's answer to a step whose execution raised. The rank stays usable: the engine
    fails or re-runs the step's requests, whose runner state the next step resets."""

    error_type: str               # the exception's class name
    message: str


@serial.register
@dataclass(frozen=True)
class RankInfo:
    """What a loaded rank reports back."""

    rank: int
    vocab_size: int
    num_layers: int
    head_dim: int
    num_kv_heads: int             # this rank's (its KV cache holds only these)
    weight_bytes: int             # parameters + buffers of this rank's shard, and the tiled
    #                               q8 copies that replaced packed values among them
    prepacked_bytes: int
    quantization_method: str
    decode_read_bytes: int        # what a batch-1 decode step streams of them (stats.decode_read_bytes)
    layer_windows: tuple = ()     # each layer's attention window (None: full); () = all full


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class RankWorker:
    def __init__(self, spec: RankSpec, tp: TPGroup) -> None:
        self.spec, self.tp = spec, tp
        self.device = _rank_device(spec.rank, spec.device)
        self.model = None
        self.runner = None
        self.checkpoint = None

    def load(self, checkpoint=None) -> RankInfo:
        """Build this rank's shard (from ``checkpoint`` when the caller has it open)."""
        from tokenmill.engine.stats import decode_read_bytes, module_bytes
        from tokenmill.layers.quant.qgemm import tiled_only_bytes
        from tokenmill.layers import native, prepacked
        from tokenmill.layers.attention.base import resolve_backend_name
        from tokenmill.models.loader import open_checkpoint
        from tokenmill.runner.model_loader import build_model
        s = self.spec
        torch.manual_seed(s.seed)
        if self.device.type == "cpu":
            native.use_isa(s.cpu_isa)   # before the build: the library is built for it
            native.build()
        checkpoint = checkpoint if checkpoint is not None else open_checkpoint(s.model_path, s.load_format)
        self.checkpoint = checkpoint   # hot-expert replicas are read from it later
        self.model = build_model(checkpoint, self.device, _dtype(s.dtype),
                                 s.max_model_len, quantization=s.quantization,
                                 quant_activations=s.quant_activations,
                                 cpu_weight_prepack=s.cpu_weight_prepack,
                                 cpu_gemm_dtype=_dtype(s.cpu_gemm_dtype),
                                 cpu_kernels=s.cpu_kernels, tp=self.tp,
                                 expert_parallel=s.expert_parallel,
                                 huge_pages=s.huge_pages,
                                 triton_kernels=resolve_backend_name(
                                     s.attention_backend, self.device) == "triton")
        a = self.model.args
        return RankInfo(rank=s.rank, vocab_size=a.vocab_size, num_layers=a.num_hidden_layers,
                        head_dim=a.head_dim, num_kv_heads=self.model.num_kv_heads,
                        weight_bytes=module_bytes(self.model) + tiled_only_bytes(self.model)
                        + prepacked.tiles_only_bytes(self.model),
                        decode_read_bytes=decode_read_bytes(self.model),
                        prepacked_bytes=self.model.prepacked_bytes,
                        quantization_method=self.model.quantization_method,
                        layer_windows=tuple(getattr(a, "sliding_windows", ()) or ()))

    def init_cache(self, kv_layout, block_size: int) -> int:
        """Allocate the KV cache and the runner; returns the speculative lookahead tokens
        the scheduler must reserve (0 without speculation)."""
        from tokenmill.runner.faults import FaultInjector
        from tokenmill.runner.model_runner import ModelRunner
        s = self.spec
        faults = FaultInjector(s.fault_injection, s.rank) if s.fault_injection else None
        self.runner = ModelRunner(self.model, kv_layout, block_size, self.device,
                                  _dtype(s.kv_dtype), s.attention_backend, seed=s.seed,
                                  torch_compile=s.torch_compile, cpu_kernels=s.cpu_kernels,
                                  faults=faults, cuda_graphs=not s.enforce_eager,
                                  max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
                                  bf16_prefill=s.cpu_gemm_dtype == "bfloat16",
                                  huge_pages=s.huge_pages)
        if s.speculative is None or s.rank != 0:
            return 0
        from tokenmill.spec.decoder import build_spec_decoder
        self.runner.spec = build_spec_decoder(s.speculative, self.runner, s.max_model_len,
                                              kv_layout.groups[0].num_blocks, s.cache_dir)
        return self.runner.spec.num_lookahead_tokens

    def execute_step(self, so):
        """The step's ModelRunnerOutput, or a StepFailure if running it raised (a bad
        request's input, NaN-driven kernel errors, an injected fault): one failed step
        must not take the rank down with every other request."""
        try:
            return self.runner.execute(so)
        except Exception as e:
            logger.exception("rank %d: a step failed", self.spec.rank)
            return StepFailure(type(e).__name__, f"rank {self.spec.rank}: {e}")

    def memory(self) -> dict:
        from tokenmill.engine.stats import module_bytes
        from tokenmill.runner.kv_tensors import kv_cache_nbytes
        return {"rank": self.spec.rank, "model_weights": module_bytes(self.model),
                "prepacked_weights": self.model.prepacked_bytes,
                "kv_cache": kv_cache_nbytes(self.runner.kv_caches) if self.runner else 0}

    def handle(self, kind: str, payload):
        """One request from the engine -> the reply (None: nothing to send back)."""
        if kind == "execute":
            out = self.execute_step(payload)
            self._finish_spec(payload.finished_req_ids)
            return out if self.spec.rank == 0 or isinstance(out, StepFailure) else None
        if kind == "release":
            self.runner.release(payload)
            self._finish_spec(payload)
            return None
        if kind == "init_cache":
            return self.init_cache(*payload)
        if kind == "spec_snapshot":
            return self.runner.spec.snapshot() if self.runner.spec is not None else None
        if kind == "spec_reset":
            if self.runner.spec is not None:
                self.runner.spec.reset_stats()
            return True
        if kind == "memory":
            return self.memory()
        if kind in ("expert_load", "expert_load_reset"):
            load = getattr(self.model, "expert_load", None)
            if load is None:
                return None
            if kind == "expert_load_reset":
                load.reset()
                return True
            return load.snapshot()
        if kind == "replicate_experts":
            from tokenmill.runner.model_loader import load_expert_replicas
            s = self.spec
            load_expert_replicas(self.model, self.checkpoint, payload, _dtype(s.dtype), s.quantization,
                                 s.quant_activations, s.cpu_kernels, s.cpu_weight_prepack,
                                 _dtype(s.cpu_gemm_dtype))
            return True
        raise ValueError(f"unknown worker request {kind!r}")


    def _finish_spec(self, req_ids) -> None:
        """A worker rank's speculative stats of requests that left (in-process, the engine
        calls finish_request itself)."""
        if self.runner.spec is not None and self.tp.is_parallel:
            for req_id in req_ids:
                self.runner.spec.finish_request(req_id)


def _rank_device(rank: int, requested: str = "auto") -> torch.device:
    from tokenmill.platform import pick_device
    device = pick_device(requested)
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


# Replies: ("ok", value) or ("error", message). Requests: (kind, payload).
def worker_process_main(spec_bytes: bytes, conn) -> None:
    """Entry point of a spawned tensor-parallel worker process."""
    spec: RankSpec = serial.decode(spec_bytes)
    # Signals to the process group are the engine's to handle: it drains, then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    tp = None
    try:
        tp = init_tp_group(spec.rank, spec.world_size, spec.master_addr, spec.master_port,
                           _rank_device(spec.rank, spec.device), spec.collective_timeout_s,
                           spec.shm_collectives)
        worker = RankWorker(spec, tp)
        conn.send_bytes(serial.encode(("ok", worker.load())))
        while True:
            kind, payload = serial.decode(conn.recv_bytes())
            if kind == "stop":
                break
            reply = worker.handle(kind, payload)
            # Every rank answers a step (None when fine), so a failure on any rank is seen.
            if kind != "release":
                conn.send_bytes(serial.encode(("ok", reply)))
    except (EOFError, KeyboardInterrupt):
        pass   # the engine went away: exit quietly
    except BaseException as e:
        message = f"rank {spec.rank}: {type(e).__name__}: {e}"
        logger.error("tensor-parallel worker failed\n%s", traceback.format_exc())
        try:
            conn.send_bytes(serial.encode(("error", message)))
        except Exception:
            pass
    finally:
        if tp is not None:
            destroy_tp_group(tp)
