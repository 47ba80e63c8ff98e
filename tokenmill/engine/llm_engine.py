"""LLMEngine: the synchronous engine. One ``step()`` = schedule -> execute (build input,
forward, sample; on every tensor-parallel rank, through the executor) -> update -> detokenize."""
from __future__ import annotations

import logging
import time
import weakref
from typing import Optional, Union

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.expert_balancer import ExpertBalancer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import Processor, PromptType
from tokenmill.runner.executor import StepFailedError, make_executor
from tokenmill.runner.worker import RankSpec
from tokenmill.engine.stats import EngineStats, free_memory_bytes
from tokenmill.kv.kv_cache_manager import PrefixCacheStats
from tokenmill.kv.layout import KVLayout, kv_bytes_read, plan_kv_layout
from tokenmill.models.hub import resolve_model
from tokenmill.models.registry import check_parallel_layout
from tokenmill.models.loader import load_tokenizer, open_checkpoint
from tokenmill.outputs import RequestOutput
from tokenmill.platform import pick_device, resolve_dtype, set_num_threads
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import RequestStatus
from tokenmill.runner.kv_tensors import bytes_per_block, decide_num_blocks, kv_storage_dtype
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.scheduler import Scheduler


logger = logging.getLogger("tokenmill.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc, pc = config.model, config.cache, config.parallel
        if pc.data_parallel_size != 1:
            raise ValueError("LLMEngine runs one replica; data_parallel_size > 1 goes through "
                             "tokenmill.engine.data_parallel")
        if pc.tensor_parallel_size > 1 and config.speculative is not None \
                and config.speculative.method != "ngram":
            # the other drafters run target layers or its embedding: collectives on rank 0 alone
            raise ValueError(f"speculative method {config.speculative.method!r} does not run "
                             "with tensor_parallel_size > 1 yet; use 'ngram'")
        self.num_threads = set_num_threads(config.num_threads)
        self.device = pick_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.model_path = resolve_model(mc.model, cache_dir=config.cache_dir)
        checkpoint = open_checkpoint(self.model_path, mc.load_format)
        hf = checkpoint.hf_config
        self.max_model_len = _decide_max_model_len(mc.max_model_len, hf)
        # before any rank process starts
        check_parallel_layout(hf, pc.tensor_parallel_size, pc.enable_expert_parallel)
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(self.model_path)
        torch.manual_seed(mc.seed)
        self.kv_dtype = kv_storage_dtype(cc.kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and config.speculative is not None \
                and config.speculative.method == "draft_model":
            raise ValueError(f"kv_cache_dtype={cc.kv_cache_dtype!r} does not work with a "
                             "draft_model speculator yet; use kv_cache_dtype='auto'")
        # Every rank (one in this process when tensor_parallel_size is 1) loads its shard.
        self.executor = make_executor(self._rank_spec(), pc, self.num_threads, checkpoint)
        # An engine dropped without shutdown() still stops its rank processes.
        weakref.finalize(self, self.executor.shutdown)
        info = self.executor.info
        r0 = info[0]
        self.vocab_size = r0.vocab_size
        self.weight_bytes = sum(i.weight_bytes for i in info)
        self.decode_read_bytes = sum(i.decode_read_bytes for i in info)   # a decode floor's weights
        # The scheduler's blocks exist once per rank, each rank holding its own KV heads.
        per_block = sum(bytes_per_block(i.num_layers, cc.block_size, i.num_kv_heads, i.head_dim,
                                        self.kv_dtype) for i in info)
        self.kv_bytes_per_token = per_block // cc.block_size
        # each layer's attention window (None: full), for what a step reads of the cache
        self.layer_windows = tuple(r0.layer_windows or (None,) * r0.num_layers)
        num_blocks = decide_num_blocks(cc.num_kv_blocks, cc.kv_cache_memory,
                                       cc.gpu_memory_utilization, per_block, self.device,
                                       self.weight_bytes)
        self.kv_layout = self._kv_layout(self.layer_windows, num_blocks)
        lookahead = self.executor.init_cache(self.kv_layout, cc.block_size)   # rank 0 speculates
        self.scheduler = Scheduler(config.scheduler, cc, self.kv_layout, self.max_model_len,
                                   num_lookahead_tokens=lookahead)
        self.processor = Processor(self.tokenizer, self.max_model_len, self.vocab_size,
                                   hf.get("hidden_size"))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self.num_failed_steps_in_a_row = 0   # failed steps not explained by a suspect
        self._expert_load_cache: Optional[tuple] = None   # (monotonic time, snapshot)
        self.expert_balancer = ExpertBalancer(pc.replicate_hot_experts, pc.expert_rebalance_interval) \
            if pc.replicate_hot_experts else None

    def _kv_layout(self, layer_windows: tuple, num_blocks: int) -> KVLayout:
        """Window groups of their own unless a drafter runs target layers (layer_skip: they
        read the target's caches through group 0's table); a drafter with caches of its own
        indexes them by group 0's table, so group 0 then keeps every block."""
        cc, sc, spec = self.config.cache, self.config.scheduler, self.config.speculative
        lookahead = 0 if spec is None else spec.num_speculative_tokens + 1   # per request, at most
        return plan_kv_layout(
            layer_windows, num_blocks, cc.block_size, explicit_blocks=cc.num_kv_blocks is not None,
            max_num_seqs=sc.max_num_seqs,
            max_step_tokens=sc.max_num_batched_tokens + sc.max_num_seqs * lookahead,
            free_windows=cc.sliding_window_pools and (spec is None or spec.method != "layer_skip"),
            primary_shared=spec is not None and spec.method != "ngram")

    def _rank_spec(self) -> RankSpec:
        mc, pc = self.config.model, self.config.parallel
        return RankSpec(
            model_path=self.model_path, dtype=str(self.dtype).removeprefix("torch."),
            kv_dtype=str(self.kv_dtype).removeprefix("torch."), max_model_len=self.max_model_len,
            quantization=mc.quantization, quant_activations=mc.quant_activations,
            cpu_weight_prepack=mc.cpu_weight_prepack, cpu_kernels=mc.cpu_kernels,
            cpu_gemm_dtype=mc.cpu_gemm_dtype, cpu_isa=mc.cpu_isa, huge_pages=mc.huge_pages,
            attention_backend=mc.attention_backend, torch_compile=mc.torch_compile, seed=mc.seed,
            device=mc.device, enforce_eager=mc.enforce_eager, load_format=mc.load_format,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            master_addr=pc.master_addr, master_port=pc.master_port,
            num_threads=self.num_threads, collective_timeout_s=pc.collective_timeout_s,
            shm_collectives=pc.shm_collectives, expert_parallel=pc.enable_expert_parallel,
            speculative=self.config.speculative, fault_injection=self.config.fault_injection,
            cache_dir=self.config.cache_dir)

    @property
    def model(self):
        """The loaded model (tensor_parallel_size 1; the ranks hold it otherwise)."""
        if self.executor.model is None:
            raise RuntimeError("the model lives in the tensor-parallel worker processes")
        return self.executor.model

    @property
    def runner(self):
        """The model runner (tensor_parallel_size 1; each rank has its own otherwise)."""
        if self.executor.runner is None:
            raise RuntimeError("the model runners live in the tensor-parallel worker processes")
        return self.executor.runner

    @property
    def spec_decoder(self):
        """The speculative decoder, or None."""
        runner = self.executor.runner
        return None if runner is None else runner.spec

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do in-process). Idempotent."""
        self.executor.shutdown()

    def warmup(self, num_prompt_tokens: int = 32, num_output_tokens: int = 4) -> None:
        """Run one short request through every stage (a many-row prefill, decode steps,
        sampling) so one-time costs, such as oneDNN's first-use code generation, the fused
        stack's plan and allocator growth, are paid at start-up and not by the first user.
        Leaves no trace: counters, prefix cache and request maps are as before."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() runs on an idle engine only")
        vocab = self.vocab_size
        num_prompt_tokens = max(1, min(num_prompt_tokens, self.max_model_len - num_output_tokens))
        prompt = [(7 * i + 3) % vocab for i in range(num_prompt_tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=num_output_tokens, ignore_eos=True)
        self.add_request("tokenmill-warmup", {"prompt_token_ids": prompt}, params)
        while self.has_unfinished_requests():
            self.step()
        self.scheduler.kv.reset_prefix_cache()
        self.scheduler.kv.prefix_stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self.num_failed_steps_in_a_row = 0
        self.stats = EngineStats()
        self.reset_expert_load()
        if self.spec_decoder is not None:
            self.spec_decoder.reset_stats()
        elif self.config.speculative is not None:
            self.executor.rank0_call("spec_reset")   # rank 0 of the workers

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Union[SamplingParams, PoolingParams], priority: int = 0,
                    cache_salt: Optional[str] = None) -> str:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input.
        With PoolingParams it is a prompt-only request whose output is an
        EmbeddingRequestOutput."""
        request_id = request_id if request_id is not None else self.processor.next_request_id()
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        pooling = isinstance(params, PoolingParams)
        text, prompt_ids = self.processor.tokenize_prompt(prompt, generates=not pooling)
        if pooling:
            requests = [self.processor.make_pooling_request(request_id, prompt_ids, params,
                                                            priority, cache_salt)]
        else:
            requests = self.processor.make_requests(request_id, prompt_ids, params, priority,
                                                    cache_salt)
        added = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add(text, requests)
        return request_id

    def abort_request(self, request_id: str) -> None:
        for child in self.output_processor.child_ids(request_id) or [request_id]:
            req = self.scheduler.requests.get(child)
            self.scheduler.finish_requests(child, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._on_finished(req)
        self.output_processor.drop(request_id)
        self._release_if_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        sched_out = self.scheduler.schedule()
        try:
            runner_out = self.executor.execute(sched_out)
        except StepFailedError as e:
            core_outputs = self._recover(sched_out, e)
        else:
            self.num_failed_steps_in_a_row = 0
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        live = {o.req_id: self._request_or_none(o.req_id) for o in core_outputs}
        results, stops = self.output_processor.process(core_outputs, live)
        for child_id, stop_str in stops:
            self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_STOPPED, stop_str)
        self._record(core_outputs, live, time.monotonic() - t0)
        self._release_if_idle()
        if self.expert_balancer is not None:
            self.expert_balancer.after_step(self)
        return results

    def _recover(self, sched_out, error: StepFailedError) -> list:
        """A step raised on a rank (the ranks are fine): the request at fault fails alone
        (Scheduler.recover_failed_step). Failing steps with nothing to isolate, many in a
        row, mean the engine itself is broken: then it raises and stops."""
        logger.error("a step failed (%s); isolating its requests", error)
        self.stats.num_failed_steps += 1
        if len(sched_out.num_scheduled_tokens) > 1 or \
                not self.scheduler.suspects.keys() & sched_out.num_scheduled_tokens.keys():
            self.num_failed_steps_in_a_row += 1
        limit = self.config.scheduler.max_failed_steps_in_a_row
        if self.num_failed_steps_in_a_row >= limit:
            raise RuntimeError(f"{limit} steps failed in a row; the engine stops") from error
        message = f"the model failed while running this request ({error.error_type})"
        return self.scheduler.recover_failed_step(sched_out, message)

    def _release_if_idle(self) -> None:
        if not self.scheduler.has_unfinished_requests():
            self.executor.release(self.scheduler.take_finished_ids())

    def _request_or_none(self, req_id: str):
        return self.scheduler.requests.get(req_id) or self.scheduler.recently_finished.get(req_id)

    def _record(self, core_outputs, live, elapsed: float) -> None:
        self.stats.num_steps += 1
        self.stats.busy_time += elapsed
        for out in core_outputs:
            self.stats.num_generated_tokens += len(out.new_token_ids)
            req = live.get(out.req_id)
            if req is not None and req.is_finished:
                self._on_finished(req)
        self.scheduler.recently_finished.clear()

    def _on_finished(self, req) -> None:
        self.stats.on_finished(req)
        if self.spec_decoder is not None:     # its per-request spec stats join the recent list
            self.spec_decoder.finish_request(req.request_id)

    # -- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict:
        """Counters since start-up (warmup excluded); terms in ``EngineStats.snapshot``:
        throughput is generated tokens per second of busy time inside ``step()``."""
        prefix = self.scheduler.kv.prefix_stats
        stats = self.stats.snapshot(self.scheduler.num_preemptions, prefix.hit_rate)
        stats["prefix_cache_queries"] = prefix.num_queries
        stats["prefix_cache_hits"] = prefix.num_hits
        stats["structured_outputs"] = self.structured_output_counters()
        if self.spec_decoder is not None:
            stats.update(self.spec_decoder.snapshot())
        elif self.config.speculative is not None:
            stats.update(self.executor.rank0_call("spec_snapshot"))
        moe = self.expert_load()
        if moe is not None:
            stats["moe"] = moe
        return stats

    def structured_output_counters(self) -> dict:
        """Constrained decoding since start-up: requests by constraint kind, failures, forced
        drafts verified / accepted (tokenmill.structured.stats) and grammar compiles."""
        return {**self.scheduler.grammar_stats.counters(), **self.processor.grammar_counters()}

    def expert_load(self, max_age_s: float = 0.0) -> Optional[dict]:
        """MoE routing counts (``ExpertLoad.snapshot``), None for a dense model. With
        ``max_age_s`` a reading that recent is reused: with worker ranks each is a round trip."""
        now = time.monotonic()
        cached = self._expert_load_cache
        if cached is None or now - cached[0] > max_age_s:
            cached = self._expert_load_cache = (now, self.executor.rank0_call("expert_load"))
        return cached[1]

    def reset_expert_load(self) -> None:
        """Zero the MoE expert load counters (every rank's)."""
        self.executor.rank0_call("expert_load_reset")
        self._expert_load_cache = None

    def kv_bytes_read(self, context: int) -> int:
        """The K/V bytes one sequence's decode step reads at ``context`` tokens, a sliding-
        window layer's over its window only (kv/layout.py kv_bytes_read)."""
        return kv_bytes_read(self.kv_bytes_per_token, self.layer_windows, context)

    def get_memory_stats(self) -> dict:
        """Bytes unless named otherwise. ``model_weights``: the loaded model's parameters and
        buffers (RoPE tables); ``prepacked_weights``: the oneDNN / tiled copies made at load
        on top of them (a tiled q8 copy replaces the packed values it was made from, and bf16
        mode's tiles the float32 weights).
        ``kv_cache_usage``: fraction of KV blocks in use, 0..1. ``free_memory``: free memory
        on the device the model runs on (system MemAvailable on CPU, free device memory on CUDA)."""
        kv = self.scheduler.kv
        ranks = self.executor.memory()
        stats = {
            "model_weights": sum(r["model_weights"] for r in ranks),
            "prepacked_weights": sum(r["prepacked_weights"] for r in ranks),  # oneDNN / tiled q8
            "free_memory": free_memory_bytes(self.device),
            "kv_cache": sum(r["kv_cache"] for r in ranks),
            "kv_cache_dtype": self.config.cache.kv_cache_dtype,
            "kv_cache_storage_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token,   # all layers, K + V, scales included
            "kv_capacity_tokens": kv.num_total_blocks * kv.block_size,
            "kv_cache_usage": kv.usage,
            "kv_cache_usage_perc": 100.0 * kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_total_blocks,
            "block_size": kv.block_size,
            # the pools: full-attention layers (window None) keep every block, sliding ones
            # only their window's (kv/layout.py); the figures above are group 0's
            "kv_groups": [{"num_layers": len(g.layers), "window": g.window, "num_blocks": g.num_blocks}
                          for g in self.kv_layout.groups],
            "tensor_parallel_size": len(ranks),
        }
        if len(ranks) > 1:   # each rank's shard and KV heads
            stats["ranks"] = ranks
        return stats


def _decide_max_model_len(requested: Optional[int], hf_config: dict) -> int:
    limit = hf_config.get("max_position_embeddings") or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length {limit}")
    return requested
