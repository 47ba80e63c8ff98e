"""Frozen, validated configuration, one dataclass per concern.

Nothing here reads the environment: the CLI and the offline API build these from arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "reference", "triton")
CPU_GEMM_DTYPES = ("float32", "bfloat16")
CPU_ISAS = ("native", "avx512", "avx2")   # layers/native.py: what each one builds and allows
DRAFTER_QUANTIZATIONS = ("int8",)   # how an eagle3 / dflash drafter's linears may be served
KV_CACHE_DTYPES = ("auto", "fp16", "float16", "bf16", "bfloat16", "int8", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, at which precision, with how long a context."""

    model: str
    dtype: str = "auto"                    # "auto" = float32 on CPU (bf16 GEMM is ~60x slower there)
    max_model_len: Optional[int] = None    # None = the checkpoint's limit
    seed: int = 0
    skip_tokenizer_init: bool = False
    # "auto" = CUDA when a GPU is visible, else the CPU.
    device: str = "auto"
    # "auto" = "triton" on CUDA when the triton package is installed, else "cpu" (C kernels
    # on a CPU, plain PyTorch elsewhere). "triton": paged attention, fused ops and packed
    # GEMMs as Triton kernels (on a CPU only in Triton's interpreter: tests of the CUDA path).
    attention_backend: str = "auto"
    # CUDA graphs are captured for decode steps of up to max_num_seqs sequences (the Triton
    # backend); True runs every step eagerly.
    enforce_eager: bool = False
    # "dummy": config.json only, random weights (speed measurements at any size, no download).
    load_format: str = "auto"
    # Weight quantization: None, "int8", "int4" / "int4-g32|g64|g128", "fp8" (online RTN),
    # "bf16" / "fp16" (linear weights rounded to 16 bits, float32 activations and sums), or
    # "gguf" (keep GGUF Q8_0/Q4_0/Q4_1 packed). GPTQ / AWQ / FP8 checkpoints need none.
    quantization: Optional[str] = None
    # Activations of int8 / int4 weight matmuls: "fp32" (exact up to summation order) or
    # "q8" (rounded to int8 per 32 values for integer dot products, as llama.cpp does: every
    # step on the tiled q8 GEMM, or decode-sized steps only without cpu_weight_prepack;
    # faster, small accuracy cost).
    quant_activations: str = "fp32"
    # The fused CPU kernels (RMSNorm, RoPE, SiLU, small-M matmul, paged attention, the
    # one-call decode stack; layers/cpu_ops.py) where the kernel library runs. False: plain
    # PyTorch for all of them (the ablation baseline). Quantized matmuls keep their kernels.
    cpu_kernels: bool = True
    # torch.compile (inductor) each decoder layer of the per-layer module path (prefill and
    # steps the one-call decode stack does not take); attention stays eager. Compiling takes
    # tens of seconds per new shape class, paid on first use.
    torch_compile: bool = False
    # CPU float32 linears keep a second copy of each weight in oneDNN's blocked layout for
    # many-row matmuls (prefill, batched decode): 1.2-2x faster GEMMs at 32-512 rows on this
    # AVX2 box (about even with MKL around 256 rows), for the float weights' memory once
    # more. Ignored off CPU. Packed int8 / int4 linears with q8 activations get a tiled
    # copy of their weights the same way (layers/quant/qgemm.py).
    cpu_weight_prepack: bool = True
    # "float32": that copy is oneDNN's. "bfloat16" (opt-in, CPUs with AVX-512 BF16 only):
    # a tiled bf16 copy instead, which every matmul of a float32 linear takes (decode rows
    # too): weights and activations rounded to bf16, float32 sums and outputs (~2x the fp32
    # GEMM rate on Zen 4, 5-8x on AMX tiles (Sapphire Rapids+) from 16 rows up, half the bytes
    # a decode step reads, half the copy's memory; fidelity in docs/bench). On AMX with a bf16
    # KV cache, prompt chunks' attention multiplies on the tiles too (bf16 q and weights).
    cpu_gemm_dtype: str = "float32"
    # Instruction sets the CPU kernels may use: "native" (all this CPU has), "avx512" (no AMX
    # tiles: bf16 mode on vdpbf16ps, as on Zen 4) or "avx2" (the AVX2 build an AVX2-only CPU
    # runs, no AVX-512 path such as bf16 compute): one machine then measures and checks the
    # code of the other. One per process (the kernel library
    # is). Torch's own kernels follow ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, not this.
    cpu_isa: str = "native"
    # Weights and the KV cache on 2 MB pages (Linux transparent huge pages; elsewhere a
    # no-op): a decode step streams both, and through 4 KB pages reads ran ~15-20 % slower
    # (utils/hugepages.py). The KV cache's resident memory then grows 2 MB at a time per
    # layer's K and V.
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be True or False, got {self.huge_pages!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")
        if self.cpu_gemm_dtype not in CPU_GEMM_DTYPES:
            raise ValueError(f"cpu_gemm_dtype must be one of {', '.join(CPU_GEMM_DTYPES)}, "
                             f"got {self.cpu_gemm_dtype!r}")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a string or None, got {self.quantization!r}")
        if self.quant_activations not in ("fp32", "q8"):
            raise ValueError(f"quant_activations must be 'fp32' or 'q8', got {self.quant_activations!r}")
        if not isinstance(self.cpu_kernels, bool):
            raise ValueError(f"cpu_kernels must be True or False, got {self.cpu_kernels!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int)
                                               or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The pool is sized by ``num_kv_blocks`` if given, else by
    ``kv_cache_memory`` bytes, else (CUDA) ``gpu_memory_utilization`` of device memory.
    ``kv_cache_dtype``: "auto" stores K/V in the model dtype; "fp16" / "bf16" (also spelled
    "float16" / "bfloat16") in half precision, rounded on write (half the bytes of float32
    to read at every decode step); "int8" / "fp8" (E4M3, also spelled "fp8_e4m3") quantized
    with a scale per token per KV head, so the same memory holds about 4x (vs float32) the
    tokens."""

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # sliding-window layers keep only their window, in block pools of their own (kv/layout.py);
    # False: one table over every layer, each keeping the whole context
    sliding_window_pools: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
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
    # Tokens a request's grammar forces next (a JSON key, say) are scheduled as drafts and
    # verified like speculative ones: exact, and several tokens for one forward. 0 turns it off.
    max_forced_drafts: int = 8
    # A failed step fails only the request that caused it (the others are re-run alone to
    # find it); this many failed steps in a row, with no step succeeding, mean the engine
    # itself is broken and it stops.
    max_failed_steps_in_a_row: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_failed_steps_in_a_row, int) or self.max_failed_steps_in_a_row < 1:
            raise ValueError("max_failed_steps_in_a_row must be a positive integer, got "
                             f"{self.max_failed_steps_in_a_row!r}")
        if not isinstance(self.max_forced_drafts, int) or self.max_forced_drafts < 0:
            raise ValueError(f"max_forced_drafts must be an integer >= 0, got {self.max_forced_drafts!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


_SPEC_METHODS = ("ngram", "draft_model", "layer_skip", "medusa", "eagle", "eagle3", "dflash")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (see tokenmill/spec). ``model``: draft checkpoint (draft_model) or
    drafter weights (medusa / eagle / eagle3 / dflash; None = random weights, for exactness
    tests). ``num_layers``:
    target layers a layer_skip draft runs. ``adaptive``: pick k per step (0..k) from measured
    cost and acceptance instead of always k. ``ngram_first``: a request whose context repeats
    itself gets prompt-lookup drafts (prompt_lookup_min / max), the method's drafter drafts
    for the others. ``speculative_token_tree`` (vLLM's spelling, eagle3): paths of child
    ranks, e.g. "[(0,), (1,), (2,), (0, 0)]": besides its chain of first choices the drafter
    offers its next choices at each depth as leaf alternatives, verified in the same forward
    (spec/draft_tree.py); depths past the tree's continue the chain alone."""

    method: str
    num_speculative_tokens: int = 4
    model: Optional[str] = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_layers: Optional[int] = None
    adaptive: bool = True
    seed: int = 0                          # random medusa / eagle heads
    quantization: Optional[str] = None     # "int8": serve an eagle3 / dflash drafter's linears in int8
    ngram_first: bool = False
    speculative_token_tree: Optional[object] = None   # str or list of tuples (vLLM's spelling)

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {_SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft model (model=...)")
        if self.quantization is not None:
            if self.quantization not in DRAFTER_QUANTIZATIONS:
                raise ValueError(f"speculative quantization must be one of {DRAFTER_QUANTIZATIONS} "
                                 f"or None, got {self.quantization!r}")
            if self.method not in ("eagle3", "dflash"):
                raise ValueError(f"speculative quantization applies to eagle3 and dflash drafters, "
                                 f"not {self.method!r}")
        if not isinstance(self.ngram_first, bool):
            raise ValueError(f"ngram_first must be true or false, got {self.ngram_first!r}")
        if self.ngram_first and self.method == "ngram":
            raise ValueError("ngram_first puts prompt lookup before another method's drafter; "
                             "the method is already 'ngram'")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        if self.speculative_token_tree is not None:
            widths = self.tree_widths
            if self.method != "eagle3":
                raise ValueError(f"speculative_token_tree needs a drafter that ranks its choices "
                                 f"(eagle3), not {self.method!r}")
            if len(widths) > k:
                raise ValueError(f"speculative_token_tree is {len(widths)} deep, past "
                                 f"num_speculative_tokens ({k})")
            if k + sum(w - 1 for w in widths) > 32:
                raise ValueError("speculative_token_tree: more than 32 draft tokens per step")

    @property
    def tree_widths(self) -> tuple:
        """Candidates per depth (the chain's included), num_speculative_tokens of them:
        (1, ..) without a tree."""
        from tokenmill.spec.draft_tree import parse_token_tree
        widths = () if self.speculative_token_tree is None else \
            parse_token_tree(self.speculative_token_tree)
        return widths + (1,) * (self.num_speculative_tokens - len(widths))

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """vLLM spelling: {"method": ..., "num_speculative_tokens": k, "model": ...}."""
        d = dict(d)
        if "method" not in d:   # vLLM infers the method from the other keys
            d["method"] = "draft_model" if d.get("model") else "ngram"
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


FAULT_KINDS = ("forward_error", "sample_error", "nan_logits", "kill_worker")


@dataclass(frozen=True)
class FaultRule:
    """Test-only fault injection (tokenmill.runner.faults): make one kind of failure happen to
    every request whose prompt contains ``trigger_token_ids``, in the step where it has
    ``at_output_token`` output tokens. ``forward_error`` / ``sample_error`` raise before the
    forward / the sampler; ``nan_logits`` makes its logits NaN; ``kill_worker`` SIGKILLs the
    rank's process. ``ranks``: the ranks it fires on (empty: all); ``max_fires``: per rank,
    0 = every time (a deterministic fault) -- 1 makes a transient one."""

    kind: str
    trigger_token_ids: tuple = ()
    at_output_token: int = 0
    ranks: tuple = ()
    max_fires: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        ids = self.trigger_token_ids
        if not isinstance(ids, (tuple, list)) or not ids or \
                not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"trigger_token_ids must be a non-empty sequence of token ids, got {ids!r}")
        object.__setattr__(self, "trigger_token_ids", tuple(ids))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        for name in ("at_output_token", "max_fires"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


_EXECUTOR_BACKENDS = ("mp", "ray")
_ROUTERS = ("prefix", "round_robin")


@dataclass(frozen=True)
class ParallelConfig:
    """How one model is split and replicated.

    ``tensor_parallel_size``: ranks one model's layers are split over (heads, FFN columns,
    vocabulary), each a worker process with ``cores / tp`` threads; 1 = today's in-process
    path. ``data_parallel_size``: whole-engine replicas, each request routed to one of them
    (``router``: "prefix" sends requests sharing their first KV blocks to the same replica,
    "round_robin" ignores content). ``distributed_executor_backend``: "mp" (local spawned
    processes) or "ray" (actors on a Ray cluster: ``ray_address`` None starts a local one,
    "auto" joins the running cluster). ``master_addr`` / ``master_port``: the rendezvous of
    a tensor-parallel group (port 0 = pick a free one). ``enable_expert_parallel``: an MoE
    model's experts are sharded whole over the tensor-parallel ranks (attention stays split
    by heads) instead of every rank holding a slice of every expert. ``replicate_hot_experts``
    (expert parallel): every ``expert_rebalance_interval`` steps each layer's that many most
    used experts (measured since the last look) are copied onto every rank, which then split
    their tokens."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    router: str = "prefix"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    ray_address: Optional[str] = None
    # Seconds a collective may wait for a peer before the step fails (a dead worker).
    collective_timeout_s: float = 120.0
    # CPU ranks of one host exchange small collectives through shared memory (microseconds)
    # instead of gloo's loopback TCP (~0.5 ms each here); False: gloo for everything.
    shm_collectives: bool = True
    enable_expert_parallel: bool = False
    replicate_hot_experts: int = 0
    expert_rebalance_interval: int = 256

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an integer in [1, 64], got {value!r}")
        if self.distributed_executor_backend not in _EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.router not in _ROUTERS:
            raise ValueError(f"router must be one of {_ROUTERS}, got {self.router!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError("master_addr must be a host name or address")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be True or False, "
                             f"got {self.enable_expert_parallel!r}")
        for name in ("replicate_hot_experts", "expert_rebalance_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.expert_rebalance_interval < 1:
            raise ValueError("expert_rebalance_interval must be at least 1 step")
        if self.replicate_hot_experts and not self.enable_expert_parallel:
            raise ValueError("replicate_hot_experts needs enable_expert_parallel")
        if not isinstance(self.shm_collectives, bool):
            raise ValueError(f"shm_collectives must be True or False, got {self.shm_collectives!r}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.collective_timeout_s!r}")

    @property
    def world_size(self) -> int:
        """Processes one replica runs on."""
        return self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: Optional[int] = None      # torch intra-op threads; None = number of cores
    cache_dir: Optional[str] = None        # where named models are fetched to
    speculative: Optional[SpeculativeConfig] = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fault_injection: tuple = ()            # FaultRule, for tests only (see FaultRule)

    def __post_init__(self) -> None:
        rules = tuple(self.fault_injection)
        if not all(isinstance(r, FaultRule) for r in rules):
            raise ValueError("fault_injection must be a sequence of FaultRule")
        object.__setattr__(self, "fault_injection", rules)
