"""Fused float32 CPU kernels (cpu_ops.c, cpu_attention.c) for the small per-layer ops of a step, each beside
the plain-PyTorch reference it must match.

Every entry point returns None when the fast path does not apply (the kernel library does
not run here, a non-CPU tensor, not float32, an unsupported layout), and the caller then
runs its PyTorch code. Whether a model uses these at all is its own setting
(``ModelConfig.cpu_kernels``): the modules and strategies that call them carry a
``cpu_kernels`` attribute, set for one model by ``set_cpu_kernels``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import native
from tokenmill.layers.kernel_choice import set_kernel_flag


def tracing() -> bool:
    """torch.compile is tracing: the plain torch ops are what the compiler fuses, so every
    fast path steps aside."""
    return torch.compiler.is_compiling()


def available() -> bool:
    """True when the kernel library runs on this machine and nothing is being traced."""
    return not tracing() and native.library() is not None


def set_cpu_kernels(model: torch.nn.Module, enabled: bool) -> None:
    """Turn the fused CPU kernels on or off for one model: every module, and every linear
    strategy, that has a ``cpu_kernels`` attribute gets ``enabled``."""
    set_kernel_flag(model, "cpu_kernels", enabled)


_F32 = torch.float32
# The kernels' value types (KV_F32 .. in cpu_simd.h) by dtype: KV caches take all four,
# 16-bit weights (linear_half) the two half types.
KV_DTYPE_CODES = {torch.float32: 0, torch.int8: 1, torch.float16: 2, torch.bfloat16: 3}
HALF_WEIGHT_CODES = {dt: KV_DTYPE_CODES[dt] for dt in (torch.float16, torch.bfloat16)}


def _ok(*tensors: torch.Tensor) -> bool:
    # Called a few times per layer per step, so kept to cheap attribute reads. isinstance,
    # not duck typing: a quantized KV cache object must not pass as a tensor.
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype is not _F32 or t.is_cuda or t.is_meta:
            return False
    return True


# -- greedy tokens ---------------------------------------------------------------------------
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R]: ``x.argmax(dim=-1)``'s answer (the first maximum of each row, or
    its first NaN) from the C kernel where it applies; torch's CPU argmax reads a large
    vocabulary row at a few GB/s (~0.45 ms per 262k-token row on two cores)."""
    if not (available() and _ok(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    native.library().tm_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                                    torch.get_num_threads())
    return out


def nonfinite_rows(x: torch.Tensor) -> Optional[list[bool]]:
    """Flags of the rows of x [R, D] (on the CPU) holding a NaN or an infinity, or None when
    no row does: one pass of the C kernel where it applies; else one total clears the usual
    step (a NaN / inf makes it non-finite) and a non-finite one is checked row by row."""
    if available() and _ok(x) and x.dim() == 2 and x.is_contiguous():
        lib, threads = native.library(), torch.get_num_threads()
        if not lib.tm_nonfinite_rows(x.data_ptr(), x.shape[0], x.shape[1], None, threads):
            return None   # the usual step: no flags to allocate
        flags = torch.empty(x.shape[0], dtype=torch.uint8)
        lib.tm_nonfinite_rows(x.data_ptr(), x.shape[0], x.shape[1], flags.data_ptr(), threads)
        return flags.bool().tolist()
    if x.numel() == 0 or math.isfinite(x.sum().item()):
        return None
    bad = ~torch.isfinite(x).all(dim=-1)
    return bad.tolist() if bool(bad.any()) else None


# -- small-M linear -----------------------------------------------------------------------
# Up to 8 rows the kernel streams W once (GEMV_MAX_M in cpu_ops.c); more rows are
# compute-bound and take the register-blocked kernel (cpu_gemm.c), with the same bits per
# row. Against oneDNN's prepacked GEMM, W read from memory as in a decode step (Emerald
# Rapids, 2 threads, SmolLM2's four shapes), the blocked kernel is ahead at 16-64 rows
# (32 rows: 140-168 vs 103-146 GFLOP/s) and behind from ~96 on: prefill and larger
# batches stay with oneDNN. The AVX2 build is about even with oneDNN held to AVX2 (same CPU;
# no AVX2-only machine measured), and the C stack then covers those steps too.
LINEAR_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x [..., K] with at most LINEAR_MAX_ROWS rows -> x W^T + b; each output row's bits do
    not depend on how many rows share the call."""
    if not (available() and _ok(x, weight) and x.is_contiguous() and weight.is_contiguous()
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]):
        return None
    m = x.numel() // max(x.shape[-1], 1)
    if m == 0 or m > LINEAR_MAX_ROWS or (bias is not None and not (_ok(bias) and bias.is_contiguous())):
        return None
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    native.library().tm_linear_small_m(x.data_ptr(), m, k, weight.data_ptr(), n,
                           bias.data_ptr() if bias is not None else None, y.data_ptr(),
                           torch.get_num_threads())
    return y


# -- bf16 compute (cpu_gemm_dtype="bfloat16") ---------------------------------------------------
# On Zen 4 (2 threads) tm_linear_bf16 (cpu_gemm_bf16.c) ran 378-424 GFLOP/s at 32-2048 rows
# against oneDNN's bf16 path's 237-402 (its conversions included) and 186-210 for the float32
# kernels, and at 1-16 rows read its half-size weights 1.5-2x faster than the float32 GEMV. It
# is in C so that the fused decode stack takes bf16-mode steps too, with the modules' bits,
# and prefill needs no second (oneDNN) bf16 copy. On AMX tiles (a 2-core Xeon with 480 MB of
# L3) the same calls ran 1.2-2.1 TFLOP/s from 16 rows up against ~200 for vdpbf16ps and
# 0.4-2.1 for oneDNN's bf16 matmul (docs/bench/2026-12-07e).


def bf16_tiles(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """W [N, K] float32 -> tm_linear_bf16's bf16 copy: tiles of 16 outputs, each [K / 2][16]
    pairs of consecutive k (N % 16 == 0, K % 2 == 0; None otherwise)."""
    n, k = weight.shape
    if n % 16 or k % 2:
        return None
    w = weight.detach().to(torch.bfloat16).contiguous().view(n // 16, 16, k // 2, 2)
    return w.permute(0, 2, 1, 3).contiguous()


def linear_bf16(x: torch.Tensor, tiles: torch.Tensor, bias: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
    """x [M, K] float32 @ W^T (+ b) with x and W rounded to bf16 and float32 sums
    (bf16_tiles' copy of W), any M; None where it does not apply. Only CPUs with
    AVX-512 BF16 run it (prepacked.check_gemm_dtype refuses the mode elsewhere)."""
    if not (available() and _ok(x) and x.is_contiguous() and x.dim() == 2
            and tiles.dim() == 4 and x.shape[1] == 2 * tiles.shape[1]):
        return None
    m = x.shape[0]
    if m == 0 or (bias is not None and not (_ok(bias) and bias.is_contiguous())):
        return None
    n = tiles.shape[0] * 16
    y = torch.empty(m, n, dtype=torch.float32)
    failed = native.library().tm_linear_bf16(x.data_ptr(), m, x.shape[1], tiles.data_ptr(), n,
                                             bias.data_ptr() if bias is not None else None,
                                             y.data_ptr(), torch.get_num_threads())
    return None if failed else y


def linear_bf16_reference(x: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor] = None,
                          kernel: Optional[str] = None) -> torch.Tensor:
    """tm_linear_bf16's arithmetic in torch: x and W rounded to bf16 (products of two bf16
    values are exact in float32), then float32 sums in the order of the kernel that runs
    (``kernel``: "avx512" / "amx"; default: this process's, native.bf16_kernel()), + bias.
    vdpbf16ps: one chain per output over the k pairs in order, the odd product, then the
    even one. AMX tiles (K % 32 == 0 only; other K take vdpbf16ps): per group of 16 k pairs,
    the even products in one chain from zero and the odd in another, then acc += (even +
    odd). Denormals, which both flush, are not modelled."""
    kernel = kernel or native.bf16_kernel()
    xb, wb = x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float()
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    pairs = x.shape[1] // 2
    if kernel == "amx" and pairs % 16 == 0:
        for g in range(0, pairs, 16):
            even = odd = torch.zeros_like(acc)
            for p in range(g, g + 16):
                even = even + xb[:, 2 * p, None] * wb[None, :, 2 * p]
                odd = odd + xb[:, 2 * p + 1, None] * wb[None, :, 2 * p + 1]
            acc = acc + (even + odd)
    else:
        for p in range(pairs):
            acc = acc + xb[:, 2 * p + 1, None] * wb[None, :, 2 * p + 1]
            acc = acc + xb[:, 2 * p, None] * wb[None, :, 2 * p]
    return acc if bias is None else acc + bias


# -- 16-bit weights, float32 activations --------------------------------------------------


def linear_half(x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x [..., K] float32 @ W^T (+ b) for a float16 / bfloat16 W [N, K], any row count: the
    bits of ``linear(x, weight.float(), bias)`` (the kernels widen W exactly, then run the
    float32 arithmetic), reading half the weight bytes. None where it does not apply."""
    if not (available() and _ok(x) and x.is_contiguous() and isinstance(weight, torch.Tensor)
            and weight.dtype in HALF_WEIGHT_CODES and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.dim() == 2 and x.shape[-1] == weight.shape[1]):
        return None
    m = x.numel() // max(x.shape[-1], 1)
    if m == 0 or (bias is not None and not (_ok(bias) and bias.is_contiguous())):
        return None
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    native.library().tm_linear_half(x.data_ptr(), m, k, weight.data_ptr(),
                                    HALF_WEIGHT_CODES[weight.dtype], n,
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                    torch.get_num_threads())
    return y


# -- many-row float32 matmul: MKL on slices of the output features -----------------------------
# On this 2-core AVX2 box MKL's sgemm loses half its speed once a weight has many output
# rows (measured with /tmp-style sweeps, GFLOPS at 2 threads, whole weight vs 256-row
# slices): gate_up [3072, 576] at 64 rows 37 vs 45, 128 rows 51 vs 75, 512 rows 50 vs 99;
# the LM head [49152, 576] at 64 rows 32 vs 64, 128 rows 41 vs 76. Slicing W by output rows
# and concatenating gives MKL problems it runs at full speed; each output element is still
# one MKL dot product over all of K.
GEMM_N_SLICE = 256


def linear_many_rows(x: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ b) for prefill / large batches: F.linear, by slices of
    GEMM_N_SLICE output rows when W has more than 2 slices (CPU float32)."""
    n = weight.shape[0]
    if not (x.dim() == 2 and n > 2 * GEMM_N_SLICE and _ok(x, weight) and not tracing()):
        return F.linear(x, weight, bias)
    y = linear_by_row_slices(x, n, lambda n0, n1: weight[n0:n1])
    if bias is not None:
        y += bias
    return y


def linear_by_row_slices(x: torch.Tensor, n: int, rows) -> torch.Tensor:
    """x @ W^T with W [n, K] given by slices: ``rows(n0, n1)`` is W[n0:n1] as float32,
    GEMM_N_SLICE rows at a time, each multiplied by MKL; the outputs concatenate."""
    out = [F.linear(x, rows(n0, min(n, n0 + GEMM_N_SLICE))) for n0 in range(0, n, GEMM_N_SLICE)]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


# -- RMSNorm ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, gemma: bool = False) -> Optional[torch.Tensor]:
    """x [..., H] -> norm(x) * weight (``gemma``: * (1 + weight), GemmaRMSNorm's stored
    ``w - 1``), each row on its own: per-head q / k norms pass [T, heads, D] views, copied
    to rows here. With ``residual`` (x [T, H] contiguous, residual the same shape):
    residual += x in place and the result is norm(residual) * weight (the fused add + norm
    of a decoder layer)."""
    if not (available() and x.dim() >= 1 and _ok(x, weight) and weight.is_contiguous()
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1]):
        return None
    if residual is not None and not (_ok(residual) and residual.is_contiguous() and x.is_contiguous()
                                     and residual.shape == x.shape):
        return None
    h = x.shape[-1]
    # rows of h contiguous floats: a strided view is copied (a [T, 1, D] view reshapes to
    # [T, D] without a copy, its rows still a qkv row apart)
    rows = x.reshape(-1, h).contiguous() if residual is None else x
    out = torch.empty(x.shape, dtype=torch.float32)
    native.library().tm_rms_norm(rows.data_ptr(), residual.data_ptr() if residual is not None else None,
                                 weight.data_ptr(), eps, int(gemma), rows.numel() // max(h, 1), h,
                                 out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:   # GemmaRMSNorm: multiplied in float32, then cast
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed).to(x.dtype)


# -- rotary -------------------------------------------------------------------------------
def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> bool:
    """Neox rotary of q [T, Hq, D] and k [T, Hkv, D] in place, using cos/sin tables [P, D] at
    ``positions`` [T] int64. q / k may be row-strided views (heads contiguous). False when
    not applicable (nothing changed)."""
    if not (available() and _ok(q, k, cos, sin) and positions.dtype == torch.int64
            and positions.device.type == "cpu" and positions.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous()):
        return False
    t, hq, d = q.shape
    if (q.stride(2) != 1 or q.stride(1) != d or k.stride(2) != 1 or k.stride(1) != d
            or k.shape[0] != t or positions.shape[0] != t or d % 2):
        return False
    native.library().tm_rope(q.data_ptr(), k.data_ptr(), t, hq, k.shape[1], d, q.stride(0), k.stride(0),
                 cos.data_ptr(), sin.data_ptr(), positions.data_ptr())
    return True


# -- act(gate) * up ------------------------------------------------------------------------
def silu_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return _gated(x, "tm_silu_mul")


def gelu_tanh_mul(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x [T, 2I] (gate | up) -> gelu(gate, approximate="tanh") * up [T, I] (Gemma's MLP)."""
    return _gated(x, "tm_gelu_tanh_mul")


def _gated(x: torch.Tensor, kernel: str) -> Optional[torch.Tensor]:
    """One gated-activation kernel of the library on [T, 2I] rows; None where it cannot run."""
    if not (available() and x.dim() == 2 and _ok(x) and x.is_contiguous() and x.shape[1] % 2 == 0):
        return None
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    getattr(native.library(), kernel)(x.data_ptr(), t, two_i // 2, out.data_ptr(), torch.get_num_threads())
    return out


def gelu_tanh_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# -- paged attention of short query runs --------------------------------------------------
_FLOAT_KV = (torch.float32, torch.float16, torch.bfloat16)


def _cache_parts(cache) -> tuple:
    """(values, per-slot scales or None, KV_DTYPE_CODES code) of a float32 / float16 /
    bfloat16 CPU cache tensor or an int8 QuantizedKV; (None, None, None) for anything the
    kernel does not read (fp8, other dtypes, other devices)."""
    if isinstance(cache, torch.Tensor):
        if (cache.dtype in _FLOAT_KV and cache.device.type == "cpu" and cache.is_contiguous()
                and not cache.is_meta):
            return cache, None, KV_DTYPE_CODES[cache.dtype]
        return None, None, None
    values, scale = getattr(cache, "values", None), getattr(cache, "scale", None)
    if (isinstance(values, torch.Tensor) and values.dtype is torch.int8 and values.device.type == "cpu"
            and values.is_contiguous() and _ok(scale) and scale.is_contiguous()):
        return values, scale, KV_DTYPE_CODES[torch.int8]
    return None, None, None


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                    seq_len: torch.Tensor, scale: float, sliding_window: Optional[int],
                    out: torch.Tensor, q_pos: Optional[torch.Tensor] = None) -> bool:
    """Attention for the requests listed in q_start / q_len / seq_len ([B] int64 each, CPU):
    query rows q_start[b] + i sit at position seq_len[b] - q_len[b] + i and attend causally
    (and within the window) to the cache through block_tables [B, W] int64. Writes those
    rows of out [T, Hq, D]; False when not applicable (nothing written).

    ``q_pos`` (draft trees): None, or [T] int64 CPU, the position p of every query row of
    ``query`` (indexed by row, q_start[b] + i), 0 <= p <= seq_len[b] - q_len[b] + i (not
    checked here: AttentionMetadata.checked_query_positions). Row i then attends to the keys
    at positions < p through the table and reads its own key at p from the slot of position
    seq_len[b] - q_len[b] + i, where its K/V were written: the bits of a row at p whose cache
    held that K/V at p (cpu_attention.c, key_swap)."""
    if q_pos is not None and not (q_pos.dtype == torch.int64 and q_pos.device.type == "cpu"
                                  and q_pos.is_contiguous() and q_pos.dim() == 1
                                  and q_pos.shape[0] >= query.shape[0]):
        raise ValueError("q_pos must be a contiguous CPU int64 tensor with one entry per query row")
    ran = _attention_kernel("tm_paged_attention", query, k_cache, v_cache, block_tables, q_start,
                            q_len, seq_len, scale, sliding_window, out, (q_pos,))
    if ran is False:
        raise MemoryError("paged attention kernel could not allocate its score buffer")
    return bool(ran)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                      seq_len: torch.Tensor, scale: float, sliding_window: Optional[int],
                      out: torch.Tensor, bf16_math: bool = False) -> bool:
    """paged_attention for prefill chunks (any number of query rows per request; float32 /
    float16 / bfloat16 caches holding every key the rows see): each row's bits depend on
    the row alone (cpu_prefill.c), so a prompt prefilled after a prefix-cache hit, or in
    chunks, equals the same prompt prefilled cold at once. False when not applicable (an
    int8 cache, a head size or GQA group the kernel does not take): nothing written.
    ``bf16_math`` (bf16 mode): on a bfloat16 cache with head size % 32 == 0 where bf16
    matmuls take AMX tiles, q . k and p . v are tile products of bf16-rounded values
    (cpu_prefill_amx.c; the same row-alone bits); anywhere else the float32 kernel."""
    if bf16_math and k_cache.dtype is torch.bfloat16 and query.shape[2] % 32 == 0 \
            and native.bf16_kernel() == "amx" and _attention_kernel(
                "tm_prefill_attention_bf16", query, k_cache, v_cache, block_tables, q_start,
                q_len, seq_len, scale, sliding_window, out):
        return True
    return bool(_attention_kernel("tm_prefill_attention", query, k_cache, v_cache, block_tables,
                                  q_start, q_len, seq_len, scale, sliding_window, out))


def _attention_kernel(name: str, query, k_cache, v_cache, block_tables, q_start, q_len, seq_len,
                      scale: float, sliding_window: Optional[int], out, tree: tuple = ()):
    """None where the kernels do not take these tensors, else whether the C call ran (the
    two kernels share their arguments, but for ``tree``: tm_paged_attention's (q_pos,) after
    seq_len, a tensor or None; the prefill kernel takes no draft trees)."""
    k_data, k_scale, k_code = _cache_parts(k_cache)
    v_data, v_scale, v_code = _cache_parts(v_cache)
    if not (available() and k_data is not None and k_code == v_code and _ok(query, out)
            and query.stride(2) == 1 and query.stride(1) == query.shape[2] and out.is_contiguous()
            and block_tables.dtype == torch.int64 and block_tables.is_contiguous()
            and block_tables.device.type == "cpu"):
        return None
    _, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    failed = getattr(native.library(), name)(
        query.data_ptr(), query.stride(0), hq, d, k_data.data_ptr(), v_data.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None, k_code, bs, hkv,
        block_tables.data_ptr(), block_tables.shape[1], q_start.shape[0], q_start.data_ptr(),
        q_len.data_ptr(), seq_len.data_ptr(), *(None if t is None else t.data_ptr() for t in tree),
        scale,
        sliding_window if sliding_window is not None else 0, out.data_ptr(),
        torch.get_num_threads())
    return not failed
