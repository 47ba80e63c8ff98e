"""Offline API with vLLM's spelling: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

from tqdm import tqdm

from tokenmill.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                              SchedulerConfig, SpeculativeConfig)
from tokenmill.engine.data_parallel import create_engine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto",
                 max_model_len: Optional[int] = None, block_size: int = 16,
                 num_kv_blocks: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_forced_drafts: int = 8,
                 enable_prefix_caching: bool = True, sliding_window_pools: bool = True,
                 scheduling_policy: str = "fcfs", skip_tokenizer_init: bool = False, seed: int = 0,
                 num_threads: Optional[int] = None, device: str = "auto",
                 attention_backend: str = "auto", enforce_eager: bool = False,
                 load_format: str = "auto",
                 cache_dir: Optional[str] = None,
                 speculative_config: Union[None, dict, SpeculativeConfig] = None,
                 speculative_model: Optional[str] = None,
                 num_speculative_tokens: Optional[int] = None,
                 quantization: Optional[str] = None, kv_cache_dtype: str = "auto",
                 quant_activations: str = "fp32", torch_compile: bool = False,
                 cpu_weight_prepack: bool = True, cpu_kernels: bool = True,
                 cpu_gemm_dtype: str = "float32", cpu_isa: str = "native",
                 huge_pages: bool = True,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 distributed_executor_backend: str = "mp", router: str = "prefix",
                 ray_address: Optional[str] = None, enable_expert_parallel: bool = False,
                 replicate_hot_experts: int = 0, expert_rebalance_interval: int = 256,
                 max_failed_steps_in_a_row: int = 16, fault_injection: Sequence = ()) -> None:
        """``fault_injection``: FaultRule objects (tokenmill.config), for tests only."""
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              skip_tokenizer_init=skip_tokenizer_init,
                              device=device, attention_backend=attention_backend,
                              enforce_eager=enforce_eager, load_format=load_format,
                              quantization=quantization,
                              quant_activations=quant_activations,
                              torch_compile=torch_compile,
                              cpu_weight_prepack=cpu_weight_prepack,
                              cpu_gemm_dtype=cpu_gemm_dtype, cpu_kernels=cpu_kernels,
                              cpu_isa=cpu_isa, huge_pages=huge_pages),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory=kv_cache_memory,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype,
                              sliding_window_pools=sliding_window_pools),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_forced_drafts=max_forced_drafts,
                                      policy=scheduling_policy,
                                      max_failed_steps_in_a_row=max_failed_steps_in_a_row),
            num_threads=num_threads, cache_dir=cache_dir,
            speculative=_speculative(speculative_config, speculative_model, num_speculative_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    data_parallel_size=data_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend,
                                    router=router, ray_address=ray_address,
                                    enable_expert_parallel=enable_expert_parallel,
                                    replicate_hot_experts=replicate_hot_experts,
                                    expert_rebalance_interval=expert_rebalance_interval),
            fault_injection=tuple(fault_injection))
        # data_parallel_size > 1: a DataParallelEngine (same surface) over replica processes
        self.engine = create_engine(config)
        self.engine.warmup()   # one-time costs now, not in the first request

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        ids = self._add_all(prompts, params, priority)
        return self._run(ids, use_tqdm)

    def embed(self, prompts, pooling_params: Union[None, PoolingParams, Sequence[PoolingParams]] = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (``out.outputs.embedding``), in prompt order: the pooled final
        hidden states of the prompt (PoolingParams: mean by default, L2-normalised). The
        prompts run through the engine like prefills, batched and chunked."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params, None), use_tqdm)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        tokenizer = self._require_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs)}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the growing RequestOutput of one prompt after every engine step."""
        params = sampling_params or SamplingParams()
        request_id = self.engine.add_request(None, prompt, params)
        finished = False
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
                        if out.finished:
                            return
                if not self.engine.has_unfinished_requests():
                    return
        finally:
            if not finished:   # left early: free its blocks
                self.engine.abort_request(request_id)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine behind this LLM (vLLM's name for it); the same object as ``engine``."""
        return self.engine

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def get_memory_stats(self) -> dict:
        return self.engine.get_memory_stats()

    # -- helpers ------------------------------------------------------------------------------
    def _require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise ValueError("this LLM was created with skip_tokenizer_init=True")
        return self.engine.tokenizer

    @staticmethod
    def _params_per_prompt(sampling_params, num: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        params = list(sampling_params)
        if len(params) != num:
            raise ValueError(f"got {len(params)} sampling_params for {num} prompts")
        return params

    def _add_all(self, prompts, params, priority) -> list[str]:
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                ids.append(self.engine.add_request(None, prompt, p, cache_salt=salt,
                                                   priority=priority[i] if priority else 0))
        except Exception:
            for request_id in ids:   # all or nothing: a bad prompt queues none of the batch
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for request_id in pending:
                self.engine.abort_request(request_id)
        return [finished[i] for i in ids if i in finished]


def _speculative(config, model: Optional[str], num_tokens: Optional[int]) -> Optional[SpeculativeConfig]:
    """vLLM's ``speculative_config`` dict, or the older ``speculative_model`` /
    ``num_speculative_tokens`` pair ("[ngram]" names prompt lookup)."""
    if isinstance(config, SpeculativeConfig):
        return config
    if config is None and model is None:
        if num_tokens is not None:
            raise ValueError("num_speculative_tokens needs speculative_model or speculative_config")
        return None
    d = dict(config or {})
    if model is not None:
        d.setdefault("method", "ngram" if model == "[ngram]" else "draft_model")
        if model != "[ngram]":
            d.setdefault("model", model)
    if num_tokens is not None:
        d.setdefault("num_speculative_tokens", num_tokens)
    return SpeculativeConfig.from_dict(d)
