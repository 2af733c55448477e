"""Parallelism below the engine: the rank layout (`ParallelConfig`), the per-rank checkpoint slicing rules
(`shard_checkpoint`) and the `Communicator` the model calls at its few sublayer boundaries.

Imports only `config` (and torch): the launcher and the worker loop, which need the engine, live in
`deepinfer/engine/distributed_*.py`.
"""
from deepinfer.distributed.communicator import Communicator
from deepinfer.distributed.parallel_config import ParallelConfig
from deepinfer.distributed.sharding import shard_checkpoint

__all__ = ["Communicator", "ParallelConfig", "shard_checkpoint"]
