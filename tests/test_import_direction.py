"""Imports point down the layer table of docs/ARCHITECTURE.md; the oracle never sees engine code."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "deepinfer"

# rank: a module may import modules of a strictly lower rank, or its own package/part (same top name)
LAYERS = {
    "env": 0,
    "config": 1, "config_keys": 1, "devices": 1,
    "formats": 2, "distributed": 2,
    "weights": 3, "kernels": 3, "cache": 3, "tokenizer": 3, "chat_encoding": 3,
    "tiny": 4, "reference": 4, "model": 4, "scheduler": 4, "sampling": 4,
    "engine": 5, "spec": 5,
    "server": 6, "parity": 6,
    "cli": 7, "ask": 7,
}
SAME_LAYER_OK = {
    ("tokenizer", "chat_encoding"), ("chat_encoding", "tokenizer"), ("config", "config_keys"), ("cli", "ask"),
    ("tiny", "reference"),  # the tiny V4.1 table sizes follow the official engram prime draw
    ("engine", "spec"),  # the engine drives speculative decoding; spec never imports the engine
}


def _top(module_path: Path) -> str:
    rel = module_path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepinfer."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("deepinfer."):
                    found.add(alias.name.split(".")[1])
    return found


def test_every_module_has_a_layer():
    tops = {_top(p) for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent != PKG}
    assert tops <= set(LAYERS), f"add these to the layer table: {sorted(tops - set(LAYERS))}"


def test_imports_point_down():
    bad = []
    for path in PKG.rglob("*.py"):
        if path.parent == PKG and path.name == "__init__.py":
            continue
        me = _top(path)
        for other in _imports(path):
            if other == me or (me, other) in SAME_LAYER_OK:
                continue
            if LAYERS[other] >= LAYERS[me]:
                bad.append(f"{path.relative_to(PKG)} imports {other}")
    assert not bad, bad


def test_reference_imports_only_config_formats_weights_tokenizer():
    for path in (PKG / "reference").rglob("*.py"):
        # tokenizer: V4.1's engram hashes a vocabulary compressed from the checkpoint's tokenizer
        assert _imports(path) <= {"config", "config_keys", "formats", "weights", "tokenizer", "reference"}, path


def test_torch_free_modules():
    """The scheduler and the block pool must never import torch (ARCHITECTURE.md)."""
    for path in list((PKG / "scheduler").rglob("*.py")) + [PKG / "cache" / "block_pool.py"]:
        if path.exists():
            assert "torch" not in path.read_text(encoding="utf-8"), path
