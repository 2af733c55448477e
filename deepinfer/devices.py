"""Moving small host tensors to a device without waiting for it.

Owns: `host_to_device`, the one way the engine's host code puts per-step tensors (ids, positions, row
indices, per-row sampling parameters) on the GPU. It sits at the bottom of the layer table because both
`model` and `sampling` need it and may not import each other.
"""
from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without a stream sync on cuda: pinned, then a non-blocking copy (torch's
    caching host allocator keeps the pinned block until the copy has run). A plain `.to("cuda")` of pageable
    memory waits for the stream, i.e. for every kernel queued before it (with asynchronous scheduling, the
    next step's whole forward)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
