"""Triton launches without the JIT's per-call dispatch: `@fast_launch` over `@triton.jit` on a kernel that
host code launches (`kernel[grid](...)`, unchanged at the call sites).

Why: an eager step (prefill, extend, a mixed batch) issues a few hundred launches, and Triton 3.6's
`JITFunction.run` costs tens of microseconds of host time per launch (binding, specialisation, cache key,
launch metadata, hook chains). On the H200's host an op around one Triton kernel took ~60 us against ~8 us
for a torch op, and the 4-layer V4-Flash slice's 1k-token prefill was host-bound: 32 ms of host calls for
12.5 ms of kernels (benchmarks/launch_overhead.py, prefill_host.py; 2026-12-04). A CUDA-graph replay does
not pay this; eager steps do.

How: the first call with a given specialisation goes through the JIT (which compiles if needed, launches and
returns the compiled kernel); later calls with the same specialisation call the compiled kernel's launcher
directly. The specialisation key here is at least as fine as Triton's own, so a cached kernel is never
launched with arguments the JIT would have compiled differently:
* constexpr parameters: their values;
* tensors: dtype and whether data_ptr() is 16-byte aligned (Triton's pointer specialisation);
* ints: == 1, divisible by 16, and the integer type Triton picks by range (i32 / i64 / u64);
* bools, floats, None: their type (Triton does not specialise float values);
* launch options (num_warps, num_stages, ...): their values; and the current CUDA device.
An argument of any other type takes the JIT path every time (correct, just not fast). So do launches while
a launch hook is installed (profilers such as proton), and every launch when `ENABLED` is False.

On by default (`DEEPINFER_FAST_LAUNCH=0`, or `launch.ENABLED = False`, takes the JIT's dispatch). Its GPU
tests passed on the H200 on 2026-12-05 (tests/test_kernels_launch.py -m gpu: every specialisation launches
the kernel the JIT would, the registered ops bit-identical both ways), where it cut the host time of the
4-layer slice's 1k-token prefill from 24.9 to 17.3 ms (benchmarks/launch_overhead.py). Off, a decorated
kernel's launch is the JIT's own plus one flag test. Under TRITON_INTERPRET=1 the decorator returns the interpreter's
function.

Programmatic dependent launch (pdl.py): a kernel whose last parameter is `PDL: tl.constexpr` is launched
with `PDL=True, launch_pdl=True` on an sm_90+ device unless the caller passes PDL itself or
`cuda.runtime.PDL_ENABLED` (the one switch of both kernel kinds, DEEPINFER_PDL=0) is False; both paths (the
cache and the JIT's) get them.

Must not: be used on a @triton.jit helper that other kernels call (only launched kernels: the compiler
needs the JITFunction itself); change what any kernel computes.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from deepinfer import env
from deepinfer.kernels.cuda import runtime as cuda_runtime  # PDL's switch and device check (one for both kinds)

ENABLED = env.fast_launch_enabled()
_MISSING = object()
_I32 = (-(2**31), 2**31)
_I64_MAX = 2**63


def _spec(v):
    """A hashable key of what Triton specialises a runtime argument on (_MISSING: a type not handled here)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    t = type(v)
    if t is int:
        kind = 0 if _I32[0] <= v < _I32[1] else (1 if v < _I64_MAX else 2)
        return (kind, v == 1, v % 16 == 0)
    if t is float or t is bool or v is None:
        return t
    return _MISSING


class FastLaunch:
    """A launched Triton kernel with a per-specialisation cache of its compiled form (see the module doc)."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self.names = [p.name for p in fn.params]
        self.name_set = frozenset(self.names)
        self.constexpr = tuple(p.is_constexpr for p in fn.params)
        self.defaults = [p.default if p.has_default else _MISSING for p in fn.params]
        self.kernels: dict[tuple, object] = {}
        self.pdl = "PDL" in self.name_set and self.constexpr[self.names.index("PDL")]
        self.hits = self.misses = 0  # (tests read them)

    def __getattr__(self, name: str):  # warmup, run, params, ... of the JIT function
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
        """All parameter values in order (defaults filled in) and the launch options, or None when the call
        names something that is neither (the JIT then reports it)."""
        vals = list(args)
        if len(vals) > len(self.names):
            return None
        options = ()
        if kwargs:
            for name, default in zip(self.names[len(vals):], self.defaults[len(vals):]):
                v = kwargs.get(name, default)
                if v is _MISSING:
                    return None
                vals.append(v)
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.name_set))
        elif len(vals) < len(self.names):
            for default in self.defaults[len(vals):]:
                if default is _MISSING:
                    return None
                vals.append(default)
        return vals, options

    def launch(self, grid, args: tuple, kwargs: dict):
        device = None  # (asked of torch once a launch: the PDL check and the cache key share it)
        if self.pdl and cuda_runtime.PDL_ENABLED and "PDL" not in kwargs:
            device = torch.cuda.current_device()
            if cuda_runtime.griddepcontrol_device(device):
                # the kernel's wait (PDL=True) and the launch attribute (launch_pdl) always travel together
                kwargs = {**kwargs, "PDL": True, "launch_pdl": True}
        if not ENABLED or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            return self.fn[grid](*args, **kwargs)
        bound = self._bind(args, kwargs)
        if bound is None:
            return self.fn[grid](*args, **kwargs)
        vals, options = bound
        spec = []
        for v, is_const in zip(vals, self.constexpr):
            if is_const:
                spec.append(v)
            elif isinstance(v, torch.Tensor):  # the common case inline (a call per argument costs ~0.2 us)
                spec.append((v.dtype, v.data_ptr() % 16 == 0))
            else:
                s = _spec(v)
                if s is _MISSING:
                    return self.fn[grid](*args, **kwargs)
                spec.append(s)
        if device is None:
            device = torch.cuda.current_device()
        key = (device, options, tuple(spec))
        try:
            kernel = self.kernels.get(key)
        except TypeError:  # an unhashable constexpr value
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            self.misses += 1
            kernel = self.kernels[key] = self.fn[grid](*args, **kwargs)
            return kernel
        self.hits += 1
        if callable(grid):
            grid = grid(dict(zip(self.names, vals)))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *vals)
        return kernel


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code: Triton 3.6 makes its helpers `constexpr_function`s, whose host calls
    unwrap every argument (~1.8 us a call on the CPU machine, ~3.5 on the H200's host; a 1k-token prefill of
    the 4-layer slice made ~490 such calls)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (the same values: 0 for 0), without its per-call unwrapping."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def fast_launch(fn):
    """Decorator over @triton.jit for kernels launched from host code (see the module doc)."""
    if not isinstance(fn, JITFunction):  # the interpreter's function (TRITON_INTERPRET=1): as it is
        return fn
    return FastLaunch(fn)


__all__ = ["ENABLED", "FastLaunch", "cdiv", "fast_launch", "next_power_of_2"]
