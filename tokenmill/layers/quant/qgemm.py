"""q8 matmuls of int8 / int4 weights on a tiled copy (qgemm.c: AVX-512 VNNI, or AVX2).

A packed weight gets a second, tiled copy (``tile``): sixteen weight rows interleaved per
32-value block, so one VNNI instruction multiplies four values of 16 rows at once and the
block scales cost one multiply-add per 16 rows (the layout is drawn in qgemm.c). It serves
the steps with more rows than the streaming kernel takes (prefill chunks, batched decode)
when activations are q8, and the decode-sized ones too: what the streaming kernel computes
(activations rounded to int8 per run of 32, exact integer block dots, int4's min term on the
exact float group sums), summed in another order. Measured (2 threads, GOPS, /tmp sweeps on
a Zen 4 box, SmolLM2 shapes): VNNI build 340-600 at 16-1024 rows vs oneDNN fp32 160-225,
and 115-300 at one row vs the streaming q8 kernel's 42-75; AVX2 build 160-227 at 16-64 rows
vs the streaming kernel's 88-141, and at one row 133-203 (int4) and 95-121 (int8) vs 48-78.
On a real Zen 3 (AVX2 only) the AVX2 build runs 120-180 at 4-512 rows against oneDNN fp32's
100-130, and 60-100 at one row (docs/bench/2026-12-06d).
With fp32 activations nothing is tiled and matmul.py works as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.layers import native
from tokenmill.layers.quant import kernels
from tokenmill.layers.quant.formats import Packed, pack_int4, unpack_int4

TILE = 16   # weight rows per tile (QG_TILE)


@dataclass
class Tiled:
    """qgemm.c's layout of one packed weight (arrays named as there)."""
    kind: int                       # kernels.KIND_I8 / KIND_I4 / KIND_I5, | KIND_HALF for float16 sc / mn
    qw: torch.Tensor                # uint8 [tiles, K/32, 256 (i4), 320 (i5) or 512 (i8: q + 128)]
    sc: torch.Tensor                # [tiles, K/G, 16], the packed weight's scale dtype (G: 16 too)
    mn: Optional[torch.Tensor]      # [tiles, K/G, 16] (i4, i8 with mins)
    group_size: int
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qw, self.sc, self.mn) if t is not None)

    def stored_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed weight's stored values of ``rows`` (int64 ids): int8 [m, K] or int4
        nibbles [m, K/2], read straight out of the tiles (``_tiled_values`` undone)."""
        rows = rows.reshape(-1)
        nb = self.in_features // 32
        tile, r = rows // TILE, rows % TILE
        if (self.kind & ~kernels.KIND_HALF) == kernels.KIND_I5:
            return _i5_rows(self.qw, tile, r, nb, self.in_features, _i5_offset(self.mn is not None))
        if (self.kind & ~kernels.KIND_HALF) == kernels.KIND_I4:
            # [t, b, p, r, i] bytes: low nibble value 4 * 2p + i, high nibble 4 * (2p + 1) + i
            b = self.qw.view(-1, nb, 4, TILE, 4)[tile, :, :, r, :]          # [m, nb, p, i]
            steps = torch.stack([b & 0x0F, b >> 4], dim=3)                   # [m, nb, p, h, i]
            return pack_int4(steps.reshape(-1, self.in_features))
        b = self.qw.view(-1, nb, 8, TILE, 4)[tile, :, :, r, :]              # [m, nb, s, i]
        return (b.reshape(-1, self.in_features).to(torch.int16) - 128).to(torch.int8)


def dequantized_rows(p: Packed, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """float32 [n, K]: rows ``ids`` (int64) of a packed weight with a tiled copy, the values
    formats.dequantize_stored gives them (stored column order), read out of the tiles in one
    kernel call; None where the kernel does not take the weight. IndexError for an id
    outside [0, N)."""
    t = p.tiled
    half = p.scales.dtype is torch.float16
    if (t is None or not kernels.available() or p.scales.dtype not in (torch.float32, torch.float16)
            or not p.scales.is_contiguous() or ids.dtype is not torch.int64
            or (p.mins is not None and (p.mins.dtype is not p.scales.dtype or not p.mins.is_contiguous()))):
        return None
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), p.in_features, dtype=torch.float32)
    if native.library().tm_tiled_rows(
            t.qw.data_ptr(), t.kind, int(t.mn is not None), p.out_features, p.in_features,
            p.scales.data_ptr(), None if p.mins is None else p.mins.data_ptr(), int(half),
            p.group_size, ids.data_ptr(), ids.numel(), out.data_ptr()):
        raise IndexError(f"a token id is outside the vocabulary [0, {p.out_features})")
    return out


def available() -> bool:
    return kernels.available()


def applies(p: Packed) -> bool:
    """Kinds and shapes the tiled kernel takes (the same as the streaming q8 kernel's)."""
    group_ok = p.group_size % 32 == 0 or (p.kind == "i8" and p.group_size == 16 and p.mins is None)
    return (p.kind in ("i8", "i4") and group_ok and p.in_features % p.group_size == 0
            and p.in_features % 32 == 0 and p.scales.device.type == "cpu")


def _by_tile(a: torch.Tensor, n: int) -> torch.Tensor:
    """[N, C] -> [tiles, C, 16], rows past N zero."""
    tiles = -(-n // TILE)
    padded = a.new_zeros(tiles * TILE, a.shape[1])
    padded[:n] = a
    return padded.view(tiles, TILE, a.shape[1]).transpose(1, 2).contiguous()


TILE_ROWS_PER_PASS = 4096   # rows re-laid out at a time: bounds the temporaries (int16 values,
#                             padded and permuted copies) to a few MB instead of several times
#                             a large weight (Gemma3's 262k-row tied head: 168 MB of int8)


def tile(p: Packed, in_place: bool = False, five_bit: bool = True) -> Tiled:
    """The tiled copy of a packed int8 / int4 weight (stored column order, like the kernels).
    int8 values that fit in five bits (GGUF Q5_0: -16..15; Q5_1 / Q5_K: 0..31 with mins)
    take the 5-bit tiles unless ``five_bit`` is False: the same products from 5.5 bits a
    weight instead of 8.5. ``in_place``: the tiles may overwrite ``p.qweight``'s memory (which
    the caller then drops): sixteen stored rows take exactly the bytes of their 8-bit or 4-bit
    tile, so each pass writes back over the rows it has just read, and no second copy of a
    large weight is ever held (5-bit tiles are smaller: they get memory of their own)."""
    if not applies(p):
        raise ValueError(f"the tiled q8 kernel takes int8 / int4 weights with groups of a multiple "
                         f"of 32 (or 16 for int8), not {p.kind} with group {p.group_size}")
    n, k, g = p.out_features, p.in_features, p.group_size
    nb = k // 32
    i5 = five_bit and _fits_five_bits(p)
    base = kernels.KIND_I4 if p.kind == "i4" else kernels.KIND_I5 if i5 else kernels.KIND_I8
    kind = kernels.kind_code(base, p.scales)
    width = {kernels.KIND_I4: 256, kernels.KIND_I5: 320, kernels.KIND_I8: 512}[base]
    if in_place and not i5 and n % TILE == 0 and p.qweight.is_contiguous():
        qw = p.qweight.view(torch.uint8).view(n // TILE, nb, width)
    else:
        qw = torch.empty(-(-n // TILE), nb, width, dtype=torch.uint8)
    for r0 in range(0, n, TILE_ROWS_PER_PASS):
        r1 = min(n, r0 + TILE_ROWS_PER_PASS)
        rows = p.qweight[r0:r1]
        qw[r0 // TILE:-(-r1 // TILE)] = (_i5_tiles(rows, r1 - r0, nb, _i5_offset(p.mins is not None))
                                         if i5 else _tiled_values(p, rows, r1 - r0, nb))
    mn = _by_tile(p.mins.to(p.scales.dtype), n) if p.mins is not None else None   # i4, Q5_1 / Q5_K
    return Tiled(kind, qw, _by_tile(p.scales, n), mn, g, n, k)


def _i5_offset(has_mins: bool) -> int:
    """u - q of a 5-bit tile's values: signed values without mins (Q5_0), unsigned with."""
    return 0 if has_mins else 16


def _fits_five_bits(p: Packed) -> bool:
    if p.kind != "i8" or p.group_size % 32 != 0 or p.qweight is None:
        return False
    q = p.qweight.view(torch.int8)
    lo = -_i5_offset(p.mins is not None)
    return bool(q.numel()) and lo <= int(q.min()) and int(q.max()) <= lo + 31


def _nibble_steps(u: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """Values [n, K] (0..15, or 0..31 for i5) -> [tiles, K/32, p, j, i, lo/hi]: register p's
    byte (j, i) holds value 4 * 2p + i (its low nibble) and 4 * (2p + 1) + i (its high one)."""
    steps = _by_tile(u, n).view(-1, nb, 8, 4, TILE).transpose(2, 3)  # [t, b, 4 bytes, 8 steps, 16]
    return steps.reshape(-1, nb, 4, 4, 2, TILE).permute(0, 1, 3, 5, 2, 4)


def _i5_tiles(rows: torch.Tensor, n: int, nb: int, offset: int) -> torch.Tensor:
    """Stored int8 rows [n, K] of five-bit values -> 5-bit tiles [tiles, K/32, 320]."""
    u = (rows.view(torch.int8).view(n, nb * 32).to(torch.int16) + offset).to(torch.uint8)
    steps = _nibble_steps(u, n, nb)
    nibbles = ((steps[..., 0] & 0x0F) | ((steps[..., 1] & 0x0F) << 4)).reshape(-1, nb, 256)
    # the fifth-bit plane: byte (j, i), bit 2p + h = bit 4 of the value in nibble h of
    # register p's byte (j, i), so one load serves a block's eight registers
    fifth = (steps >> 4).permute(0, 1, 3, 4, 2, 5).reshape(-1, nb, 64, 8)   # [t, b, byte, reg]
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)
    plane = (fifth * weights).sum(dim=-1, dtype=torch.uint8)
    return torch.cat([nibbles, plane], dim=2)


def _i5_rows(qw: torch.Tensor, tile: torch.Tensor, r: torch.Tensor, nb: int, k: int,
             offset: int) -> torch.Tensor:
    """``_i5_tiles`` undone for the rows (tile, r): int8 [m, K]."""
    raw = qw[tile]                                                      # [m, nb, 320]
    nib = raw[:, :, :256].reshape(-1, nb, 4, TILE, 4)[torch.arange(len(r)), :, :, r, :]   # [m, nb, p, i]
    low = torch.stack([nib & 0x0F, nib >> 4], dim=3)                    # [m, nb, p, h, i]
    plane = raw[:, :, 256:].reshape(-1, nb, TILE, 4)[torch.arange(len(r)), :, r, :]   # [m, nb, i]
    bits = (plane.unsqueeze(2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1   # [m, nb, reg, i]
    bits = bits.view(-1, nb, 4, 2, 4)                                   # [m, nb, p, h, i]
    u = (low | (bits << 4)).reshape(-1, k).to(torch.int16)
    return (u - offset).to(torch.int8)


def _tiled_values(p: Packed, rows: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """Stored rows [n, K/2 or K] of a packed weight -> their tiles [tiles, K/32, 256 | 512]."""
    if p.kind == "i4":
        steps = _nibble_steps(unpack_int4(rows).view(n, nb * 32), n, nb)   # [t, b, p, j, i, lo/hi]
        return (steps[..., 0] | (steps[..., 1] << 4)).reshape(-1, nb, 256)
    q = (rows.view(torch.int8).view(n, nb * 32).to(torch.int16) + 128).to(torch.uint8)
    steps = _by_tile(q, n).view(-1, nb, 8, 4, TILE).permute(0, 1, 2, 4, 3)   # [t, b, s, j, i]
    return steps.reshape(-1, nb, 512)


def qgemm_q8(x: torch.Tensor, t: Tiled) -> torch.Tensor:
    """x [M, K] float32 contiguous (stored column order) -> [M, N] float32."""
    m, k = x.shape
    y = torch.empty(m, t.out_features, dtype=torch.float32)
    if m == 0:
        return y
    if native.library().tm_qgemm_q8(x.data_ptr(), m, k, t.kind, t.qw.data_ptr(), t.sc.data_ptr(),
                       t.mn.data_ptr() if t.mn is not None else None,
                       t.group_size, t.out_features, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError("tiled q8 matmul could not allocate its activation buffer")
    return y


def tile_packed_linears(model: nn.Module) -> int:
    """Give every int8 / int4 part of the packed linears that take q8 activations its tiled
    copy (where the kernel library runs), which then holds the only copy of the values:
    every q8 step reads the tiles, and the rare readers of stored rows (a tied embedding,
    float-activation fallbacks) take them from the tiles. Returns the tiles' bytes (the
    released values leave the module's parameters, so they leave ``model_weights`` too)."""
    from tokenmill.layers.quant.matmul import kernel_applies
    from tokenmill.layers.quant.methods import PackedLinearMethod
    if not available():
        return 0
    added = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not (isinstance(method, PackedLinearMethod) and method.use_kernel
                and method.activations == "q8"):
            continue
        for i, part in enumerate(module.packed):
            if part.tiled is None and applies(part) and kernel_applies(part):
                name = _values_parameter(module, i, part)
                part.tiled = tile(part, in_place=name is not None)
                added += part.tiled.nbytes()
                if name is not None:   # drop the values (overwritten if tiled in place)
                    delattr(module, name)
                    module.quant_param_names.remove(name)
                    part.qweight = None
    return added


def tiled_only_bytes(model: nn.Module) -> int:
    """Bytes of the tiled copies that hold the only copy of their values (no qweight left):
    the weights as a step reads them, next to the parameters."""
    parts = [p for m in model.modules() if isinstance(getattr(m, "packed", None), list)
             for p in m.packed]   # linears' parts (a PackedEmbedding's is its head's)
    return sum(p.tiled.nbytes() for p in parts if p.qweight is None and p.tiled is not None)


def _values_parameter(module: nn.Module, index: int, part: Packed) -> Optional[str]:
    """The name of the module's parameter holding part ``index``'s stored values, as
    methods.set_packed registers them; None if they are held some other way (left alone)."""
    name = "qweight" if len(module.packed) == 1 else f"qweight_{index}"
    param = module._parameters.get(name)
    return name if param is not None and param.data_ptr() == part.qweight.data_ptr() else None
