"""tokenmill itself, as `bench compare` measures it: precision "fp32" (weights dequantized
to float32), "gguf" (the GGUF's quantized blocks kept packed) or "gguf-q8" (kept packed,
activations rounded to int8 for integer dot products, as llama.cpp does, on the tiled q8
GEMM), "bf16" (float32 weights, many-row matmuls on a bf16 copy) or "bf16w" / "fp16w" (weights
rounded to 16 bits once, activations and sums float32: quantization "bf16" / "fp16"). The KV cache dtype is the
spec's ``kv_cache_dtype`` (llama.cpp keeps f16 K/V: ``--kv-cache-dtype fp16`` matches it). Prefix
caching is off so a repeated run never reuses the previous run's prompts (the other engines
cannot); the KV pool holds exactly the parallel sequences' need, as llama.cpp's context is
sized."""
from __future__ import annotations

import time

BLOCK_SIZE = 16
# "bf16": float32 weights whose matmuls run on a tiled bf16 copy (cpu_gemm_dtype; CPUs with
# AVX-512 BF16), activations rounded to bf16, float32 sums
PRECISIONS = ("fp32", "bf16", "bf16w", "fp16w", "gguf", "gguf-q8")
_QUANTIZATION = {"gguf": "gguf", "gguf-q8": "gguf", "bf16w": "bf16", "fp16w": "fp16"}


class TokenmillEngine:
    def __init__(self, spec: dict) -> None:
        import tokenmill
        from tokenmill import LLM
        precision = spec["precision"]
        if precision not in PRECISIONS:
            raise ValueError(f"tokenmill precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        max_len = spec["max_seq_len"]
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        self.llm = LLM(model=spec["model_path"],
                       quantization=_QUANTIZATION.get(precision),
                       quant_activations="q8" if precision == "gguf-q8" else "fp32",
                       cpu_gemm_dtype="bfloat16" if precision == "bf16" else "float32",
                       cpu_isa=spec.get("cpu_isa", "native"),
                       kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                       num_threads=spec["num_threads"], skip_tokenizer_init=True,
                       max_model_len=max_len, max_num_seqs=spec["max_num_seqs"],
                       max_num_batched_tokens=max(2048, spec["prefill_len"] + 1),
                       block_size=BLOCK_SIZE, num_kv_blocks=spec["max_num_seqs"] * blocks_per_seq + 1,
                       enable_prefix_caching=False)
        engine = self.llm.engine
        import torch
        from tokenmill.layers import native
        self.info = {"version": tokenmill.__version__, "threads": engine.num_threads,
                     "weights": spec["model_path"].rsplit("/", 1)[-1],
                     "weight_bytes": engine.weight_bytes,
                     # what a decode step streams (tiles where a matmul reads tiles; no embedding
                     # or RoPE tables, of which it reads a row): the floor's weights
                     "decode_weight_bytes": engine.decode_read_bytes,
                     "kv_bytes_per_token": engine.kv_bytes_per_token,
                     "kv_layer_windows": list(engine.layer_windows),
                     "kv_cache_dtype": spec.get("kv_cache_dtype", "auto"),
                     "cpu_isa": spec.get("cpu_isa", "native"),
                     "kernel_flags": " ".join(native.build_flags()),
                     "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                     "dtype": str(engine.dtype).replace("torch.", "")}

    def _params(self, max_tokens: int):
        from tokenmill import SamplingParams
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def single(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        engine = self.llm.engine
        request_id = engine.add_request(None, {"prompt_token_ids": prompt}, self._params(max_tokens))
        tokens: list[int] = []
        first = None
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter() - t0
        return tokens, first, time.perf_counter() - t0

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 self._params(max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
