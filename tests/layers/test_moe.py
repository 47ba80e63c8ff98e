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
    load = ExpertLoad(num_layers=2, num_experts=4)
    assert load.imbalance(0) == 0.0
    load.record(0, torch.tensor([[0, 1], [0, 2], [0, 3]]))
    assert load.counts[0] == [3, 1, 1, 1] and load.counts[1] == [0, 0, 0, 0]
    assert load.imbalance(0) == pytest.approx(3 / 1.5)
