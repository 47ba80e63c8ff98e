"""`tokenmill bench moe`: what a Mixture-of-Experts model costs and gains here, in one run.

- fused experts vs the per-token loop (``layers.moe.fused_experts`` / ``experts_reference``)
  on one layer of the model's shape, at ``--loop-tokens`` tokens;
- the MoE model vs a dense twin with the same active parameters per token (the same
  attention, embedding and head; one FFN ``top_k x`` an expert's width): batch-1 prefill
  and decode tok/s, and output tok/s of ``--batch`` sequences decoding together;
- a layer x expert heat map of the tokens routed during the batched run (PNG next to the
  report; imbalance per layer in the JSON).

Without ``--model`` a Mixtral-shaped random model sized for this machine is written once
(seeded, HF safetensors layout) under the cache directory, with its dense twin beside it.
Peers (HF transformers, llama.cpp on a GGUF of the same weights) run through
``tokenmill bench compare --model DIR``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from tokenmill.bench.common import emit, machine_info, median_of, random_prompts
from tokenmill.bench.report import Chart, add_output_args


@dataclass(frozen=True)
class RandomMoEShape:
    hidden: int = 576
    layers: int = 16
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    vocab: int = 49152
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"mixtral-h{self.hidden}-l{self.layers}-e{self.experts}-k{self.top_k}"
                f"-i{self.expert_intermediate}-s{self.seed}")


def add_parser(sub) -> None:
    p = sub.add_parser("moe", help="MoE vs dense (equal active params), fused experts vs the "
                                   "per-token loop, expert load heat map")
    p.add_argument("--model", default=None,
                   help="an MoE checkpoint (default: a random Mixtral-shaped one, see --hidden ...)")
    p.add_argument("--dense-model", default=None,
                   help="the dense model to compare with (default: the random model's twin; "
                        "none for --model)")
    shape = RandomMoEShape()
    for field, value in asdict(shape).items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=value,
                       help="random model: " + field.replace("_", " "))
    p.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--loop-tokens", type=int, default=64, help="tokens for fused vs loop")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--json", default=None)
    add_output_args(p)
    p.set_defaults(func=run)


# -- the random model and its dense twin ---------------------------------------------------------
def write_random_pair(shape: RandomMoEShape, root: str) -> tuple[str, str]:
    """(MoE dir, dense dir), written once: Mixtral tensors drawn N(0, 0.02^2) (norms 1) and a
    Llama twin sharing every non-FFN tensor, its FFN ``top_k x`` one expert wide."""
    moe_dir, dense_dir = os.path.join(root, shape.name), os.path.join(root, shape.name + "-dense")
    if os.path.isfile(os.path.join(moe_dir, "model.safetensors")) and \
            os.path.isfile(os.path.join(dense_dir, "model.safetensors")):
        return moe_dir, dense_dir
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(shape.seed)
    head_dim = shape.hidden // shape.heads

    def rand(*dims):
        return (torch.randn(*dims, generator=g) * 0.02).contiguous()

    common = {"model.embed_tokens.weight": rand(shape.vocab, shape.hidden),
              "model.norm.weight": torch.ones(shape.hidden)}
    moe, dense = dict(common), dict(common)
    dense_inter = shape.top_k * shape.expert_intermediate
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shared = {p + "self_attn.q_proj.weight": rand(shape.heads * head_dim, shape.hidden),
                  p + "self_attn.k_proj.weight": rand(shape.kv_heads * head_dim, shape.hidden),
                  p + "self_attn.v_proj.weight": rand(shape.kv_heads * head_dim, shape.hidden),
                  p + "self_attn.o_proj.weight": rand(shape.hidden, shape.heads * head_dim),
                  p + "input_layernorm.weight": torch.ones(shape.hidden),
                  p + "post_attention_layernorm.weight": torch.ones(shape.hidden)}
        moe.update(shared)
        dense.update(shared)
        moe[p + "block_sparse_moe.gate.weight"] = rand(shape.experts, shape.hidden)
        for e in range(shape.experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            moe[q + "w1.weight"] = rand(shape.expert_intermediate, shape.hidden)
            moe[q + "w3.weight"] = rand(shape.expert_intermediate, shape.hidden)
            moe[q + "w2.weight"] = rand(shape.hidden, shape.expert_intermediate)
        dense[p + "mlp.gate_proj.weight"] = rand(dense_inter, shape.hidden)
        dense[p + "mlp.up_proj.weight"] = rand(dense_inter, shape.hidden)
        dense[p + "mlp.down_proj.weight"] = rand(shape.hidden, dense_inter)
    base = {"hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
            "head_dim": head_dim, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    configs = {moe_dir: {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                         "intermediate_size": shape.expert_intermediate, "num_local_experts": shape.experts,
                         "num_experts_per_tok": shape.top_k, "sliding_window": None},
               dense_dir: {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                           "intermediate_size": dense_inter}}
    for path, tensors in ((moe_dir, moe), (dense_dir, dense)):
        tmp = path + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(configs[path], f, indent=2)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(path):   # a half-written earlier attempt
            import shutil
            shutil.rmtree(path)
        os.replace(tmp, path)
    return moe_dir, dense_dir


# -- measurements ------------------------------------------------------------------------------------
def fused_vs_loop(hidden: int, inter: int, experts: int, top_k: int, tokens: int, repeats: int) -> dict:
    from tokenmill.layers.moe import experts_reference, fused_experts, route
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.02
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)

    def timed(fn):
        def once():
            t = time.perf_counter()
            fn(x, w13, w2, weights, ids)
            return time.perf_counter() - t
        return median_of(once, repeats)[0]
    fused, loop = timed(fused_experts), timed(experts_reference)
    return {"tokens": tokens, "fused_ms": round(fused * 1e3, 3), "loop_ms": round(loop * 1e3, 3),
            "speedup": round(loop / fused, 2)}


def engine_speeds(model: str, args) -> tuple[dict, Optional[dict]]:
    """Batch-1 prefill / decode tok/s and batched output tok/s of one model, and the expert
    load of the batched run (None for a dense model)."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(model=model, skip_tokenizer_init=True, num_threads=args.num_threads,
              max_model_len=max(args.prefill_len, args.prompt_len + args.output_len) + 8,
              max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    engine = llm.llm_engine
    vocab = engine.vocab_size

    def timed_generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    prefill_prompt = random_prompts(1, args.prefill_len, vocab, seed=1)
    prefill_s = median_of(lambda: timed_generate(prefill_prompt, 1), args.repeats)[0]
    short = random_prompts(1, args.prompt_len, vocab, seed=2)
    first_s = median_of(lambda: timed_generate(short, 1), args.repeats)[0]
    full_s = median_of(lambda: timed_generate(short, args.output_len), args.repeats)[0]
    batch = random_prompts(args.batch, args.prompt_len, vocab, seed=3)
    timed_generate(batch, 2)   # warm the batched shapes
    engine.reset_expert_load()
    batch_s = timed_generate(batch, args.output_len)
    load = engine.expert_load()
    row = {"prefill_tok_s": round(args.prefill_len / prefill_s, 1),
           "decode_tok_s": round((args.output_len - 1) / max(full_s - first_s, 1e-9), 1),
           "batch_tok_s": round(args.batch * args.output_len / batch_s, 1),
           "weight_bytes": engine.get_memory_stats()["model_weights"]}
    engine.shutdown()
    return row, load


def draw_heatmap(load: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    counts = torch.tensor(load["counts"], dtype=torch.float64)
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1) * load["num_experts"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * load["num_experts"], 1.2 + 0.3 * load["num_layers"]))
    image = ax.imshow(share.numpy(), aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("tokens routed / even share")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args) -> int:
    from tokenmill.models.loader import open_checkpoint
    shape = RandomMoEShape(**{f: getattr(args, f) for f in asdict(RandomMoEShape())})
    if args.model is None:
        root = os.path.join(args.cache_dir or os.path.expanduser("~/.cache/tokenmill"), "bench")
        moe_model, dense_model = write_random_pair(shape, root)
        dense_model = args.dense_model or dense_model
    else:
        moe_model, dense_model = args.model, args.dense_model
    cfg = open_checkpoint(moe_model).hf_config
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        raise SystemExit(f"{moe_model} is not a Mixture-of-Experts model")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    loop = fused_vs_loop(cfg["hidden_size"], inter, experts, cfg["num_experts_per_tok"],
                         args.loop_tokens, args.repeats)
    moe_row, load = engine_speeds(moe_model, args)
    rows = [{"name": "tokenmill-moe", **moe_row}]
    if dense_model:
        dense_row, _ = engine_speeds(dense_model, args)
        rows.append({"name": "tokenmill-dense-equal-active", **dense_row})
        for key in ("prefill_tok_s", "decode_tok_s", "batch_tok_s"):
            rows[0][f"vs_dense.{key}"] = round(moe_row[key] / dense_row[key], 3)
    result = {"bench": "moe", "model": moe_model, "dense_model": dense_model,
              "shape": asdict(shape) if args.model is None else None,
              "settings": {k: getattr(args, k) for k in ("batch", "prompt_len", "output_len",
                                                         "prefill_len", "repeats")},
              "fused_vs_loop": loop, "expert_load": load, "machine": machine_info(), "rows": rows}
    emit(result, args.json, args.output_dir, rows=rows,
         chart=Chart("name", ("prefill_tok_s", "decode_tok_s", "batch_tok_s"), highlight="tokenmill-moe",
                     title="MoE vs dense with equal active parameters"))
    if args.output_dir and load is not None:
        os.makedirs(args.output_dir, exist_ok=True)
        heatmap = os.path.join(args.output_dir, "moe_heatmap.png")
        if draw_heatmap(load, heatmap):
            print(f"wrote {heatmap}", file=sys.stderr)
    return 0
