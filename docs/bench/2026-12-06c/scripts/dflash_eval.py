"""Greedy block acceptance of DFlash drafters on three sets of sequences, with the training
recipe's measure (DFlashRecipe.acceptance: up to 16 anchors a sequence, drafts over the draft
vocabulary): 48 training sequences, 48 held-out ones (the trainer's split), and the target's
greedy continuations of `bench spec`'s 64 chat prompts (ShareGPT's benchmark split, never
trained on; cached in /tmp/dflash-eval-bench).
usage: python dflash_eval.py DRAFTER_DIR [DRAFTER_DIR ...]"""
import sys
import torch
from tokenmill import LLM
from tokenmill.spec.bench import _prompts
from tokenmill.spec.dflash import load_dflash
from tokenmill.spec.train.data import prepare, split_heldout
from tokenmill.spec.train.dflash_recipe import DFlashRecipe
from tokenmill.spec.train.trainer import tau_of

torch.set_num_threads(2)
llm = LLM(model="smollm2-135m", num_threads=2, max_num_seqs=64)
target, recipe = llm.engine.model, DFlashRecipe()
layers = (1, 8, 14, 20, 27)
seqs = prepare(llm, "/root/.cache/tokenmill/drafter-data/smollm2-135m", layers, 1600, 160, 256, 0,
               "smollm2-135m", turns="all")
train, heldout = split_heldout(seqs, 0.05, 0)
chat, _ = _prompts(llm.engine.tokenizer, "chat", 64, "sharegpt")
bench = prepare(llm, "/tmp/dflash-eval-bench", layers, len(chat), 160, 256, 0, "smollm2-135m",
                prompts=[p["prompt_token_ids"] for p in chat])
for d in sys.argv[1:]:
    drafter = load_dflash(d, target, torch.device("cpu")).float().eval()
    for name, group in (("train", train[:48]), ("held-out", heldout[:48]), ("bench chat", bench)):
        acc = recipe.acceptance(drafter, target, group, k=6)
        print(f"{d}  {name:10s} tau {tau_of(acc):.3f}  {[round(a, 3) for a in acc]}", flush=True)
