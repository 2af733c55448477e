"""`SchedulerConfig`: the limits one scheduling step works within. Frozen; validated on construction.

Must not: read the environment or a checkpoint — the engine builds this from its EngineConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # cap on RUNNING sequences (and size of the ring / compressor-state slot pools)
    max_num_batched_tokens: int  # token budget of one step: prefill chunks + decode tokens + draft tokens
    max_model_len: int  # most token positions one sequence may have computed (KV entries)
    block_size: int  # token positions per KV block
    num_blocks: int  # blocks in the pool
    chunked_prefill: bool = True  # split a prompt over steps when it exceeds the remaining budget

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "chunked_prefill":
                if not isinstance(value, bool):
                    raise ValueError(f"chunked_prefill must be a bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")
        # A lone sequence of max_model_len must fit, or it would preempt itself forever.
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_blocks * block_size = {self.num_blocks * self.block_size} cannot hold one sequence of "
                f"max_model_len = {self.max_model_len}")
        # Without chunking a prompt is computed in one step, so the budget must take the longest prompt.
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked_prefill is off")
