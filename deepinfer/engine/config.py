"""`EngineConfig`: everything the engine needs to know besides the checkpoint's own ModelConfig.

Frozen, validated in __post_init__; derived sizes (KV blocks) are decided by the runner after its
warm-up forward and passed to the scheduler, never guessed here.
"""
from __future__ import annotations

from dataclasses import dataclass

NUMERICS = ("exact", "official", "fast")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "exact" float64; "official" bit-identical to the oracle (one sequence per call); "fast" the official
    # rounding points batched with quantised weights (family v4; the CUDA path)
    numerics: str = "exact"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 128  # tokens per KV block; a multiple of the largest compression ratio (128)
    num_blocks: int | None = None  # None: sized from kv_cache_bytes after the warm-up forward
    kv_cache_bytes: int = 1 << 30  # CPU budget for KV blocks (on CUDA: what is free after the warm-up)
    gpu_memory_utilization: float = 0.9
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N": params, caches and per-step metadata live there
    seed: int = 0  # seeds unseeded sampling reproducibly within one engine
    # fast numerics on cuda: replay pure-decode steps from CUDA graphs captured per batch bucket at start
    # (model/decode_step.py); False, or DEEPINFER_CUDA_GRAPHS=0, runs the same decode path eagerly
    cuda_graphs: bool = True
    # schedule step n+1 while step n runs on the device, doing the host's work on step n's tokens meanwhile
    # (engine/llm_engine.py); None: on for one CUDA process without speculative decoding
    async_scheduling: bool | None = None
    # parallelism (deepinfer/distributed, engine/distributed_*.py): one process per rank, world = tp * dp;
    # experts split in expert_parallel_size shards (1, tp or tp*dp)
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_timeout_s: float = 300.0  # a collective waiting longer than this fails the group

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"EngineConfig: {msg}")

        if self.numerics not in NUMERICS:
            bad(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size % 128:
            bad(f"block_size {self.block_size} must be a multiple of 128 (a compressed entry may not span blocks)")
        if self.num_blocks is not None and self.num_blocks <= 0:
            bad(f"num_blocks must be positive, got {self.num_blocks}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            bad(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        world = self.tensor_parallel_size * self.data_parallel_size
        if self.expert_parallel_size not in (1, self.tensor_parallel_size, world):
            bad(f"expert_parallel_size must be 1, tensor_parallel_size or tensor*data parallel size ({world}), "
                f"got {self.expert_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
