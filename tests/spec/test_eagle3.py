"""EAGLE-3: the paged proposer and the dense chains (training's) against a reference written out
here from the paper's description, entries reused across requests sharing a prefix, checkpoints
(ours, the speculators layout, EAGLE's), the training recipe on a target's own continuations,
and end to end: greedy output equals no speculation, and in the engine (chunked prefill,
preemption, prefix caching) every chain equals a dense one over features recomputed from
scratch."""
import json
import math
import random

import pytest
import torch

from tests.spec.drafter_reference import PROMPTS, State, rms, run
from tokenmill import LLM
from tokenmill.spec.trainable import init_weights
from tokenmill.spec.draft_input import DraftInput, StepFeatures
from tokenmill.spec.eagle3 import (Eagle3Proposer, build_eagle3_proposer, config_for_target,
                                   load_eagle3, save_eagle3)
from tokenmill.spec.eagle3_model import (DenseChain, Eagle3Head, default_aux_layers,
                                         previous_features)
from tokenmill.spec.train.data import extract_features, prepare
from tokenmill.spec.train.data import choose_draft_vocab
from tokenmill.spec.train.eagle3_recipe import Eagle3Recipe

PAGE = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is fastest, and on a loaded machine a second one spins."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny_llama6")
    save_tiny_llama(path, num_hidden_layers=6)
    return LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=64, num_threads=1).engine.runner


def make_head(target, seed=0, draft_vocab=200):
    """A random head over a scattered reduced vocabulary (so d2t is not the identity)."""
    head = init_weights(Eagle3Head(config_for_target(target, draft_vocab, (0, 2, 5))), seed, std=0.15)
    head.set_vocab(torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(seed))
                   [:draft_vocab].sort().values)
    return head.eval()


# -- a reference, written out from the paper's description ------------------------------------
def rope(x, pos, theta):
    """x [heads, D] at one position: pairs (i, i + D/2) rotated by pos * theta^(-2i/D)."""
    d = x.shape[-1] // 2
    angle = pos * theta ** (-torch.arange(d).double() * 2 / (2 * d))
    cos, sin = angle.cos().float(), angle.sin().float()
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_drafts(head, target, tokens, aux, k):
    """Entries one at a time: entry p = (t_p, g(p-1)), q/k/v of [input_layernorm(embed);
    hidden_norm(g)], residual g; the chain from the newest token feeds each output h back as
    the next feature with the drafted token; every entry sees all earlier entries."""
    c, layer = head.config, head.layers[0]
    at, m, eps = layer.self_attn, layer.mlp, c.rms_norm_eps
    g = aux @ head.fc.weight.T
    emb = target.model.embed_tokens.weight
    keys, values = [], []

    def entry(tok, feat, pos):
        x = torch.cat([rms(emb[tok], layer.input_layernorm.weight, eps),
                       rms(feat, layer.hidden_norm.weight, eps)])
        q = rope((x @ at.q_proj.weight.T).view(c.num_heads, -1), pos, c.rope_theta)
        keys.append(rope((x @ at.k_proj.weight.T).view(c.num_kv_heads, -1), pos, c.rope_theta))
        values.append((x @ at.v_proj.weight.T).view(c.num_kv_heads, -1))
        group = c.num_heads // c.num_kv_heads
        kk = torch.stack(keys).repeat_interleave(group, 1)
        vv = torch.stack(values).repeat_interleave(group, 1)
        w = (torch.einsum("hd,nhd->hn", q, kk) / math.sqrt(c.head_dim)).softmax(-1)
        h = feat + torch.einsum("hn,nhd->hd", w, vv).reshape(-1) @ at.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight, eps)
        return h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T

    b = len(tokens) - 1
    for p in range(b):
        entry(tokens[p], g[p - 1] if p else torch.zeros(c.hidden_size), p)
    feat, tok, drafts = g[b - 1], tokens[b], []
    for j in range(k):
        feat = entry(tok, feat, b + j)
        d = int((rms(feat, head.norm.weight, eps) @ head.lm_head.weight.T).argmax())
        tok = d + int(head.d2t[d])
        drafts.append(tok)
    return drafts


def dense_drafts(head, target, tokens, aux, k):
    """The same chain through DenseChain (training's code). aux: rows of positions 0..b-1."""
    b = len(tokens) - 1
    embed = target.model.embed_tokens
    g = head.project(aux[:b])
    g_prev = previous_features(torch.cat([g, g.new_zeros(1, g.shape[1])]), [b + 1])
    chain = DenseChain(head, head.embed(embed, torch.tensor(tokens)), g_prev,
                       torch.arange(b + 1), torch.tensor([b]))
    h, out = chain.step(), []
    for j in range(k):
        if j:
            h = chain.step(head.embed(embed, torch.tensor(out[-1:])), h)
        out.append(int(head.to_target(head.logits(h).argmax(-1))[0]))
    return out


def features(req_ids, spans, tokens, tables, aux):
    return StepFeatures(req_ids, [s for s, _ in spans], [e - s for s, e in spans],
                        [tokens[r][s:e] for r, (s, e) in zip(req_ids, spans)],
                        [tables[r] for r in req_ids],
                        torch.cat([aux[r][s:e] for r, (s, e) in zip(req_ids, spans)]))


def make_proposer(runner, head, num_blocks=16):
    from tokenmill.runner.kv_tensors import allocate_kv_caches
    c = head.config
    kv = allocate_kv_caches(1, num_blocks, PAGE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")[0]
    return Eagle3Proposer(head, runner.model, kv, torch.zeros(num_blocks * PAGE, c.hidden_size),
                          runner.backend, PAGE, torch.device("cpu"))


@torch.inference_mode()
def test_paged_chains_equal_the_reference_and_reuse_a_shared_prefix(runner):
    target = runner.model
    head = make_head(target)
    proposer = make_proposer(runner, head)
    assert proposer.aux_layers == (0, 2, 5) and proposer.needs_lookahead
    g = torch.Generator().manual_seed(1)
    tokens = {"a": torch.randint(3, 380, (11,), generator=g).tolist(),
              "b": torch.randint(3, 380, (14,), generator=g).tolist()}
    tokens["c"] = tokens["a"][:8] + torch.randint(3, 380, (5,), generator=g).tolist()
    tables = {"a": [5, 2, 9, 4], "b": [1, 7, 3, 12], "c": [5, 2, 14, 6]}   # c shares a's 2 pages
    aux = {r: torch.randn(len(t), 3 * 64, generator=g) for r, t in tokens.items()}
    aux["c"][:8] = aux["a"][:8]                       # same tokens, same target features
    # a prefill chunk of a and b (features only), then the rest with drafting
    proposer.propose(DraftInput([], [], None, features(["a", "b"], [(0, 6), (0, 8)], tokens, tables, aux)))
    states = [State(r, tokens[r], tables[r], len(tokens[r])) for r in ("a", "b")]
    drafts = proposer.propose(DraftInput(states, [3, 2], None,
                                         features(["b", "a"], [(8, 13), (6, 10)], tokens, tables, aux)))
    # c: a prefix-cache hit on a's first two pages, its own rows from position 8 on
    c = State("c", tokens["c"], tables["c"], len(tokens["c"]))
    drafts += proposer.propose(DraftInput([c], [3], None, features(["c"], [(8, 12)], tokens, tables, aux)))
    for s, d in zip(states + [c], drafts):
        b = s.num_tokens - 1
        ref = reference_drafts(head, target, s.all_tokens, aux[s.req_id][:b], len(d))
        assert d == ref, s.req_id
        assert dense_drafts(head, target, s.all_tokens, aux[s.req_id], len(d)) == ref
    assert [len(d) for d in drafts] == [3, 2, 3] and len(set(drafts[0] + drafts[2])) > 2
    assert all(bool(head.t2d[t]) for d in drafts for t in d)    # d2t lands in the draft vocab
    # a chain never writes past its block table: 16 slots, newest at 15 -> 1 draft
    short = State("a", tokens["a"] + [7, 8, 9, 10, 11], tables["a"], 16)
    proposer.propose(DraftInput([], [], None, features(["a"], [(10, 15)], {"a": short.all_tokens},
                                                         tables, {"a": torch.randn(16, 192)})))
    assert len(proposer.propose(DraftInput([short], [3], None, None))[0]) == 1


@torch.inference_mode()   # the engine's kernels: a row's bits do not depend on the row count
def test_steps_recorded_together_write_what_steps_recorded_one_by_one(runner):
    """A queue of steps (a chunk, then one decode row at a time, each reading its
    predecessor's feature) written in one call leaves the same features and K/V as writing
    each step at once."""
    from tokenmill.spec.draft_input import PendingFeatures
    head = make_head(runner.model)
    g = torch.Generator().manual_seed(2)
    tokens = {"a": torch.randint(3, 380, (12,), generator=g).tolist()}
    tables = {"a": [5, 2, 9]}
    aux = {"a": torch.randn(12, 3 * 64, generator=g)}
    steps = [features(["a"], [(0, 6)], tokens, tables, aux)] + \
        [features(["a"], [(p, p + 1)], tokens, tables, aux) for p in range(6, 12)]
    one_by_one, together = make_proposer(runner, head), make_proposer(runner, head)
    for f in steps:
        one_by_one.record(f)
    queue = PendingFeatures()
    for f in steps:
        queue.add(f)
    together.record(queue.take())
    assert torch.equal(one_by_one.features, together.features)
    assert all(torch.equal(a, b) for a, b in zip(one_by_one.kv_cache, together.kv_cache))
    assert float(together.kv_cache[0].abs().sum()) > 0


# -- checkpoints ----------------------------------------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])
def test_one_matmul_for_q_k_v_gives_what_query_and_kv_give(qk_norm):
    from tokenmill.spec.eagle3_model import Eagle3Config, Eagle3Layer
    from tokenmill.spec.trainable import Rotary, quantize_linears
    c = Eagle3Config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                     draft_vocab_size=50, vocab_size=100, aux_layers=(0, 1, 2), qk_norm=qk_norm)
    layer = init_weights(Eagle3Layer(c), 3, std=0.1)
    x = torch.randn(3, 128)
    cos, sin = Rotary(16, 10000.0, None).cos_sin(torch.tensor([0, 5, 9]), torch.float32)
    for serve in ("float", "int8"):
        if serve == "int8":
            quantize_linears(layer, "int8")
        with torch.inference_mode():
            q, k, v = layer.qkv(x, cos, sin)
            k_alone, v_alone = layer.kv(x, cos, sin)
            assert torch.equal(q, layer.query(x, cos, sin))
            assert torch.equal(k, k_alone) and torch.equal(v, v_alone)


def test_rotary_tables_grow_to_any_position_and_give_the_formulas_values():
    from tokenmill.spec.trainable import Rotary
    rot = Rotary(16, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    for positions in (torch.tensor([0, 3, 255]), torch.tensor([[7, 4000], [1, 2]]), torch.tensor([-2, 5])):
        freqs = positions.float().unsqueeze(-1) * rot.inv_freq      # the float32 formula
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = rot.cos_sin(positions, torch.float32)
        assert cos.shape == (*positions.shape, 16)
        torch.testing.assert_close(cos, emb.cos() * rot.mscale, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, emb.sin() * rot.mscale, rtol=0, atol=1e-6)
    assert rot._tables[torch.device("cpu")][0].shape[0] == 4096     # doubled past 4000


def test_default_layers():
    assert default_aux_layers(30) == (1, 14, 26)      # vLLM's (2, 15, 27) for SmolLM2-135M
    assert default_aux_layers(32) == (1, 15, 28)
    assert default_aux_layers(2) == (0, 1) and default_aux_layers(6) == (0, 2, 5)


def test_save_load_round_trip(runner, tmp_path):
    target = runner.model
    head = make_head(target, seed=3)
    save_eagle3(head, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 200
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]   # HF hidden_states numbering
    loaded = load_eagle3(str(tmp_path), target, torch.device("cpu"))
    assert loaded.config == head.config and loaded.embed_tokens is None
    own, got = head.state_dict(), loaded.state_dict()
    assert own.keys() == got.keys() and all(torch.equal(own[n], got[n]) for n in own)


def published(path, layout, extra=None, embed=None):
    """A tiny checkpoint written by hand: the speculators layout or the EAGLE repo's."""
    from safetensors.torch import save_file
    h, heads, kv, hd, inter, vd = 64, 4, 2, 16, 96, 50
    layer = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter,
             "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
             "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 384,
             "max_position_embeddings": 2048, "attention_bias": False, "tie_word_embeddings": False}
    if layout == "speculators":
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer, "draft_vocab_size": vd,
               "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 3, 6],
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "x"}}}
        prefix = "layers.0."
    else:
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": vd}
        prefix = "midlayer."
    if layout == "speculators":
        layer.update((extra or {}).pop("layer", {}))
    cfg.update(extra or {})
    g = torch.Generator().manual_seed(7)
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for name, shape in {"hidden_norm.weight": (h,), "input_layernorm.weight": (h,),
                        "post_attention_layernorm.weight": (h,),
                        "self_attn.q_proj.weight": (heads * hd, 2 * h),
                        "self_attn.k_proj.weight": (kv * hd, 2 * h),
                        "self_attn.v_proj.weight": (kv * hd, 2 * h),
                        "self_attn.o_proj.weight": (h, heads * hd), "mlp.gate_proj.weight": (inter, h),
                        "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}.items():
        shapes[prefix + name] = shape
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    ids = torch.arange(3, 3 + 2 * vd, 2)               # every other id from 3
    tensors["d2t"] = ids - torch.arange(vd)
    tensors["t2d"] = torch.zeros(384, dtype=torch.bool)
    tensors["t2d"][ids] = True
    if layer["model_type"] == "qwen3":
        for name in ("q_norm", "k_norm"):
            tensors[f"{prefix}self_attn.{name}.weight"] = torch.rand(hd, generator=g) + 0.5
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors, ids


def test_published_layouts_load_to_the_same_module(runner, tmp_path):
    target, cpu = runner.model, torch.device("cpu")
    tensors, ids = published(tmp_path / "s", "speculators")
    spec = load_eagle3(str(tmp_path / "s"), target, cpu)
    c = spec.config
    assert (c.aux_layers, c.draft_vocab_size, c.head_dim, c.intermediate_size) == ((0, 2, 5), 50, 16, 96)
    assert torch.equal(spec.to_target(torch.arange(50)), ids)        # draft id -> target id
    assert torch.equal(spec.draft_ids(), ids) and int(spec.t2d.sum()) == 50
    got = spec.state_dict()
    assert all(torch.equal(got[n], tensors[n].float()) for n in tensors if n in got)
    # EAGLE's own layout (midlayer.*, no layer ids: the default), with the target's embeddings
    published(tmp_path / "e", "eagle", embed=target.model.embed_tokens.weight.detach().clone())
    eagle = load_eagle3(str(tmp_path / "e"), target, cpu)
    assert eagle.config == c and eagle.embed_tokens is None           # shared, not copied
    assert all(torch.equal(eagle.state_dict()[n], got[n]) for n in got)
    # different embeddings are the drafter's own
    published(tmp_path / "o", "eagle", embed=torch.randn(384, 64))
    assert load_eagle3(str(tmp_path / "o"), target, cpu).embed_tokens is not None
    save_eagle3(spec, str(tmp_path / "again"))                         # ours reads back the same
    again = load_eagle3(str(tmp_path / "again"), target, cpu)
    assert again.config == c and all(torch.equal(again.state_dict()[n], got[n]) for n in got)


def test_qwen3_shaped_layer(runner, tmp_path):
    tensors, _ = published(tmp_path, "speculators", {"layer": {"model_type": "qwen3"}})
    head = load_eagle3(str(tmp_path), runner.model, torch.device("cpu"))
    assert head.config.qk_norm
    assert torch.equal(head.layer.self_attn.k_norm.weight, tensors["layers.0.self_attn.k_norm.weight"].float())
    tokens = torch.randint(3, 380, (9,)).tolist()
    aux = torch.randn(9, 192)
    with torch.inference_mode():
        proposer = make_proposer(runner, head)
        state = State("q", tokens, [3, 1, 8], 9)
        proposer.propose(DraftInput([], [], None, features(["q"], [(0, 8)], {"q": tokens},
                                                             {"q": state.block_ids}, {"q": aux})))
        drafts = proposer.propose(DraftInput([state], [3], None, None))[0]
        assert drafts == dense_drafts(head, runner.model, tokens, aux, 3)


@pytest.mark.parametrize("extra, match", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, "outside the target"),
    ({"num_hidden_layers": 2}, "layers are not supported"),
    ({"hidden_size": 32}, "width"),
])
def test_load_rejects_what_it_cannot_run(runner, tmp_path, extra, match):
    published(tmp_path, "eagle", extra)
    with pytest.raises(ValueError, match=match):
        load_eagle3(str(tmp_path), runner.model, torch.device("cpu"))


# -- training -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def continuations(tmp_path_factory):
    """A small-weight target's greedy continuations (runs and cycles: learnable) + features."""
    from tests.conftest import save_tiny_llama
    path = tmp_path_factory.mktemp("train_target")
    save_tiny_llama(path, num_hidden_layers=4, seed=3, initializer_range=0.12)
    llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=32, num_threads=1)
    prompts = [[random.Random(i).randrange(3, 380) for _ in range(6)] for i in range(24)]
    layers = Eagle3Recipe().aux_layers(llm.engine.model)
    seqs = prepare(llm, str(tmp_path_factory.mktemp("data")), layers, len(prompts), 24, 16, 0,
                   "tiny", prompts=prompts)
    return llm.engine.model, seqs


def test_draft_vocabulary_is_the_most_frequent_continuation_tokens(continuations):
    _, seqs = continuations
    ids = choose_draft_vocab(seqs, 384, 16)
    counts = torch.bincount(torch.cat([s.token_ids[s.prompt_len:] for s in seqs]), minlength=384)
    assert ids.tolist() == sorted(ids.tolist()) and len(set(ids.tolist())) == 16
    assert counts[ids].min() >= counts[torch.ones(384, dtype=torch.bool).index_fill_(0, ids, False)].max()
    assert choose_draft_vocab(seqs, 384, 384).tolist() == list(range(384))


def test_recipe_learns_and_measures_acceptance(continuations, tmp_path):
    from tokenmill.spec.train.trainer import TrainConfig, Trainer
    target, seqs = continuations
    train, heldout = seqs[:20], seqs[20:]
    recipe = Eagle3Recipe()
    assert recipe.aux_layers(target) == (0, 2, 3)
    options = {"draft_vocab": 96, "ttt_steps": 3, "positions_per_sequence": 16}
    torch.manual_seed(0)
    head = recipe.build(target, options, seed=0, data=train)
    assert head.lm_head.weight.shape == (96, 64) and int(head.t2d.sum()) == 96
    before = recipe.acceptance(head, target, train, k=3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses, rng = [], random.Random(0)
    for _ in range(120):
        loss, metrics = recipe.loss(head, target, rng.sample(train, 8))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(metrics["loss"])
    assert sum(losses[-10:]) < 0.3 * sum(losses[:10])
    # a random target's next token is hard to guess from 4 sequences it never saw: the
    # chains are checked where they learned, held-out ones only for their range
    after = recipe.acceptance(head, target, train, k=3)
    held = recipe.acceptance(head, target, heldout, k=3)
    assert len(after) == len(held) == 3 and all(0.0 <= a <= 1.0 for a in after + before + held)
    assert after[0] > max(before[0] + 0.3, 0.4) and after == sorted(after, reverse=True)
    # the shared trainer drives the recipe and leaves a checkpoint load_eagle3 reads
    cfg = TrainConfig(steps=2, batch_sequences=2, eval_every=2, checkpoint_every=2, k=2,
                      options=options)
    summary = Trainer(recipe, target, train, heldout, cfg, str(tmp_path), progress=False).run()
    assert len(summary["heldout_acceptance"]) == 2
    loaded = load_eagle3(str(tmp_path), target, torch.device("cpu"))
    assert loaded.config.draft_vocab_size == 96 and torch.equal(loaded.d2t, head.d2t)


# -- end to end -----------------------------------------------------------------------------
def eagle3_llm(model_dir, quantization=None, **kw):
    kw.setdefault("num_kv_blocks", 256)
    return LLM(model=model_dir, skip_tokenizer_init=True, num_threads=1, **kw,
               speculative_config=dict(method="eagle3", num_speculative_tokens=3, adaptive=False,
                                       quantization=quantization))


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    return run(LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=256, num_threads=1), PROMPTS)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_equals_plain(tiny_llama_dir, plain_outputs, quantization):
    llm = eagle3_llm(tiny_llama_dir, quantization)
    assert isinstance(llm.engine.runner.spec.proposer, Eagle3Proposer)
    head = llm.engine.runner.spec.proposer.head
    assert (head.lm_head.packed is not None) == (quantization is not None)
    assert run(llm, PROMPTS) == plain_outputs
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]


class CheckingProposer(Eagle3Proposer):
    """Compares every chain with a dense one over features recomputed by running the target
    over the request's tokens in one prefill."""

    def __init__(self, base: Eagle3Proposer, runner) -> None:
        super().__init__(base.head, base.target, base.kv_cache, base.features, base.backend,
                         base.block_size, base.device)
        self.runner, self.checked = runner, 0

    def draft(self, states, counts, widths=()):
        drafts = super().draft(states, counts, widths)
        for s, d in zip(states, drafts):
            if self.checked >= 60:   # enough seen (each check reruns the target)
                break
            b = s.num_tokens - 1
            aux, _ = next(extract_features(self.runner, [s.tokens(0, b)], self.aux_layers))
            assert d == dense_drafts(self.head, self.target, s.tokens(0, b + 1), aux, len(d))
            self.checked += 1
        return drafts


@pytest.mark.parametrize("blocks, what", [(14, "num_preemptions"), (40, "prefix_cache_hit_rate")])
def test_paged_state_is_right_under_chunking_preemption_and_prefix_cache(tiny_llama_dir, plain_outputs,
                                                                         blocks, what):
    # lookahead slots make the small pool preempt, the larger one keep cached prefixes
    llm = eagle3_llm(tiny_llama_dir, num_kv_blocks=blocks, max_num_batched_tokens=24, max_num_seqs=8)
    runner = llm.engine.runner
    runner.spec.proposer = checker = CheckingProposer(runner.spec.proposer, runner)
    for _ in range(2):   # cold, then warm prefix cache
        assert run(llm, PROMPTS) == plain_outputs
    assert checker.checked > 20 and llm.get_stats()[what] > 0
    mem = llm.get_memory_stats()
    assert mem["num_free_blocks"] == mem["num_total_blocks"]


class Streaks:
    """A k controller that drafts in short bursts between long k = 0 streaks (adaptive k's
    pattern when speculation rarely pays), so features queue up between drafts."""

    def __init__(self, k: int, on: int = 2, off: int = 7) -> None:
        self.k, self.on, self.off, self.step = k, on, off, 0

    def choose(self, batch_size: int) -> tuple[int, int]:
        self.step += 1
        return (self.k if self.step % (self.on + self.off) < self.on else 0), 0

    def record(self, *args, **kwargs) -> None:
        pass

    def estimated_speedup(self) -> float:
        return 0.0


@pytest.mark.parametrize("max_rows", [5, 256])   # flushed when full, or only before drafts
def test_queued_features_leave_every_chain_right(tiny_llama_dir, plain_outputs, max_rows):
    llm = eagle3_llm(tiny_llama_dir, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)
    runner = llm.engine.runner
    runner.spec.controller = Streaks(3)
    runner.spec.proposer = checker = CheckingProposer(runner.spec.proposer, runner)
    checker.pending.max_rows = max_rows
    queued = []
    take = checker.pending.take
    checker.pending.take = lambda: queued.append(len(checker.pending.steps)) or take()
    for _ in range(2):   # cold, then warm prefix cache
        assert run(llm, PROMPTS) == plain_outputs
    assert checker.checked > 20 and max(queued) > (1 if max_rows == 5 else 3)   # steps written together


def test_last_writes_keeps_the_newest_of_each_slot():
    from tokenmill.spec.draft_input import last_writes
    slots = torch.tensor([7, 3, 7, 9, 3, 0])
    assert last_writes(slots).tolist() == [2, 3, 4, 5]


def test_build_from_a_checkpoint(tiny_llama_dir, tmp_path):
    from tokenmill.config import SpeculativeConfig
    runner = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, num_kv_blocks=32,
                 num_threads=1).engine.runner
    save_eagle3(make_head_small(runner.model), str(tmp_path))
    proposer = build_eagle3_proposer(SpeculativeConfig(method="eagle3", model=str(tmp_path)),
                                     runner, 32)
    assert proposer.aux_layers == (0, 1) and proposer.features.shape == (32 * runner.block_size, 64)


def make_head_small(target):
    return init_weights(Eagle3Head(config_for_target(target, 100)), 0, std=0.1)
