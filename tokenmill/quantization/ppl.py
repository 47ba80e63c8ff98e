"""`tokenmill eval ppl`: perplexity on the held-out ShareGPT evaluation split (never used for
calibration), optionally with the KL divergence of next-token distributions against a base
model. Windows of ``context_len`` tokens; every token after a window's first is scored, up to
``max_tokens`` scored tokens in total.

``kv_cache_dtype`` evaluates a quantized KV cache. A prefill chunk that starts at position 0
attends to its own fresh K/V and never reads the cache back, so a quantized cache only
matters once prefill is chunked: ``chunk_size`` (the scheduler's token budget per step)
makes every window after its first chunk attend to cached, quantized K/V. Compare runs with
the same ``chunk_size``; the JSON reports which one was used."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from tokenmill.layers import native


def _llm(model: str, quantization: Optional[str], context_len: int, num_threads, cache_dir,
         kv_cache_dtype: str = "auto", chunk_size: Optional[int] = None,
         quant_activations: str = "fp32", cpu_gemm_dtype: str = "float32",
         cpu_isa: str = "native"):
    from tokenmill import LLM
    return LLM(model=model, quantization=quantization, num_threads=num_threads,
               cache_dir=cache_dir, enable_prefix_caching=False, max_model_len=context_len + 8,
               max_num_batched_tokens=chunk_size or context_len + 8, max_num_seqs=1,
               kv_cache_dtype=kv_cache_dtype, quant_activations=quant_activations,
               cpu_gemm_dtype=cpu_gemm_dtype, cpu_isa=cpu_isa)


class _LogitTap:
    """Keeps the prompt-position logits the runner computes for ``prompt_logprobs``
    (installed on one model instance for the duration of an evaluation only)."""

    def __init__(self, model) -> None:
        self.model, self.inner, self.rows = model, model.compute_logits, []
        model.compute_logits = self

    def __call__(self, hidden):
        logits = self.inner(hidden)
        self.rows.append(logits.float())
        return logits

    def take(self, num: int) -> torch.Tensor:
        # In call order: the prompt rows of each prefill chunk, then the one sampled row.
        rows = torch.cat(self.rows)[:num]
        self.rows = []
        return rows

    def close(self) -> None:
        del self.model.compute_logits   # back to the class method


def _score(llm, ids: list[int], tap: Optional[_LogitTap]):
    """(sum of -log p over tokens 1.., their count, log-probs [n-1, V] or None)."""
    from tokenmill.sampling_params import SamplingParams
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
                       use_tqdm=False)[0]
    nll = -sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids)))
    logp = torch.log_softmax(tap.take(len(ids) - 1), dim=-1) if tap else None
    return nll, len(ids) - 1, logp


def evaluate(model: str, quantization: Optional[str] = None, max_tokens: int = 4096,
             context_len: int = 512, kl_base: Optional[str] = None, num_threads=None,
             cache_dir: Optional[str] = None, kv_cache_dtype: str = "auto",
             chunk_size: Optional[int] = None, quant_activations: str = "fp32",
             cpu_gemm_dtype: str = "float32", cpu_isa: str = "native") -> dict:
    """``chunk_size``: prefill tokens per step (None = a whole window in one step);
    ``quant_activations``: "q8" scores the int8-activation path of packed linears;
    ``cpu_gemm_dtype``: "bfloat16" scores the bf16 compute mode (every float matmul in bf16);
    ``cpu_isa``: "avx512" scores it on vdpbf16ps where the CPU has AMX tiles (one per process)."""
    from tokenmill.quantization.calibration import text_token_windows
    t0 = time.time()
    llm = _llm(model, quantization, context_len, num_threads, cache_dir, kv_cache_dtype, chunk_size,
               quant_activations, cpu_gemm_dtype, cpu_isa)
    num_windows = math.ceil(max_tokens / (context_len - 1))
    windows = text_token_windows(llm.get_tokenizer(), "evaluation", num_windows, context_len, cache_dir)
    base = None
    if kl_base:
        base = _llm(model if kl_base == "same" else kl_base, None, context_len, num_threads,
                    cache_dir, chunk_size=chunk_size, cpu_isa=cpu_isa)
    taps = (_LogitTap(llm.engine.model), _LogitTap(base.engine.model)) if base else (None, None)
    nll, count, kl_sum = 0.0, 0, 0.0
    try:
        for ids in windows:
            ids = ids[:max_tokens - count + 1]
            n_nll, n, logp = _score(llm, ids, taps[0])
            nll, count = nll + n_nll, count + n
            if base:
                _, _, base_logp = _score(base, ids, taps[1])
                kl_sum += float((base_logp.exp() * (base_logp - logp)).sum())
            if count >= max_tokens:
                break
    finally:
        for tap in taps:
            if tap:
                tap.close()
    result = {"model": model, "quantization": getattr(llm.engine.model, "quantization_method", quantization or "none"),
              "perplexity": round(math.exp(nll / count), 4), "num_tokens": count,
              "context_len": context_len, "weight_bytes": llm.engine.weight_bytes,
              "quant_activations": quant_activations, "cpu_gemm_dtype": cpu_gemm_dtype,
              "cpu_isa": cpu_isa, "bf16_matmul": native.bf16_kernel() if cpu_gemm_dtype == "bfloat16" else None,
              "kv_cache_dtype": kv_cache_dtype, "chunk_size": chunk_size or context_len + 8,
              "kv_bytes_per_token": llm.engine.kv_bytes_per_token,
              "kv_capacity_tokens": llm.get_memory_stats()["kv_capacity_tokens"],
              "seconds": round(time.time() - t0, 1)}
    if base:
        result["kl_divergence"] = round(kl_sum / count, 6)
    return result
