"""Head-based drafters that read the target's hidden state: Medusa and EAGLE (chains, no
trees yet). Weights load from a directory (config.json + *.safetensors, names as the
reference checkpoints); without one the heads are random, which is enough to test exactness.

- Medusa: head i (ResBlocks + a vocab projection) maps the hidden state h that produced the
  newest token to a guess for the token i + 1 places after it. One pass, no KV.
- EAGLE: autoregression in feature space. Input at a step: fc([embed(token), feature]) where
  feature is the target's hidden state for the token's predecessor (then the head's own
  output); one decoder layer; the target's norm + head give the next draft. This chain
  attends only within itself (a scratch cache), not to the context: a simplification that
  costs acceptance with trained heads, never exactness.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from tokenmill.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM
from tokenmill.models.weights import load_weights
from tokenmill.spec.coupled import draft_tokens
from tokenmill.spec.drafter_files import read_drafter_dir
from tokenmill.layers.rotary import RotaryEmbedding


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [B, hidden]
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``shared_lm_head``: the heads end at their ResBlocks and share the target's LM head
    (tokenmill's trained heads: on a CPU each own vocabulary projection would cost as much
    memory traffic as the target's head, per head; config key ``medusa_shared_lm_head``)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1,
                 shared_lm_head: bool = False) -> None:
        super().__init__()
        self.shared_lm_head = shared_lm_head
        projection = [] if shared_lm_head else [nn.Linear(hidden, vocab, bias=False)]
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], *projection)
            for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.medusa_head)

    def logits(self, hidden: torch.Tensor, k: int, target) -> torch.Tensor:
        """hidden [B, H] -> [B, k, V]: heads 0..k-1 (head i guesses i + 1 places past the
        token ``hidden`` produced)."""
        outs = torch.stack([self.medusa_head[i](hidden) for i in range(k)], dim=1)
        if not self.shared_lm_head:
            return outs.float()
        b, _, h = outs.shape
        rows = outs.reshape(b * k, h).to(target.model.norm.weight.dtype)
        return target.compute_logits(rows).view(b, k, -1)


class MedusaProposer:
    needs_lookahead = False
    aux_layers = ()
    couples_noise = True   # random rows race with the target's noise (spec/coupled.py)

    def __init__(self, heads: MedusaHeads, target) -> None:
        self.heads, self.target = heads, target

    @torch.inference_mode()
    def propose(self, inp) -> list[list[int]]:
        states, num_drafts, hidden = inp.states, inp.num_drafts, inp.hidden
        k = max(num_drafts, default=0)
        if k == 0:
            return [[] for _ in states]
        logits = self.heads.logits(hidden.to(self._dtype()), k, self.target)   # [B, k, V]
        rows = [s for s in states for _ in range(k)]   # head j guesses output position n0 + j
        positions = [len(s.output_token_ids) + j for s in states for j in range(k)]
        guesses = draft_tokens(logits.reshape(len(states) * k, -1).float(), rows, positions,
                               self.target.args.vocab_size)
        return [g[:n] for g, n in zip(guesses.view(len(states), k).tolist(), num_drafts)]

    def _dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype

    def drop(self, req_ids) -> None:
        pass


class EagleHead(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size)
        rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        self.layers = nn.ModuleList([LlamaDecoderLayer(a, rotary, 0)])

    stacked_params = LlamaForCausalLM.stacked_params


class EagleProposer:
    needs_lookahead = False
    aux_layers = ()
    couples_noise = True   # random rows race with the target's noise (spec/coupled.py)

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, backend, device) -> None:
        self.head, self.target, self.backend, self.device = head, target, backend, device
        a = target.args
        self.block_size = 16
        self._kv_shape = (a.num_key_value_heads, a.head_dim)

    @torch.inference_mode()
    def propose(self, inp) -> list[list[int]]:
        states, num_drafts, hidden = inp.states, inp.num_drafts, inp.hidden
        rows = [i for i, k in enumerate(num_drafts) if k > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not rows:
            return drafts
        k = max(num_drafts[i] for i in rows)
        cache, tables = self._scratch(len(rows), k)
        tokens = [states[i].tokens(states[i].num_tokens - 1, states[i].num_tokens)[0] for i in rows]
        feature = hidden[torch.tensor(rows, device=self.device)]
        pos0 = torch.tensor([states[i].num_tokens - 1 for i in rows], device=self.device)
        for step in range(k):
            meta = self.backend.build_metadata([1] * len(rows), [step + 1] * len(rows), tables,
                                               self.block_size, self.device)
            emb = self.target.model.embed_tokens(torch.tensor(tokens, device=self.device))
            x = self.head.fc(torch.cat([emb, feature.to(emb.dtype)], dim=-1))
            feature = self.head.layers[0](pos0 + step, x, cache, meta, self.backend)
            logits = self.target.compute_logits(self.target.model.norm(feature))
            tokens = draft_tokens(logits.float(), [states[i] for i in rows],
                                  [len(states[i].output_token_ids) + step for i in rows],
                                  self.target.args.vocab_size).tolist()
            for j, i in enumerate(rows):
                if step < num_drafts[i]:
                    drafts[i].append(tokens[j])
        return drafts

    def _scratch(self, num_rows: int, k: int):
        """A private paged cache for the chains: request j owns blocks [j * nb, (j + 1) * nb)."""
        nb = -(-k // self.block_size)
        dtype = self.head.fc.weight.dtype
        shape = (num_rows * nb, self.block_size) + self._kv_shape
        cache = (torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device))
        return cache, [list(range(j * nb, (j + 1) * nb)) for j in range(num_rows)]

    def drop(self, req_ids) -> None:
        pass


def _init_random(module: nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std if p.dim() > 1 else torch.zeros(p.shape))


def build_medusa(path: Optional[str], target: LlamaForCausalLM, num_heads: int, seed: int,
                 device) -> MedusaHeads:
    a = target.args
    if path is None:
        heads = MedusaHeads(a.hidden_size, a.vocab_size, num_heads)
        _init_random(heads, seed, std=0.05)
        return heads.to(device).eval()
    cfg, tensors = read_drafter_dir(path)
    heads = MedusaHeads(a.hidden_size, a.vocab_size, cfg.get("medusa_num_heads", num_heads),
                        cfg.get("medusa_num_layers", 1), bool(cfg.get("medusa_shared_lm_head", False)))
    heads.load_state_dict(tensors)
    return heads.to(device).eval()


def save_medusa(heads: MedusaHeads, path: str) -> None:
    """The layout ``build_medusa`` (and Medusa's own loaders, for unshared heads) read."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    num_layers = len(heads.medusa_head[0]) - (0 if heads.shared_lm_head else 1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": heads.num_heads, "medusa_num_layers": num_layers,
                   "medusa_shared_lm_head": heads.shared_lm_head}, f, indent=1)
    save_file({k: v.detach().float().contiguous() for k, v in heads.state_dict().items()},
              os.path.join(path, "model.safetensors"))


def build_eagle(path: Optional[str], target: LlamaForCausalLM, seed: int, device) -> EagleHead:
    head = EagleHead(target.args)
    if path is None:
        _init_random(head, seed, std=0.05)
        for layer in head.layers:   # RMSNorm weights of 0 would zero the layer's input
            layer.input_layernorm.weight.data.fill_(1.0)
            layer.post_attention_layernorm.weight.data.fill_(1.0)
    else:
        _, tensors = read_drafter_dir(path)
        load_weights(head, ((n, t) for n, t in tensors.items() if not n.startswith("embed_tokens")))
    return head.to(device=device, dtype=target.model.norm.weight.dtype).eval()
