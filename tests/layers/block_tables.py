"""Block tables for attention tests: requests own shuffled blocks, so no kernel can pass by
assuming a request's blocks are consecutive."""
import torch


def shuffled_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                          gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(order[used:used + n])
        used += n
    if used > num_blocks:
        raise ValueError(f"{used} blocks needed, the pool has {num_blocks}")
    return tables
