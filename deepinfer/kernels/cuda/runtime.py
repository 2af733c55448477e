"""Compile CUDA C++ with NVRTC and launch it through the CUDA driver API, on torch's current stream.

`CudaKernel(source_name, function, signature)`: the function `function` of the package's file
`source_name` (a .cu next to this module), compiled for the device's own architecture (sm_XY, e.g. sm_90)
on its first launch on that device, the cubin cached in memory and on disk
(`$DEEPINFER_CACHE_DIR/cuda`, default `~/.cache/deepinfer/cuda`, keyed by the source, the options and the
NVRTC version). `kernel.launch(grid, block, args, shared=0)` launches it with `cuLaunchKernel` on
`torch.cuda.current_stream()`: inside a CUDA-graph capture the launch is captured like any other.
`available()` says whether NVRTC and the driver could be loaded (False on a machine without them: the
callers then keep their Triton kernels).

signature: one code per kernel argument: "p" pointer (a torch tensor, its data_ptr), "i" int32, "l" int64,
"f" float32, "m" a TMA tensor map (the 128 bytes of `encode_tensor_map`, a `const __grid_constant__`
parameter). The launch checks the count and packs the arguments into one buffer in the parameter layout:
the offsets the driver reports for the loaded function (cuFuncGetParamInfo), else the native ABI (each
parameter at a multiple of its size). The reported offsets matter for tensor maps: the compiler puts a
64-byte-aligned parameter where the constant bank makes it aligned, which can leave padding before the
first parameter (48 bytes on sm_90), so no layout computed on the host alone is right.
`encode_tensor_map(tensor, box)`: the tiled TMA descriptor of a uint8 tensor (cuTensorMapEncodeTiled);
`cached_tensor_map` the same, kept per tensor and box (for tensors that live as long as the model).
Must not: import triton; compile at import time.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import struct
import threading
from functools import lru_cache
from pathlib import Path

import torch

from deepinfer import env

# the arguments travel as one packed buffer (cuLaunchKernel's `extra`) laid out at the driver's parameter offsets
# (`packer_for_layout`; struct's native alignment, the kernel parameter ABI, before loading), and one pack costs ~2 us of host time where
# per-argument ctypes objects cost ~24 (on the CPU machine): it matters on the eager decode paths
_STRUCT_CODES = {"p": "Q", "i": "i", "l": "q", "f": "f", "m": "128s"}
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), 64-byte aligned
_LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE, _LAUNCH_PARAM_END = 1, 2, 0
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID: programmatic dependent launch
# programmatic dependent launch of the kernels written for it: the CUDA ones here (pdl=True) and the Triton
# ones with a PDL parameter (triton/launch.py reads this flag too; DEEPINFER_PDL=0: plainly)
PDL_ENABLED = env.pdl_enabled()
FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute: clusters of 9..16 CTAs (sm_90)
MAX_PORTABLE_CLUSTER = 8  # CTAs a cluster may hold without that attribute


def cluster_attributes(cluster_size: int) -> dict[int, int]:
    """The function attributes a kernel compiled with `cluster_size` CTAs a cluster needs (CudaKernel's
    `attributes`): beyond the portable size, the non-portable one allowed."""
    return {FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 1} if cluster_size > MAX_PORTABLE_CLUSTER else {}


class CudaRuntimeError(RuntimeError):
    """NVRTC or the driver failed (the message carries their own error text and, for a compile, its log)."""


def _candidates_nvrtc() -> list[str]:
    """libnvrtc paths, most specific first: the NVIDIA wheels torch depends on (nvidia/cuda_nvrtc, nvidia/cu13),
    torch's lib directory, $CUDA_HOME / /usr/local/cuda, then the loader's own search."""
    found: list[str] = []
    try:
        import nvidia  # the namespace package of the CUDA wheels

        for root in list(nvidia.__path__):
            found += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True)
    except ImportError:
        pass
    found += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnvrtc*.so*")), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    # skip the builtins / alt libraries: they are loaded by libnvrtc itself
    keep = [p for p in found if "builtins" not in os.path.basename(p) and ".alt." not in os.path.basename(p)]
    return keep + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    errors = []
    for path in _candidates_nvrtc():
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            errors.append(f"{path}: {err}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise CudaRuntimeError("NVRTC (libnvrtc) not found; tried: " + "; ".join(errors[-4:]))


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise CudaRuntimeError(f"the CUDA driver (libcuda.so.1) could not be loaded: {err}") from err
    return lib


@lru_cache(maxsize=None)
def griddepcontrol_device(index: int) -> bool:
    """Device `index` is sm_90+, which has griddepcontrol (PDL's wait and trigger)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


@lru_cache(maxsize=1)
def _has_launch_ex() -> bool:
    """The driver has cuLaunchKernelEx (CUDA 12.0+), which takes the PDL launch attribute."""
    return hasattr(_driver(), "cuLaunchKernelEx")


def available() -> bool:
    """NVRTC and the CUDA driver load, and torch sees a CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        _nvrtc()
        _driver()
    except CudaRuntimeError:
        return False
    return True


def sm90a_usable(device: torch.device) -> bool:
    """A CUDA device of compute capability exactly 9.0 (the warpgroup kernels' wgmma and setmaxnreg are sm_90a)
    with NVRTC and the driver: each such kernel's launcher's `usable`."""
    return device.type == "cuda" and available() and torch.cuda.get_device_capability(device) == (9, 0)


def _check_nvrtc(result: int, what: str) -> None:
    if result != 0:
        msg = _nvrtc().nvrtcGetErrorString(result)
        raise CudaRuntimeError(f"NVRTC {what} failed: {msg.decode() if msg else result}")


def _check_cu(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise CudaRuntimeError(f"CUDA driver {what} failed ({result}): {text.value.decode() if text.value else '?'}")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """NVRTC: CUDA C++ `source` -> cubin bytes for `arch` (e.g. "sm_90"). No device is needed (tests compile
    on the CPU machine when NVRTC is installed). Raises CudaRuntimeError with NVRTC's log on a compile error."""
    return compile_with_log(source, name, arch, options)[0]


def ptxas_report(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """ptxas's verdict on the build, read offline: its "Used N registers, ..." line ("?" if none) and its
    "Potential Performance Loss" lines (e.g. C7515 / C7511: wgmma.mma_async serialized, each waiting for the one
    before: what the compiler did to the kernel's MMA pipeline)."""
    log = compile_with_log(source, name, arch, (*options, "--ptxas-options=-v"))[1]
    lines = [line.strip() for line in log.splitlines()]
    used = next((line for line in lines if "Used" in line and "registers" in line), "?")
    return used, [line for line in lines if "Performance Loss" in line]


def ptxas_advisories(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> list[str]:
    """`ptxas_report`'s advisories alone."""
    return ptxas_report(source, name, arch, options)[1]


def compile_with_log(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """`compile_cubin`, and NVRTC's log (ptxas's messages with --ptxas-options=-v)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                 "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        result = lib.nvrtcCompileProgram(prog, len(opts), arr)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result != 0:
            raise CudaRuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _cache_dir() -> Path:
    from deepinfer import env

    return env.cache_dir() / "cuda"


def cached_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """`compile_cubin` through the on-disk cache (a failed write leaves the cache alone)."""
    key = hashlib.sha256("\0".join((source, name, arch, *options, str(nvrtc_version()))).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{Path(name).stem}-{arch}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    cubin = compile_cubin(source, name, arch, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)
    except OSError:
        pass
    return cubin


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def read_source(source_name: str, root: Path = Path(__file__).parent) -> str:
    """A .cu file of this package (of `root`) with its local `#include "x.cuh"` lines replaced by those files
    (once each): one self-contained source for NVRTC and for the cubin cache's key."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        text = (root / name).read_text()

        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return expand(header)

        return _LOCAL_INCLUDE.sub(include, text)

    return expand(source_name)


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


# CUtensorMapEncodeTiled's enums (cuda.h): data type, interleave, swizzle, L2 promotion, OOB fill
_TMA_UINT8, _TMA_INTERLEAVE_NONE, _TMA_L2_256B, _TMA_OOB_FILL_ZERO = 0, 0, 3, 0
TMA_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}  # swizzle span in bytes -> CUtensorMapSwizzle


def check_tensor_map(shape: tuple[int, ...], strides: tuple[int, ...], data_ptr: int, box: tuple[int, ...],
                     swizzle: int = 0) -> str | None:
    """Why a uint8 tensor (shape, element strides, address) and box cannot make a tiled TMA descriptor (None: they
    can). The driver's rules: rank 1..5, unit innermost stride, 16-byte aligned base and outer strides (< 2^40),
    box dims 1..256 and the innermost box a multiple of 16 bytes; with a swizzle (32, 64 or 128 bytes) the
    innermost box at most the swizzle span."""
    if swizzle not in TMA_SWIZZLES:
        return f"swizzle {swizzle}: must be one of {sorted(TMA_SWIZZLES)} bytes"
    if swizzle and box and box[-1] > swizzle:
        return f"box {box}: with the {swizzle}-byte swizzle the innermost box must be at most {swizzle} bytes"
    if not 1 <= len(shape) <= 5 or len(box) != len(shape):
        return f"rank {len(shape)} with box rank {len(box)}: both must be 1..5 and equal"
    if strides[-1] != 1:
        return f"innermost stride {strides[-1]}: must be 1"
    if data_ptr % 16 or any(st % 16 or st >= 1 << 40 for st in strides[:-1]):
        return f"address {data_ptr:#x} and outer strides {strides[:-1]} bytes must be multiples of 16 (and < 2^40)"
    if any(not 1 <= b <= 256 for b in box) or box[-1] % 16:
        return f"box {box}: each dim 1..256, the innermost a multiple of 16 bytes"
    return None


def encode_tensor_map(tensor: torch.Tensor, box: tuple[int, ...], swizzle: int = 0) -> bytes:
    """The 128-byte tiled TMA descriptor (CUtensorMap) of a CUDA uint8 tensor: `box` (outermost first, like the
    shape) is the tile one copy moves; `swizzle` bytes (0: none; 128: the layout wgmma's 128-byte swizzled
    descriptors read), zero fill out of bounds, 256-byte L2 promotion. The tensor must outlive every launch
    that uses the descriptor (it holds the address, not a reference)."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.dtype != torch.uint8 or not tensor.is_cuda:
        raise ValueError(f"encode_tensor_map: a CUDA uint8 tensor, got {tensor.dtype} on {tensor.device}")
    why = check_tensor_map(shape, strides, tensor.data_ptr(), tuple(box), swizzle)
    if why:
        raise ValueError(f"encode_tensor_map: shape {shape}: {why}")
    rank = len(shape)
    # cuda.h orders dims innermost first; globalStrides lists the rank - 1 outer strides in bytes
    dims = (ctypes.c_uint64 * rank)(*reversed(shape))
    outer = (ctypes.c_uint64 * max(1, rank - 1))(*reversed(strides[:-1]))
    boxes = (ctypes.c_uint32 * rank)(*reversed(tuple(box)))
    unit = (ctypes.c_uint32 * rank)(*([1] * rank))
    out = ctypes.create_string_buffer(TENSOR_MAP_BYTES)
    _check_cu(_driver().cuTensorMapEncodeTiled(out, _TMA_UINT8, rank, ctypes.c_void_p(tensor.data_ptr()), dims, outer,
                                               boxes, unit, _TMA_INTERLEAVE_NONE, TMA_SWIZZLES[swizzle], _TMA_L2_256B,
                                               _TMA_OOB_FILL_ZERO), f"cuTensorMapEncodeTiled(shape {shape}, box {box})")
    return out.raw


_MAP_CACHE: dict[tuple, bytes] = {}
MAP_CACHE_LIMIT = 4096  # 128 bytes each: every weight map of a 61-layer model many times over


def cached_tensor_map(tensor: torch.Tensor, box: tuple[int, ...], swizzle: int = 0) -> bytes:
    """`encode_tensor_map` for tensors that live as long as the model (the expert banks): encoded once per
    (address, shape, strides, box, swizzle, device) and kept, so a launch costs no driver call. A key names
    the map exactly (a new tensor at a freed one's address with the same shape and strides has the same
    map); past MAP_CACHE_LIMIT entries the cache is emptied and refills."""
    key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tuple(box), swizzle, tensor.device.index)
    found = _MAP_CACHE.get(key)
    if found is None:
        if len(_MAP_CACHE) >= MAP_CACHE_LIMIT:
            _MAP_CACHE.clear()
        found = _MAP_CACHE[key] = encode_tensor_map(tensor, box, swizzle)
    return found


def _param_layout(fn: ctypes.c_void_p, count: int) -> list[tuple[int, int]] | None:
    """(offset, size) of each of the loaded function's `count` parameters, from the driver; None where the
    driver has no cuFuncGetParamInfo (before CUDA 12.4) or refuses."""
    drv = _driver()
    if not hasattr(drv, "cuFuncGetParamInfo"):
        return None
    offset, size, layout = ctypes.c_size_t(), ctypes.c_size_t(), []
    for i in range(count):
        if drv.cuFuncGetParamInfo(fn, ctypes.c_size_t(i), ctypes.byref(offset), ctypes.byref(size)) != 0:
            return None
        layout.append((offset.value, size.value))
    return layout


def packer_for_layout(signature: str, layout: list[tuple[int, int]], function: str = "kernel") -> struct.Struct:
    """The argument buffer's struct for parameters at the given (offset, size)s: padding up to each offset.
    A size that differs from the signature code's is a wrong signature: CudaRuntimeError naming it."""
    fields, cursor = ["<"], 0
    for i, (code, (offset, size)) in enumerate(zip(signature, layout)):
        want = struct.calcsize("<" + _STRUCT_CODES[code])
        if size != want or offset < cursor:
            raise CudaRuntimeError(f"{function}: parameter {i} is {size} bytes at offset {offset}, the signature "
                                   f"{signature!r} says {code!r} ({want} bytes) after byte {cursor}")
        if offset > cursor:
            fields.append(f"{offset - cursor}x")
        fields.append(_STRUCT_CODES[code])
        cursor = offset + size
    return struct.Struct("".join(fields))


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (CUDA 12): the launch shape cuOccupancyMaxActiveClusters asks about (no attributes: the
    kernels here fix their cluster shape at compile time) and cuLaunchKernelEx's (attrs: the PDL attribute)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, then the 64-byte value union (only its first int is set
    here: programmaticStreamSerializationAllowed)."""
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class CudaKernel:
    """One `extern "C" __global__` function of a .cu file in this package; compiled and loaded per device on
    first use. `defines`: -D options (compile-time constants: each distinct set is its own cubin); `arch_suffix`
    "a" compiles for the architecture-specific target (sm_90a: wgmma, setmaxnreg), which runs only on that
    exact architecture. `attributes`: {CUfunction_attribute: value} set on the function when it is loaded
    (e.g. NON_PORTABLE_CLUSTER_SIZE_ALLOWED for a compile-time cluster of more than 8 CTAs). `pdl`: the kernel
    calls pdl_enter() (pdl_common.cuh) before its first access to memory an earlier kernel writes, so it is
    launched with programmatic dependent launch (cuLaunchKernelEx) on sm_90+ while PDL_ENABLED."""

    def __init__(self, source_name: str, function: str, signature: str, defines: dict[str, int] | None = None,
                 arch_suffix: str = "", attributes: dict[int, int] | None = None, pdl: bool = False):
        bad = set(signature) - set(_STRUCT_CODES)
        if bad:
            raise ValueError(f"CudaKernel {function}: unknown signature codes {sorted(bad)}; known {sorted(_STRUCT_CODES)}")
        if arch_suffix not in ("", "a"):
            raise ValueError(f"CudaKernel {function}: arch_suffix must be '' or 'a', got {arch_suffix!r}")
        self.arch_suffix = arch_suffix
        self.source_name = source_name
        self.function = function
        self.signature = signature
        self._packer = struct.Struct("@" + "".join(_STRUCT_CODES[c] for c in signature))  # until loaded
        self._packers: dict[int, struct.Struct] = {}  # per device: from the loaded function's parameter offsets
        self._pointer_args = tuple(i for i, c in enumerate(signature) if c == "p")
        self.options = tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))
        self.attributes = dict(attributes or {})
        self.pdl = pdl
        self._functions: dict[int, ctypes.c_void_p] = {}
        self._shared_limit: dict[int, int] = {}  # dynamic shared memory allowed per device (48 KB until raised)
        self._clusters: dict[tuple, int] = {}  # max_active_clusters per (device, grid, block, shared)
        self._modules: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def cubin(self, arch: str) -> bytes:
        return cached_cubin(read_source(self.source_name), self.source_name, arch, self.options)

    def _function(self, device: torch.device) -> ctypes.c_void_p:
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._functions.get(index)
        if fn is not None:
            return fn
        with self._lock:
            if index in self._functions:
                return self._functions[index]
            try:
                image = self.cubin(device_arch(torch.device("cuda", index)) + self.arch_suffix)
            except CudaRuntimeError as err:
                raise CudaRuntimeError(f"{err}\n(the decode ops run their Triton kernels instead with "
                                       "DEEPINFER_MOE_DECODE_KERNEL=triton and DEEPINFER_LINEAR_DECODE_KERNEL=triton)"
                                       ) from err
            drv = _driver()
            with torch.cuda.device(index):
                torch.cuda.current_stream().cuda_stream  # torch makes the device's primary context current
                module = ctypes.c_void_p()
                _check_cu(drv.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData")
                fn = ctypes.c_void_p()
                _check_cu(drv.cuModuleGetFunction(ctypes.byref(fn), module, self.function.encode()),
                          f"cuModuleGetFunction({self.function})")
                for attribute, value in self.attributes.items():
                    _check_cu(drv.cuFuncSetAttribute(fn, int(attribute), int(value)),
                              f"cuFuncSetAttribute({self.function}, {attribute}, {value})")
            layout = _param_layout(fn, len(self.signature))
            if layout is None and "m" in self.signature:
                raise CudaRuntimeError(f"{self.function}: its tensor-map parameters need the driver's parameter "
                                       "offsets (cuFuncGetParamInfo, CUDA 12.4+), which this driver does not report")
            self._packers[index] = self._packer if layout is None else packer_for_layout(self.signature, layout,
                                                                                         self.function)
            self._modules[index] = module
            self._functions[index] = fn
            return fn

    def _allow_shared(self, fn: ctypes.c_void_p, index: int, shared: int) -> None:
        """Raise the function's dynamic shared memory limit to `shared` bytes where it is above 48 KB (what a
        launch or an occupancy query of that size needs first; once per device and size)."""
        if shared > 48 * 1024 and self._shared_limit.get(index, 48 * 1024) < shared:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check_cu(_driver().cuFuncSetAttribute(fn, 8, int(shared)), f"cuFuncSetAttribute({self.function})")
            self._shared_limit[index] = shared

    def max_active_clusters(self, grid: tuple[int, int, int], block: tuple[int, int, int], device: torch.device,
                            shared: int = 0) -> int:
        """Clusters of this (compile-time clustered) kernel that can be resident at once on `device` for this
        launch shape (cuOccupancyMaxActiveClusters): 0 means a launch would fail (the cluster does not fit one
        GPC at the CTAs' resource use), so the caller takes an unclustered form. Cached per shape."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, tuple(grid), tuple(block), shared)
        if key not in self._clusters:
            fn = self._function(device)
            self._allow_shared(fn, index, shared)
            config = _LaunchConfig(*grid, *block, shared, None, None, 0)
            count = ctypes.c_int()
            with torch.cuda.device(index):
                _check_cu(_driver().cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(config)),
                          f"cuOccupancyMaxActiveClusters({self.function})")
            self._clusters[key] = count.value
        return self._clusters[key]

    def prepare(self, device: torch.device) -> None:
        """Compile and load for `device` now (before a CUDA-graph capture: loading a module inside one fails)."""
        self._function(device)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, device: torch.device,
               shared: int = 0) -> None:
        if len(args) != len(self.signature):
            raise ValueError(f"{self.function}: {len(self.signature)} arguments expected, got {len(args)}")
        fn = self._function(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._allow_shared(fn, index, shared)
        packer = self._packers[index]
        values = list(args)
        for i in self._pointer_args:
            v = values[i]
            values[i] = v.data_ptr() if isinstance(v, torch.Tensor) else int(v)
        try:
            packed = packer.pack(*values)
        except struct.error as err:
            raise ValueError(f"{self.function}: arguments {args!r} do not fit the signature {self.signature!r}: {err}")
        buf = ctypes.create_string_buffer(packed, len(packed))
        size = ctypes.c_size_t(len(packed))
        extra = (ctypes.c_void_p * 5)(_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf), _LAUNCH_PARAM_BUFFER_SIZE,
                                      ctypes.addressof(size), _LAUNCH_PARAM_END)
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        # without PDL (off, before sm_90, an old driver) the kernel's pdl_enter() returns at once
        if self.pdl and PDL_ENABLED and griddepcontrol_device(index) and _has_launch_ex():
            attr = _LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = _LaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, stream,
                                   ctypes.addressof(attr), 1)
            _check_cu(_driver().cuLaunchKernelEx(ctypes.byref(config), fn, None, extra),
                      f"cuLaunchKernelEx({self.function})")
            return
        _check_cu(_driver().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared,
                                           stream, None, extra), f"cuLaunchKernel({self.function})")
