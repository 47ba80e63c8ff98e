"""`tokenmill train-drafter`: train a drafter for a target on the target's own continuations.

    tokenmill train-drafter --method eagle3 --model smollm2-135m --output drafters/eagle3

Steps: (1) the target continues ShareGPT calibration prompts (greedy, plus --sampled-passes
sampled ones; in batch, cached in --data-dir, shared by every method), (2) the target's hidden states at the layers the method
reads are computed and cached beside them, (3) the recipe trains (resumable from
OUTPUT/checkpoint), (4) OUTPUT gets the drafter in the layout its loader reads, plus
training_log.json, training_curves.png and train_summary.json. Use it with
``--speculative-config '{"method": "<method>", "model": "OUTPUT"}'`` (draft-model: method
"draft_model").
"""
from __future__ import annotations

import json
import os
import time

# Defaults sized for SmolLM2-135M on 2 CPU cores (docs/spec_training.md has the timings).
DEFAULT_STEPS = {"eagle3": 1200, "dflash": 1200, "medusa": 600, "draft-model": 800}


def add_train_drafter_parser(sub) -> None:
    from tokenmill.spec.train.recipes import METHODS
    p = sub.add_parser("train-drafter", help="train a speculative drafter (EAGLE-3, DFlash, Medusa, "
                                             "a distilled draft model) on the target's own outputs")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model", default="smollm2-135m", help="the target")
    p.add_argument("--output", required=True, help="directory for the drafter (resumes if it holds a checkpoint)")
    p.add_argument("--data-dir", default=None,
                   help="where continuations and hidden states are cached (default: "
                        "~/.cache/tokenmill/drafter-data/<model>)")
    p.add_argument("--num-prompts", type=int, default=640, help="calibration prompts the target continues")
    p.add_argument("--turns", choices=["first", "all"], default="first",
                   help="ShareGPT user turns used as prompts: opening turns only (~1100 in the "
                        "calibration split) or every user turn, each standing alone (~3500)")
    p.add_argument("--sampled-passes", type=int, default=0,
                   help="continuations sampled per prompt besides the greedy one (more contexts "
                        "from the same prompts; cached like the greedy pass)")
    p.add_argument("--sample-temperature", type=float, default=0.8,
                   help="temperature of the sampled passes")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens per continuation")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--heldout-fraction", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default per method)")
    p.add_argument("--batch-sequences", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default per method)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--k", type=int, default=6, help="draft positions the held-out acceptance covers")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe option, e.g. num_layers=2, block_size=8, draft_vocab=8192 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_drafter)


DEFAULT_LR = {"eagle3": 1e-3, "dflash": 6e-4, "medusa": 1e-3, "draft-model": 2e-4}


def parse_options(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_train_drafter(args) -> int:
    import torch
    from tokenmill import LLM
    from tokenmill.models.hub import DEFAULT_CACHE_DIR
    from tokenmill.spec.draft_input import validate_aux_layers
    from tokenmill.spec.train.data import build_seconds, prepare, split_heldout
    from tokenmill.spec.train.recipes import get_recipe
    from tokenmill.spec.train.trainer import TrainConfig, Trainer
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = TrainConfig(steps=args.steps or DEFAULT_STEPS[args.method],
                      batch_sequences=args.batch_sequences,
                      lr=args.lr or DEFAULT_LR[args.method], seed=args.seed,
                      eval_every=args.eval_every, k=args.k, options=parse_options(args.option))
    recipe = get_recipe(args.method)
    t0 = time.perf_counter()
    # 64 sequences at a time: generation is the data step's long part (batched GEMMs)
    llm = LLM(model=args.model, seed=args.seed, num_threads=args.num_threads, max_num_seqs=64)
    target = llm.engine.model
    layers = validate_aux_layers(recipe.aux_layers(target), target.args.num_hidden_layers, args.method)
    data_dir = args.data_dir or os.path.join(DEFAULT_CACHE_DIR, "drafter-data",
                                             os.path.basename(os.path.normpath(args.model)))
    seqs = prepare(llm, data_dir, layers, args.num_prompts, args.max_tokens,
                   args.max_prompt_tokens, args.seed, args.model, turns=args.turns,
                   sampled_passes=args.sampled_passes, temperature=args.sample_temperature)
    # what the cached data took to build (by whichever run built it), and this run's share
    data_seconds = time.perf_counter() - t0
    built_seconds = build_seconds(data_dir, layers, 1 + args.sampled_passes)
    train, heldout = split_heldout(seqs, args.heldout_fraction, args.seed)
    os.makedirs(args.output, exist_ok=True)
    summary = Trainer(recipe, target, train, heldout, cfg, args.output,
                      progress=not args.no_progress).run()
    summary.update(model=args.model, data_dir=data_dir, data_seconds=round(data_seconds, 1),
                   data_build_seconds=built_seconds,
                   num_sequences=len(seqs), num_train_tokens=sum(s.num_tokens for s in train))
    with open(os.path.join(args.output, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{args.method}: {summary['steps']} steps in {summary['train_seconds']:.0f} s "
          f"(+ {data_seconds:.0f} s data), held-out tau {summary['heldout_tau']}, "
          f"acceptance {summary['heldout_acceptance']} -> {args.output}")
    return 0
