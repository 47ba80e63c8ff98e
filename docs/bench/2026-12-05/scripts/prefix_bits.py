# usage: python prefix_bits.py [chat|grounded]: SmolLM2-135M gguf-q8, bench spec's 8 ShareGPT prompts, 96 greedy tokens: plain cold vs plain after a prefix hit, vs n-gram speculation (k=3) cold and after a hit; prints which prompts give identical tokens
import sys, torch
torch.set_num_threads(2)
from tokenmill import LLM, SamplingParams
from tokenmill.spec.bench import _prompts, _use
from tokenmill.spec.decoder import build_spec_decoder
from tokenmill.config import SpeculativeConfig
wl = sys.argv[1] if len(sys.argv) > 1 else "chat"
llm = LLM(model="smollm2-135m", quantization="gguf", quant_activations="q8", num_threads=2, max_num_seqs=8,
          kv_cache_memory=512 * 1024**2, sliding_window_pools=False)
e = llm.engine
prompts, _ = _prompts(e.tokenizer, wl, 8, "sharegpt")
params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
def gen(ps): return [tuple(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]
salt = lambda s: [dict(p, cache_salt=s) for p in prompts]
A = gen(prompts)                 # cold
B = gen(prompts)                 # prefix hits
dec = build_spec_decoder(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False), e.runner, e.max_model_len, e.scheduler.kv.num_total_blocks)
_use(e, dec)
C = gen(salt("cold-ngram"))      # speculation, cold
D = gen(prompts)                 # speculation, prefix hits
_use(e, None)
E1 = gen(salt("x1"))             # plain cold again (salted)
print("plain cold vs plain hit", [a == b for a, b in zip(A, B)])
print("plain cold vs spec cold", [a == c for a, c in zip(A, C)])
print("plain cold vs spec hit ", [a == d for a, d in zip(A, D)])
print("plain cold vs plain cold salted", [a == x for a, x in zip(A, E1)])
for i, (a, c) in enumerate(zip(A, C)):
    if a != c:
        j = next(k for k in range(len(a)) if a[k] != c[k])
        print("prompt", i, "len", len(prompts[i]["prompt_token_ids"]), "first diff at output", j)
print([len(p["prompt_token_ids"]) for p in prompts])
o = llm.generate([prompts[5]], params, use_tqdm=False)[0]
print("cached", o.num_cached_tokens)
