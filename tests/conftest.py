"""Shared fixtures: the embedded tiny V4 checkpoint (generated once per machine into the cache dir) and
oracles over it in both numerics."""
from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

# The tiny model's matrices are small: one thread is as fast, and immune to oversubscription when
# another process shares the 2 cores (OpenMP spin-waits made runs 50x slower here).
torch.set_num_threads(1)


_GC_SLACK_BYTES = 1 << 30  # resident growth since the last collection that triggers the next one
_rss_after_gc = [0]
_RSS_LOG = os.environ.get("DEEPINFER_TEST_RSS_LOG")


try:
    _LIBC_MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _LIBC_MALLOC_TRIM = None  # not glibc: resident memory as the allocator keeps it


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc): without it a process's resident size stays at its high
    water mark, which two test workers sharing the CI machine's 24 GB cannot both keep."""
    if _LIBC_MALLOC_TRIM is not None:
        _LIBC_MALLOC_TRIM(0)


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux: collect after every test


@pytest.fixture(autouse=True)
def _free_cycles_after_tests():
    """Collect reference cycles once the process has grown by _GC_SLACK_BYTES since the last collection.
    Tests that wrap an engine's methods in closures over the engine (test_engine's logits capture, among
    others) leave engines, their KV caches and models in cycles, which only a full collection frees, and
    Python's generational thresholds rarely run one: the suite's resident memory reached 19 GB
    of the CI machine's 24 by test_engine (2026-12-04, measured per module). A collection after every test
    kept it under 13 GB, but the suite took 20.3 minutes against 16.7 in the runs before (each full
    collection walks the whole heap); growth-triggered, it runs only after the tests that allocate."""
    yield
    rss = _resident_bytes()
    if rss is None or rss > _rss_after_gc[0] + _GC_SLACK_BYTES:
        gc.collect()
        _malloc_trim()
        _rss_after_gc[0] = _resident_bytes() or 0
    if _RSS_LOG:  # DEEPINFER_TEST_RSS_LOG=path: each test's resident size after it (which tests hold memory)
        with open(_RSS_LOG, "a") as f:
            f.write(f"{os.getpid()} {(rss or 0) >> 20} {(_resident_bytes() or 0) >> 20} "
                    f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\n")


@pytest.fixture(scope="session")
def tiny_v4_dir():
    from deepinfer.tiny import default_model_dir

    return default_model_dir("v4", seed=0)


@pytest.fixture(scope="session")
def tiny_v4_raw(tiny_v4_dir):
    """Checkpoint tensors exactly as stored, loaded through the real loader (with its checks)."""
    from deepinfer.config import ModelConfig
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    return cfg, load_tensors(tiny_v4_dir, cfg, progress=False)


@pytest.fixture(scope="session")
def fast_params(tiny_v4_raw):
    """(cfg, the tiny V4 checkpoint's fast-numerics params on the CPU)."""
    from deepinfer.model.factory import v4_params

    cfg, raw = tiny_v4_raw
    return cfg, v4_params(raw, cfg, "fast", "cpu")


@pytest.fixture(scope="session")
def oracle_factory(tiny_v4_raw):
    """oracle_factory(numerics=..., ...) -> a fresh V4Model over the tiny checkpoint (fresh caches)."""
    cfg, raw = tiny_v4_raw
    params_cache = {}

    def make(numerics="exact", revision="current", quirks="intended", max_batch=4, max_seq_len=512):
        from deepinfer.reference.numerics import Numerics
        from deepinfer.reference.params import prepare_params
        from deepinfer.reference.v4 import V4Model

        num = Numerics(numerics, revision, cfg.act_block)
        key = (numerics, revision)
        if key not in params_cache:
            params_cache[key] = prepare_params(raw, cfg, num)
        return V4Model(cfg, params_cache[key], num, max_batch, max_seq_len, keep_stale_state=quirks == "official")

    return make


@pytest.fixture(scope="session")
def tiny_v41_dir():
    from deepinfer.tiny import default_model_dir

    return default_model_dir("v41", seed=0)


@pytest.fixture(scope="session")
def oracle41_factory(tiny_v41_dir):
    """oracle41_factory(numerics=..., quirks=...) -> a fresh V41Model over the tiny V4.1 checkpoint."""
    from deepinfer.config import ModelConfig
    from deepinfer.reference.numerics import Numerics
    from deepinfer.reference.params import prepare_params
    from deepinfer.reference.v41 import V41Model
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    raw = load_tensors(tiny_v41_dir, cfg, progress=False)
    tok = Tokenizer.from_checkpoint(tiny_v41_dir)
    cache = {}

    def make(numerics="exact", quirks="intended", max_batch=4, max_seq_len=256):
        num = Numerics(numerics, "current", cfg.act_block)
        if numerics not in cache:
            cache[numerics] = prepare_params(raw, cfg, num)
        return V41Model(cfg, cache[numerics], num, max_batch, max_seq_len, quirks_official=quirks == "official",
                        tokenizer=tok)

    return make


@pytest.fixture(scope="module")
def cuda_kernels():
    """A CUDA device with the Triton kernels registered (skips without one)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deepinfer.engine.model_runner import start_cuda_kernels

    start_cuda_kernels()
