"""`tokenmill verify-spec`: a user-facing exactness check of a speculative configuration.

1. Greedy: the same prompts with and without speculation must give identical tokens.
2. Sampling (temperature > 0): many samples of the first few tokens of one prompt with and
   without speculation; a chi-square homogeneity test per output position (pooling rare
   tokens) at significance --alpha. PASS when no position rejects (Bonferroni over positions).
"""
from __future__ import annotations

import json
from typing import Optional

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "def fibonacci(n):",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning, my friend.",
]


def add_verify_spec_parser(sub) -> None:
    p = sub.add_parser("verify-spec", help="check that speculative decoding is exact "
                                           "(greedy equality + a sampling distribution test)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculative-config", required=True,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=None,
                   help="prompt as comma-separated token ids (repeatable; no tokenizer needed)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--num-samples", type=int, default=400, help="samples per side at temperature")
    p.add_argument("--sample-tokens", type=int, default=3, help="output positions tested")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--alpha", type=float, default=1e-3, help="significance level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=cmd_verify_spec)


def _llm(args, spec: Optional[dict]):
    from tokenmill import LLM
    return LLM(model=args.model, seed=args.seed, num_threads=args.num_threads,
               kv_cache_memory=512 * 1024**2, speculative_config=spec,
               skip_tokenizer_init=bool(args.prompt_ids and not args.prompt))


def check_greedy(plain, spec, prompts: list, max_tokens: int) -> tuple[bool, str]:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    same = sum(x == y for x, y in zip(a, b))
    return same == len(a), f"{same}/{len(a)} prompts identical ({max_tokens} tokens each)"


def check_sampling(plain, spec, prompt, args) -> tuple[bool, list]:
    import torch
    from tokenmill import SamplingParams
    from tokenmill.spec.exactness import two_sample_chi_square
    params = SamplingParams(temperature=args.temperature, max_tokens=args.sample_tokens,
                            ignore_eos=True)
    sides = []
    for llm in (plain, spec):
        outs = llm.generate([prompt] * args.num_samples, params, use_tqdm=False)
        sides.append([o.outputs[0].token_ids for o in outs])
    vocab = plain.engine.model.args.vocab_size
    alpha = args.alpha / args.sample_tokens      # Bonferroni: one test per position
    results = []
    for pos in range(args.sample_tokens):
        counts = [torch.bincount(torch.tensor([s[pos] for s in side if len(s) > pos]),
                                 minlength=vocab) for side in sides]
        results.append((pos, two_sample_chi_square(*counts)))
    return all(r.passed(alpha) for _, r in results), results


def cmd_verify_spec(args) -> int:
    spec_cfg = json.loads(args.speculative_config)
    spec_cfg.setdefault("adaptive", False)       # verify speculation itself, every step
    prompts = [{"prompt_token_ids": [int(t) for t in ids.split(",")]} for ids in args.prompt_ids or []]
    prompts += args.prompt or ([] if prompts else DEFAULT_PROMPTS)
    plain, spec = _llm(args, None), _llm(args, spec_cfg)
    ok_greedy, msg = check_greedy(plain, spec, prompts, args.max_tokens)
    print(f"greedy: {'PASS' if ok_greedy else 'FAIL'}  {msg}")
    ok_sample, results = check_sampling(plain, spec, prompts[0], args)
    for pos, r in results:
        print(f"  position {pos}: chi2={r.statistic:.2f} dof={r.dof} p={r.p_value:.4f} "
              f"TV={r.total_variation:.3f}")
    print(f"sampling (T={args.temperature}, {args.num_samples} samples per side, "
          f"alpha={args.alpha} over {args.sample_tokens} positions): "
          f"{'PASS' if ok_sample else 'FAIL'}")
    stats = spec.get_stats()
    print(f"acceptance: mean length {stats['spec_mean_acceptance_length']:.2f}, "
          f"rate {stats['spec_acceptance_rate']:.2f}")
    return 0 if ok_greedy and ok_sample else 1
