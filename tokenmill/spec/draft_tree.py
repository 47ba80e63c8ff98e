"""Draft trees: a chain of drafts plus leaf alternatives, verified in one forward.

A drafter's top token at each depth continues the chain; its next best tokens at that depth
(``alternatives``) are verified beside it as leaves. When the target's token at a depth is
not the chain's but one of its alternatives, that alternative is kept and its own row gives
the token after it, so one step still emits up to depth + 1 tokens, and the first positions,
where most drafts fail, get several tries (the trained EAGLE-3 on SmolLM2: the target's
token is the drafter's first choice 0.29 of the time on T = 1 chat contexts, among its
first four 0.50).

Nodes are numbered in the order the step computes them, after the request's newest token
(the root). ``parents[i]``: node i's parent (-1: the root). The supported shape: chain nodes
first (node i's parent i - 1), then leaves whose parent is the root or a chain node. So a
node's position is the root's + its depth, and every key it attends to other than its own
sits at its canonical position (layers/cpu_attention.c reads the own key of a row at
another position from the slot it was written to). Prefixes of the node list are trees of
the same shape (the scheduler cuts drafts to its budget).

Pure Python: the scheduler imports it.
"""
from __future__ import annotations

import ast
from typing import NamedTuple, Optional, Sequence


class DraftTree(NamedTuple):
    """A request's drafts when they branch: node tokens (chain first) and their parents."""
    tokens: list
    parents: list


def chain_length(parents: Sequence[int]) -> int:
    """How many leading nodes form the chain (node i's parent i - 1)."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def validate(parents: Sequence[int]) -> None:
    """Raises ValueError unless ``parents`` has the supported shape."""
    k = chain_length(parents)
    for i in range(k, len(parents)):
        if not -1 <= parents[i] < k:
            raise ValueError(f"draft tree: node {i}'s parent {parents[i]} is not the root or a "
                             f"chain node (chain of {k}); only leaf alternatives are supported")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (the root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def is_chain(parents: Optional[Sequence[int]]) -> bool:
    return parents is None or chain_length(parents) == len(parents)


def build(chain: Sequence[int], alternatives: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a chain and, per depth d (from 1), the alternatives to the chain's
    token at depth d (a depth past the chain has none). Alternatives equal to the chain's token
    are dropped (two children with one token could never both be kept)."""
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    for d, alts in enumerate(alternatives[:len(chain)]):
        seen = {chain[d]}
        for t in alts:
            if t not in seen:
                seen.add(t)
                tokens.append(t)
                parents.append(d - 1)
    return tokens, parents


def accepted_path(parents: Sequence[int], tokens: Sequence[int], target: Sequence[int]) -> list[int]:
    """The nodes kept by verification, root to leaf: from the root, while the target's token
    at the current node's row (``target[0]``: the root's, ``target[i + 1]``: node i's) is one
    of its children, move to that child. The step then emits the path's tokens and the
    target's token at the last node's row."""
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault(p, {})[t] = i
    path, node = [], -1
    while True:
        nxt = children.get(node, {}).get(target[node + 1])
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def parse_token_tree(spec) -> tuple[int, ...]:
    """vLLM's ``speculative_token_tree`` (a list of paths of child ranks, as a list or its
    string: "[(0,), (1,), (0, 0)]") -> candidates per depth, the chain's included. Only trees
    whose paths branch at their last step are supported: (0, 0, 2) is the third candidate at
    depth 3; (1, 0), a child of an alternative, is refused."""
    try:
        paths = ast.literal_eval(spec) if isinstance(spec, str) else spec
        paths = {tuple(int(r) for r in p) for p in paths}
    except (TypeError, ValueError, SyntaxError):
        raise ValueError(f"speculative_token_tree must be a list of tuples of child ranks, got {spec!r}") from None
    if not paths or () in paths:
        raise ValueError("speculative_token_tree must name at least one node, and no empty path")
    widths: dict[int, int] = {}
    for p in paths:
        if any(r < 0 for r in p):
            raise ValueError(f"speculative_token_tree: negative rank in {p}")
        if any(p[:-1]):
            raise ValueError(f"speculative_token_tree: {p} continues an alternative; only the "
                             "chain of first choices continues (alternatives are leaves)")
        if p[:-1] and p[:-1] not in paths:
            raise ValueError(f"speculative_token_tree: {p}'s parent {p[:-1]} is missing")
        widths[len(p)] = max(widths.get(len(p), 0), p[-1] + 1)
    depth = max(widths)
    for d in range(1, depth + 1):
        w = widths.get(d, 0)
        missing = [(0,) * (d - 1) + (r,) for r in range(w) if (0,) * (d - 1) + (r,) not in paths]
        if missing or w == 0:
            raise ValueError(f"speculative_token_tree: ranks at depth {d} must run 0..n-1 "
                             f"without gaps (missing {missing or [(0,) * d]})")
    return tuple(widths[d] for d in range(1, depth + 1))
