"""`tokenmill bench gpu`: the CUDA backend measured on one GPU, each number beside its
baseline from the same run:

- fidelity: greedy tokens vs HF transformers on the same device and weights (SmolLM2 shapes,
  random weights: no hub here), float32 and bfloat16;
- latency: batch-1 decode ms/token at a fixed context, with CUDA graphs and eager, as a
  multiple of the HBM floor (weights + KV bytes read once / measured copy bandwidth);
- throughput: output tok/s at 64-256 sequences, and HF transformers' generate() on the same
  shapes at the first batch size.

Shapes: "smollm2" (135M) and "llama3-8b" (Llama-3-8B's config, random weights through
load_format="dummy"). Runs on a CPU too (for its own test), where every number is slow.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time

import torch

from tokenmill.bench.common import emit, machine_info, measure_bandwidth_gbps, random_prompts

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384, rope_theta=10000.0,
                 max_position_embeddings=1024, tie_word_embeddings=False),
}


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="CUDA backend: fidelity vs HF, decode vs the HBM floor, throughput")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--fidelity-shape", default="smollm2", choices=sorted(SHAPES))
    p.add_argument("--shapes", default="smollm2,llama3-8b", help="latency / throughput shapes")
    p.add_argument("--precisions", default="bfloat16,fp8", help="bfloat16, float16, float32, fp8")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers baselines")
    p.add_argument("--json", default=None)
    p.add_argument("--output-dir", default=None)
    p.set_defaults(func=run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_config_dir(path: str, shape: str) -> str:
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama",
               rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2,
               torch_dtype="bfloat16")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _release(llm) -> None:
    llm.engine.shutdown()
    del llm
    _free_device_memory()


def _llm(path: str, precision: str, device: str, **kw):
    from tokenmill import LLM
    dtype, quant = ("bfloat16", "fp8") if precision == "fp8" else (precision, None)
    return LLM(model=path, dtype=dtype, quantization=quant, device=device,
               skip_tokenizer_init=True, enable_prefix_caching=False, **kw)


def fidelity(args, workdir: str, dev: torch.device) -> list[dict]:
    """Greedy tokens of tokenmill vs HF generate() on the same random weights and device."""
    import transformers
    path = os.path.join(workdir, "fidelity")
    write_config_dir(path, args.fidelity_shape)
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.initializer_range = 0.1   # peaked logits: greedy ties would measure noise, not fidelity
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    prompts = random_prompts(8, 64, cfg.vocab_size, seed=5)
    rows = []
    for dtype in ("float32", "bfloat16"):
        from tokenmill import SamplingParams
        llm = _llm(path, dtype, args.device, max_num_seqs=8)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        backend = llm.engine.runner.backend.name
        _release(llm)
        hf = transformers.LlamaForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype)).to(dev).eval()
        theirs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p["prompt_token_ids"]], device=dev)
                out = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, attention_mask=torch.ones_like(ids))
                theirs.append(out[0, ids.shape[1]:].tolist())
        del hf
        same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                       for x, y in zip(ours, theirs)]
        rows.append({"section": "fidelity", "dtype": dtype, "backend": backend,
                     "identical_sequences": f"{sum(x == y for x, y in zip(ours, theirs))}/{len(ours)}",
                     "mean_matching_prefix": round(statistics.mean(same_prefix), 1), "of_tokens": 32})
    return rows


def _decode_ms(llm, context_len: int, decode_tokens: int, vocab: int) -> float:
    from tokenmill import SamplingParams
    engine = llm.engine
    prompt = random_prompts(1, context_len, vocab, seed=1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    samples = []
    for _ in range(3):
        engine.add_request(None, prompt, params)
        engine.step()   # prefill + first token
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        samples.append((time.perf_counter() - t) / decode_tokens * 1e3)
    return statistics.median(samples)


def latency(args, path: str, shape: str, precision: str, bandwidth: float) -> list[dict]:
    """Batch-1 decode at ``context_len``: CUDA graphs, then eager, vs the HBM floor."""
    rows = []
    for eager in (False, True):
        llm = _llm(path, precision, args.device, load_format="dummy", enforce_eager=eager,
                   max_num_seqs=8, max_model_len=args.context_len + args.decode_tokens + 16,
                   max_num_batched_tokens=args.context_len + 1)
        engine = llm.engine
        a = engine.model.args
        ms = _decode_ms(llm, args.context_len, args.decode_tokens, engine.vocab_size)
        kv_bytes = engine.kv_bytes_read(args.context_len + args.decode_tokens // 2)
        floor_ms = (engine.decode_read_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
        rows.append({"section": "latency", "shape": shape, "precision": precision,
                     "cuda_graphs": not eager and engine.runner.graphs is not None,
                     "backend": engine.runner.backend.name, "context_len": args.context_len,
                     "decode_ms_per_token": round(ms, 3), "hbm_floor_ms": round(floor_ms, 3),
                     "x_floor": round(ms / floor_ms, 2), "weight_gb": round(engine.weight_bytes / 1e9, 2),
                     "layers": a.num_hidden_layers})
        _release(llm)
    return rows


def throughput(args, path: str, shape: str, precision: str) -> list[dict]:
    from tokenmill import SamplingParams
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        llm = _llm(path, precision, args.device, load_format="dummy", max_num_seqs=batch,
                   max_model_len=args.input_len + args.output_len + 16,
                   max_num_batched_tokens=max(2048, batch * 8))
        prompts = random_prompts(batch, args.input_len, llm.engine.vocab_size, seed=2)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)   # warm-up (graphs, autotuning)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"section": "throughput", "shape": shape, "precision": precision,
                     "engine": "tokenmill", "num_seqs": batch, "output_tok_s": round(tokens / elapsed, 1)})
        _release(llm)
    return rows


def hf_throughput(args, path: str, shape: str, dev: torch.device, batch: int) -> dict:
    """HF transformers generate() on one padded batch (same shapes, random bf16 weights)."""
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(path)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    prompts = random_prompts(batch, args.input_len, cfg.vocab_size, seed=2)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:2], max_new_tokens=4, attention_mask=torch.ones_like(ids[:2]), **kw)
        _sync(dev)
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                          attention_mask=torch.ones_like(ids), **kw)
        _sync(dev)
        elapsed = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * batch
    del hf
    _free_device_memory()
    return {"section": "throughput", "shape": shape, "precision": str(dtype).removeprefix("torch."),
            "engine": "hf-transformers", "num_seqs": batch, "output_tok_s": round(tokens / elapsed, 1)}


def run(args) -> int:
    from tokenmill.platform import pick_device
    dev = pick_device(args.device)
    # 1 GiB on a GPU: large enough that launch and sync costs vanish at HBM speed
    bandwidth = measure_bandwidth_gbps(1 << 30 if dev.type == "cuda" else 256 << 20, device=dev)
    result = {"bench": "gpu", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "copy_bandwidth_gb_s": round(bandwidth, 1), "machine": machine_info()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-gpu-") as workdir:
        rows += fidelity(args, workdir, dev)
        for shape in args.shapes.split(","):
            path = write_config_dir(os.path.join(workdir, shape), shape)
            for precision in args.precisions.split(","):
                rows += latency(args, path, shape, precision, bandwidth)
                rows += throughput(args, path, shape, precision)
            if not args.skip_hf:
                hf = hf_throughput(args, path, shape, dev, int(args.batch_sizes.split(",")[0]))
                ours = [r for r in rows if r["section"] == "throughput" and r["shape"] == shape
                        and r["num_seqs"] == hf["num_seqs"] and r["engine"] == "tokenmill"]
                for r in ours:
                    r["vs_hf"] = round(r["output_tok_s"] / hf["output_tok_s"], 2)
                rows.append(hf)
    result["rows"] = rows
    emit(result, args.json, args.output_dir)
    return 0
