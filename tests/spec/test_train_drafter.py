"""Drafter training on a tiny target: the self-distillation data (cached continuations, hidden
states aligned with positions), the shared loop (a resumed run ends with the same weights as
an uninterrupted one), and a trained Medusa drafter that is both exact and accepted."""
import json
import os
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.spec.train.data import prepare, split_heldout
from tokenmill.spec.train.medusa_recipe import MedusaRecipe
from tokenmill.spec.train.target_ops import head_logits
from tokenmill.spec.train.trainer import TrainConfig, Trainer, tau_of

PROMPTS = [[random.Random(i).randrange(3, 380) for _ in range(random.Random(-i).randrange(4, 12))]
           for i in range(64)]


@pytest.fixture(scope="module")
def target_dir(looping_llama_dir):
    return looping_llama_dir


@pytest.fixture(scope="module")
def llm(target_dir):
    return LLM(model=target_dir, skip_tokenizer_init=True, num_kv_blocks=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def data(llm, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("drafter_data"))
    seqs = prepare(llm, folder, (1, 3), len(PROMPTS), 24, 64, 0, "tiny", prompts=PROMPTS)
    return folder, seqs


def test_data_is_the_targets_greedy_continuation_with_aligned_features(llm, data):
    folder, seqs = data
    assert len(seqs) == len(PROMPTS)
    target = llm.engine.model
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                        SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for seq, prompt, out in zip(seqs, PROMPTS, outs):
        assert seq.token_ids.tolist() == prompt + list(out.outputs[0].token_ids)
        assert seq.prompt_len == len(prompt)
        assert seq.aux.shape == (seq.num_tokens, 2 * 64) and seq.final.shape == (seq.num_tokens, 64)
        # row p predicts token p + 1: greedy, so the head's argmax is the next token
        pred = head_logits(target, seq.final).argmax(-1)
        assert torch.equal(pred[seq.prompt_len - 1:-1], seq.token_ids[seq.prompt_len:])
    # the continuations are cached: asking again reads the file, not the target
    before = os.path.getmtime(os.path.join(folder, "continuations.json"))
    again = prepare(llm, folder, (1, 3), len(PROMPTS), 24, 64, 0, "tiny", prompts=PROMPTS)
    assert os.path.getmtime(os.path.join(folder, "continuations.json")) == before
    assert all(torch.equal(a.aux, b.aux) for a, b in zip(seqs, again))


def test_layer_ids_outside_the_target_are_refused():
    from tokenmill.spec.draft_input import validate_aux_layers
    with pytest.raises(ValueError, match="outside the target"):
        validate_aux_layers((1, 4), 4, "eagle3")
    with pytest.raises(ValueError, match="twice"):     # the C stack writes one column block each
        validate_aux_layers((1, 2, 1), 4, "eagle3")


class _Interrupt(Exception):
    pass


class _StopAt(MedusaRecipe):
    def __init__(self, stop: int) -> None:
        self.stop, self.calls = stop, 0

    def loss(self, heads, target, batch):
        self.calls += 1
        if self.calls == self.stop:
            raise _Interrupt
        return super().loss(heads, target, batch)


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(llm, data, tmp_path):
    _, seqs = data
    cfg = TrainConfig(steps=8, batch_sequences=4, checkpoint_every=3, eval_every=4, k=2)
    target = llm.engine.model
    whole = Trainer(MedusaRecipe(), target, seqs, seqs[:2], cfg, str(tmp_path / "a"), progress=False)
    whole.run()
    with pytest.raises(_Interrupt):
        Trainer(_StopAt(5), target, seqs, seqs[:2], cfg, str(tmp_path / "b"), progress=False).run()
    resumed = Trainer(MedusaRecipe(), target, seqs, seqs[:2], cfg, str(tmp_path / "b"), progress=False)
    resumed.run()
    assert resumed.log[0]["step"] == 1 and len(resumed.log) == 8
    for (name, a), (_, b) in zip(whole.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        assert torch.equal(a, b), name
    other = TrainConfig(steps=8, batch_sequences=4, checkpoint_every=3, eval_every=4, k=2, lr=5e-4)
    with pytest.raises(ValueError, match="another run"):
        Trainer(MedusaRecipe(), target, seqs, seqs[:2], other, str(tmp_path / "b"), progress=False).run()
    longer = TrainConfig(steps=10, batch_sequences=4, checkpoint_every=3, eval_every=4, k=2)
    extended = Trainer(MedusaRecipe(), target, seqs, seqs[:2], longer, str(tmp_path / "b"), progress=False)
    extended.run()   # a finished run goes on for two more steps
    assert [r["step"] for r in extended.log][-3:] == [8, 9, 10]
    for name in ("training_curves.png", "training_log.json", "config.json", "model.safetensors"):
        assert os.path.isfile(tmp_path / "b" / name)


def test_trained_medusa_is_accepted_on_heldout_prompts_and_exact(llm, data, target_dir, tmp_path):
    _, seqs = data
    train, heldout = split_heldout(seqs, 0.2, seed=0)
    cfg = TrainConfig(steps=150, batch_sequences=8, lr=3e-3, eval_every=150, k=3,
                      options={"num_heads": 3})
    trainer = Trainer(MedusaRecipe(), llm.engine.model, train, heldout, cfg, str(tmp_path),
                      progress=False)
    summary = trainer.run()
    assert summary["heldout_tau"] > 1.5, summary
    # it learned (the heads start as identity maps, which already guess runs of one token)
    first = sum(r["loss"] for r in trainer.log[:10]) / 10
    assert summary["final_loss"] < 0.7 * first, (first, summary["final_loss"])
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["medusa_shared_lm_head"] is True
    # drafts accepted on held-out prompts
    assert _served_tau(llm, target_dir, "medusa", str(tmp_path), heldout, 24) > 1.5


def _served_tau(llm, target_dir, method, drafter_dir, heldout, max_tokens) -> float:
    """Serves the trained drafter on the held-out prompts: greedy output must equal the
    target alone; returns the engine's mean acceptance length."""
    spec = LLM(model=target_dir, skip_tokenizer_init=True, num_kv_blocks=256,
               speculative_config=dict(method=method, model=drafter_dir,
                                       num_speculative_tokens=3, adaptive=False))
    prompts = [{"prompt_token_ids": s.token_ids[:s.prompt_len].tolist()} for s in heldout]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == ref
    return spec.get_stats()["spec_mean_acceptance_length"]


def test_tau_counts_the_targets_own_token():
    assert tau_of([0.5, 0.25]) == 1.75


def test_dense_training_stack_computes_the_targets_hidden_states(llm, data):
    from tokenmill.spec.train.dense_llama import DenseLlama
    _, seqs = data
    target = llm.engine.model
    full = DenseLlama.from_target(target, target.args.num_hidden_layers)
    with torch.no_grad():
        for seq in seqs[:3]:
            out = full(target.model.embed_tokens(seq.token_ids).float())
            torch.testing.assert_close(out, seq.final, atol=5e-3, rtol=1e-3)   # stored as fp16


def test_distilled_draft_model_learns_and_serves_exactly(llm, data, target_dir, tmp_path):
    from tokenmill.spec.train.distill_recipe import DistillRecipe
    _, seqs = data
    train, heldout = split_heldout(seqs, 0.2, seed=0)
    cfg = TrainConfig(steps=40, batch_sequences=8, lr=2e-3, eval_every=40, k=3,
                      options={"num_layers": 1})
    trainer = Trainer(DistillRecipe(), llm.engine.model, train, heldout, cfg, str(tmp_path), progress=False)
    summary = trainer.run()
    first = sum(r["loss"] for r in trainer.log[:5]) / 5
    assert summary["final_loss"] < 0.8 * first, (first, summary["final_loss"])
    assert len(summary["heldout_acceptance"]) == 3 and summary["heldout_tau"] > 1.0
    assert _served_tau(llm, target_dir, "draft_model", str(tmp_path), heldout, 16) > 1.0


class _CharTokenizer:
    """One id per character of the user text (the template adds nothing)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert len(messages) == 1 and messages[0]["role"] == "user"
        return [ord(c) for c in messages[0]["content"]]


def test_calibration_prompts_take_opening_turns_first_then_every_later_user_turn(monkeypatch):
    from tokenmill.data import sharegpt
    from tokenmill.spec.train.data import calibration_prompts

    def turns(*texts):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                for i, t in enumerate(texts)]
    convs = [turns("a1", "r", "a2", "r", "a3"), turns("b1", "r", "b2-far-too-long"),
             turns("c1", "r", " ", "r", "c2")]
    monkeypatch.setattr(sharegpt, "conversations", lambda split, cache_dir=None: [list(c) for c in convs])
    text = lambda prompts: sorted("".join(map(chr, p)) for p in prompts)
    tok = _CharTokenizer()
    first = calibration_prompts(tok, 100, 8, seed=0)
    assert text(first) == ["a1", "b1", "c1"]
    every = calibration_prompts(tok, 100, 8, seed=0, turns="all")
    assert text(every[:3]) == ["a1", "b1", "c1"]      # opening turns first
    assert text(every) == ["a1", "a2", "a3", "b1", "c1", "c2"]   # no replies, blanks or long ones
    assert len(calibration_prompts(tok, 4, 8, seed=0, turns="all")) == 4
    with pytest.raises(ValueError, match="turns"):
        calibration_prompts(tok, 4, 8, seed=0, turns="later")


def test_cached_continuations_are_redone_for_other_turns(llm, tmp_path, monkeypatch):
    from tokenmill.spec.train import data as data_mod
    calls = []
    real = data_mod.generate_continuations
    monkeypatch.setattr(data_mod, "generate_continuations",
                        lambda *a: calls.append(1) or real(*a))
    folder = str(tmp_path)
    prompts = PROMPTS[:2]
    data_mod.prepare(llm, folder, (1,), 2, 4, 64, 0, "tiny", prompts=prompts)
    path = os.path.join(folder, "continuations.json")
    with open(path) as f:
        cached = json.load(f)
    del cached["turns"]                                  # a cache from before the fact existed
    with open(path, "w") as f:
        json.dump(cached, f)
    data_mod.prepare(llm, folder, (1,), 2, 4, 64, 0, "tiny", prompts=prompts)   # opening turns
    assert len(calls) == 1
    data_mod.prepare(llm, folder, (1,), 2, 4, 64, 0, "tiny", prompts=prompts, turns="all")
    assert len(calls) == 2


def test_sampled_passes_add_seeded_continuations_of_the_same_prompts(llm, tmp_path, monkeypatch):
    from tokenmill.spec.train import data as data_mod
    calls = []
    real = data_mod.generate_continuations
    monkeypatch.setattr(data_mod, "generate_continuations",
                        lambda *a: calls.append(a[3]) or real(*a))
    folder, prompts = str(tmp_path), PROMPTS[:6]
    seqs = data_mod.prepare(llm, folder, (1,), 6, 12, 64, 0, "tiny", prompts=prompts,
                            sampled_passes=1, temperature=1.0)
    assert calls == [0.0, 1.0] and len(seqs) == 12
    greedy, sampled = seqs[:6], seqs[6:]
    assert [s.sampled for s in seqs] == [False] * 6 + [True] * 6
    assert [s.prompt_index for s in sampled] == list(range(6))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=1.0, max_tokens=12, seed=1_000_003 + j)
                         for j in range(6)], use_tqdm=False)
    for seq, g, prompt, out in zip(sampled, greedy, prompts, outs):
        assert seq.token_ids.tolist() == prompt + list(out.outputs[0].token_ids)
        # the prompt's rows are the greedy sequence's rows: same tokens, same target
        n = len(prompt)
        assert torch.allclose(seq.final[:n], g.final[:n], atol=1e-3)
        assert torch.allclose(seq.aux[:n], g.aux[:n], atol=1e-3)
    assert any(not torch.equal(s.token_ids, g.token_ids) for s, g in zip(sampled, greedy))
    # cached per pass: the same request generates nothing, another temperature only the sample
    data_mod.prepare(llm, folder, (1,), 6, 12, 64, 0, "tiny", prompts=prompts,
                     sampled_passes=1, temperature=1.0)
    data_mod.prepare(llm, folder, (1,), 6, 12, 64, 0, "tiny", prompts=prompts,
                     sampled_passes=1, temperature=0.5)
    assert calls == [0.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="temperature > 0"):
        data_mod.prepare(llm, folder, (1,), 6, 12, 64, 0, "tiny", prompts=prompts,
                         sampled_passes=1, temperature=0.0)


def test_held_out_prompts_keep_their_sampled_continuations_out_of_training(data):
    from dataclasses import replace
    _, seqs = data
    sampled = [replace(s, sampled=True) for s in seqs]
    train, heldout = split_heldout(seqs + sampled, 0.2, seed=0)
    assert heldout and all(not s.sampled for s in heldout)
    held = {s.prompt_index for s in heldout}
    assert held == {s.prompt_index for s in split_heldout(seqs, 0.2, seed=0)[1]}
    assert len(train) == 2 * (len(seqs) - len(held))
    assert not any(s.prompt_index in held for s in train)


def test_final_states_alone_are_taken_from_a_finished_folder_and_redone_for_new_tokens(
        llm, tmp_path, monkeypatch):
    from tokenmill.spec.train import data as data_mod
    calls = []
    real = data_mod.extract_features
    monkeypatch.setattr(data_mod, "extract_features", lambda *a: calls.append(a[2]) or real(*a))
    folder, prompts = str(tmp_path), PROMPTS[:5]
    with_layers = data_mod.prepare(llm, folder, (1, 3), 5, 8, 64, 0, "tiny", prompts=prompts)
    # Medusa / a draft model read the final states only: the (1, 3) run already holds them
    final_only = data_mod.prepare(llm, folder, (), 5, 8, 64, 0, "tiny", prompts=prompts)
    assert calls == [(1, 3)]
    for a, b in zip(with_layers, final_only):
        assert torch.equal(a.final, b.final) and b.aux.shape == (a.num_tokens, 0)
    # the build time stays recorded: generation + the one target run, for either folder
    built = data_mod.build_seconds(folder, (1, 3))
    assert built is not None and built >= 0 and data_mod.build_seconds(folder, ()) == built
    # the cached continuations change token for token, lengths kept (offsets equal): both
    # folders are stale, and the layers are computed again rather than read
    path = os.path.join(folder, "continuations.json")
    with open(path) as f:
        cached = json.load(f)
    for s in cached["sequences"]:
        s["output"] = [(t + 1) % 380 + 3 for t in s["output"]]
    with open(path, "w") as f:
        json.dump(cached, f)
    again = data_mod.prepare(llm, folder, (), 5, 8, 64, 0, "tiny", prompts=prompts)
    assert calls == [(1, 3), ()]
    assert not all(torch.equal(a.final, b.final) for a, b in zip(final_only, again))
    assert all(torch.equal(a.final, b.final) for a, b in zip(again, data_mod.prepare(
        llm, folder, (1, 3), 5, 8, 64, 0, "tiny", prompts=prompts)))
    assert calls == [(1, 3), (), (1, 3)]
