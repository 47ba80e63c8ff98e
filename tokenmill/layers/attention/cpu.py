"""Faster paged attention in plain PyTorch, tuned for CPU (correct on any device).

Two paths, chosen per request from the Python query lengths:
- short runs of generated tokens (decode tokens, 1 + k speculative tokens) are batched: whole KV blocks are
  gathered into a padded [B, L, Hkv, D] tensor with one index op and attended with one
  masked SDPA call. GQA costs no copy: the G query heads sharing a KV head are folded
  into SDPA's query-length axis, so K/V are read once per KV head.
- long runs and every run of prompt tokens (prefill chunks, however short: the last rows
  after a prefix-cache hit) go one request at a time through SDPA; a chunk starting at
  position 0 attends to its fresh K/V directly, without reading the cache back.
Where the C kernels run, both take them instead (cpu_ops.paged_attention for the short runs,
cpu_ops.prefill_attention for the chunks: each row's bits fixed by the row alone, so a
prompt prefilled after a prefix-cache hit equals the same prompt prefilled cold).
A draft tree's run (``meta.query_positions``) goes through cpu_ops.paged_attention whatever
its length: only that kernel reads a leaf alternative's own key from its written slot
(neither PyTorch path does), and its rows have the bits of the same tokens decoded as a
chain. The other runs of that step take their usual paths (a prompt chunk beside a tree
keeps its prefill bits).
Compute is fp32 (bf16 matmul on CPU is far slower); the output has the query's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_ops
from tokenmill.layers.attention.base import AttentionBackend, check_gqa, write_kv
from tokenmill.layers.attention.metadata import AttentionMetadata

# Runs up to this many query tokens share the padded batched path. Past it, padding every
# request's queries to the longest run wastes more than the per-request loop costs.
MAX_BATCHED_QUERY_LEN = 8


class CpuAttention(AttentionBackend):
    """``cpu_kernels``: short runs on float32 CPU caches go through the fused C kernel
    (cpu_attention.c) where the library runs; False keeps every step in PyTorch.
    ``bf16_prefill`` (bf16 mode): prompt runs take cpu_ops.prefill_attention's bf16 tile
    kernel where it runs (a bfloat16 cache, AMX); other long runs (speculative ones) keep
    the float32 kernel, whatever shares their step."""

    name = "cpu"

    def __init__(self, cpu_kernels: bool = True, bf16_prefill: bool = False) -> None:
        self.cpu_kernels = cpu_kernels
        self.bf16_prefill = bf16_prefill

    @property
    def supports_draft_trees(self) -> bool:
        """Draft trees take the C kernel (see the module docstring): it must be on and built."""
        return self.cpu_kernels and cpu_ops.available()

    def forward(
        self,
        query: torch.Tensor,    # [T, num_heads, head_dim]
        key: torch.Tensor,      # [T, num_kv_heads, head_dim]
        value: torch.Tensor,    # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        check_gqa(query.shape[1], k_cache.shape[2])
        out = torch.empty_like(query)
        # a draft tree's run takes the C paged kernel whatever its length; every other run
        # takes its usual path, so its bits do not depend on a tree beside it
        trees = meta.tree_runs() or (False,) * meta.num_reqs
        short = [b for b, q in enumerate(meta.query_lens)
                 if trees[b] or (q <= MAX_BATCHED_QUERY_LEN and not meta.is_prompt_run(b))]
        if any(trees):
            self._draft_trees(query, k_cache, v_cache, meta, short, scale, sliding_window, out)
        elif short and not (self.cpu_kernels and _fused(cpu_ops.paged_attention, query, k_cache,
                                                        v_cache, meta, short, scale, sliding_window, out)):
            _batched_short(query, k_cache, v_cache, meta, short, scale, sliding_window, out)
        long = [b for b, q in enumerate(meta.query_lens)
                if not trees[b] and (q > MAX_BATCHED_QUERY_LEN or meta.is_prompt_run(b))]
        groups = [(long, False)]
        if self.bf16_prefill:   # a run's kernel depends on the run alone, not on its step
            groups = [([b for b in long if meta.is_prompt_run(b)], True),
                      ([b for b in long if not meta.is_prompt_run(b)], False)]
        for reqs, bf16 in groups:
            if reqs and not (self.cpu_kernels and _fused(
                    cpu_ops.prefill_attention, query, k_cache, v_cache, meta, reqs, scale,
                    sliding_window, out, bf16_math=bf16)):
                self._prefill_each(query, key, value, k_cache, v_cache, meta, reqs, scale,
                                   sliding_window, out)
        return out

    @staticmethod
    def _prefill_each(query, key, value, k_cache, v_cache, meta: AttentionMetadata,
                      long: list[int], scale: float, sliding_window: Optional[int],
                      out: torch.Tensor) -> None:
        """Long runs one request at a time through SDPA (the C kernels do not take them)."""
        starts = _starts(meta.query_lens)
        for b in long:
            s, e = starts[b], starts[b] + meta.query_lens[b]
            out[s:e] = _prefill_one(
                query[s:e], key[s:e], value[s:e], k_cache, v_cache,
                meta.block_tables[b], meta.seq_lens_list[b], scale, sliding_window,
                meta.plan_cache,
            ).to(out.dtype)

    def _draft_trees(self, query, k_cache, v_cache, meta: AttentionMetadata, reqs: list[int],
                     scale: float, sliding_window: Optional[int], out: torch.Tensor) -> None:
        """The short runs of a step that verifies draft trees, trees included, through the C
        paged kernel (a PyTorch fallback would attend the chain node's key in place of an
        alternative's own: a wrong answer, so none is taken)."""
        if not self.supports_draft_trees:
            raise ValueError("draft trees need the C attention kernel (cpu_kernels on and the "
                             "kernel library built)")
        if not _fused(cpu_ops.paged_attention, query, k_cache, v_cache, meta, reqs, scale,
                      sliding_window, out, meta.checked_query_positions()):
            raise ValueError("draft trees need the C attention kernel, which does not take "
                             f"these tensors (query {query.dtype}, cache {k_cache.dtype})")


def _starts(query_lens: list[int]) -> list[int]:
    starts, total = [], 0
    for q in query_lens:
        starts.append(total)
        total += q
    return starts


def _batched_short(
    query: torch.Tensor,    # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    reqs: list[int],        # indices of the requests on this path
    scale: float,
    sliding_window: Optional[int],
    out: torch.Tensor,      # [T, num_heads, head_dim], rows of `reqs` are written
) -> None:
    key = ("short", tuple(reqs), sliding_window)
    plan = meta.plan_cache.get(key)
    if plan is None:
        plan = meta.plan_cache[key] = _short_plan(meta, reqs, sliding_window, query.device,
                                                  query.shape[1] // k_cache.shape[2])
    flat_ids, tok, valid, mask = plan
    k, v = _gather_flat(k_cache, v_cache, flat_ids, tok.shape[0])
    num_reqs, max_q = tok.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    # [Bs, Qmax, H, D] -> [Bs, Hkv, Qmax*G, D]: heads sharing a KV head become query rows.
    q = query[tok].float().view(num_reqs, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, max_q * group, head_dim)
    o = _masked_attention(q, k, v, mask, scale)
    # [Bs, Hkv, Qmax*G, D] -> [Bs, Qmax, H, D]
    o = o.view(num_reqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    o = o.reshape(num_reqs, max_q, num_kv_heads * group, head_dim)
    if max_q == 1:  # pure decode: every row is real, skip the boolean select
        out[tok[:, 0]] = o[:, 0].to(out.dtype)
    else:
        out[tok[valid]] = o[valid].to(out.dtype)


def _fused(kernel, query, k_cache, v_cache, meta: AttentionMetadata, reqs: list[int], scale: float,
           sliding_window: Optional[int], out: torch.Tensor,
           q_pos: Optional[torch.Tensor] = None, **kernel_args) -> bool:
    """The requests ``reqs`` through one C kernel call (cpu_ops.paged_attention for short
    runs, cpu_ops.prefill_attention for prefill chunks): no gather, no padding, one call per
    layer. False when it does not apply; the PyTorch path then runs. ``q_pos``: every query
    row's position in a draft tree step (paged_attention only)."""
    if not cpu_ops.available():
        return False
    key = ("fused", kernel.__name__, tuple(reqs))
    plan = meta.plan_cache.get(key)
    if plan is None:
        starts = _starts(meta.query_lens)
        tables = meta.block_tables if len(reqs) == meta.num_reqs else \
            meta.block_tables[torch.tensor(reqs)].contiguous()
        plan = meta.plan_cache[key] = (
            tables.cpu(), torch.tensor([starts[b] for b in reqs], dtype=torch.int64),
            torch.tensor([meta.query_lens[b] for b in reqs], dtype=torch.int64),
            torch.tensor([meta.seq_lens_list[b] for b in reqs], dtype=torch.int64))
    tables, q_start, q_len, seq_len = plan
    tree = {} if q_pos is None else {"q_pos": q_pos}
    return kernel(query, k_cache, v_cache, tables, q_start, q_len, seq_len, scale, sliding_window,
                  out, **tree, **kernel_args)


def _short_plan(meta: AttentionMetadata, reqs: list[int], sliding_window: Optional[int],
                device, group: int) -> tuple:
    """Everything about the batched short-query path that is the same in every layer."""
    num_blocks_used = -(-max(meta.seq_lens_list[b] for b in reqs) // meta.block_size)
    req_idx = torch.tensor(reqs, device=device)
    flat_ids = meta.block_tables[req_idx, :num_blocks_used].reshape(-1)
    tok, q_pos, valid = _short_query_index(meta, reqs, device)      # each [Bs, Qmax]
    mask = _folded_mask(q_pos, num_blocks_used * meta.block_size, group, sliding_window)
    return flat_ids, tok, valid, mask


def _gather_flat(k_cache: torch.Tensor, v_cache: torch.Tensor, flat_ids: torch.Tensor,
                 num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    # -> 2 x [Bs, Hkv, nb*block_size, D] fp32
    _, block_size, num_kv_heads, head_dim = k_cache.shape

    def gather(cache: torch.Tensor) -> torch.Tensor:
        g = cache.index_select(0, flat_ids).view(num_reqs, -1, num_kv_heads, head_dim)
        return g.float().transpose(1, 2)
    return gather(k_cache), gather(v_cache)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with plain matmuls. For a handful of query rows the
    CPU flash-SDPA kernel costs milliseconds of setup per call; two batched matmuls cost
    microseconds. q [Bs, Hkv, Qg, D]; k, v [Bs, Hkv, L, D]; mask broadcastable to
    [Bs, Hkv, Qg, L] -> [Bs, Hkv, Qg, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _folded_mask(
    q_pos: torch.Tensor,  # [Bs, Qmax] query positions
    num_keys: int,
    group: int,
    sliding_window: Optional[int],
) -> torch.Tensor:        # [Bs, 1, Qmax*G or 1, L] bool
    """Mask matching the folded query layout: row qi*G + g is query qi of head g."""
    num_reqs, max_q = q_pos.shape
    mask = _mask(q_pos, num_keys, sliding_window)                    # [Bs, Qmax, L]
    if max_q == 1:  # decode: one row serves all G folded heads by broadcast, no copy
        return mask[:, None]
    mask = mask[:, None, :, None, :].expand(-1, 1, -1, group, -1)
    return mask.reshape(num_reqs, 1, max_q * group, num_keys)


# A sliding-window prefill takes its queries in tiles of at least this many rows: tile
# [s, e) reads only keys (s - window, e), so the work grows with q_len * window rather than
# q_len * seq_len, and each tile is still large enough for the flash kernel to pay off.
MIN_WINDOW_TILE = 64
# Query rows per SDPA call when a prefill chunk follows a cached context: SDPA widens its
# boolean mask to float, so one call for a 2048-token chunk at context 8192 held ~70 MB more
# at its peak; tiles of 256 rows hold ~1 MB.
PREFILL_QUERY_TILE = 256


def _prefill_windowed(
    q: torch.Tensor,            # [q_len, num_heads, head_dim]
    key: torch.Tensor,          # [q_len, num_kv_heads, head_dim] this chunk's fresh K
    value: torch.Tensor,
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_blocks]
    seq_len: int,
    scale: float,
    window: int,
    plan_cache: Optional[dict],
) -> torch.Tensor:              # [q_len, num_heads, head_dim] fp32
    q_len = q.shape[0]
    ctx = seq_len - q_len
    k, v, k_first = _window_keys(key, value, k_cache, v_cache, block_table, seq_len,
                                 max(0, ctx - window + 1))           # [1, Hkv, S', D]
    qt = q.float().transpose(0, 1)[None]                             # [1, H, q_len, D]
    return _attend_in_tiles(qt, k, v, ctx, k_first, max(window, MIN_WINDOW_TILE), window,
                            scale, plan_cache)


def _attend_in_tiles(qt: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, k_first: int,
                     tile: int, window: Optional[int], scale: float,
                     plan_cache: Optional[dict]) -> torch.Tensor:
    """Query rows qt [1, H, q_len, D] at positions ctx, ctx + 1, .. in tiles of ``tile`` rows,
    each against the keys it can see (causal, within ``window``) among k / v [1, Hkv, S', D],
    whose row 0 is position k_first. -> [q_len, H, D] fp32."""
    q_len = qt.shape[2]
    out = torch.empty(q_len, qt.shape[1], qt.shape[3], dtype=torch.float32, device=qt.device)
    for s in range(0, q_len, tile):
        e = min(s + tile, q_len)
        q_first = ctx + s                                            # absolute positions
        lo = 0 if window is None else max(k_first, q_first - window + 1) - k_first
        hi = ctx + e - k_first                                       # key rows [lo, hi)
        mask = _cached_mask(q_first - (k_first + lo), e - s, hi - lo, window, qt.device,
                            plan_cache)
        o = F.scaled_dot_product_attention(
            qt[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=scale,
            enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


def _window_keys(key, value, k_cache, v_cache, block_table, seq_len: int, first: int):
    """K/V of positions [first', seq_len) as 2 x [1, Hkv, S', D] fp32 with first' <= first
    (whole blocks are read); returns them and first'."""
    if seq_len == key.shape[0]:            # the chunk is the whole context: use it directly
        k, v = key[first:].float().transpose(0, 1), value[first:].float().transpose(0, 1)
        return k[None], v[None], first
    block_size = k_cache.shape[1]
    b0, b1 = first // block_size, -(-seq_len // block_size)
    k, v = _gather_blocks(k_cache, v_cache, block_table[None, b0:b1])
    end = seq_len - b0 * block_size
    return k[:, :, :end], v[:, :, :end], b0 * block_size


def _cached_mask(offset: int, num_queries: int, num_keys: int, window: Optional[int], device,
                 plan_cache: Optional[dict]) -> torch.Tensor:  # [num_queries, num_keys] bool
    """Query i (at key row offset + i) may attend key row j when j <= offset + i (and
    offset + i - window < j with a window). The same few shapes recur in every tile and
    layer of a step: cached in the step's plan_cache."""
    cache_key = ("mask", offset, num_queries, num_keys, window)
    mask = plan_cache.get(cache_key) if plan_cache is not None else None
    if mask is None:
        q_pos = torch.arange(offset, offset + num_queries, device=device)
        mask = _mask(q_pos, num_keys, window)
        if plan_cache is not None:
            plan_cache[cache_key] = mask
    return mask


def _gather_blocks(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    tables: torch.Tensor,   # [Bs, nb] block ids
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [Bs, Hkv, nb*block_size, D] fp32
    # Whole blocks are copied (contiguous rows), not slot by slot; positions past a
    # request's seq_len are padding that the mask hides. index_select over a flat id list
    # is a plain row copy, about 2x faster on CPU than advanced indexing with a 2-D index.
    # A quantized cache (kv_quant.QuantizedKV) dequantizes inside index_select: read caches
    # only through index_select here and in _gather_flat.
    num_reqs, nb = tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_ids = tables.reshape(-1)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        g = cache.index_select(0, flat_ids)
        g = g.view(num_reqs, nb * block_size, num_kv_heads, head_dim)
        return g.float().transpose(1, 2)

    return gather(k_cache), gather(v_cache)


def _short_query_index(
    meta: AttentionMetadata, reqs: list[int], device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tok, q_pos, valid: [Bs, Qmax]
    """Token rows, positions and validity of each request's queries, padded to Qmax.

    Padding rows repeat the request's last real token so they never see an empty key set
    (which would give NaN); they are dropped before writing the output.
    """
    starts = _starts(meta.query_lens)
    q_lens = torch.tensor([meta.query_lens[b] for b in reqs], device=device)
    first = torch.tensor([starts[b] for b in reqs], device=device)
    ctx = torch.tensor([meta.seq_lens_list[b] for b in reqs], device=device) - q_lens
    max_q = max(meta.query_lens[b] for b in reqs)
    i = torch.arange(max_q, device=device)[None, :]                  # [1, Qmax]
    valid = i < q_lens[:, None]
    i = torch.minimum(i, q_lens[:, None] - 1)
    return first[:, None] + i, ctx[:, None] + i, valid


def _mask(
    q_pos: torch.Tensor,  # [..., Q] int64 positions of the queries
    num_keys: int,
    sliding_window: Optional[int],
) -> torch.Tensor:        # [..., Q, num_keys] bool, True = may attend
    # k <= q_pos also hides padding keys: every query position is < its request's seq_len.
    k_pos = torch.arange(num_keys, device=q_pos.device)
    allowed = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        allowed &= k_pos > q_pos[..., None] - sliding_window
    return allowed


def _prefill_one(
    q: torch.Tensor,            # [q_len, num_heads, head_dim]
    key: torch.Tensor,          # [q_len, num_kv_heads, head_dim] this chunk's fresh K
    value: torch.Tensor,        # [q_len, num_kv_heads, head_dim]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_blocks]
    seq_len: int,
    scale: float,
    sliding_window: Optional[int],
    plan_cache: Optional[dict] = None,   # per-step cache shared by the layers
) -> torch.Tensor:              # [q_len, num_heads, head_dim] fp32
    q_len = q.shape[0]
    ctx = seq_len - q_len
    if sliding_window is not None and seq_len > sliding_window:
        return _prefill_windowed(q, key, value, k_cache, v_cache, block_table, seq_len, scale,
                                 sliding_window, plan_cache)
    # no window, or one no shorter than the sequence: every key of the context is visible
    k, v, _ = _window_keys(key, value, k_cache, v_cache, block_table, seq_len, 0)  # [1, Hkv, S, D]
    # 4-D inputs on purpose: on CPU, 3-D SDPA falls back to the unfused math kernel (~4x
    # slower); 4-D reaches the flash kernel, which also handles GQA without copying K/V.
    qt = q.float().transpose(0, 1)[None]                                 # [1, H, q_len, D]
    if ctx == 0:
        o = F.scaled_dot_product_attention(
            qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    # after a cached context, queries go in tiles, each against the keys up to its last row
    return _attend_in_tiles(qt, k, v, ctx, 0, PREFILL_QUERY_TILE, None, scale, plan_cache)
