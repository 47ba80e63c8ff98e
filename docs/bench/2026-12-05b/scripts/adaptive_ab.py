# usage: adaptive_ab.py [--quantization gguf --quant-activations q8] [--batch 8] [--workload chat] [--rounds 6]
# plain decoding vs one speculative method, alternating in one process (bench spec's prompts and
# engine); prints each round's tok/s, the medians and best-of ratio, and the k histogram.
import argparse, statistics
from argparse import Namespace
from tokenmill import LLM, SamplingParams
from tokenmill.spec import bench as sb
from tokenmill.spec.decoder import build_spec_decoder

ap = argparse.ArgumentParser()
ap.add_argument("--drafter", default="/work/drafters/eagle3-more")
ap.add_argument("--method", default="adaptive_ngram_eagle3_int8")
ap.add_argument("--quantization", default=None)
ap.add_argument("--quant-activations", default="fp32")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--workload", default="chat")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--k", type=int, default=3)
a = ap.parse_args()
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=a.batch, sliding_window_pools=False,
          quantization=a.quantization, quant_activations=a.quant_activations)
engine = llm.engine
cfg = sb._configs([a.method], Namespace(drafter=[f"eagle3={a.drafter}"], k=a.k, layer_skip_layers=4,
                                       draft_model=None))[a.method]
dec = build_spec_decoder(cfg, engine.runner, engine.max_model_len, engine.scheduler.kv.num_total_blocks)
prompts, _ = sb._prompts(engine.tokenizer, a.workload, max(a.batch, 8), "sharegpt")
params = [SamplingParams(temperature=a.temperature, max_tokens=96, ignore_eos=True,
                         seed=None if a.temperature == 0 else 1000 + i) for i in range(len(prompts))]
rates = {"none": [], a.method: []}
for r in range(a.rounds + 1):
    for name, d in (("none", None), (a.method, dec)):
        sb._use(engine, d)
        rate, _ = sb._generate(llm, sb._salted(prompts, d, name), params)
        if r == 0 and d is not None:
            d.reset_stats()
        elif r > 0:
            rates[name].append(rate)
sb._use(engine, None)
ratios = [s / n for s, n in zip(rates[a.method], rates["none"])]
print("none   ", " ".join(f"{x:.0f}" for x in rates["none"]))
print(a.method, " ".join(f"{x:.0f}" for x in rates[a.method]))
print(f"median ratio {statistics.median(ratios):.3f}, ratio of bests {max(rates[a.method]) / max(rates['none']):.3f}, "
      f"k chosen {dict(sorted(dec.stats.k_chosen.items()))}")
ctl = dec.controller
if hasattr(ctl, "arms"):
    print("arms (bucket, mode, k): predicted tok/s, steps")
    for key, arm in sorted(ctl.arms.items()):
        print(f"  {key}: {arm.rate:.1f} ({arm.count} steps, {1000 * arm.seconds / max(arm.rows, 1e-9):.2f} ms/request)")
    for key, acc in sorted(ctl.acceptance.items()):
        print(f"  acceptance {key}: d {[round(x / max(s, 1e-9), 2) for x, s in zip(acc.drafted, acc.seen)]} "
              f"a {[round(x / max(o, 1e-9), 2) for x, o in zip(acc.accepted, acc.offered)]}")
