"""DFlash in the engine: the proposer (a paged context cache + one block forward per draft
call), the loader / writer of z-lab's checkpoint layout, and the random drafter for exactness
tests. The math is in tokenmill.spec.dflash_model.

Context cache: per draft layer, the context K (after k_proj, k_norm, RoPE) and V of every
verified position, in paged tensors indexed by the target's block tables (slot of position p:
block_ids[p // block_size] * block_size + p % block_size). K/V rather than the ``fc`` output:
each row is projected once, when its token is verified, and a draft call only gathers; keeping
the fc output would redo num_layers k/v projections of the whole context on every call, for a
cache 2 * kv_heads * head_dim / hidden per layer smaller. An entry depends only on the target's
feature at its position, which depends only on tokens <= that position: entries stay valid
under prefix caching (a cached block's rows were written when its tokens were verified) and
never need rolling back (rows of rejected drafts are never written; a position verified again
overwrites its slot). Nothing is written past the verified positions: no lookahead slots.

Checkpoint layout (z-lab/dflash, "DFlashDraftModel"): config.json as a Qwen3 config with
``block_size`` and ``dflash_config`` {``target_layer_ids``, ``mask_token_id``}; weights fc,
hidden_norm, norm, layers.i.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}. z-lab's layer id l reads HF
``hidden_states[l + 1]`` (index 0 is the embeddings), the output of decoder layer l: the same
number in tokenmill.spec.draft_input's numbering, so ids load unchanged.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from tokenmill.spec.coupled import coupled, draft_tokens
from tokenmill.spec.dflash_model import (DFlashConfig, DFlashDrafter, init_weights,
                                         spread_layer_ids)
from tokenmill.spec.draft_head import DraftHead
from tokenmill.spec.drafter_files import load_checked_state, read_drafter_dir
from tokenmill.spec.trainable import quantize_linears
from tokenmill.spec.draft_input import (DraftInput, PendingFeatures, StepFeatures, last_writes,
                                        paged_slots, record_then_draft, run_slots,
                                        validate_aux_layers)

__all__ = ["DFlashConfig", "DFlashDrafter", "DFlashProposer", "build_dflash_proposer",
           "config_for_target", "load_dflash", "save_dflash"]


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])          # [num_blocks * block_size, kv_heads, D]


class DFlashProposer:
    needs_lookahead = False   # only verified positions are written
    couples_noise = True      # random rows race with the target's noise (spec/coupled.py)

    def __init__(self, drafter: DFlashDrafter, target, kv_caches: list, block_size: int,
                 device) -> None:
        self.drafter, self.target = drafter, target
        self.kv_caches = kv_caches      # per draft layer (K, V) [blocks, block_size, kv_heads, D]
        self.block_size = block_size    # the target's page size (its block tables index these)
        self.device = device
        self.aux_layers = drafter.config.target_layer_ids
        self.max_drafts = drafter.block_size - 1
        self.head = DraftHead(target, getattr(drafter, "draft_vocab_ids", None))
        self.pending = PendingFeatures()   # steps' features not yet recorded

    def drop(self, req_ids) -> None:
        pass    # the cache belongs to the target's blocks, not to requests

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> list[list[int]]:
        return record_then_draft(self, inp)

    def draft(self, states: list, counts: list[int], widths: tuple = ()) -> list[list[int]]:
        """One block forward per state; at most counts[i] (and block_size - 1) drafts each
        (chains: ``widths`` is not used)."""
        want = [min(n, self.max_drafts) for n in counts]
        return [g[:n] for g, n in zip(self._draft(states, max(want)), want)]

    def record(self, f: StepFeatures) -> None:
        """Writes the context K/V of every verified row of one or more steps (in step order:
        a slot written twice keeps its newest entry)."""
        slots, positions = run_slots(f, self.block_size)
        slots = slots.to(self.device)
        keep = last_writes(slots)
        kv = self.drafter.context_kv(f.aux.to(self.device)[keep], positions.to(self.device)[keep])
        for (k_cache, v_cache), (k, v) in zip(self.kv_caches, kv):
            _flat(k_cache)[slots[keep]] = k.to(k_cache.dtype)
            _flat(v_cache)[slots[keep]] = v.to(v_cache.dtype)

    def _draft(self, states: list, num_rows: int) -> list[list[int]]:
        """Block rows 1..num_rows of every state: their argmax, or at T > 0 their race with
        the target's noise at the output positions they predict (spec/coupled.py)."""
        h = self.block_hidden(states)[:, 1:1 + num_rows]                     # [R, rows, hidden]
        h = h.reshape(-1, h.shape[-1])
        if not any(coupled(s) for s in states):
            return self.head.argmax(h).view(len(states), num_rows).tolist()
        rows = [s for s in states for _ in range(num_rows)]
        positions = [len(s.output_token_ids) + j for s in states for j in range(num_rows)]
        tokens = draft_tokens(self.head.logits(h).float(), rows, positions,
                              self.target.args.vocab_size, self.head.to_target)
        return tokens.view(len(states), num_rows).tolist()

    def block_hidden(self, states: list) -> torch.Tensor:
        """[R, block_size, hidden]: one block forward per state; the block starts at the newest
        token b and its context is positions 0..b-1, gathered from the paged cache."""
        newest = [s.num_tokens - 1 for s in states]
        width, bs, dev = max(newest), self.drafter.block_size, self.device
        slots = torch.stack([torch.cat([paged_slots(s.block_ids, torch.arange(b), self.block_size),
                                        torch.zeros(width - b, dtype=torch.int64)])
                             for s, b in zip(states, newest)]).to(dev)          # [R, width]
        context = [(_flat(k)[slots], _flat(v)[slots]) for k, v in self.kv_caches]
        start = torch.tensor(newest, dtype=torch.int64, device=dev)
        mask = None
        if min(newest) < width:   # shorter contexts are padded: hide the padding
            seen = torch.arange(width, device=dev) < start[:, None]
            own = torch.ones(len(states), bs, dtype=torch.bool, device=dev)
            mask = torch.cat([seen, own], dim=1)[:, None, :].expand(-1, bs, -1)
        first = torch.tensor([s.tokens(b, b + 1)[0] for s, b in zip(states, newest)], device=dev)
        x = self.drafter.block_input(self.target.model.embed_tokens, first)
        positions = start[:, None] + torch.arange(bs, device=dev)
        return self.drafter(x, positions, context, mask)


# -- configs and checkpoints -----------------------------------------------------------------
# tokenmill's extra tensor: the draft vocabulary (ascending target ids) the proposer's head
# is restricted to (tokenmill.spec.draft_head); checkpoints without it use the whole head.
DRAFT_VOCAB_KEY = "draft_vocab_ids"

def target_dtype(target) -> torch.dtype:
    return target.model.norm.weight.dtype


def config_for_target(target, num_layers: int = 1, block_size: int = 16,
                      target_layer_ids: Optional[tuple] = None,
                      mask_token_id: Optional[int] = None) -> DFlashConfig:
    """A drafter shaped like one of the target's layers (z-lab's choice). Default mask token:
    the last id (a target without a mask token has no spare row; the last BPE merge is rare)."""
    a = target.args
    ids = target_layer_ids or spread_layer_ids(a.num_hidden_layers, 5)
    return DFlashConfig(
        hidden_size=a.hidden_size, num_layers=num_layers, num_heads=a.num_attention_heads,
        num_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
        intermediate_size=a.intermediate_size, target_layer_ids=tuple(ids),
        mask_token_id=a.vocab_size - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling, num_target_layers=a.num_hidden_layers)


def _check_supported(cfg: dict) -> None:
    extra = cfg.get("dflash_config") or {}
    arch = " ".join(cfg.get("architectures") or [])
    if "DFlash2" in arch or "selector_rank" in extra or "conv_kernel_size" in extra:
        raise ValueError("DFlash2 checkpoints (dynamic convolutions, candidate selector) are "
                         "not supported; only DFlashDraftModel")
    if cfg.get("is_causal") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError("dflash: causal or sliding-window draft layers are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"dflash: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if extra.get("output_multiplier", 1.0) != 1.0 or extra.get("final_logit_softcapping"):
        raise ValueError("dflash: output_multiplier / final_logit_softcapping are not supported")


def config_from_hf(cfg: dict) -> DFlashConfig:
    """z-lab's config.json -> DFlashConfig (their ``dflash_config`` keys win over top-level
    ones, as in their loader)."""
    _check_supported(cfg)
    extra = cfg.get("dflash_config") or {}

    def pick(name, default=None):
        return extra.get(name, cfg.get(name, default))

    layers = cfg["num_hidden_layers"]
    ids = pick("target_layer_ids")
    if ids is None:   # older checkpoints: z-lab's default, one target layer per draft layer
        if not cfg.get("num_target_layers"):
            raise ValueError("dflash config names neither target_layer_ids nor num_target_layers")
        ids = spread_layer_ids(cfg["num_target_layers"], layers)
    if pick("mask_token_id") is None:
        raise ValueError("dflash config has no mask_token_id (dflash_config.mask_token_id): "
                         "add the id of the tokenizer's mask token the drafter was trained with")
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":   # transformers 5
        scaling = rope
    heads = cfg["num_attention_heads"]
    return DFlashConfig(
        hidden_size=cfg["hidden_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"], target_layer_ids=tuple(ids),
        mask_token_id=int(pick("mask_token_id")), block_size=int(pick("block_size", 16)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=scaling, attention_bias=bool(cfg.get("attention_bias", False)),
        input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
        num_target_layers=int(cfg.get("num_target_layers") or 0))


def config_to_hf(c: DFlashConfig, vocab_size: Optional[int] = None) -> dict:
    extra = {"block_size": c.block_size, "mask_token_id": c.mask_token_id,
             "target_layer_ids": list(c.target_layer_ids)}
    if c.input_embedding_scale != 1.0:
        extra["input_embedding_scale"] = c.input_embedding_scale
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
           "attention_bias": c.attention_bias, "attention_dropout": 0.0,
           "layer_types": ["full_attention"] * c.num_layers, "use_sliding_window": False,
           "sliding_window": None, "tie_word_embeddings": False, "block_size": c.block_size,
           "dflash_config": extra}
    if c.num_target_layers:
        cfg["num_target_layers"] = c.num_target_layers
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def _load_state(drafter: DFlashDrafter, tensors: dict, path: str) -> None:
    state = {(n[len("model."):] if n.startswith("model.") else n): t for n, t in tensors.items()
             if not n.endswith("rotary_emb.inv_freq")}
    load_checked_state(drafter, state, path, "a DFlash drafter")


def load_dflash(path: str, target, device) -> DFlashDrafter:
    """A z-lab layout directory -> the drafter, checked against the target, in its dtype."""
    cfg, tensors = read_drafter_dir(path)
    config = config_from_hf(cfg)
    a = target.args
    if config.hidden_size != a.hidden_size:
        raise ValueError(f"dflash drafter hidden size {config.hidden_size} differs from the "
                         f"target's {a.hidden_size}: it was trained for another model")
    validate_aux_layers(config.target_layer_ids, a.num_hidden_layers, "dflash")
    if not 0 <= config.mask_token_id < a.vocab_size:
        raise ValueError(f"dflash mask_token_id {config.mask_token_id} is outside the target's "
                         f"vocabulary ({a.vocab_size})")
    ids = tensors.pop(DRAFT_VOCAB_KEY, None)
    if ids is not None and (ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0
                            or int(ids.max()) >= a.vocab_size):
        raise ValueError(f"{path}: {DRAFT_VOCAB_KEY} must list token ids of the target's "
                         f"vocabulary ({a.vocab_size})")
    drafter = DFlashDrafter(config)
    _load_state(drafter, tensors, path)
    drafter = drafter.to(device=device, dtype=target_dtype(target)).eval()
    drafter.draft_vocab_ids = None if ids is None else ids.to(torch.int64)
    return drafter


def save_dflash(drafter: DFlashDrafter, path: str, vocab_size: Optional[int] = None) -> None:
    """The layout ``load_dflash`` (and z-lab's loader, given their modelling code) reads."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(drafter.config, vocab_size), f, indent=1)
    tensors = {n: t.detach().contiguous() for n, t in drafter.state_dict().items()}
    ids = getattr(drafter, "draft_vocab_ids", None)
    if ids is not None:
        tensors[DRAFT_VOCAB_KEY] = ids.to(torch.int64).contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))


def random_dflash(target, seed: int, device, num_layers: int = 1,
                  block_size: int = 16) -> DFlashDrafter:
    drafter = init_weights(DFlashDrafter(config_for_target(target, num_layers, block_size)), seed)
    return drafter.to(device=device, dtype=target_dtype(target)).eval()


def build_dflash_proposer(config, runner, num_blocks: int) -> DFlashProposer:
    """``config.model``: a checkpoint directory, or None for a seeded random drafter (exactness
    tests). Its context cache has the target's page size and block count."""
    from tokenmill.runner.kv_tensors import allocate_kv_caches
    target = runner.model
    if config.model:
        drafter = load_dflash(config.model, target, runner.device)
    else:
        drafter = random_dflash(target, config.seed, runner.device)
    if config.quantization:
        quantize_linears(drafter, config.quantization)
    c = drafter.config
    caches = allocate_kv_caches(c.num_layers, num_blocks, runner.block_size, c.num_kv_heads,
                                c.head_dim, drafter.param_dtype, runner.device)
    return DFlashProposer(drafter, target, caches, runner.block_size, runner.device)
