"""Triton kernels of the CUDA attention backend (triton.py): the KV write and paged attention.

Terms (as in metadata.py): a request's query tokens are the last ``query_len`` of its
``seq_len`` context tokens, whose K/V sit in cache slots ``block_table[pos // block_size] *
block_size + pos % block_size``. Caches are ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a quantized one (int8 / fp8 E4M3) carries fp32 scales ``[num_blocks,
block_size, num_kv_heads]`` quantized exactly as kv_quant.quantize_kv does.

One attention program serves one (request, tile of BLOCK_Q query tokens, KV head, split):
its rows are the tile's tokens times the KV head's group of query heads (GQA: K/V are read
once for the whole group). Decode steps use tiles of one token. Every length is read from
device tensors, and the grid depends only on host integers (batch, longest query, splits),
so a captured CUDA graph serves any context length. With ``num_splits`` > 1 (flash
decoding: few sequences, long contexts) each split attends to its share of the context
and a second kernel merges the partial results by their log-sum-exp.

Loops run with ``while`` over device-loaded bounds: Triton's interpreter (the CPU tests)
cannot take a loaded value as a ``range`` bound.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.layers.triton_ops import dot_f32, round_to

_QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = torch.finfo(torch.float32).tiny   # the scale floor of kv_quant.quantize_kv
_LOG2E = 1.4426950408889634
MIN_TILE = 16           # tl.dot needs every tile dimension >= 16
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the merge than it saves


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Splits of the context per (request, KV head): enough programs to fill the GPU's
    streaming multiprocessors when the batch alone does not, never a split shorter than
    MIN_SPLIT_TOKENS; a power of two so that graph buckets share compiled kernels."""
    programs = max(1, num_reqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = min(-(-num_sms // programs), max(1, max_seq_len // MIN_SPLIT_TOKENS), MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)


# -- KV write ---------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                     slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     cache_stride_slot, cache_stride_head, scale_stride_slot,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                     QMAX: tl.constexpr, TINY: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:   # padding rows of a graph bucket carry slot -1: nothing to write
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        dst = slot * cache_stride_slot + h * cache_stride_head + d
        scale_dst = slot * scale_stride_slot + h
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=d_ok, other=0.0)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=d_ok, other=0.0)
        _store_kv_row(k, k_cache_ptr + dst, k_scale_ptr + scale_dst, d_ok, QUANT, QMAX, TINY)
        _store_kv_row(v, v_cache_ptr + dst, v_scale_ptr + scale_dst, d_ok, QUANT, QMAX, TINY)


@triton.jit
def _store_kv_row(x, dst_ptr, scale_ptr, d_ok, QUANT: tl.constexpr, QMAX: tl.constexpr,
                  TINY: tl.constexpr):
    if QUANT == 0:   # rounded to nearest even, as torch's write, also in the interpreter
        tl.store(dst_ptr, round_to(x.to(tl.float32), dst_ptr.dtype.element_ty), mask=d_ok)
    else:
        # Same arithmetic as kv_quant.quantize_kv: IEEE divisions, clamp, then int8 rounds
        # half to even (torch's rule) and fp8 converts with round-to-nearest-even.
        x = x.to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX), TINY)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if QUANT == 1:
            y = _round_half_even(y)
        else:
            y = _e4m3_bits(y)
        tl.store(dst_ptr, y.to(tl.int8), mask=d_ok)   # fp8 caches arrive viewed as int8
        tl.store(scale_ptr, scale)


@triton.jit
def _e4m3_bits(y):
    """The E4M3 byte nearest to y (|y| <= 448, ties to even), as torch converts. Encoded
    here rather than by Triton's conversion, which in the interpreter (the CPU tests) drops
    the carry when rounding up crosses a power of two, and the sign of zero."""
    a = tl.abs(y)
    exponent = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # The grid: 3 mantissa bits from 2**-6 up, a fixed step of 2**-9 below (subnormals).
    step_exp = tl.maximum(exponent - 127, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    a = _round_half_even(a / step) * step          # exact: step is a power of two
    bits = a.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    code = tl.where(exponent >= 121,                # normal: biased exponent 7 + unbiased
                    ((exponent - 120) << 3) | ((bits >> 20) & 7),
                    (a * 512.0).to(tl.int32))       # subnormal: multiples of 2**-9
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1   # kept for zero too, as torch does
    return code | (sign << 7)


@triton.jit
def _round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


def write_kv(key: torch.Tensor,            # [T, num_kv_heads, head_dim]
             value: torch.Tensor,          # [T, num_kv_heads, head_dim]
             k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
             v_cache: torch.Tensor,
             slot_mapping: torch.Tensor,   # [T] int64; a negative slot is skipped
             k_scale: Optional[torch.Tensor] = None,   # [num_blocks, block_size, Hkv] fp32
             v_scale: Optional[torch.Tensor] = None) -> None:
    """Store this step's K/V (quantized when the cache is int8 / fp8) at their slots."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    quant, qmax = _QUANT_CODES.get(k_cache.dtype, 0), _QMAX.get(k_cache.dtype, 1.0)
    k_scale = k_cache if k_scale is None else k_scale   # unused pointers when not quantized
    v_scale = v_cache if v_scale is None else v_scale
    if quant:   # the kernel stores the quantized bytes
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2), k_scale.stride(1) if quant else 0,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), QUANT=quant,
        QMAX=qmax, TINY=_TINY)


def _check_cache(k_cache, v_cache, k_scale, v_scale) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the Triton attention kernels need contiguous KV caches")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("K and V caches differ in shape or dtype")
    quantized = k_cache.dtype in _QUANT_CODES
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError("an int8 / fp8 KV cache needs its scales, a float one none")
    if quantized and not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("KV cache scales must be contiguous")
    if (k_cache.dtype == torch.float8_e4m3fn and k_cache.is_cuda
            and torch.cuda.get_device_capability(k_cache.device) < (8, 9)):
        raise ValueError("an fp8 KV cache on the Triton backend needs a GPU of compute "
                         "capability 8.9+ (Ada, Hopper); use kv_cache_dtype='int8'")


def _block_d(head_dim: int) -> int:
    return max(MIN_TILE, triton.next_power_of_2(head_dim))


# -- paged attention --------------------------------------------------------------------------
@triton.jit
def _load_kv_tile(cache_ptr, scale_ptr, slot_off, scale_off, d, k_ok, d_ok,
                  QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] of K or V at the given slot offsets, in the dot's dtype."""
    x = tl.load(cache_ptr + slot_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                other=0.0)
    if QUANT != 0:
        s = tl.load(scale_ptr + scale_off, mask=k_ok, other=0.0)
        x = x.to(tl.float32) * s[:, None]
    return x.to(DTYPE)


@triton.jit
def _attention_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        query_start_ptr, seq_lens_ptr, block_tables_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        c_block, c_slot, c_head, s_block, s_slot, s_head,
        qk_scale_log2, window, num_heads,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, KV_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
        QUANT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if tile * BLOCK_Q < q_len:
        # Rows: token (tile * BLOCK_Q + m // GROUP_P) and query head (kv_head * GROUP +
        # m % GROUP_P); padded rows are masked out of every load and store.
        m = tl.arange(0, BLOCK_M)
        qi = tile * BLOCK_Q + m // GROUP_P
        head = kv_head * GROUP + m % GROUP_P
        row_ok = (m < BLOCK_Q * GROUP_P) & (m % GROUP_P < GROUP) & (qi < q_len)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + qi) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = seq_len - q_len + qi                       # [BLOCK_M] absolute positions
        # Keys this tile can see: causal up to its last token, the window back from its first.
        hi = seq_len - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
        lo = tl.where(window > 0,
                      tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0), 0)
        num_tiles = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        pos = lo + split * per_split * BLOCK_N
        end = tl.minimum(hi, pos + per_split * BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        while pos < end:
            k_pos = pos + tl.arange(0, BLOCK_N)
            k_ok = k_pos < end
            block = tl.load(block_tables_ptr + b * stride_bt + k_pos // KV_BLOCK, mask=k_ok,
                            other=0)
            offset = k_pos % KV_BLOCK
            slot_off = block * c_block + offset * c_slot + kv_head * c_head
            scale_off = block * s_block + offset * s_slot + kv_head * s_head
            k = _load_kv_tile(k_ptr, k_scale_ptr, slot_off, scale_off, d, k_ok, d_ok, QUANT,
                              q.dtype)
            s = dot_f32(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale_log2
            allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if window > 0:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_kv_tile(v_ptr, v_scale_ptr, slot_off, scale_off, d, k_ok, d_ok, QUANT,
                              q.dtype)
            acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, DOT_PREC, UPCAST)
            m_i = m_new
            pos += BLOCK_N
        # A row that saw no key (a padding row of context 0) writes zeros.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        store_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            o_rows = (q_start + qi) * stride_ot + head * stride_oh
            tl.store(out_ptr + o_rows[:, None] + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            part = ((q_start + qi) * num_heads + head) * NUM_SPLITS + split   # [T, H, S] row
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=store_mask)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)),
                           float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """out[t, h] = the splits' outputs weighted by their share of the softmax mass."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = (t * num_heads + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row + s)
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)                                  # empty splits weigh 0
    o = tl.load(part_o_ptr + (row + s)[:, None] * BLOCK_D + d[None, :])
    total = tl.sum(w, axis=0)
    merged = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, merged.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_attention(
        query: torch.Tensor,            # [T, num_heads, head_dim]
        k_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        query_start_loc: torch.Tensor,  # [B + 1] int64
        seq_lens: torch.Tensor,         # [B] int64 (0: a padding row, whose output is zeros)
        block_tables: torch.Tensor,     # [B, max_num_blocks] int64
        max_query_len: int,
        scale: float,
        sliding_window: Optional[int] = None,
        k_scale: Optional[torch.Tensor] = None,   # [num_blocks, block_size, Hkv] fp32
        v_scale: Optional[torch.Tensor] = None,
        num_splits: int = 1,
) -> torch.Tensor:                      # [T, num_heads, head_dim], query's dtype
    """Causal (optionally sliding-window) attention of every query token over its request's
    cached context, any mix of prefill chunks, decode tokens and speculative runs."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    _check_cache(k_cache, v_cache, k_scale, v_scale)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if query.stride(2) != 1:
        query = query.contiguous()
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_q = 1 if max_query_len == 1 else min(triton.next_power_of_2(max_query_len),
                                               max(1, 64 // group_p))
    block_d = _block_d(head_dim)
    quant = _QUANT_CODES.get(k_cache.dtype, 0)
    scales = (k_scale, v_scale) if quant else (k_cache, v_cache)
    parts = _split_buffers(num_tokens, num_heads, num_splits, block_d, query.device)
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _attention_kernel[grid](
        query, k_cache, v_cache, scales[0], scales[1], out, parts[0], parts[1],
        query_start_loc, seq_lens, block_tables,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(scales[0].stride()[:3] if quant else (0, 0, 0)),
        scale * _LOG2E, sliding_window or 0, num_heads,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
        BLOCK_M=max(MIN_TILE, block_q * group_p), BLOCK_N=64 if head_dim <= 128 else 32,
        HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK=k_cache.shape[1], NUM_SPLITS=num_splits,
        QUANT=quant, DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=query.device.type != "cuda")
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            parts[0], parts[1], out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d)
    return out


def _split_buffers(num_tokens: int, num_heads: int, num_splits: int, block_d: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split outputs [T, H, S, BLOCK_D] and log2-sum-exps [T, H, S] (fp32); placeholders
    when there is one split."""
    if num_splits == 1:
        return (torch.empty(1, device=device), torch.empty(1, device=device))
    return (torch.empty(num_tokens, num_heads, num_splits, block_d, device=device),
            torch.empty(num_tokens, num_heads, num_splits, device=device))
