"""The benchmarks' A/B sets of DEEPINFER_* switches (`--env-sets` / `--prefill-env-sets`: "K=V,K2=V2", "" for
the defaults), shared by decode_anatomy.py, bench_engine_slice.py and run_slice.py.

`parse(strings)` -> one dict a set. `apply(env_set, sets)`: every key any set names removed from the environment,
then this set's values put in; the switches the ops read at each call follow at once, and PDL's (read once at
import, `kernels/cuda/runtime.py`) is set to follow too. `saved(sets)` / `restore(values)`: the environment's own
values of those keys, put back after the runs.
Must not: be imported by the package.
"""
from __future__ import annotations

import os


def parse(strings: list[str]) -> list[dict[str, str]]:
    return [dict(kv.split("=", 1) for kv in s.split(",") if kv) for s in strings]


def _follow_pdl() -> None:
    from deepinfer import env
    from deepinfer.kernels.cuda import runtime as cuda_runtime

    cuda_runtime.PDL_ENABLED = env.pdl_enabled()


def apply(env_set: dict[str, str], sets: list[dict[str, str]]) -> None:
    for key in {k for st in sets for k in st}:
        os.environ.pop(key, None)
    os.environ.update(env_set)
    _follow_pdl()


def saved(sets: list[dict[str, str]]) -> dict[str, str | None]:
    return {k: os.environ.get(k) for st in sets for k in st}


def restore(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _follow_pdl()
