"""Where a replayed decode step's time goes on its MAIN stream: the chain every other stream forks from and
joins back into, so its span is the step's span. A per-kernel sum (decode_anatomy's table) cannot say
that: the side streams' kernels overlap the main chain, and a kernel that looks long there may be off the
path. This reads the profiler's kernel records with their streams and lays out the main stream in order:
each kernel's time, the idle time before it, and, where the main stream sat idle, the side-stream kernel
that ended last before it resumed (what it was most likely waiting on: a join).

    ks = profiled_kernels(graph.replay)               # needs CUDA
    print(format_critical_path(critical_path(ks), rows=120))
    print(format_timeline(main_stream_path(ks), rows=120))

Read it with DEEPINFER_PDL=0: with programmatic dependent launch a kernel starts early and waits on the
device for its predecessor, so its recorded time includes that wait and the gaps read negative.
A replayed graph's kernels run on the streams the graph's executor picks, not on the streams they were
captured on (H100, 2026-12-07: the "main" stream of the replay carried the shared expert while the routed
experts' chain ran beside it), so `critical_path` also walks back from the step's last kernel, each time
to the kernel that ended last before it started, on any stream: with PDL off a kernel starts once its last
dependency ends, so that chain is the step's critical path up to launch latencies.
The analysis (`main_stream_path`, `critical_path`, `kernel_table`) is plain Python over (stream, start, end, name) records,
tested on the CPU (tests/test_stream_timeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Kernel:
    stream: int
    start_us: float
    end_us: float
    name: str


@dataclass
class MainStep:
    """One main-stream kernel: its own time, the main stream's idle time before it (from the previous main
    kernel's end; 0 for the first), and the side kernel that ended last inside that idle window, if any."""
    name: str
    us: float
    idle_before_us: float
    waited_on: str | None = None
    end_us: float = 0.0  # its end, on the profiler's clock


@dataclass
class Timeline:
    span_us: float
    main_stream: int
    steps: list[MainStep] = field(default_factory=list)
    first_us: float = 0.0
    side: list[Kernel] = field(default_factory=list)  # the other streams' kernels, by start

    @property
    def side_kernels(self) -> int:
        return len(self.side)

    @property
    def side_us(self) -> float:
        return sum(k.end_us - k.start_us for k in self.side)

    @property
    def main_busy_us(self) -> float:
        return sum(s.us for s in self.steps)

    @property
    def main_idle_us(self) -> float:
        return sum(s.idle_before_us for s in self.steps)


def main_stream_path(kernels: list[Kernel], idle_floor_us: float = 0.0) -> Timeline:
    """Lay out the main stream of one replay. The main stream is the one whose kernels start first and end
    last (the graph forks from it and joins into it); of several that qualify, the one with more kernels.
    A side kernel is named as waited on when it ends inside an idle window of the main stream longer than
    idle_floor_us (the last such one: the join that released the main stream)."""
    if not kernels:
        raise ValueError("main_stream_path: no kernels (did the profiler record the replay?)")
    first = min(k.start_us for k in kernels)
    last = max(k.end_us for k in kernels)
    by_stream: dict[int, list[Kernel]] = {}
    for k in kernels:
        by_stream.setdefault(k.stream, []).append(k)
    for ks in by_stream.values():
        ks.sort(key=lambda k: k.start_us)

    def rank(s: int) -> tuple:
        ks = by_stream[s]
        return (ks[0].start_us == first, max(k.end_us for k in ks) == last, len(ks))

    main = max(by_stream, key=rank)
    side = sorted((k for s, ks in by_stream.items() if s != main for k in ks), key=lambda k: k.end_us)
    tl = Timeline(span_us=last - first, main_stream=main, first_us=first,
                  side=sorted(side, key=lambda k: k.start_us))
    prev_end = None
    for k in by_stream[main]:
        idle = 0.0 if prev_end is None else max(0.0, k.start_us - prev_end)
        waited = None
        if prev_end is not None and idle > idle_floor_us:
            inside = [s for s in side if prev_end < s.end_us <= k.start_us]
            if inside:
                waited = inside[-1].name
        tl.steps.append(MainStep(k.name, k.end_us - k.start_us, idle, waited, k.end_us))
        prev_end = k.end_us if prev_end is None else max(prev_end, k.end_us)
    return tl


def critical_path(kernels: list[Kernel], slack_us: float = 0.3) -> list[MainStep]:
    """The chain that bounds the step, first kernel first: from the kernel that ends last, step back each
    time to the kernel (any stream) with the latest end at or before this one's start + slack_us (records
    are rounded; a kernel can start a hair before its predecessor's recorded end). idle_before_us is the gap
    to that predecessor: launch latency or a wait the trace does not show."""
    if not kernels:
        raise ValueError("critical_path: no kernels (did the profiler record the replay?)")
    by_end = sorted(kernels, key=lambda k: k.end_us)
    cur = by_end[-1]
    chain = []
    while True:
        preds = [k for k in by_end if k.end_us <= cur.start_us + slack_us and k is not cur
                 and k.start_us < cur.start_us]
        prev = preds[-1] if preds else None
        gap = 0.0 if prev is None else max(0.0, cur.start_us - prev.end_us)
        chain.append(MainStep(cur.name, cur.end_us - cur.start_us, gap, end_us=cur.end_us))
        if prev is None:
            break
        cur = prev
    return chain[::-1]


def _by_name(named_us, name_width: int) -> list[tuple[str, int, float]]:
    """(name, us) pairs grouped by their name's first name_width characters: (name, count, summed us), the
    largest sum first."""
    by_name: dict[str, list[float]] = {}
    for name, us in named_us:
        by_name.setdefault(name[:name_width], []).append(us)
    return sorted(((n, len(v), sum(v)) for n, v in by_name.items()), key=lambda r: -r[2])


def format_critical_path(chain: list[MainStep], rows: int = 0, name_width: int = 48) -> str:
    """A summary line, the path's kernels by name (largest first), then (rows > 0) its first `rows` in order."""
    busy, idle = sum(s.us for s in chain), sum(s.idle_before_us for s in chain)
    out = [f"critical path: {len(chain)} kernels, {busy:.1f} us in kernels + {idle:.1f} us between them"]
    for name, n, us in _by_name(((s.name, s.us) for s in chain), name_width)[:20]:
        out.append(f"    {us:8.1f} us {n:4d}x  {name}")
    if rows:
        out.append("  in order (us: gap before, own time):")
        for i, s in enumerate(chain[:rows]):
            out.append(f"    {i:4d} {s.idle_before_us:6.1f} {s.us:7.1f}  {s.name[:name_width]}")
    return "\n".join(out)


def format_timeline(tl: Timeline, rows: int = 0, name_width: int = 48) -> str:
    """A summary line, the idle windows' largest culprits, then (rows > 0) the first `rows` main kernels and
    the side streams' kernels that start before the last of those ends (stream, start from the first kernel,
    own time)."""
    out = [f"main stream {tl.main_stream}: {len(tl.steps)} kernels, {tl.main_busy_us:.1f} us busy + "
           f"{tl.main_idle_us:.1f} us idle = {tl.main_busy_us + tl.main_idle_us:.1f} of a {tl.span_us:.1f} us span; "
           f"side streams {tl.side_kernels} kernels, {tl.side_us:.1f} us"]
    if tl.side_kernels == 0 and tl.main_busy_us > 1.05 * tl.span_us:
        out.append("  (every kernel reported on one stream, yet they overlap: this profiler did not tell the graph's "
                   "branches apart, so the idle figures are the device's, not the main chain's)")
    waits = _by_name(((s.waited_on, s.idle_before_us) for s in tl.steps if s.waited_on is not None), name_width)
    if waits:
        out.append("  main stream idle, by the side kernel that ended last before it resumed:")
        for name, n, us in waits[:12]:
            out.append(f"    {us:8.1f} us {n:4d}x  {name}")
    out.append("  main stream busy, by kernel:")
    for name, n, us in _by_name(((s.name, s.us) for s in tl.steps), name_width)[:20]:
        out.append(f"    {us:8.1f} us {n:4d}x  {name}")
    if rows:
        out.append("  main stream in order (us: idle before, own time):")
        for i, s in enumerate(tl.steps[:rows]):
            wait = f"  <- {s.waited_on[:name_width]}" if s.waited_on else ""
            out.append(f"    {i:4d} {s.idle_before_us:6.1f} {s.us:7.1f}  {s.name[:name_width]}{wait}")
        if tl.side:
            t0 = tl.first_us  # (every kernel's earliest start, side ones included)
            horizon = tl.steps[min(rows, len(tl.steps)) - 1].end_us
            out.append("  side streams in order (stream, us from the step's first kernel, own time):")
            for k in tl.side:
                if k.start_us > horizon:
                    break
                out.append(f"    {k.stream:4d} {k.start_us - t0:8.1f} {k.end_us - k.start_us:7.1f}  {k.name[:name_width]}")
    return "\n".join(out)


def profiled_kernels(fn) -> list[Kernel]:
    """Run fn (e.g. a CUDA graph's replay) once under the profiler; its kernels with their streams.
    Copies and memsets are left out (they are not kernels of the step's math)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name()
        if "memcpy" in name.lower() or "memset" in name.lower():
            continue
        start = e.start_ns() / 1e3
        out.append(Kernel(int(e.device_resource_id()), start, start + e.duration_ns() / 1e3, name))
    return out


def kernel_table(kernels: list[Kernel], top: int, name_width: int = 70) -> dict:
    """The kernels by name, (name, launches, us) largest first (the first `top`), their summed device time
    and the span from the first kernel's start to the last one's end (decode_anatomy's per-kernel table)."""
    if not kernels:
        return {"kernels": 0}
    rows = _by_name(((k.name, k.end_us - k.start_us) for k in kernels), name_width)
    return {"kernels": len(kernels), "kernel_us": sum(k.end_us - k.start_us for k in kernels),
            "span_us": max(k.end_us for k in kernels) - min(k.start_us for k in kernels), "top": rows[:top]}
