"""CUDA-event timing: warm up, then the median of `reps` timed calls (METHOD.md: never a host clock on
asynchronous work, never a single run)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def host_timed(fn: Callable, add: Callable[[float], None]) -> Callable:
    """`fn` wrapped to hand its host-clock ms to `add` after each call (returned or raised); nothing is
    synchronised, so on asynchronous work it is the host's share only."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add((time.perf_counter() - t0) * 1e3)

    return timed


def host_call_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median host-clock ms of one call of `fn` with no sync inside it (synchronised before and after each):
    the host's time issuing the work; above the device's time for it, the work is bound by its launches."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def cuda_time_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_ms(fn: Callable[[], object], reps: int) -> float:
    """ms a call of `reps` calls of `fn` run back to back, with no synchronisation between them (events around
    the whole run): the host's work for call n+1 overlaps the device's for call n where `fn` allows it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graph_replay_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median ms of replaying `fn` captured in a CUDA graph (device time without the Python launch gaps;
    `triton.testing.do_bench` times the replays with events). Warm-up runs on a side stream before the
    capture, as torch.cuda.graphs asks; nan (reason printed) when `fn` cannot be captured."""
    import triton

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as err:
        print(f"graph capture failed: {str(err)[:200]}")
        return float("nan")
    return triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
