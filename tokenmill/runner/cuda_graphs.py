"""Decode steps replayed from CUDA graphs.

A decode step (every scheduled request computes one token) launches a few hundred small
kernels; at small batches their launch cost, not the GPU, sets the step time. A CUDA graph
captured once per batch-size bucket replays them in one launch.

A graph reads and writes fixed addresses, so the step's inputs are copied into persistent
buffers sized for the largest bucket, and a batch of B requests runs the graph of the
smallest bucket >= B. The padding rows compute garbage that nothing reads: their slot is -1
(the KV write skips it) and their context length 0 (attention writes zeros). The attention
kernels take their grid from host integers fixed per bucket (batch, one query token, the
number of context splits chosen for the longest context served) and every length from the
device buffers, so one capture serves every context length. Each KV group (kv/layout.py:
sliding-window layers with a pool of their own) has its own table and slot buffers, and the
bucket's metadata routes its layers there (``by_window``), as a step's metadata does.

Without capture (``capture=False``) the same padded buffers run eagerly: that is how the
padding logic is tested where there is no GPU (the kernels run in Triton's interpreter).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.kv.layout import KVLayout
from tokenmill.layers.attention.triton import TritonAttention, TritonAttentionMetadata
from tokenmill.runner.input_builder import ModelInput

logger = logging.getLogger("tokenmill.cuda_graphs")


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets: 1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class DecodeGraphs:
    """Persistent decode inputs, and one captured graph (or eager run) per batch bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, backend: TritonAttention,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: bool, kv_layout: Optional[KVLayout] = None) -> None:
        from tokenmill.layers.attention.triton_kernels import choose_num_splits
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.group_of_window = kv_layout.group_of_window() if kv_layout is not None else {}
        num_groups = len(kv_layout.groups) if kv_layout is not None else 1
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.capture = capture
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)          # [n]
        self.positions = torch.zeros(n, **i64)          # [n]
        self.slot_mapping = torch.full((num_groups, n), -1, **i64)  # [groups, n]
        self.seq_lens = torch.zeros(n, **i64)           # [n]
        self.query_start_loc = torch.arange(n + 1, **i64)   # [n + 1]: one token per request
        self.block_tables = torch.zeros(num_groups, n, self.max_blocks, **i64)   # [groups, n, max_blocks]
        self.metas = {size: self._meta(size, choose_num_splits(
            size, backend.num_kv_heads, max_model_len, backend.num_sms)) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, size: int, num_splits: int) -> TritonAttentionMetadata:
        groups = [TritonAttentionMetadata(
            num_tokens=size, query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[g, :size],
            slot_mapping=self.slot_mapping[g, :size], query_lens=[1] * size,
            seq_lens_list=[0] * size,   # not read by the Triton backend: lengths are on device
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size, num_splits=num_splits) for g in range(len(self.block_tables))]
        groups[0].by_window = {w: groups[g] for w, g in self.group_of_window.items() if g}
        return groups[0]

    def bucket(self, inp: ModelInput) -> Optional[int]:
        """The bucket that runs this step, or None when it is not a plain decode step."""
        meta = inp.attn_meta
        num_reqs = len(meta.query_lens)
        if meta.max_query_len != 1 or num_reqs > self.sizes[-1] or inp.pooling:
            return None
        if any(m.block_tables.shape[1] > self.max_blocks for m in self._group_metas(meta)):
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def _group_metas(self, meta) -> list:
        """The step's metadata of each KV group, group 0 first."""
        out = [meta] * len(self.block_tables)
        for w, g in self.group_of_window.items():
            out[g] = meta.for_window(w)
        return out

    def run(self, inp: ModelInput, size: int) -> torch.Tensor:   # -> [B, hidden]
        """Copy the step into the buffers (padding the rest of the bucket), run, slice."""
        meta, b = inp.attn_meta, len(inp.attn_meta.query_lens)
        self.input_ids[:b].copy_(inp.input_ids)
        self.positions[:b].copy_(inp.positions)
        self.seq_lens[:b].copy_(meta.seq_lens)
        for g, m in enumerate(self._group_metas(meta)):
            self.slot_mapping[g, :b].copy_(m.slot_mapping)
            self.block_tables[g, :b, :m.block_tables.shape[1]].copy_(m.block_tables)
        self.input_ids[b:size].zero_()
        self.positions[b:size].zero_()
        self.slot_mapping[:, b:size].fill_(-1)
        self.seq_lens[b:size].zero_()
        if self.capture:
            graph, out = self._graph(size)
            graph.replay()
        else:
            out = self._forward(size)
        return out[:b]

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.metas[size]
        meta.plan_cache.clear()   # per-step lookups (RoPE tables) are recomputed from the buffers
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta,
                          self.backend)

    def _graph(self, size: int) -> tuple:
        if size not in self.graphs:
            self.capture_all()
        return self.graphs[size]

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the others reuse its memory pool). Each is
        run once eagerly first so that Triton compiles its kernels outside the capture."""
        pool = None
        self.slot_mapping.fill_(-1)   # the capture runs write nothing into the cache
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", list(self.sizes))
