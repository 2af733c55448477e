"""The official tensor table reproduces the real checkpoints' inventories exactly (names, dtypes, shapes).

The inventories in tests/fixtures/index/*.names.txt were collected from public header dumps; the V4.1,
0731 and Pro-0813 ones expand to the official tensor counts and byte totals (see their headers)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from deepinfer.config import ModelConfig
from deepinfer.weights.schema import expected_tensors, skipped_prefixes

FIX = Path(__file__).parent / "fixtures"
KIND = {"BF16": "bf16", "F32": "f32", "F8_E4M3": "fp8", "F8_E8M0": "scale", "I8": "fp4", "I64": "int"}


def expand_inventory(name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for line in (FIX / "index" / f"{name}.names.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        pat, dtype, shape, rest = re.match(r"(\S+)\s+(\S+)\s+\[([^\]]*)\]\s*(.*)", line.strip()).groups()
        dims = tuple(int(x) for x in shape.split(",") if x.strip())
        ranges = {"L": [None], "E": [None], "B": [None]}
        for extra in rest.split():
            key, spans = extra.split("=")
            ranges[key] = []
            for span in spans.split(","):
                lo, _, hi = span.partition("-")
                ranges[key] += list(range(int(lo), int(hi or lo) + 1))
        for L in ranges["L"]:
            for E in ranges["E"]:
                for B in ranges["B"]:
                    full = pat.replace("{L}", str(L)).replace("{E}", str(E)).replace("{B}", str(B))
                    out[full] = (KIND[dtype], dims)
    return out


@pytest.mark.parametrize("model,count", [("v41-flash", 96085), ("v4-flash-0731", 72317), ("v4-pro-0813", 149782),
                                         ("v4-flash", 69187)])
def test_schema_matches_official_inventory(model, count):
    cfg = ModelConfig.from_checkpoint(FIX / "configs" / model)
    inventory = expand_inventory(model)
    assert len(inventory) == count
    skipped = skipped_prefixes(cfg)
    lm = {k: v for k, v in inventory.items() if not (skipped and k.startswith(skipped))}
    specs = expected_tensors(cfg)
    assert set(specs) == set(lm)
    wrong = [(n, lm[n], (s.kind, s.shape)) for n, s in specs.items() if (s.kind, s.shape) != lm[n]]
    assert not wrong, wrong[:5]


def test_v41_vision_is_skipped_not_modelled():
    cfg = ModelConfig.from_checkpoint(FIX / "configs" / "v41-flash")
    vision = [k for k in expand_inventory("v41-flash") if k.startswith(skipped_prefixes(cfg))]
    expected = expected_tensors(cfg)  # built once: rebuilding it per key made this the suite's third-slowest test
    assert len(vision) == 96085 - len(expected) and all(k not in expected for k in vision)
