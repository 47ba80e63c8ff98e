"""At temperature 1 speculative sampling reproduces the target distribution, for every method,
on a tiny model: chi-square goodness of fit at significance 1e-3 (fixed seeds) of the second
output token against its exact marginal from HF transformers, sum_t1 p(t1) p(t2 | t1), and of
the third token given the most frequent first two. The first token never involves drafts; the
second and third are accepted drafts or recovered / bonus tokens."""
from collections import Counter

import pytest
import torch

from tests.spec.test_spec_engine import METHODS, PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.spec.exactness import chi_square_gof

ALPHA = 1e-3
NUM_SAMPLES = 1200
# n-gram lookup needs the sampled token to occur in the prompt: give it every token.
PROMPT_FOR = {"ngram": list(range(3, 384))}


def exact(hf, prompt):
    """p(t1), p(t2) marginal, and a function giving p(t3 | t1, t2), all float64."""
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        V = p1.numel()
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2_given = torch.softmax(hf(seqs).logits[:, -1].double(), -1)   # [V, V]

        @torch.no_grad()
        def p3(t1, t2):
            logits = hf(torch.tensor([prompt + [t1, t2]])).logits[0, -1]
            return torch.softmax(logits.double(), -1)
    return p1, p1 @ p2_given, p3


# Two methods in the default run (layer_skip, and draft trees: the newest verification path);
# all of them under -m slow (each takes ~20 s on 2 quiet cores).
DEFAULT_RUN = ("layer_skip", "eagle3_tree")


@pytest.mark.parametrize("method", [m if m in DEFAULT_RUN else pytest.param(m, marks=pytest.mark.slow)
                                    for m in METHODS])
def test_spec_sampling_matches_target_distribution(tiny_llama_dir, tiny_llama_hf, method, tmp_path):
    from tests.conftest import save_tiny_llama
    prompt = PROMPT_FOR.get(method, PROMPTS[1])
    cfg = dict(METHODS[method], num_speculative_tokens=3, adaptive=False)
    if method == "draft_model":
        save_tiny_llama(tmp_path, seed=0, num_hidden_layers=1)
        cfg["model"] = str(tmp_path)
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=1024,
              max_num_seqs=256, seed=3, speculative_config=cfg)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)   # warm the prefix cache
    outs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    seqs = [o.outputs[0].token_ids for o in outs]
    stats = llm.get_stats()
    assert stats["spec_num_draft_tokens"] > NUM_SAMPLES // 2      # drafts really were verified
    p1, p2, p3 = exact(tiny_llama_hf, prompt)
    V = p1.numel()
    r1 = chi_square_gof(torch.bincount(torch.tensor([s[0] for s in seqs]), minlength=V), p1)
    r2 = chi_square_gof(torch.bincount(torch.tensor([s[1] for s in seqs]), minlength=V), p2)
    (t1, t2), _ = Counter((s[0], s[1]) for s in seqs).most_common(1)[0]
    third = [s[2] for s in seqs if (s[0], s[1]) == (t1, t2)]
    r3 = chi_square_gof(torch.bincount(torch.tensor(third), minlength=V), p3(t1, t2))
    assert r1.passed(ALPHA) and r2.passed(ALPHA) and r3.passed(ALPHA), (r1, r2, r3, len(third))
