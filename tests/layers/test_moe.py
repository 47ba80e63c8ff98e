"""MoE routing and fused experts against the per-token reference loop."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.moe import ExpertLoad, experts_reference, fused_experts, route


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 4, 2, True), (7, 8, 2, False),
                                                               (33, 8, 3, True), (5, 16, 1, False)])
def test_fused_experts_match_the_per_token_loop(tokens, experts, top_k, renormalize):
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 24, 40
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    gate = torch.randn(experts, hidden, generator=g)
    weights, ids = route(F.linear(x, gate), top_k, renormalize)
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, experts_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_route_picks_the_top_k_softmax_weights():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    renormed, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormed.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="top_k must be in"):
        route(logits, 5, renormalize=True)


def test_expert_load_counts_and_imbalance():
    load = ExpertLoad(num_layers=2, num_experts=4, num_ranks=2)
    assert load.snapshot()["imbalance"] == [0.0, 0.0]
    load.record(0, torch.bincount(torch.tensor([0, 1, 0, 2, 0, 3]), minlength=4))
    load.rank_pairs.add_(torch.tensor([4, 2]))
    snap = load.snapshot()
    assert snap["counts"] == [[3, 1, 1, 1], [0, 0, 0, 0]] and snap["routed"] == 6
    assert snap["imbalance"][0] == pytest.approx(3 / 1.5) and snap["dropped"] == 0
    assert snap["per_rank"] == [4, 2] and snap["rank_imbalance"] == pytest.approx(4 / 3)
    load.reset()
    assert load.snapshot()["routed"] == 0


@pytest.mark.parametrize("tokens", [1, 9])
def test_sparse_moe_layer_matches_the_reference(tokens):
    """The layer (router, expert Linears, shared expert) against the per-token loop over
    the same weights stacked."""
    from tokenmill.layers.moe import MoEArgs, SparseMoE
    from tokenmill.models.llama import LlamaArgs, LlamaMLP
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, shared = 16, 24, 20
    a = LlamaArgs(vocab_size=8, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=1e4, rope_scaling=None, max_position_embeddings=16,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    moe = MoEArgs(num_experts=5, top_k=2, expert_intermediate_size=inter, renormalize=False,
                  shared_expert_intermediate_size=shared)
    layer = SparseMoE(hidden, moe, lambda i, tp, reduce: LlamaMLP(a, tp, i, reduce))
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.stack([layer.experts[str(e)].gate_up_proj.weight for e in range(5)])
    w2 = torch.stack([layer.experts[str(e)].down_proj.weight for e in range(5)])
    weights, ids = route(layer.gate(x), 2, False)
    se = layer.shared_expert
    want = experts_reference(x, w13, w2, weights, ids) + torch.sigmoid(layer.shared_expert_gate(x)) * \
        experts_reference(x, se.gate_up_proj.weight[None], se.down_proj.weight[None],
                          torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.long))
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_expert_shares_split_replicated_experts_across_ranks():
    """Two ranks of an expert-parallel group (experts 0-1 and 2-3), expert 2 replicated on
    both: the ranks' partial sums add up to the whole layer, each token computed once."""
    from tokenmill.layers.moe import combine_experts
    g = torch.Generator().manual_seed(5)
    hidden, inter, experts = 12, 16, 4
    x = torch.randn(11, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    weights, ids = route(torch.randn(11, experts, generator=g), 2, renormalize=True)
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    calls = []

    def run(e, rows):
        calls.append((e, rows.shape[0]))
        return F.silu(rows @ w13[e][:inter].T) * (rows @ w13[e][inter:].T) @ w2[e].T
    rank0 = combine_experts(x, weights, ids, run, counts, {0: (0, 1), 1: (0, 1), 2: (0, 2)})
    rank1 = combine_experts(x, weights, ids, run, counts, {2: (1, 2), 3: (0, 1)})
    torch.testing.assert_close(rank0 + rank1, experts_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert sum(n for e, n in calls if e == 2) == counts[2]   # split, not duplicated


def test_balancer_picks_the_hottest_experts_of_the_window():
    from tokenmill.engine.expert_balancer import ExpertBalancer
    b = ExpertBalancer(num_hot=1, interval=1)
    assert b.choose([[0, 0, 0, 0]]) is None                 # nothing routed yet
    assert b.choose([[5, 1, 0, 2]]) == [[0]]
    assert b.choose([[5, 1, 9, 2]]) == [[2]]                 # the window since the last look
    assert b.choose([[1, 3, 0, 0]]) == [[1]]                 # counts went down: a reset
