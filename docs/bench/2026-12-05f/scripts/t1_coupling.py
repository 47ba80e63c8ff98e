"""How close a trained EAGLE-3 drafter's first-draft distribution q is to the target's p at
temperature T, on held-out positions of the drafter's own data (greedy continuations):
sum min(p, q) (the acceptance of standard rejection sampling), and the acceptance of the
race tokenmill uses so seeded outputs stay those of plain decoding (draft = argmax q / E,
target token = argmax p / E, one shared Exp(1) noise row E; Monte Carlo over noise rows),
for the drafter's logits divided by several temperatures t.
Usage: t1_coupling.py DRAFTER_DIR [T] [NOISE_DRAWS]"""
import json, os, sys
import torch
from tokenmill import LLM
from tokenmill.models.hub import DEFAULT_CACHE_DIR
from tokenmill.spec.eagle3 import load_eagle3
from tokenmill.spec.train.data import load_sequences, split_heldout
from tokenmill.spec.train.eagle3_recipe import Eagle3Recipe
from tokenmill.spec.train.target_ops import head_logits

drafter, temp = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
draws = int(sys.argv[3]) if len(sys.argv) > 3 else 16
contexts = sys.argv[4] if len(sys.argv) > 4 else "greedy"
llm = LLM(model="smollm2-135m", max_num_seqs=1)
target = llm.engine.model
head = load_eagle3(drafter, target, "cpu").float()
recipe = Eagle3Recipe()
layers = recipe.aux_layers(target)
seqs = load_sequences(os.path.join(DEFAULT_CACHE_DIR, "drafter-data", "smollm2-135m"), tuple(layers), 0)
_, heldout = split_heldout(seqs, 0.05, 0)
if contexts == "sampled":
    from tokenmill import SamplingParams
    from tokenmill.spec.train.data import TrainSequence, extract_features
    prompts = [s.token_ids[:s.prompt_len].tolist() for s in heldout]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=temp, max_tokens=160, seed=7 + i) for i in range(len(prompts))],
                        use_tqdm=False)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    heldout = [TrainSequence(torch.tensor(ids), len(p), aux, final)
               for ids, p, (aux, final) in zip(full, prompts, extract_features(llm.engine.runner, full, tuple(layers)))]
g = torch.Generator().manual_seed(0)
out = {"drafter": drafter, "T": temp, "contexts": contexts, "heldout_sequences": len(heldout), "noise_draws": draws, "rows": []}
with torch.no_grad():
    starts = [recipe._starts(s, 16, False, s.prompt_len) for s in heldout]
    keep = [(s, b) for s, b in zip(heldout, starts) if b]
    logits, at, ok, tokens, finals = recipe._unroll(head, target, [s for s, _ in keep], [b for _, b in keep], 1)
    draft_logits = logits[0][ok[0]]                                  # [S, draft_vocab]
    p = (head_logits(target, finals[at[0][ok[0]]]).float() / temp).softmax(-1)   # [S, V]
    ids = head.draft_ids()
    V = p.shape[1]
    for t in (0.6, 0.8, 1.0, 1.25, 1.5):
        q = torch.zeros_like(p)
        q[:, ids] = (draft_logits / (temp * t)).softmax(-1)
        overlap = torch.minimum(p, q).sum(-1).mean().item()
        agree = 0.0
        for _ in range(draws):
            e = torch.empty(p.shape).exponential_(generator=g)
            agree += ((p / e).argmax(-1) == (q / e).argmax(-1)).float().mean().item() / draws
        row = {"drafter_t": t, "sum_min_pq": round(overlap, 4), "race_agreement": round(agree, 4),
               "greedy_agreement": round((p.argmax(-1) == q.argmax(-1)).float().mean().item(), 4)}
        out["rows"].append(row)
        print(row, flush=True)
    out["positions"] = int(p.shape[0])
    out["target_top1_mass"] = round(p.max(-1).values.mean().item(), 4)
    out["draft_vocab_mass"] = round(p[:, ids].sum(-1).mean().item(), 4)
print(json.dumps(out))
