"""Draft trees (a chain plus leaf alternatives, spec/draft_tree.py): the shape and its vLLM
spelling, the verification walk, the scheduler's cuts, and end to end: greedy and seeded
output equal no speculation when alternatives are kept (their K/V moved to its position's
slot), and a trained-like drafter's runners-up join as alternatives."""
import random

import pytest
import torch

from tests.spec.drafter_reference import PROMPTS, run
from tests.spec.test_coupled import seeded_outputs
from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.runner import fused_stack, model_runner
from tokenmill.sample.metadata import RowSamplingState, build_sampling_metadata
from tokenmill.sample.rejection import RejectionSampler
from tokenmill.sampling_params import SamplingParams as Params
from tokenmill.spec import draft_tree
from tokenmill.spec.draft_tree import DraftTree
from tokenmill.spec.eagle3 import Eagle3Proposer


# -- the shape ----------------------------------------------------------------------------
def test_vllm_spelling_gives_candidates_per_depth():
    assert draft_tree.parse_token_tree("[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]") == (3, 2, 1)
    assert draft_tree.parse_token_tree([(0,)]) == (1,)
    cfg = SpeculativeConfig(method="eagle3", num_speculative_tokens=4,
                            speculative_token_tree="[(0,), (1,), (0, 0)]")
    assert cfg.tree_widths == (2, 1, 1, 1)


@pytest.mark.parametrize("tree, match", [
    ("[(1, 0)]", "continues an alternative"), ("[(0,), (0, 1, 0)]", "continues an alternative"),
    ("[(0,), (2,)]", "without gaps"), ("[(0, 0)]", "parent"), ("[]", "at least one"),
    ("[(0,), (-1,)]", "negative"), ("[('a',)]", "tuples of child ranks"),
    ("[(0,", "tuples of child ranks"), ("abc", "tuples of child ranks")])
def test_unsupported_trees_are_refused(tree, match):
    with pytest.raises(ValueError, match=match):
        draft_tree.parse_token_tree(tree)


def test_config_refuses_trees_it_cannot_run():
    with pytest.raises(ValueError, match="ranks its choices"):
        SpeculativeConfig(method="ngram", speculative_token_tree="[(0,), (1,)]")
    with pytest.raises(ValueError, match="past num_speculative_tokens"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=1,
                          speculative_token_tree="[(0,), (0, 0)]")


def test_build_orders_chain_first_and_drops_repeats():
    tokens, parents = draft_tree.build([5, 6, 7], [[8, 5, 9], [], [1]])
    assert tokens == [5, 6, 7, 8, 9, 1] and parents == [-1, 0, 1, -1, -1, 1]
    assert draft_tree.depths(parents) == [1, 2, 3, 1, 1, 3]
    assert draft_tree.chain_length(parents) == 3
    draft_tree.validate(parents)
    with pytest.raises(ValueError, match="leaf alternatives"):
        draft_tree.validate([-1, 0, 3, 1])
    # any prefix is a tree of the same shape (the scheduler cuts drafts to its budget)
    for n in range(len(parents) + 1):
        draft_tree.validate(parents[:n])


@pytest.mark.parametrize("draws, path", [
    # the target's draw at each row: row 0 the root, row i + 1 node i
    ({0: 5, 1: 6, 2: 7}, [0, 1, 2]),     # the chain all the way
    ({0: 8, 4: 6}, [3]),                 # the alternative at depth 1 (a leaf: its draw ends it)
    ({0: 5, 1: 6, 2: 1}, [0, 1, 5]),     # the chain to depth 2, the alternative at depth 3
    ({0: 9, 1: 6}, [4]),                 # the other alternative at depth 1
    ({0: 2}, []),                        # nothing kept
])
def test_walk_keeps_the_child_the_target_drew(draws, path):
    tokens, parents = [5, 6, 7, 8, 9, 1], [-1, 0, 1, -1, -1, 1]
    target = [draws.get(row, 0) for row in range(len(tokens) + 1)]
    assert draft_tree.accepted_path(parents, tokens, target) == path


def test_rejection_sampler_emits_the_kept_path_and_its_logprobs():
    V = 12
    tokens, parents = [5, 6, 3, 9], [-1, 0, -1, 0]    # chain 5, 6; 3 at depth 1; 9 at depth 2
    logits = torch.randn(5, V)
    for row, best in [(0, 5), (1, 9), (4, 2)]:        # root -> 5, node 0 -> 9 (alt), node 3 -> 2
        logits[row, best] = 10.0
    rows = [RowSamplingState(Params(temperature=0.0, logprobs=1), [1], [], None, None) for _ in range(5)]
    meta = build_sampling_metadata(rows, V, "cpu", torch.Generator())
    out = RejectionSampler()(logits, meta, [tokens], draft_parents=[parents])
    assert out.token_ids == [[5, 9, 2]] and out.num_accepted == [2]
    assert out.emitted_rows == [[0, 1, 4]]
    assert out.logprobs.token_ids[[0, 1, 4], 0].tolist() == [5, 9, 2]   # each emitted token's
    # a chain given as parents verifies as the chain does
    chain = RejectionSampler()(logits[:3], build_sampling_metadata(rows[:3], V, "cpu", torch.Generator()),
                               [[5, 6]])
    as_tree = RejectionSampler()(logits[:3], build_sampling_metadata(rows[:3], V, "cpu", torch.Generator()),
                                 [[5, 6]], draft_parents=[[-1, 0]])
    assert (chain.token_ids, chain.emitted_rows) == (as_tree.token_ids, as_tree.emitted_rows)


# -- the scheduler's cuts -----------------------------------------------------------------
def test_scheduler_cuts_trees_by_depth_and_slots_and_gives_grammars_the_chain():
    from tests.sched.test_scheduler import make_sched, req
    sched = make_sched()
    r = req("a-1", 4, max_tokens=3)     # 3 tokens to go: depth <= 2
    tokens, parents = [5, 6, 7, 8, 9, 1], [-1, 0, 1, -1, -1, 1]
    got = sched._usable_drafts(r, tokens, parents)
    assert got == ([5, 6, 8, 9], [-1, 0, -1, -1])
    assert sched._usable_drafts(r, [5, 6], [-1, 0]) == ([5, 6], None)   # a chain is a chain
    sched.max_model_len = r.num_tokens + 3     # three more slots: the first two nodes fit
    assert sched._usable_drafts(req("b-2", 4), tokens, parents) == ([5, 6], [-1, 0])


# -- end to end ---------------------------------------------------------------------------
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]"    # 7 rows: the one-call C stack
# 10 rows: past the C stack's 8, the modules (the C attention kernel still takes the tree)
WIDE_TREE = "[(0,), (1,), (2,), (3,), (4,), (0, 0), (0, 1), (0, 2), (0, 0, 0)]"


def tree_llm(model_dir, tree=TREE, ngram_first=False, **kw):
    spec = dict(method="eagle3", num_speculative_tokens=3, adaptive=False,
                speculative_token_tree=tree, ngram_first=ngram_first)
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=model_dir, skip_tokenizer_init=True, num_threads=1, speculative_config=spec, **kw)


class OracleTrees(Eagle3Proposer):
    """Drafts trees that put the target's true next tokens (from a plain run) at random
    places: the chain or one of the alternatives, so kept alternatives at every depth (and
    their K/V moves) decide what comes next."""

    def __init__(self, base: Eagle3Proposer, futures: dict, seed: int = 0) -> None:
        super().__init__(base.head, base.target, base.kv_cache, base.features, base.backend,
                         base.block_size, base.device)
        self.futures, self.rng, self.kept_alternatives = futures, random.Random(seed), 0

    def draft(self, states, counts, widths=()):
        super().draft(states, counts, widths)     # the drafter's own state moves on as usual
        out = []
        for s, n in zip(states, counts):
            future = self.futures[tuple(s.prompt_token_ids)][len(s.output_token_ids):]
            chain, alts = [], []
            for d in range(min(n, len(future))):
                true, width = future[d], widths[d] if d < len(widths) else 1
                wrong = [(true + 1 + i + self.rng.randrange(40)) % 380 + 3 for i in range(0, 200, 41)]
                wrong = [t for t in dict.fromkeys(wrong) if t != true][:width]
                if width > 1 and d < 2 and self.rng.random() < 0.5:   # the true token as an alternative
                    chain.append(wrong[0])
                    alts.append(wrong[1:width - 1] + [true])
                    break                               # the chain past a wrong token is moot
                chain.append(true)
                alts.append(wrong[:width - 1])
            out.append(DraftTree(*draft_tree.build(chain, alts)) if chain else [])
        return out


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1), PROMPTS)


@pytest.mark.parametrize("kv_cache_dtype, tree", [("auto", TREE), ("fp16", TREE), ("int8", TREE),
                                                  ("auto", WIDE_TREE)])
def test_kept_alternatives_leave_greedy_output_plain(tiny_llama_dir, plain_outputs, kv_cache_dtype,
                                                     tree, monkeypatch):
    plain = run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1,
                    kv_cache_dtype=kv_cache_dtype), PROMPTS, n=24)
    llm = tree_llm(tiny_llama_dir, tree, kv_cache_dtype=kv_cache_dtype)
    forward, fused = fused_stack.forward, []

    def recording(model, ids, positions, caches, meta, *args, **kwargs):
        hidden = forward(model, ids, positions, caches, meta, *args, **kwargs)
        if meta.query_positions is not None:     # a step that verified trees
            fused.append(hidden is not None)
        return hidden
    monkeypatch.setattr(fused_stack, "forward", recording)
    runner = llm.engine.runner
    runner.spec.proposer = OracleTrees(runner.spec.proposer, {tuple(p): o for p, o in zip(PROMPTS, plain)})
    moved = []
    move = model_runner.move_kv_positions
    monkeypatch.setattr(model_runner, "move_kv_positions",
                        lambda caches, layout, bs, moves: moved.extend(moves) or move(caches, layout, bs, moves))
    assert run(llm, PROMPTS, n=24) == plain
    assert len(moved) > 20          # alternatives were kept, at depths 1 and 2
    assert all(b < a for _, a, b in moved)
    # which path verified the trees: the C stack, or past its 8 rows the modules
    assert all(fused) if tree == TREE else not all(fused)
    stats = llm.get_stats()
    assert stats["spec_num_accepted_tokens"] > 0


def test_moves_are_needed(tiny_llama_dir, plain_outputs, monkeypatch):
    """Without moving a kept alternative's K/V the output goes wrong: the test above sees it."""
    llm = tree_llm(tiny_llama_dir)
    runner = llm.engine.runner
    plain = run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1),
                PROMPTS, n=24)
    runner.spec.proposer = OracleTrees(runner.spec.proposer, {tuple(p): o for p, o in zip(PROMPTS, plain)})
    monkeypatch.setattr(model_runner, "move_kv_positions", lambda *a: None)
    assert run(llm, PROMPTS, n=24) != plain


@pytest.mark.parametrize("ngram_first", [False, True])
def test_random_drafter_trees_greedy_and_seeded_equal_plain(tiny_llama_dir, plain_outputs, ngram_first):
    llm = tree_llm(tiny_llama_dir, ngram_first=ngram_first)
    assert run(llm, PROMPTS) == plain_outputs
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    plain = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=64, num_threads=1)
    assert seeded_outputs(tree_llm(tiny_llama_dir, ngram_first=ngram_first), 16) == seeded_outputs(plain, 16)


def test_eagle3_runners_up_become_alternatives(tiny_llama_dir):
    llm = tree_llm(tiny_llama_dir)
    proposer = llm.engine.runner.spec.proposer
    seen = []
    draft = proposer.draft

    def recording(states, counts, widths=()):
        out = draft(states, counts, widths)
        seen.extend(out)
        return out
    proposer.draft = recording
    run(llm, PROMPTS[:3], n=8)
    trees = [d for d in seen if isinstance(d, DraftTree)]
    assert trees and all(draft_tree.depths(t.parents).count(1) == 3 for t in trees
                         if draft_tree.chain_length(t.parents) == 3)
    for t in trees:
        draft_tree.validate(t.parents)
        for d in set(draft_tree.depths(t.parents)):   # no two siblings share a token
            kids = [x for x, p, dd in zip(t.tokens, t.parents, draft_tree.depths(t.parents)) if dd == d]
            assert len(kids) == len(set(kids))


def test_kept_alternatives_leave_seeded_output_plain(tiny_llama_dir):
    """T = 1 with per-request seeds: the oracle knows the seeded plain run's tokens, so whole
    trees are kept (their bonus rows draw at depth k) and alternatives too (siblings share
    their position's noise row)."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)

    def outputs(engine):
        return [o.outputs[0].token_ids for o in
                engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    plain = outputs(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1))
    llm = tree_llm(tiny_llama_dir)
    runner = llm.engine.runner
    runner.spec.proposer = OracleTrees(runner.spec.proposer, {tuple(p): o for p, o in zip(PROMPTS, plain)})
    assert outputs(llm) == plain
    stats = llm.get_stats()
    assert stats["spec_num_accepted_tokens"] > 3 * stats["spec_num_drafts"] / 2


def test_adaptive_k_measures_each_tree_against_its_chain(tiny_llama_dir):
    plain = run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1),
                PROMPTS, n=24)
    spec = dict(method="eagle3", num_speculative_tokens=3, speculative_token_tree=TREE, ngram_first=True)
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_threads=1, num_kv_blocks=256,
              speculative_config=spec)
    dec = llm.engine.runner.spec
    assert dec.controller.modes == 4          # (lookup + drafter, lookup only) x (tree, chain)
    widths = []
    propose = dec.proposer.propose
    dec.proposer.propose = lambda inp: widths.append(inp.widths) or propose(inp)
    for _ in range(3):
        assert run(llm, PROMPTS, n=24) == plain
    stats = llm.get_stats()
    assert stats["spec_tree_steps"] > 0
    assert dec.widths in widths and () in widths      # both were played
