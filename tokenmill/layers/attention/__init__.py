"""Paged attention: metadata, backend interface, torch reference and CPU fast path."""

from tokenmill.layers.attention.base import AttentionBackend, get_attention_backend, write_kv
from tokenmill.layers.attention.cpu import CpuAttention
from tokenmill.layers.attention.metadata import AttentionMetadata
from tokenmill.layers.attention.reference import ReferenceAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuAttention",
    "ReferenceAttention",
    "get_attention_backend",
    "write_kv",
]
