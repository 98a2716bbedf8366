"""Paged KV cache: storage, block allocation and the KV layouts that map (layer, depth) to slots."""

from loopserve.cache.layout import LAYOUTS, KVLayout
from loopserve.cache.pool import BlockAllocator, KVStore

__all__ = ["LAYOUTS", "KVLayout", "BlockAllocator", "KVStore"]
