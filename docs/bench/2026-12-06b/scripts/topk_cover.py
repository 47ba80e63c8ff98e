"""2026-12-05f's t1_coupling.py turned to draft trees: at the first draft position of held-out
contexts (the drafter's own greedy continuations, or ``sampled`` ones drawn at T), how often
the target's token is among the drafter's first k choices: its greedy token among q's top k,
and its race winner (argmax p / E) among the top k of q / E for the same Exp(1) noise E
(Monte Carlo over noise rows).
Usage: topk_cover.py DRAFTER_DIR [T] [NOISE_DRAWS] [greedy|sampled]"""
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
    V = p.shape[1]
    q = torch.zeros_like(p)
    q[:, ids] = (draft_logits / temp).softmax(-1)
    tgt_greedy = p.argmax(-1)
    for kk in (1, 2, 3, 4, 6, 8):
        cov_g = (q.topk(kk, -1).indices == tgt_greedy[:, None]).any(-1).float().mean().item()
        cov_r = 0.0
        for _ in range(draws):
            e = torch.empty(p.shape).exponential_(generator=g)
            tr = (p / e).argmax(-1)
            cov_r += ((q / e).topk(kk, -1).indices == tr[:, None]).any(-1).float().mean().item() / draws
        row = {"k": kk, "greedy_cover": round(cov_g, 4), "race_cover": round(cov_r, 4)}
        out["rows"].append(row)
        print(row, flush=True)
    out["positions"] = int(p.shape[0])
    out["target_top1_mass"] = round(p.max(-1).values.mean().item(), 4)
    out["draft_vocab_mass"] = round(p[:, ids].sum(-1).mean().item(), 4)
print(json.dumps(out))
