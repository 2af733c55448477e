"""KV-cache management. `block_pool` is pure Python accounting (no tensors); the tensor-side layouts and
cache storage live in sibling modules and are imported from there directly, so importing this package
stays cheap and tensor-free for the scheduler."""
from deepinfer.cache.block_pool import BlockPool, BlockPoolError, SequenceSlots

__all__ = ["BlockPool", "BlockPoolError", "SequenceSlots"]
