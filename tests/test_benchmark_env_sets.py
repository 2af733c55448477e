"""benchmarks/env_sets.py (the benchmarks' A/B switch sets, CPU): parsing, every set's keys cleared before a set is
applied (so "" means the defaults), PDL's import-time switch following the set, and the environment's own values
restored."""
from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "env_sets.py")
_spec = importlib.util.spec_from_file_location("env_sets", _PATH)
env_sets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(env_sets)


def test_parse():
    assert env_sets.parse(["A=1,B=x=y", "", "C=0"]) == [{"A": "1", "B": "x=y"}, {}, {"C": "0"}]


def test_apply_clears_every_sets_keys_and_restore_puts_back(monkeypatch):
    from deepinfer.kernels.cuda import runtime

    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_KERNEL", "wgmma")  # the environment's own value
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    monkeypatch.setattr(runtime, "PDL_ENABLED", True)
    sets = env_sets.parse(["DEEPINFER_ATTN_PREFILL_KERNEL=triton,DEEPINFER_PDL=0", ""])
    own = env_sets.saved(sets)
    env_sets.apply(sets[0], sets)
    assert os.environ["DEEPINFER_ATTN_PREFILL_KERNEL"] == "triton" and runtime.PDL_ENABLED is False
    env_sets.apply(sets[1], sets)  # "": the defaults, not the previous set's or the environment's values
    assert "DEEPINFER_ATTN_PREFILL_KERNEL" not in os.environ and "DEEPINFER_PDL" not in os.environ
    assert runtime.PDL_ENABLED is True
    env_sets.apply(sets[0], sets)
    env_sets.restore(own)
    assert os.environ["DEEPINFER_ATTN_PREFILL_KERNEL"] == "wgmma" and "DEEPINFER_PDL" not in os.environ
    assert runtime.PDL_ENABLED is True
