"""Adaptive k next to a variant of itself and to no speculation, in bench spec's interleaved
rounds (batch B, 96 tokens, SmolLM2-135M), with a log of every step the controllers recorded.
  k0:      the variant's controller always answers k = 0 (drafter attached, features kept):
           what the spec path costs on steps that draft nothing
  nodrain: the variant has the draining-batch rule switched off (needs b932329's
           SpecDecoder._tokens_left; the rule was reverted after these runs)
usage: adaptive_ab.py k0|nodrain EAGLE3_DIR [quantization|none] [batch] [repeats] [workload] [temp]"""
import argparse
import collections
import sys

from tokenmill import LLM, SamplingParams
from tokenmill.spec import bench
from tokenmill.spec.adaptive import FixedK
from tokenmill.spec.decoder import build_spec_decoder

variant, eagle = sys.argv[1], sys.argv[2]
quant = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 8
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 4
workload = sys.argv[6] if len(sys.argv) > 6 else "chat"
temp = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
args = argparse.Namespace(drafter=[f"eagle3={eagle}"], k=3, layer_skip_layers=8, draft_model=None,
                          token_tree="[(0,), (1,), (2,)]", repeats=repeats)
configs = bench._configs(["adaptive_ngram", "adaptive_ngram_eagle3_int8"], args)
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=batch, kv_cache_memory=1024 * 1024**2,
          quantization=quant, quant_activations="q8" if quant else "fp32", sliding_window_pools=False)
engine = llm.engine
prompts, _ = bench._prompts(engine.tokenizer, workload, max(batch, 4), "sharegpt")
params = [SamplingParams(temperature=temp, max_tokens=96, ignore_eos=True, seed=None if temp == 0 else 1000 + i)
          for i in range(len(prompts))]


def build(cfg):
    return build_spec_decoder(cfg, engine.runner, engine.max_model_len, engine.scheduler.kv.num_total_blocks)


decoders = {"none": None}
for name, cfg in configs.items():
    decoders[name] = build(cfg)
    other = build(cfg)
    if variant == "k0":
        other.controller = FixedK(0)
    else:
        other._tokens_left = lambda runner, req_ids: None
    decoders[name.replace("adaptive_", variant + "_")] = other

logs = collections.defaultdict(list)   # name -> (batch, negative when draining; k; mode; s; tokens)


def logged(name, controller):
    record = controller.record

    def logging_record(batch, k, seconds, verdicts=(), mode=0, *flag):   # flag: b932329's draining
        draining = bool(flag and flag[0])
        tokens = sum(a + 1 for _, a in verdicts) if k else (1 if draining else batch)
        logs[name].append((-batch if draining else batch, k, mode, seconds, tokens))
        record(batch, k, seconds, verdicts, mode, *flag)
    controller.record = logging_record


for name, dec in decoders.items():
    if dec is not None:
        logged(name, dec.controller)


class NoBar:
    def update(self):
        pass


rows = bench._measure(llm, decoders, prompts, params, args, NoBar())
for name, r in rows.items():
    print(f"{name:32s} tok/s {r['tok_s']:8.2f} ratio {r['ratio']:.3f} k {r.get('k_chosen')}")
for name, log in logs.items():
    agg = collections.defaultdict(lambda: [0, 0.0, 0])
    for b, k, m, sec, tok in log:
        a = agg[(b, m, k)]
        a[0] += 1
        a[1] += sec
        a[2] += tok
    print(name)
    for key in sorted(agg):
        n, sec, tok = agg[key]
        print(f"  b={key[0]} mode={key[1]} k={key[2]}: steps {n:4d}  ms/step {1000*sec/n:7.2f}  "
              f"tok/step {tok/n:5.2f}  tok/s {tok/sec:7.1f}")
