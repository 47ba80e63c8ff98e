"""DFlash (block-diffusion drafter): the paged proposer against a plain dense reference written
here, bidirectional block attention, checkpoints (ours and z-lab's naming), the training
recipe on a learnable synthetic set, and end to end: greedy output equals no speculation, and
in the engine (chunked prefill, preemption, prefix caching) every block forward equals a dense
forward over features recomputed from scratch."""
import json
import math
import random

import pytest
import torch

from tests.spec.drafter_reference import PROMPTS, State, rms, run
from tokenmill import LLM
from tokenmill.runner.kv_tensors import allocate_kv_caches
from tokenmill.spec.dflash import (DFlashProposer, config_for_target, load_dflash,
                                   save_dflash)
from tokenmill.spec.dflash_model import DFlashDrafter, init_weights
from tokenmill.spec.draft_input import DraftInput, StepFeatures
from tokenmill.spec.trainable import Linear
from tokenmill.spec.train.data import TrainSequence, extract_features
from tokenmill.spec.train.dflash_recipe import DFlashRecipe

PAGE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny_llama6")
    save_tiny_llama(path, num_hidden_layers=6)
    return LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64).engine.runner


def make_drafter(target, seed=0, **kw):
    kw.setdefault("num_layers", 2)
    kw.setdefault("block_size", 5)
    kw.setdefault("target_layer_ids", (0, 2, 5))
    return init_weights(DFlashDrafter(config_for_target(target, **kw)), seed, std=0.15).eval()


# -- a dense reference, written out from the paper's description -------------------------------
def rope(x, positions, theta):
    """x [T, heads, D]: pairs (i, i + D/2) rotated by position * theta^(-2i/D)."""
    d = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-torch.arange(d).double() * 2 / (2 * d))
    cos, sin = angle.cos()[:, None].float(), angle.sin()[:, None].float()
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_layer(layer, c, x, ctx, pos_ctx, pos_blk):
    """One draft layer over the block rows x [bs, hidden], context rows ctx [b, hidden]."""
    at, m, eps = layer.self_attn, layer.mlp, c.rms_norm_eps
    h = rms(x, layer.input_layernorm.weight, eps)

    def project(src, w, n):
        return (src @ w.T).view(src.shape[0], n, c.head_dim)

    def keys(src, pos):
        return rope(rms(project(src, at.k_proj.weight, c.num_kv_heads), at.k_norm.weight, eps),
                    pos, c.rope_theta)

    q = rope(rms(project(h, at.q_proj.weight, c.num_heads), at.q_norm.weight, eps), pos_blk,
             c.rope_theta)
    k = torch.cat([keys(ctx, pos_ctx), keys(h, pos_blk)])
    v = torch.cat([project(ctx, at.v_proj.weight, c.num_kv_heads),
                   project(h, at.v_proj.weight, c.num_kv_heads)])
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)   # no mask at all
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
    x = x + out @ at.o_proj.weight.T
    h = rms(x, layer.post_attention_layernorm.weight, eps)
    gated = torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)
    return x + gated @ m.down_proj.weight.T


def reference_hidden(drafter, target, aux, first_token):
    """aux [b, F]: the context features at positions 0..b-1; the block starts at b."""
    c, b = drafter.config, aux.shape[0]
    ctx = rms(aux @ drafter.fc.weight.T, drafter.hidden_norm.weight, c.rms_norm_eps)
    ids = torch.tensor([first_token] + [c.mask_token_id] * (c.block_size - 1))
    x = target.model.embed_tokens(ids).float()
    for layer in drafter.layers:
        x = reference_layer(layer, c, x, ctx, torch.arange(b), torch.arange(b, b + c.block_size))
    return rms(x, drafter.norm.weight, c.rms_norm_eps)


def features(req_ids, spans, tokens, tables, aux):
    return StepFeatures(req_ids, [s for s, _ in spans], [e - s for s, e in spans],
                        [tokens[r][s:e] for r, (s, e) in zip(req_ids, spans)],
                        [tables[r] for r in req_ids],
                        torch.cat([aux[r][s:e] for r, (s, e) in zip(req_ids, spans)]))


@torch.inference_mode()
def test_paged_proposer_equals_dense_reference(runner):
    target = runner.model
    drafter = make_drafter(target)
    c = drafter.config
    caches = allocate_kv_caches(c.num_layers, 16, PAGE, c.num_kv_heads, c.head_dim, torch.float32,
                                torch.device("cpu"))
    proposer = DFlashProposer(drafter, target, caches, PAGE, torch.device("cpu"))
    assert proposer.aux_layers == (0, 2, 5) and proposer.max_drafts == 4
    assert not proposer.needs_lookahead
    g = torch.Generator().manual_seed(1)
    tokens = {"a": torch.randint(3, 380, (10,), generator=g).tolist(),
              "b": torch.randint(3, 380, (14,), generator=g).tolist()}
    tables = {"a": [5, 2, 9], "b": [1, 7, 3, 12]}     # scattered pages
    aux = {r: torch.randn(len(t), 3 * c.hidden_size, generator=g) for r, t in tokens.items()}
    # a prefill chunk of each (features only), then the rest with drafting
    chunk = features(["a", "b"], [(0, 6), (0, 8)], tokens, tables, aux)
    proposer.propose(DraftInput([], [], None, chunk))
    states = [State(r, tokens[r], tables[r], len(tokens[r])) for r in ("a", "b")]
    drafts = proposer.propose(DraftInput(states, [9, 2], None,
                                         features(["b", "a"], [(8, 13), (6, 9)], tokens, tables, aux)))
    assert [len(d) for d in drafts] == [4, 2]        # capped at block_size - 1
    hidden = proposer.block_hidden(states)
    for i, s in enumerate(states):
        b = s.num_tokens - 1                          # the newest token: no feature yet
        ref = reference_hidden(drafter, target, aux[s.req_id][:b], s.all_tokens[b])
        torch.testing.assert_close(hidden[i], ref, atol=2e-4, rtol=2e-4)
        guesses = target.compute_logits(ref[1:]).argmax(-1).tolist()
        assert drafts[i] == guesses[:len(drafts[i])]
    assert len(set(drafts[0])) > 1                    # the check can tell rows apart


@torch.inference_mode()
def test_block_attention_is_bidirectional(runner):
    target = runner.model
    drafter = make_drafter(target)
    aux = torch.randn(1, 7, 3 * drafter.config.hidden_size)
    ctx = drafter.context_kv(aux, torch.arange(7)[None])
    x = drafter.block_input(target.model.embed_tokens, torch.tensor([11]))
    positions = torch.arange(7, 12)[None]
    before = drafter(x, positions, ctx)
    x2 = x.clone()
    x2[0, 4] += 1.0                                   # change only the last block row
    after = drafter(x2, positions, ctx)
    assert not torch.allclose(before[0, 1], after[0, 1], atol=1e-4)   # an earlier row sees it
    # and every row reads the context
    ctx2 = drafter.context_kv(aux + 1.0, torch.arange(7)[None])
    assert not torch.allclose(before[0, 0], drafter(x, positions, ctx2)[0, 0], atol=1e-4)


# -- checkpoints ----------------------------------------------------------------------------
def test_save_load_round_trip(runner, tmp_path):
    target = runner.model
    drafter = make_drafter(target, seed=3)
    save_dflash(drafter, str(tmp_path), vocab_size=target.args.vocab_size)
    loaded = load_dflash(str(tmp_path), target, torch.device("cpu"))
    assert loaded.config == drafter.config
    own, got = drafter.state_dict(), loaded.state_dict()
    assert own.keys() == got.keys() and all(torch.equal(own[n], got[n]) for n in own)


def zlab_checkpoint(path, target, layer_ids, mask_id, extra_cfg=None):
    """A tiny checkpoint written by hand with z-lab's config keys and weight names."""
    from safetensors.torch import save_file
    h, heads, kv, hd, inter = 64, 4, 2, 16, 128
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "attention_bias": False,
           "block_size": 8,
           "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids},
           "head_dim": hd, "hidden_act": "silu", "hidden_size": h, "intermediate_size": inter,
           "layer_types": ["full_attention"], "num_attention_heads": heads, "num_hidden_layers": 1,
           "num_key_value_heads": kv, "num_target_layers": 6, "rms_norm_eps": 1e-6,
           "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
           "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 384,
           **(extra_cfg or {})}
    g = torch.Generator().manual_seed(7)
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
             "self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h),
             "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, heads * hd),
             "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "mlp.gate_proj": (inter, h),
             "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    shapes = {"fc.weight": (h, len(layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              **{f"layers.0.{n}.weight": shape for n, shape in layer.items()}}
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_load_zlab_layout(runner, tmp_path):
    target = runner.model
    tensors = zlab_checkpoint(tmp_path / "z", target, [1, 3, 4], 383)
    drafter = load_dflash(str(tmp_path / "z"), target, torch.device("cpu"))
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_layers) == (8, 383, (1, 3, 4), 1)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (4, 2, 16, 1e6)
    got = drafter.state_dict()
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[n], tensors[n].float()) for n in tensors)
    save_dflash(drafter, str(tmp_path / "again"))    # and ours reads back the same module
    again = load_dflash(str(tmp_path / "again"), target, torch.device("cpu"))
    assert again.config == c and all(torch.equal(again.state_dict()[n], got[n]) for n in got)


@pytest.mark.parametrize("ids, mask, extra, match", [
    ([1, 9], 5, None, "outside the target"),
    ([1], 999, None, "mask_token_id"),
    ([1], 5, {"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ([1], 5, {"layer_types": ["sliding_attention"]}, "sliding"),
])
def test_load_rejects_what_it_cannot_run(runner, tmp_path, ids, mask, extra, match):
    zlab_checkpoint(tmp_path, runner.model, ids, mask, extra)
    with pytest.raises(ValueError, match=match):
        load_dflash(str(tmp_path), runner.model, torch.device("cpu"))


# -- training -------------------------------------------------------------------------------
def repetitive_sequences(runner, layers, count, seed):
    """Cycles of 5 tokens repeated (learnable in a few hundred steps), with the target's real
    features over them."""
    rng = random.Random(seed)
    cycles = [random.Random(c).sample(range(3, 380), 5) for c in range(3)]
    seqs = [(cycles[rng.randrange(3)] * 12)[:rng.randrange(30, 45)] for _ in range(count)]
    return [TrainSequence(torch.tensor(s), 6, aux.clone(), final.clone())
            for s, (aux, final) in zip(seqs, extract_features(runner, seqs, layers))]


def test_recipe_learns_and_measures_acceptance(runner, tmp_path):
    from tokenmill.spec.train.trainer import TrainConfig, Trainer
    target, recipe = runner.model, DFlashRecipe()
    layers = recipe.aux_layers(target)
    assert layers == (1, 2, 3)
    train = repetitive_sequences(runner, layers, 12, seed=0)
    heldout = repetitive_sequences(runner, layers, 3, seed=1)
    torch.manual_seed(0)
    drafter = recipe.build(target, {"num_layers": 1, "block_size": 4}, seed=0)
    before = recipe.acceptance(drafter, target, heldout, k=4)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    random.seed(0)           # the recipe draws its anchors from the global generator
    for _ in range(80):
        loss, metrics = recipe.loss(drafter, target, random.sample(train, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    assert sum(losses[-10:]) < 0.2 * sum(losses[:10])
    after = recipe.acceptance(drafter, target, heldout, k=4)
    assert len(after) == 4 and all(0.0 <= a <= 1.0 for a in after + before)
    assert after[3] == 0.0                           # block_size 4: at most 3 drafts
    assert after[0] > max(before[0], 0.5) and after == sorted(after, reverse=True)
    # the shared trainer drives the recipe and leaves a checkpoint load_dflash reads
    cfg = TrainConfig(steps=2, batch_sequences=2, eval_every=2, checkpoint_every=2, k=3,
                      options={"num_layers": 1, "block_size": 4})
    summary = Trainer(recipe, target, train, heldout, cfg, str(tmp_path), progress=False).run()
    assert len(summary["heldout_acceptance"]) == 3
    assert load_dflash(str(tmp_path), target, torch.device("cpu")).config.block_size == 4


def test_loss_and_acceptance_read_the_draft_vocabulary(runner):
    """With a draft vocabulary the loss is cross-entropy over its rows of the head, labels
    outside it weighing nothing, and held-out drafts are its argmax mapped back to ids."""
    from tokenmill.spec.train.target_ops import head_logits
    target, recipe = runner.model, DFlashRecipe()
    layers = recipe.aux_layers(target)
    seqs = repetitive_sequences(runner, layers, 3, seed=3)
    drafter = recipe.build(target, {"num_layers": 1, "block_size": 4, "blocks_per_sequence": 50},
                           seed=0)
    labels = torch.cat([s.token_ids[s.prompt_len + 1:] for s in seqs]).unique()
    ids = torch.cat([labels[::2], torch.tensor([0, 1])]).unique()     # half the labels in
    drafter.draft_vocab_ids = ids
    loss, _ = recipe.loss(drafter, target, seqs)
    # by hand: every anchor of every sequence (50 > the continuation), decayed weights
    index = {int(t): i for i, t in enumerate(ids)}
    total = weight = 0.0
    for seq in seqs:
        anchors = recipe._anchors(seq, 50)
        h = recipe.blocks(drafter, target, seq, anchors).detach()
        for b, a in enumerate(anchors):
            for j in range(1, min(4, seq.num_tokens - a)):
                label = int(seq.token_ids[a + j])
                if label not in index:
                    continue
                w = math.exp(-(j - 1) / recipe.gamma)
                logits = head_logits(target, h[b, j][None])[0, ids]
                total += w * float(torch.nn.functional.cross_entropy(
                    logits[None], torch.tensor([index[label]])))
                weight += w
    assert weight > 0 and abs(loss.item() - total / weight) < 1e-4
    # acceptance: the proposer's choice (argmax over the draft rows), as target ids
    acc = recipe.acceptance(drafter, target, seqs, k=3)
    hits = 0
    for seq in seqs:
        anchors = recipe._anchors(seq, 16)
        h = recipe.blocks(drafter, target, seq, anchors)[:, 1]
        guess = ids[head_logits(target, h)[:, ids].argmax(-1)]
        hits += int((guess == seq.token_ids[torch.tensor(anchors) + 1]).sum())
    assert acc[0] == hits / sum(len(recipe._anchors(s, 16)) for s in seqs)
    # a batch none of whose labels is in the vocabulary weighs nothing and does not stop training
    drafter.draft_vocab_ids = torch.tensor([0, 1])
    loss, metrics = recipe.loss(drafter, target, seqs)
    loss.backward()
    assert loss.item() == 0.0 and metrics["acc"] == 0.0


# -- end to end -----------------------------------------------------------------------------
def dflash_llm(model_dir, quantization=None, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=model_dir, skip_tokenizer_init=True, **kw,
               speculative_config=dict(method="dflash", num_speculative_tokens=3, adaptive=False,
                                       quantization=quantization))


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256), PROMPTS)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_equals_plain(tiny_llama_dir, plain_outputs, quantization):
    llm = dflash_llm(tiny_llama_dir, quantization)
    if quantization:
        assert all(m.packed is not None for m in llm.engine.runner.spec.proposer.drafter.modules()
                   if isinstance(m, Linear))
    assert run(llm, PROMPTS) == plain_outputs
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]


class CheckingProposer(DFlashProposer):
    """Compares every block forward with a dense one over features recomputed by running the
    target over the request's tokens in one prefill."""

    def __init__(self, base: DFlashProposer, runner) -> None:
        super().__init__(base.drafter, base.target, base.kv_caches, base.block_size, base.device)
        self.runner, self.checked, self.calls, self.wrong = runner, 0, 0, []

    def block_hidden(self, states):
        hidden = super().block_hidden(states)
        self.calls += 1
        i = self.calls % len(states)     # one request per call: each check reruns the target
        s, b = states[i], states[i].num_tokens - 1
        aux, _ = next(extract_features(self.runner, [s.tokens(0, b)], self.aux_layers))
        ctx = self.drafter.context_kv(aux[None], torch.arange(b)[None])
        first = torch.tensor(s.tokens(b, b + 1))
        x = self.drafter.block_input(self.target.model.embed_tokens, first)
        dense = self.drafter(x, torch.arange(b, b + self.drafter.block_size)[None], ctx)
        # recorded, not raised: the engine would isolate the failing step's requests
        if not torch.allclose(hidden[i], dense[0], atol=1e-4, rtol=1e-4):
            self.wrong.append((s.req_id, b, float((hidden[i] - dense[0]).abs().max())))
        self.checked += 1
        return hidden


def test_paged_context_right_with_chunking_preemption_prefix_cache(tiny_llama_dir, plain_outputs):
    llm = dflash_llm(tiny_llama_dir, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8)
    runner = llm.engine.runner
    runner.spec.proposer = checker = CheckingProposer(runner.spec.proposer, runner)
    for _ in range(2):   # cold, then warm prefix cache
        assert run(llm, PROMPTS, n=12) == [o[:12] for o in plain_outputs]
    stats = llm.get_stats()
    assert checker.checked > 20 and not checker.wrong
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_rate"] > 0


def test_draft_vocabulary_restricts_the_head_and_round_trips(runner, tmp_path):
    from tokenmill.spec.draft_head import DraftHead
    target = runner.model
    ids = torch.tensor([3, 7, 50, 51, 200, 383])
    hidden = torch.randn(9, target.args.hidden_size)
    want = ids[target.compute_logits(hidden)[:, ids].argmax(-1)]
    assert torch.equal(DraftHead(target, ids).argmax(hidden), want)
    assert torch.equal(DraftHead(target, None).argmax(hidden), target.compute_logits(hidden).argmax(-1))
    drafter = make_drafter(target, seed=4)
    drafter.draft_vocab_ids = ids
    save_dflash(drafter, str(tmp_path), vocab_size=target.args.vocab_size)
    loaded = load_dflash(str(tmp_path), target, torch.device("cpu"))
    assert torch.equal(loaded.draft_vocab_ids, ids)
    proposer = DFlashProposer(loaded, target, [], runner.block_size, torch.device("cpu"))
    assert torch.equal(proposer.head.token_ids, ids)
