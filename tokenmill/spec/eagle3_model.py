"""EAGLE-3 drafter math (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test").

One decoder layer drafts autoregressively. Terms, for a sequence of tokens t_0, t_1, ...:
- feature g(p): ``fc`` of the target's low / middle / high layer outputs at position p
  (concatenated, [n_aux * target_hidden] -> [hidden]); g(p) came from tokens 0..p and
  "predicts" t_{p+1}.
- entry p: the layer's input at position p, built from (embed(t_p), g(p - 1)): q/k/v read
  cat(input_layernorm(embed), hidden_norm(g)) [2 * hidden]; the residual stream starts at g
  (at hidden_norm(g) with ``norm_before_residual``). Entry 0 has no predecessor: g(-1) = 0.
  Its output h (before ``norm``) through ``norm`` + ``lm_head`` guesses t_{p+1}.
- chain from b (the newest token, which has no feature yet): entry b gives draft 1; then entry
  b + j is (embed(draft j), h of entry b + j - 1): after the first step the feature is the
  drafter's own output. A chain step attends to the verified entries 0..b and to its own
  earlier steps (EAGLE-3's "training-time test" attention).
Entry p depends only on tokens <= p, so entries kept in paged KV indexed by the target's block
tables stay valid under prefix caching (see tokenmill.spec.eagle3). Published training aligns
(g(p - 1), t_p) the same way, at RoPE position p or p - 1 (the same attention: RoPE is
relative); entry 0 is ours alone (they start at (g(0), t_1)), one extra key a published drafter
never saw, which our recipe trains with.

``lm_head`` scores a reduced draft vocabulary: draft id i is target id i + d2t[i]; ``t2d``
marks the target ids that have a draft id. Names follow the speculators layout (fc, layers.0.*,
norm, lm_head, d2t, t2d), so ``state_dict()`` is the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.spec.trainable import Linear, LinearGroup, RMSNorm, Rotary, SwiGLU, rotate


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    vocab_size: int                     # the target's
    aux_layers: tuple                   # target decoder layers read (tokenmill numbering)
    target_hidden_size: int = 0         # 0: the same as hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False               # Qwen3-shaped layer: RMSNorm per head of q and k
    norm_before_residual: bool = False  # residual starts at hidden_norm(g), not g
    norm_before_fc: bool = False        # RMSNorm over the concatenated features before fc

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(x) for x in self.aux_layers))
        if not self.aux_layers:
            raise ValueError("eagle3 needs at least one target layer")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"eagle3: {self.num_heads} heads over {self.num_kv_heads} kv heads "
                             f"of dim {self.head_dim} is not a valid attention shape")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"eagle3 draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, {self.vocab_size}] (the target's vocabulary)")

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * (self.target_hidden_size or self.hidden_size)


def default_aux_layers(num_layers: int) -> tuple:
    """EAGLE-3's low / middle / high choice: the inputs of layers 2, L // 2 and L - 3 (vLLM's
    and the EAGLE repo's default), i.e. the outputs of layers 1, L // 2 - 1, L - 4. Targets too
    shallow for that spread up to three distinct layers from first to last."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return tuple(sorted({round(i * (num_layers - 1) / 2) for i in range(3)}))


class Eagle3Layer(nn.Module):
    """The decoder layer, in pieces the paged path (attention by the engine's backend) and the
    dense path (``DenseChain``) share."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        h, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        # plain containers: parameter names are the checkpoint's (layers.0.self_attn.q_proj...)
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = Linear(2 * h, q_size, bias=c.attention_bias)
        attn.k_proj = Linear(2 * h, kv_size, bias=c.attention_bias)
        attn.v_proj = Linear(2 * h, kv_size, bias=c.attention_bias)
        attn.o_proj = Linear(q_size, h, bias=c.attention_bias)
        if c.qk_norm:
            attn.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            attn.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.mlp = SwiGLU(h, c.intermediate_size, bias=c.mlp_bias)
        self.kv_proj = LinearGroup(attn.k_proj, attn.v_proj)
        self.qkv_proj = LinearGroup(attn.q_proj, attn.k_proj, attn.v_proj)
        self.norm_before_residual = c.norm_before_residual
        self.scale = c.head_dim ** -0.5

    def inputs(self, embeds: torch.Tensor, g: torch.Tensor) -> tuple:
        """embeds, g [T, hidden] -> (the attention input [T, 2 * hidden], the residual)."""
        normed = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return x, (normed if self.norm_before_residual else g)

    def _heads(self, t: torch.Tensor, n: int, norm_name: str) -> torch.Tensor:
        t = t.unflatten(-1, (n, self.head_dim))
        norm = getattr(self.self_attn, norm_name, None)
        return t if norm is None else norm(t)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """x [T, 2 * hidden] -> K (rotated), V [T, kv_heads, D]."""
        k, v = self.kv_proj(x).split(self.kv_proj.sizes, dim=-1)
        k = rotate(self._heads(k, self.num_kv_heads, "k_norm"), cos, sin)
        return k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """x [T, 2 * hidden] -> Q, K (rotated), V [T, heads | kv_heads, D] from one matmul
        (a drafting step's rows)."""
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).unflatten(-1, (hq + 2 * hkv, self.head_dim))
        q, k, v = heads.split([hq, hkv, hkv], dim=1)
        if hasattr(self.self_attn, "q_norm"):
            return (rotate(self.self_attn.q_norm(q), cos, sin),
                    rotate(self.self_attn.k_norm(k), cos, sin), v)
        qk = rotate(heads[:, :hq + hkv], cos, sin)       # q and k rotate in one pass
        return qk[:, :hq], qk[:, hq:], v

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * hidden] -> Q (rotated) [T, heads, D]."""
        return rotate(self._heads(self.self_attn.q_proj(x), self.num_heads, "q_norm"), cos, sin)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [T, heads * D] (attention output) -> the layer's output h [T, hidden]."""
        h = residual + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, own_embeddings: bool = False) -> None:
        super().__init__()
        c = self.config = config
        if c.norm_before_fc:
            self.input_norm = RMSNorm(c.feature_size, c.rms_norm_eps)
        self.fc = Linear(c.feature_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # A drafter narrower than its target cannot read the target's embeddings.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embeddings else None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[:c.draft_vocab_size] = True
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    @property
    def param_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [draft_vocab] ascending target ids -> d2t offsets and t2d mask."""
        ids = draft_to_target.to(self.d2t.device, torch.int64)
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of every draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def embed(self, target_embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (target ids) -> [T, hidden] in the drafter's dtype."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embed
        return table(ids).to(self.param_dtype)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, n_aux * target_hidden] -> features g [T, hidden]."""
        x = aux.to(self.param_dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] (layer output) -> draft-vocabulary logits [T, draft_vocab] (float32)."""
        return self.lm_head(self.norm(h)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def previous_features(g: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """g [N, hidden] of sequences packed back to back (``lengths``) -> the feature each entry
    reads: g(p - 1) within its sequence, zeros at each sequence's entry 0."""
    out, row = torch.zeros_like(g), 0
    for n in lengths:
        out[row + 1:row + n] = g[row:row + n - 1]
        row += n
    return out


class DenseChain:
    """Chains over packed sequences without a paged cache (training and references). The
    context is entries 0..N-1: ``embeds`` [N, hidden] of the tokens, ``g_prev`` [N, hidden] the
    feature each reads (``previous_features``), at ``positions`` [N]; ``doc`` [N] names each
    row's sequence (None: one sequence). One chain starts at each row index of ``starts`` [S].
    ``step()`` runs the chains' first step (entry b); ``step(embeds_j, h)`` the next (entry
    b + j: the token guessed by step j - 1 and its output h), each attending to the context
    entries <= b of its own sequence and to its own earlier steps."""

    def __init__(self, head: Eagle3Head, embeds: torch.Tensor, g_prev: torch.Tensor,
                 positions: torch.Tensor, starts: torch.Tensor,
                 doc: Optional[torch.Tensor] = None) -> None:
        self.head, self.positions = head, positions[starts]
        layer = head.layer
        x, residual = layer.inputs(embeds, g_prev)
        cos, sin = head.rotary.cos_sin(positions, x.dtype)
        self.k_ctx, self.v_ctx = layer.kv(x, cos, sin)                   # [N, kv_heads, D]
        rows = torch.arange(embeds.shape[0], device=embeds.device)
        self.visible = rows[None, :] <= starts[:, None]                  # [S, N]
        if doc is not None:
            self.visible &= doc[None, :] == doc[starts][:, None]
        self.first = (x[starts], residual[starts], cos[starts], sin[starts])
        self.k_own: list[torch.Tensor] = []                              # [S, kv_heads, D] per step
        self.v_own: list[torch.Tensor] = []

    def step(self, embeds: Optional[torch.Tensor] = None,
             h: Optional[torch.Tensor] = None) -> torch.Tensor:
        """-> this step's outputs h [S, hidden]."""
        layer = self.head.layer
        if embeds is None:
            x, residual, cos, sin = self.first
        else:
            x, residual = layer.inputs(embeds, h)
            positions = self.positions + len(self.k_own) + 1
            cos, sin = self.head.rotary.cos_sin(positions, x.dtype)
            k, v = layer.kv(x, cos, sin)
            self.k_own.append(k)
            self.v_own.append(v)
        q = layer.query(x, cos, sin)
        return layer.finish(self._attend(q, layer.scale), residual)

    def _attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        # q [S, heads, D] -> [S, heads * D] over the visible context and the chain's own steps
        group = q.shape[1] // self.k_ctx.shape[1]
        k_ctx = self.k_ctx.repeat_interleave(group, dim=1)
        v_ctx = self.v_ctx.repeat_interleave(group, dim=1)
        scores = torch.einsum("shd,nhd->shn", q, k_ctx).float() * scale
        scores = scores.masked_fill(~self.visible[:, None, :], float("-inf"))
        if self.k_own:
            k_own = torch.stack(self.k_own, dim=1).repeat_interleave(group, dim=2)
            own = torch.einsum("shd,sjhd->shj", q, k_own).float() * scale
            scores = torch.cat([scores, own], dim=-1)
        weights = scores.softmax(-1).to(q.dtype)
        n = k_ctx.shape[0]
        out = torch.einsum("shn,nhd->shd", weights[..., :n], v_ctx)
        if self.v_own:
            v_own = torch.stack(self.v_own, dim=1).repeat_interleave(group, dim=2)
            out = out + torch.einsum("shj,sjhd->shd", weights[..., n:], v_own)
        return out.flatten(1)
