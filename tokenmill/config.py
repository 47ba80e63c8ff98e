"""Frozen, validated configuration, one dataclass per concern.

Nothing here reads the environment: the CLI and the offline API build these from arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, at which precision, with how long a context."""

    model: str
    dtype: str = "auto"                    # "auto" = float32 on CPU (bf16 GEMM is ~60x slower there)
    max_model_len: Optional[int] = None    # None = the checkpoint's limit
    seed: int = 0
    skip_tokenizer_init: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The pool is sized by ``num_kv_blocks`` if given, else by
    ``kv_cache_memory`` bytes, else (CUDA) ``gpu_memory_utilization`` of device memory."""

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int)
                                                 or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget. ``max_num_batched_tokens`` smaller than a prompt forces chunked prefill."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"                   # "fcfs" | "priority"
    max_queued_requests: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: Optional[int] = None      # torch intra-op threads; None = number of cores
    cache_dir: Optional[str] = None        # where named models are fetched to
