"""How the paged KV cache is laid out over a model's layers: groups of layers that share a
block table.

Full-attention layers keep every block of a request. The layers of one sliding window keep
only the blocks their window can still see, in a block pool (and cache tensors) of their own:
at 8192 tokens of context, a 512-token window holds ~34 blocks per request instead of 512.
The blocks that slide out of the window return to that pool (still findable by the prefix
cache until evicted), and the request's table points there at the group's *null block* (id 0,
zeros, never written), which a backend may read but always masks.

Group 0 is the primary group: the full-attention layers (where every layer slides, the group
of the widest window). Its table is a request's ``block_ids``, which drafters that keep caches
of their own index. Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tokenmill.utils import cdiv

NULL_BLOCK = 0   # in a windowed group: the block a table shows where the window has passed


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]       # model layer indices whose caches this group's table indexes
    window: Optional[int]         # tokens a query sees back (its own included); None: all
    num_blocks: int               # physical blocks, a windowed group's null block included


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    layer_windows: tuple = ()     # each layer's attention window (None: full); () = all full

    @classmethod
    def single(cls, num_blocks: int, num_layers: int = 1) -> "KVLayout":
        """Every layer in one table that keeps every block (no sliding window is freed)."""
        return cls((KVGroup(tuple(range(num_layers)), None, num_blocks),))

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def group_of_window(self) -> dict:
        """Attention window -> the group its layers are in (layers that share a window always
        share a group)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return {windows[layer]: g for g, group in enumerate(self.groups) for layer in group.layers}


def kv_bytes_read(bytes_per_token: float, layer_windows: Sequence[Optional[int]], context: int) -> int:
    """The K/V bytes one sequence's decode step reads at ``context`` tokens: each layer's
    share of ``bytes_per_token`` (every layer's K + V, scales included; the layers alike)
    over its window, or over the whole context where it has none. Benchmarks' memory floors
    count a sliding-window model's cache this way (Gemma 3: 15 of 18 layers see 512 tokens)."""
    windows = list(layer_windows) or [None]
    per_layer = bytes_per_token / len(windows)
    return int(sum(per_layer * (context if w is None else min(context, w)) for w in windows))


def first_live_block(num_computed: int, window: Optional[int], block_size: int) -> int:
    """The first block a query at position ``num_computed`` (or later) can still see: it reads
    keys from num_computed - window + 1 on. Every block before it is dead for the window."""
    if window is None:
        return 0
    return max(0, (num_computed - window + 1) // block_size)


def window_blocks_bound(window: int, block_size: int, max_num_seqs: int, max_step_tokens: int) -> int:
    """Blocks a windowed group can need at once: each running request holds its last
    window - 1 keys plus what it computes this step, and one step computes at most
    ``max_step_tokens`` tokens over all requests (each request's span may start and end
    in a partly used block: 2 blocks of slack per request)."""
    return cdiv(max_num_seqs * (window - 1) + max_step_tokens, block_size) + 2 * max_num_seqs


def plan_kv_layout(layer_windows: Sequence[Optional[int]], num_blocks: int, block_size: int, *,
                   explicit_blocks: bool, max_num_seqs: int, max_step_tokens: int,
                   free_windows: bool, primary_shared: bool) -> KVLayout:
    """Split the pool of ``num_blocks`` (what one table over every layer would hold) into groups.

    A window group gets the blocks its requests can need at once (``window_blocks_bound``)
    plus its null block, and only where that is fewer than ``num_blocks``; its layers join
    group 0 otherwise. With a byte budget (``explicit_blocks`` False) the bytes a window group
    does not take go to group 0, so full-attention layers hold more context; an explicit
    block count gives group 0 exactly that many. ``free_windows`` False keeps one table for
    every layer (as before windows were freed); ``primary_shared``: a drafter indexes caches
    of its own by group 0's table, so group 0 must keep every block even if its layers slide.
    """
    num_layers = len(layer_windows)
    windows = tuple(layer_windows)
    if not free_windows or not any(w is not None for w in windows):
        return KVLayout(KVLayout.single(num_blocks, num_layers).groups, windows)
    by_window: dict = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w, []).append(layer)
    primary_key = None if None in by_window else max(by_window)
    primary = by_window.pop(primary_key)

    def window_group(layers: list, w: int) -> Optional[KVGroup]:
        need = window_blocks_bound(w, block_size, max_num_seqs, max_step_tokens) + 1
        return KVGroup(tuple(layers), w, need) if need < num_blocks else None

    sized = []
    for w, layers in sorted(by_window.items()):
        group = window_group(layers, w)
        if group is None:
            primary = primary + layers   # the window would save nothing: stay in group 0
        else:
            sized.append(group)
    if primary_key is not None and not primary_shared:   # every layer slides
        first = window_group(primary, primary_key)
        if first is not None:
            return KVLayout((first, *sized), windows)
    primary_blocks = num_blocks
    if sized and not explicit_blocks:   # the bytes window groups do not take go to group 0
        layer_blocks = num_blocks * num_layers - sum(g.num_blocks * len(g.layers) for g in sized)
        primary_blocks = layer_blocks // len(primary)
    return KVLayout((KVGroup(tuple(sorted(primary)), None, primary_blocks), *sized), windows)
