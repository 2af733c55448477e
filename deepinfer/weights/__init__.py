"""Checkpoint weights: lazy reading, checking against the config, loading, writing and conversion.

Owns the public API of `deepinfer.weights`: `CheckpointReader` (HF shards / single file / converted
`model{rank}-mp{n}` files), `check_checkpoint` -> `CheckReport`, `load_tensors` -> `LoadedWeights`,
`write_checkpoint` (HF-style shards + index), `convert_checkpoint` (the official convert.py), and the
tensor table `expected_tensors` / `TensorSpec` from `schema`.

Must not: import the model, kernels or engine (weights sit below them in the layer table).
"""
from deepinfer.weights.check import CheckReport, Problem, check_checkpoint
from deepinfer.weights.convert import (
    convert_checkpoint,
    converted_specs,
    expert_owner,
    native_name,
    official_key_dim,
    routed_expert_index,
)
from deepinfer.weights.loader import LoadedWeights, load_tensors
from deepinfer.weights.reader import CheckpointError, CheckpointReader, read_header
from deepinfer.weights.schema import TensorSpec, expected_tensors, scale_name
from deepinfer.weights.writer import shard_name, write_checkpoint

__all__ = [
    "CheckReport",
    "CheckpointError",
    "CheckpointReader",
    "LoadedWeights",
    "Problem",
    "TensorSpec",
    "check_checkpoint",
    "convert_checkpoint",
    "converted_specs",
    "expected_tensors",
    "expert_owner",
    "load_tensors",
    "native_name",
    "official_key_dim",
    "read_header",
    "routed_expert_index",
    "scale_name",
    "shard_name",
    "write_checkpoint",
]
