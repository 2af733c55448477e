"""kernels/cuda/runtime.py on the CPU machine: the launch's argument buffer follows the kernel parameter ABI
(each parameter at a multiple of its size), bad signatures and argument counts are refused before anything
is loaded, and NVRTC's compile errors come back with its log (where NVRTC is installed; the GPU tests of the
kernels in tests/test_kernels_*_mma.py exercise compile, load and launch on the device)."""
from __future__ import annotations

import re
import struct

import pytest
import torch

from deepinfer.kernels.cuda import runtime


def test_packed_arguments_follow_the_parameter_abi():
    k = runtime.CudaKernel("fp4_moe_mma.cu", "f", "pipfl")
    t = torch.zeros(3)
    packed = k._packer.pack(t.data_ptr(), 7, 5, 1.5, -2)
    # p @0, i @8, p @16 (aligned up from 12), f @24, l @32 (aligned up from 28)
    assert len(packed) == 40
    assert struct.unpack_from("<Q", packed, 0)[0] == t.data_ptr() and struct.unpack_from("<i", packed, 8)[0] == 7
    assert struct.unpack_from("<Q", packed, 16)[0] == 5 and struct.unpack_from("<f", packed, 24)[0] == 1.5
    assert struct.unpack_from("<q", packed, 32)[0] == -2
    # int32 and float32 take 4 bytes each: "iif" is 12 bytes, the float at 8
    small = runtime.CudaKernel("fp4_moe_mma.cu", "f", "iif")._packer.pack(1, 2, 0.5)
    assert len(small) == 12 and struct.unpack_from("<f", small, 8)[0] == 0.5


def test_reported_parameter_offsets_place_tensor_maps_after_the_compilers_padding():
    """sm_90 cubins put a 64-byte-aligned tensor map 48 bytes into the parameters (its constant bank starts
    at 0x210): the buffer must follow the offsets the driver reports, not the native ABI."""
    layout = [(48, 128), (176, 128), (304, 8), (312, 4)]
    packer = runtime.packer_for_layout("mmpi", layout)
    m0, m1 = bytes(range(128)), bytes(range(128, 256))
    packed = packer.pack(m0, m1, 0xABCDEF, 7)
    assert len(packed) == 316 and packed[:48] == bytes(48) and packed[48:176] == m0 and packed[176:304] == m1
    assert struct.unpack_from("<Q", packed, 304)[0] == 0xABCDEF and struct.unpack_from("<i", packed, 312)[0] == 7
    with pytest.raises(runtime.CudaRuntimeError, match="parameter 2 is 4 bytes at offset 304, the signature 'mmpi' says 'p'"):
        runtime.packer_for_layout("mmpi", [(48, 128), (176, 128), (304, 4), (312, 4)])


def test_bad_signature_and_argument_count_are_refused():
    with pytest.raises(ValueError, match="unknown signature codes \\['x'\\]"):
        runtime.CudaKernel("fp4_moe_mma.cu", "f", "px")
    k = runtime.CudaKernel("fp4_moe_mma.cu", "f", "pi")
    with pytest.raises(ValueError, match="2 arguments expected, got 1"):
        k.launch((1, 1, 1), (32, 1, 1), (torch.zeros(1),), torch.device("cpu"))


def need_nvrtc() -> None:
    """Skip the calling test where NVRTC is not installed (the CPU tests that compile .cu sources offline)."""
    try:
        runtime.nvrtc_version()
    except runtime.CudaRuntimeError as err:
        pytest.skip(f"no NVRTC here: {err}")


def test_compile_errors_carry_the_nvrtc_log():
    need_nvrtc()
    with pytest.raises(runtime.CudaRuntimeError, match="could not compile bad.cu for sm_90:(.|\\n)*undefined"):
        runtime.compile_cubin('extern "C" __global__ void f() { undefined_thing(); }', "bad.cu", "sm_90")


def compile_configs(source: str, configs: list[dict], arch: str = "sm_90") -> None:
    """Compile a package .cu for `arch` under each set of -D defines (skip where NVRTC is not installed): the
    kernels' CPU tests, so a source that does not compile fails before any device time is spent."""
    need_nvrtc()
    text = runtime.read_source(source)
    for cfg in configs:
        cubin = runtime.compile_cubin(text, source, arch, tuple(f"-D{k}={v}" for k, v in cfg.items()))
        assert cubin[:4] == b"\x7fELF", cfg


def test_cached_tensor_maps_are_encoded_once_per_tensor_and_box(monkeypatch):
    """The launchers' weight maps: one driver encode per (tensor, box, swizzle); another box or tensor is
    another map; past MAP_CACHE_LIMIT entries the cache empties and refills."""
    encoded = []
    monkeypatch.setattr(runtime, "_MAP_CACHE", {})
    monkeypatch.setattr(runtime, "encode_tensor_map",
                        lambda t, box, swizzle=0: encoded.append((t.data_ptr(), box, swizzle)) or bytes(128))
    w, s = torch.zeros(2, 64, 64, dtype=torch.uint8), torch.zeros(2, 64, 16, dtype=torch.uint8)
    for _ in range(3):
        runtime.cached_tensor_map(w, (1, 64, 64))
    assert len(encoded) == 1
    runtime.cached_tensor_map(w, (1, 32, 64))
    runtime.cached_tensor_map(w, (1, 32, 64), swizzle=64)
    runtime.cached_tensor_map(s, (1, 64, 16))
    assert len(encoded) == 4
    monkeypatch.setattr(runtime, "MAP_CACHE_LIMIT", 4)
    runtime.cached_tensor_map(s, (1, 32, 16))  # the fifth: the cache empties first
    assert len(runtime._MAP_CACHE) == 1 and len(encoded) == 5
    runtime.cached_tensor_map(w, (1, 64, 64))
    assert len(encoded) == 6


def test_local_includes_are_inlined_once(tmp_path):
    (tmp_path / "h.cuh").write_text("int h_twice;\n")
    (tmp_path / "g.cuh").write_text('#include "h.cuh"\nint g;\n')
    (tmp_path / "k.cu").write_text('#include "h.cuh"\n#include "g.cuh"\nint k;\n')
    assert runtime.read_source("k.cu", tmp_path).count("int h_twice;") == 1
    text = runtime.read_source("fp4_moe_mma.cu")
    assert not re.search(r'^#include "mma_common.cuh"', text, re.MULTILINE) and "mma_common.cuh" in text
    assert text.count("__device__ __forceinline__ u32 bmul2(") == 1


def cuda_with_nvrtc() -> torch.device:
    """The CUDA device for the mma kernels' GPU tests; skips without CUDA, NVRTC or the driver library."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not runtime.available():
        pytest.skip("NVRTC or the CUDA driver library is missing")
    return torch.device("cuda")
