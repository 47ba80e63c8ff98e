"""A tied embedding that reads its rows from the quantized LM head.

With tied weights the embedding and the head are one matrix. Once the head is packed
(int8 / int4 / fp8 / GGUF blocks), keeping a float32 copy only for row lookups would hold
the biggest tensor of a small model twice (SmolLM2-135M: 113 MB fp32 next to a 28 MB int8
head). Looking rows up in the packed head instead dequantizes just the rows a step needs;
for a GGUF model the values are identical (the float embedding was dequantized from the
same blocks). A GGUF whose head is packed from the embedding's own blocks gets this module
before loading (``embed_from_packed_head``), so the float table is never even read (Gemma3:
671 MB of float32 for 262k x 640, which set the load's peak memory).
"""
from __future__ import annotations

import torch
from typing import Callable, Optional

from torch import nn

from tokenmill.layers.quant import qgemm
from tokenmill.layers.quant.formats import Packed, dequantize_stored


class PackedEmbedding(nn.Module):
    """Rows of a Packed weight: given, or (``source``) the head's, read once it is loaded."""

    def __init__(self, packed: Optional[Packed] = None, source: Optional[Callable[[], Packed]] = None,
                 shape: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        if packed is not None:
            _check_order(packed)
            shape = (packed.out_features, packed.in_features)
        # Plain attributes, not parameters or submodules: the tensors belong to (and are
        # counted with) the head.
        self._packed, self._source = packed, source
        self.num_embeddings, self.embedding_dim = shape

    @property
    def packed(self) -> Packed:
        if self._packed is None:
            self._packed = _check_order(self._source())
        return self._packed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden] fp32
        p = self.packed
        ids = input_ids.reshape(-1)
        values = qgemm.dequantized_rows(p, ids)   # one kernel call where the head is tiled
        if values is None:
            rows = Packed(p.kind, p.stored(ids), p.scales.index_select(0, ids),
                          p.mins.index_select(0, ids) if p.mins is not None else None,
                          p.group_size, ids.numel(), p.in_features)
            values = dequantize_stored(rows)
        return values.view(*input_ids.shape, p.in_features)


def _check_order(packed: Packed) -> Packed:
    if packed.perm is not None:
        raise ValueError("a packed embedding needs columns in natural order (no act-order)")
    return packed


def embed_from_packed_head(model: nn.Module) -> bool:
    """Before loading a GGUF: a tied float embedding whose head takes packed blocks becomes
    a PackedEmbedding over the head's (future) packed weight; True if done. Tensor-parallel
    ranks keep their float vocab-parallel embedding (see share_packed_head_with_embedding)."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(model, "args", None) is not None and model.args.tie_word_embeddings
            and isinstance(embed, nn.Embedding) and head is not None
            and "qweight" in getattr(head, "quant_param_names", ())):
        return False
    if getattr(embed, "tp", None) is not None and embed.tp.is_parallel:
        return False
    if getattr(head, "weight", None) is embed.weight:
        del head.weight
    _free_table(embed)

    def head_packed() -> Packed:
        if len(head.packed) != 1:
            raise ValueError("a tied packed head must be one packed weight")
        return head.packed[0]
    inner.embed_tokens = PackedEmbedding(source=head_packed, shape=(embed.num_embeddings, embed.embedding_dim))
    return True


def share_packed_head_with_embedding(model: nn.Module) -> bool:
    """Swap a tied float embedding for a PackedEmbedding over the packed head; True if done.
    A tensor-parallel rank keeps its vocab-parallel embedding (it masks and all-reduces)
    but fills it with the packed head's values, so its lookups equal one process's."""
    parts = _tied_packed_head(model)
    if parts is None:
        return False
    head, inner = model.lm_head, model.model
    embed = inner.embed_tokens
    if getattr(embed, "tp", None) is not None and embed.tp.is_parallel:
        embed.weight = nn.Parameter(dequantize_stored(parts[0]).to(embed.weight.dtype),
                                    requires_grad=False)
        if getattr(head, "weight", None) is not None and head.weight is not embed.weight:
            del head.weight
        return True
    if getattr(head, "weight", None) is embed.weight:   # head still holds the float tensor
        del head.weight
    _free_table(embed)
    inner.embed_tokens = PackedEmbedding(parts[0])
    return True


class HalfEmbedding(nn.Module):
    """Rows of a tied head's 16-bit weight (quantization "bf16" / "fp16"), widened to float32:
    the embedding and the head are one matrix, rounded once, held once."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self._head = [head]   # a list: the head stays the model's submodule, not this one's
        self.num_embeddings, self.embedding_dim = head.weight.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden] fp32
        table = self._head[0].weight
        rows = table.index_select(0, input_ids.reshape(-1)).float()
        return rows.view(*input_ids.shape, self.embedding_dim)


def share_half_head_with_embedding(model: nn.Module) -> bool:
    """After loading: a tied float embedding whose head now holds 16-bit weights reads its
    rows from the head (HalfEmbedding); True if done. A tensor-parallel rank keeps its
    vocab-parallel embedding, filled with the rounded values, so its lookups equal one
    process's."""
    from tokenmill.layers.quant.methods import HalfWeightMethod
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(model, "args", None) is not None and model.args.tie_word_embeddings
            and isinstance(embed, nn.Embedding) and head is not None
            and isinstance(getattr(head, "quant_method", None), HalfWeightMethod)
            and tuple(head.weight.shape) == tuple(embed.weight.shape)):
        return False
    if getattr(embed, "tp", None) is not None and embed.tp.is_parallel:
        embed.weight.data = head.weight.data.to(embed.weight.dtype)
        return True
    _free_table(embed)
    inner.embed_tokens = HalfEmbedding(head)
    return True


class TiledEmbedding(nn.Module):
    """Rows of a tied head's bf16 tiles (bf16 mode, ``prepacked.bf16_tiles``), widened to
    float32. Every matmul of the head reads its tiles, so a float32 table kept only for row
    lookups would be the biggest tensor held twice (Gemma3-270m: 671 MB next to 335 MB of
    tiles). The rows are the bf16-rounded values, as the head multiplies them."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        from tokenmill.layers import prepacked
        self._head = [head]   # a list: the head stays the model's submodule, not this one's
        tiles = prepacked.bf16_tiles(head)
        self.num_embeddings, self.embedding_dim = tiles.shape[0] * 16, tiles.shape[1] * 2

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, hidden] fp32
        from tokenmill.layers import prepacked
        tiles = prepacked.bf16_tiles(self._head[0])   # [N / 16, K / 2, 16, 2]
        ids = input_ids.reshape(-1)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = tiles[ids // 16, :, ids % 16]                     # [T, K / 2, 2]
        return rows.reshape(*input_ids.shape, self.embedding_dim).float()


def share_tiled_head_with_embedding(model: nn.Module) -> bool:
    """bf16 mode, after ``prepack_linears``: a tied float embedding whose head has bf16
    tiles reads its rows from them (TiledEmbedding), and the float32 table the two shared
    is freed; True if done. A tensor-parallel rank keeps its vocab-parallel embedding."""
    from tokenmill.layers import prepacked
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(model, "args", None) is not None and model.args.tie_word_embeddings
            and isinstance(embed, nn.Embedding) and head is not None
            and getattr(head, "weight", None) is embed.weight
            and prepacked.bf16_tiles(head) is not None):
        return False
    if getattr(embed, "tp", None) is not None and embed.tp.is_parallel:
        return False
    inner.embed_tokens = TiledEmbedding(head)
    prepacked.free_float_weight(head, prepacked.parameter_holders(model))   # now its only holder
    _free_table(embed)
    return True


def _free_table(embed: nn.Module) -> None:
    """Release a replaced embedding's float table now: its parameter holds the module's
    bound weight_loader, a reference cycle that only the cycle collector would break."""
    embed.weight.data = torch.empty(0, dtype=embed.weight.dtype)


def _tied_packed_head(model: nn.Module):
    """The packed head's parts when the model ties a float embedding to a packed head."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(model, "args", None) is not None and model.args.tie_word_embeddings
            and isinstance(embed, nn.Embedding) and head is not None):
        return None
    parts = getattr(head, "packed", None)
    if not parts or len(parts) != 1 or parts[0].perm is not None \
            or parts[0].out_features != embed.num_embeddings \
            or parts[0].in_features != embed.embedding_dim:
        return None
    return parts
