"""EAGLE-3 in the engine: the proposer (the drafter's own paged KV across steps), loaders of
published checkpoints (the speculators layout and the EAGLE repo's) and our writer. The math
and the terms (feature g, entry p, chain) are in tokenmill.spec.eagle3_model.

Paged state, indexed by the target's block tables (slot of position p:
block_ids[p // block_size] * block_size + p % block_size):
- K/V of entry p (the drafter's single layer), written when t_p and g(p - 1) are known;
- g(p), the projected feature of every verified position, so that the first entry of a step's
  rows can read its predecessor's feature even when that position was verified by another
  request (a prefix-cache hit) or in an earlier prefill chunk.
Both depend only on tokens <= p: valid under prefix caching, no rollback. A step's verified
rows [s, s + n) write entries s..s + n - 1 and g(s)..g(s + n - 1). Drafting from the newest
token b writes entry b (verified data: t_b and g(b - 1)) and then speculative entries
b + 1..b + k - 1 into the scheduler's lookahead slots (``needs_lookahead``); verification
rewrites the accepted ones and later queries never read the rest.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from tokenmill.layers.attention.base import write_kv
from tokenmill.spec import draft_tree
from tokenmill.spec.coupled import draft_tokens
from tokenmill.spec.draft_tree import DraftTree
from tokenmill.spec.trainable import init_weights, quantize_linears
from tokenmill.spec.drafter_files import load_checked_state, read_drafter_dir
from tokenmill.spec.draft_input import (DraftInput, PendingFeatures, StepFeatures, last_writes,
                                        paged_slots, record_then_draft, run_slots,
                                        validate_aux_layers)
from tokenmill.spec.eagle3_model import Eagle3Config, Eagle3Head, default_aux_layers

__all__ = ["Eagle3Config", "Eagle3Head", "Eagle3Proposer", "build_eagle3_proposer",
           "config_for_target", "load_eagle3", "random_eagle3", "save_eagle3"]


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots [end - start] of positions start..end-1 through one block table."""
    return paged_slots(block_ids, torch.arange(start, end), block_size)


class Eagle3Proposer:
    needs_lookahead = True   # the chain writes entries past the newest token
    couples_noise = True     # random rows race with the target's noise (spec/coupled.py)

    def __init__(self, head: Eagle3Head, target, kv_cache: tuple, features: torch.Tensor,
                 backend, block_size: int, device) -> None:
        self.head, self.target = head, target
        self.vocab = target.args.vocab_size   # the width of the target's logits and noise rows
        self.kv_cache = kv_cache    # (K, V) [num_blocks, block_size, kv_heads, D]
        self.features = features    # [num_blocks * block_size, hidden]: g of verified positions
        self.backend, self.block_size, self.device = backend, block_size, device
        self.aux_layers = head.config.aux_layers
        self.pending = PendingFeatures()   # steps' features not yet recorded

    def drop(self, req_ids) -> None:
        pass    # everything lives in the target's blocks

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> list[list[int]]:
        return record_then_draft(self, inp)

    def record(self, f: StepFeatures) -> None:
        """Entries and features of every verified row of one or more steps (in step order:
        a slot written twice keeps its newest entry)."""
        bs, dev, head = self.block_size, self.device, self.head
        g = head.project(f.aux.to(dev))
        slots, positions = run_slots(f, bs)
        slots = slots.to(dev)
        keep = last_writes(slots)
        # every feature first: a run's first entry reads its predecessor's, which an earlier
        # run of the same call may have written
        self.features[slots[keep]] = g[keep].to(self.features.dtype)
        # each row's predecessor: the row before it in its run, or for a run's first row the
        # stored feature of the position before (none at position 0: zeros)
        firsts, before = [], []
        row = 0
        for s, n, table in zip(f.starts, f.counts, f.block_ids):
            firsts.append(row)
            before.append(table[(s - 1) // bs] * bs + (s - 1) % bs if s > 0 else -1)
            row += n
        before = torch.tensor(before, dtype=torch.int64, device=dev)
        stored = self.features[before.clamp(min=0)].to(g.dtype)
        prev = torch.cat([g.new_zeros(1, g.shape[1]), g[:-1]])
        prev[torch.tensor(firsts, device=dev)] = torch.where((before >= 0)[:, None], stored,
                                                             torch.zeros_like(stored))
        tokens = torch.tensor([t for ids in f.token_ids for t in ids], device=dev)
        embeds = head.embed(self.target.model.embed_tokens, tokens)
        x, _ = head.layer.inputs(embeds, prev)
        cos, sin = head.rotary.cos_sin(positions.to(dev), x.dtype)
        k, v = head.layer.kv(x, cos, sin)
        write_kv(k[keep], v[keep], self.kv_cache[0], self.kv_cache[1], slots[keep])

    def draft(self, states: list, counts: list[int], widths: tuple = ()) -> list:
        """Chains from each state's newest token, ``counts[i]`` drafts each (never past
        the slots of its block table). ``widths[d]`` > 1: the chain's runners-up at depth
        d + 1 join as leaf alternatives (a DraftTree; spec/draft_tree.py): no extra forward,
        they come from the same logits."""
        bs, dev, head = self.block_size, self.device, self.head
        newest = [s.num_tokens - 1 for s in states]
        counts = [min(c, len(s.block_ids) * bs - b) for s, c, b in zip(states, counts, newest)]
        tokens = torch.tensor([s.tokens(b, b + 1)[0] for s, b in zip(states, newest)], device=dev)
        g = self.features[torch.cat([_slots(s.block_ids, b - 1, b, bs)
                                     for s, b in zip(states, newest)]).to(dev)]
        live = list(range(len(states)))
        drafts: list[list[int]] = [[] for _ in states]
        alternatives: list[list[list[int]]] = [[] for _ in states]
        for step in range(max(counts, default=0)):
            keep = [j for j, i in enumerate(live) if counts[i] > step]
            if len(keep) < len(live):
                index = torch.tensor(keep, device=dev)
                live, tokens, g = [live[j] for j in keep], tokens[index], g[index]
            positions = [newest[i] + step for i in live]
            g = self._forward([states[i] for i in live], positions, tokens, g)
            width = widths[step] if step < len(widths) else 1
            tokens = draft_tokens(head.logits(g), [states[i] for i in live],
                                  [len(states[i].output_token_ids) + step for i in live],
                                  self.vocab, head.to_target, width)
            others = [[]] * len(live)
            if width > 1:
                tokens, others = tokens[0], tokens[1].tolist()
            for i, t, alts in zip(live, tokens.tolist(), others):
                drafts[i].append(t)
                alternatives[i].append(alts)
        return [DraftTree(*draft_tree.build(d, a)) if any(a) else d
                for d, a in zip(drafts, alternatives)]

    def _forward(self, states: list, positions: list[int], tokens: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor:
        """One entry per chain at ``positions``: (tokens [R], g [R, hidden]) -> h [R, hidden]."""
        head, dev = self.head, self.device
        meta = self.backend.build_metadata([1] * len(states), [p + 1 for p in positions],
                                           [s.block_ids for s in states], self.block_size, dev)
        x, residual = head.layer.inputs(head.embed(self.target.model.embed_tokens, tokens), g)
        cos, sin = head.rotary.cos_sin(torch.tensor(positions, device=dev), x.dtype)
        q, k, v = head.layer.qkv(x, cos, sin)
        out = self.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                   self.kv_cache[0], self.kv_cache[1], meta, head.layer.scale)
        return head.layer.finish(out.reshape(out.shape[0], -1), residual)


# -- configs ---------------------------------------------------------------------------------
def config_for_target(target, draft_vocab_size: Optional[int] = None,
                      aux_layers: Optional[tuple] = None) -> Eagle3Config:
    """A drafter layer shaped like one of the target's (EAGLE-3's choice)."""
    a = target.args
    return Eagle3Config(
        hidden_size=a.hidden_size, num_heads=a.num_attention_heads,
        num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
        intermediate_size=a.intermediate_size,
        draft_vocab_size=min(draft_vocab_size or a.vocab_size, a.vocab_size),
        vocab_size=a.vocab_size,
        aux_layers=tuple(aux_layers or default_aux_layers(a.num_hidden_layers)),
        rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings)


def _layer_config(t: dict, extra: dict, aux_layers: tuple) -> Eagle3Config:
    """An HF decoder config ``t`` (+ EAGLE-3 keys in ``extra``) -> Eagle3Config."""
    if int(t.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"eagle3: drafters of {t['num_hidden_layers']} layers are not "
                         "supported (one decoder layer only)")
    if (t.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"eagle3: hidden_act {t['hidden_act']!r} is not supported (silu only)")
    kind = t.get("model_type", "llama")
    if kind not in ("llama", "qwen3"):
        raise ValueError(f"eagle3: layers of model_type {kind!r} are not supported "
                         "(llama, qwen3)")
    rope = t.get("rope_parameters") or {}
    scaling = t.get("rope_scaling") or \
        (rope if rope.get("rope_type", "default") != "default" else None)
    heads, hidden = t["num_attention_heads"], t["hidden_size"]
    return Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=t.get("num_key_value_heads") or heads,
        head_dim=t.get("head_dim") or hidden // heads, intermediate_size=t["intermediate_size"],
        draft_vocab_size=int(extra.get("draft_vocab_size") or t["vocab_size"]),
        vocab_size=int(t["vocab_size"]), aux_layers=aux_layers,
        target_hidden_size=int(extra.get("target_hidden_size") or 0),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(t.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=scaling, max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
        attention_bias=bool(t.get("attention_bias", False)),
        mlp_bias=bool(t.get("mlp_bias", False)), qk_norm=kind == "qwen3",
        norm_before_residual=bool(extra.get("norm_before_residual", False)),
        norm_before_fc=bool(extra.get("norm_before_fc", False)))


def config_from_checkpoint(cfg: dict, num_target_layers: int) -> Eagle3Config:
    """config.json of either layout -> Eagle3Config. Layer ids there count like HF's
    ``hidden_states`` (0 = the embeddings, l = the output of decoder layer l - 1, as vLLM
    and speculators read them): ours are one less. Without ids, EAGLE-3's default."""
    if cfg.get("speculators_model_type", "eagle3") != "eagle3":
        raise ValueError(f"not an eagle3 speculator: {cfg['speculators_model_type']!r}")
    layer_cfg = cfg.get("transformer_layer_config") or cfg       # speculators | EAGLE's own
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or \
        (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ours = tuple(int(i) - 1 for i in ids) if ids else default_aux_layers(num_target_layers)
    return _layer_config(layer_cfg, cfg, ours)


def config_to_speculators(c: Eagle3Config, speculative_tokens: int = 3,
                          verifier: Optional[str] = None) -> dict:
    layer = {"model_type": "qwen3" if c.qk_norm else "llama", "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
             "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
             "max_position_embeddings": c.max_position_embeddings,
             "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
             "vocab_size": c.vocab_size, "tie_word_embeddings": False}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
           "norm_before_residual": c.norm_before_residual,
           "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.aux_layers],
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy",
                                     "speculative_tokens": speculative_tokens}],
               "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    if c.target_hidden_size and c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if c.norm_before_fc:
        cfg["norm_before_fc"] = True
    return cfg


# -- checkpoints -----------------------------------------------------------------------------
def _our_names(tensors: dict) -> dict:
    """EAGLE's ``midlayer.`` is our ``layers.0.``; a ``model.`` prefix and RoPE tables go."""
    out = {}
    for name, t in tensors.items():
        name = name[len("model."):] if name.startswith("model.") else name
        if name.endswith("rotary_emb.inv_freq") or name.startswith("verifier_"):
            continue
        out[name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name] = t
    return out


def _check_target(c: Eagle3Config, target, path: str) -> None:
    a = target.args
    validate_aux_layers(c.aux_layers, a.num_hidden_layers, "eagle3")
    if (c.target_hidden_size or c.hidden_size) != a.hidden_size:
        raise ValueError(f"{path}: the drafter reads features of width "
                         f"{c.target_hidden_size or c.hidden_size}, the target's are "
                         f"{a.hidden_size}: it was trained for another model")
    if c.vocab_size != a.vocab_size:
        raise ValueError(f"{path}: the drafter's vocabulary ({c.vocab_size}) differs from the "
                         f"target's ({a.vocab_size})")


def load_eagle3(path: str, target, device) -> Eagle3Head:
    """A speculators-layout or EAGLE-layout directory -> the head, checked against the target,
    in the target's dtype. Own embeddings equal to the target's are dropped (shared)."""
    cfg, tensors = read_drafter_dir(path)
    c = config_from_checkpoint(cfg, target.args.num_hidden_layers)
    _check_target(c, target, path)
    state = _our_names(tensors)
    embed = state.pop("embed_tokens.weight", None)
    # a packed (GGUF) target embedding has no float weight to compare: keep the drafter's own
    target_embed = getattr(target.model.embed_tokens, "weight", None)
    own = embed is not None and not (target_embed is not None and embed.shape == target_embed.shape
                                     and torch.equal(embed.to(target_embed.device, target_embed.dtype),
                                                     target_embed))
    if own:
        state["embed_tokens.weight"] = embed
    elif c.hidden_size != target.args.hidden_size:
        raise ValueError(f"{path}: a drafter of width {c.hidden_size} needs its own embed_tokens")
    if "d2t" not in state and c.draft_vocab_size == c.vocab_size:   # full vocabulary: identity
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    head = Eagle3Head(c, own_embeddings=own)
    load_checked_state(head, {n: (t.to(torch.int64) if n == "d2t" else t.bool() if n == "t2d" else t)
                              for n, t in state.items()}, path, "an EAGLE-3 drafter")
    return head.to(device=device, dtype=target.model.norm.weight.dtype).eval()


def save_eagle3(head: Eagle3Head, path: str, speculative_tokens: int = 3,
                verifier: Optional[str] = None) -> None:
    """The speculators layout (read by ``load_eagle3`` and vLLM's eagle3 loader)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_speculators(head.config, speculative_tokens, verifier), f, indent=1)
    save_file({n: t.detach().contiguous() for n, t in head.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def random_eagle3(target, seed: int, device, std: float = 0.02) -> Eagle3Head:
    """A seeded random head over the full vocabulary (exactness tests)."""
    head = init_weights(Eagle3Head(config_for_target(target)), seed, std)
    return head.to(device=device, dtype=target.model.norm.weight.dtype).eval()


def build_eagle3_proposer(config, runner, num_blocks: int) -> Eagle3Proposer:
    """``config.model``: a checkpoint directory, or None for a seeded random head. The drafter's
    K/V and feature pages have the target's page size and block count."""
    from tokenmill.runner.kv_tensors import allocate_kv_caches
    target = runner.model
    if config.model:
        head = load_eagle3(config.model, target, runner.device)
    else:
        head = random_eagle3(target, config.seed, runner.device)
    if config.quantization:
        quantize_linears(head, config.quantization)
    c, dtype = head.config, head.param_dtype
    kv = allocate_kv_caches(1, num_blocks, runner.block_size, c.num_kv_heads, c.head_dim, dtype,
                            runner.device)[0]
    features = torch.zeros(num_blocks * runner.block_size, c.hidden_size, dtype=dtype,
                           device=runner.device)
    return Eagle3Proposer(head, target, kv, features, runner.backend, runner.block_size,
                          runner.device)
