"""Reference backend `--ref official:PATH`: the official DeepSeek `inference/` folder, loaded at run time
from a user-given path (never copied into this repo) and run unmodified.

Loading follows generate.py: `ModelArgs(**config)`, `torch.set_default_dtype(bfloat16)`, `Transformer(args)`,
then the weights of `model{rank}-mp{world_size}.safetensors` (the layout of the official convert.py) copied
into the parameters. The folder's own `kernel.py` is used when it imports (TileLang + CUDA); otherwise
`official_kernel_shim` stands in for it as `sys.modules["kernel"]` (and for `fast_hadamard_transform`),
only while the official code is imported or run, so nothing leaks into the rest of the process.

The residual state is captured with hooks on the official modules: the embedding's output (expanded to
hc streams, as `Transformer.forward` does) and, per `Block`, the two results of its `hc_post` (after the
attention and after the FFN) — the full 4-stream residual, the same points the oracle taps.

Must not: edit or copy the official files; change the official numerics (global dtype, kernels) outside
the calls it makes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Callable

import torch

from deepinfer.config import ModelConfig
from deepinfer.parity.dump import rank_and_world
from deepinfer.parity.official_kernel_shim import KERNEL_NAMES, hadamard_module, kernel_module

MODEL_NAMES = ("ModelArgs", "Transformer", "Block")  # what this backend needs from model.py
_counter = 0


class OfficialLoadError(ValueError):
    """The official folder or its checkpoint cannot be used (names the file and what is wrong)."""


def _load_source(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _real_kernel(folder: Path) -> types.ModuleType | None:
    """The folder's kernel.py when it imports and CUDA is present (it JIT-compiles TileLang for CUDA)."""
    if os.environ.get("DEEPINFER_OFFICIAL_KERNEL", "auto") == "shim" or not torch.cuda.is_available():
        return None
    try:
        return _load_source("kernel", folder / "kernel.py")
    except ImportError:
        return None


@contextlib.contextmanager
def _official_modules(kernel: types.ModuleType):
    """sys.modules["kernel"] (and fast_hadamard_transform when not installed) for the official code; the
    previous entries are restored on exit."""
    saved = {k: sys.modules.get(k) for k in ("kernel", "fast_hadamard_transform")}
    sys.modules["kernel"] = kernel
    if saved["fast_hadamard_transform"] is None and importlib.util.find_spec("fast_hadamard_transform") is None:
        sys.modules["fast_hadamard_transform"] = hadamard_module()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def load_official_module(folder: str | Path) -> tuple[types.ModuleType, types.ModuleType]:
    """(model module, kernel module) of an official inference folder; OfficialLoadError says what is missing."""
    global _counter
    folder = Path(folder)
    if not folder.is_dir():
        raise OfficialLoadError(f"official inference folder {folder} does not exist")
    for fname in ("model.py", "kernel.py"):
        if not (folder / fname).is_file():
            raise OfficialLoadError(f"{folder}: no {fname} (expected the official inference/ folder)")
    kernel = _real_kernel(folder) or kernel_module()
    missing = [n for n in KERNEL_NAMES if not hasattr(kernel, n)]
    if missing:
        raise OfficialLoadError(f"{folder / 'kernel.py'}: does not define {missing}")
    _counter += 1
    sys.path.insert(0, str(folder))  # generate.py runs from the folder: sibling imports must resolve
    try:
        with _official_modules(kernel):
            model = _load_source(f"deepinfer_official_model_{_counter}", folder / "model.py")
    except ImportError as e:
        raise OfficialLoadError(f"{folder / 'model.py'}: import failed: {e}") from None
    finally:
        sys.path.remove(str(folder))
    missing = [n for n in MODEL_NAMES if not hasattr(model, n)]
    if missing:
        raise OfficialLoadError(f"{folder / 'model.py'}: does not define {missing}")
    return model, kernel


def _join_process_group(world: int) -> None:
    """Under torchrun (WORLD_SIZE > 1) join the group as generate.py does: NCCL, one GPU per rank."""
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _model_args(mod: types.ModuleType, config: dict, max_batch_size: int, max_seq_len: int):
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    known = {k: v for k, v in config.items() if k in fields}
    known.update(max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return mod.ModelArgs(**known), sorted(set(config) - fields)


def find_config(model_dir: Path, folder: Path) -> Path:
    """The ModelArgs config generate.py would be given: the checkpoint's inference/config.json, else the
    official folder's config.json."""
    for path in (model_dir / "inference" / "config.json", folder / "config.json"):
        if path.is_file():
            return path
    raise OfficialLoadError(f"no ModelArgs config: neither {model_dir / 'inference' / 'config.json'} nor "
                            f"{folder / 'config.json'} exists")


def converted_file(model_dir: Path, rank: int, world: int, scratch: Path) -> Path:
    """`model{rank}-mp{world}.safetensors` from model_dir, or converted from its HF shards into `scratch`."""
    name = f"model{rank}-mp{world}.safetensors"
    if (model_dir / name).is_file():
        return model_dir / name
    if any(model_dir.glob("model*-mp*.safetensors")):
        raise OfficialLoadError(f"{model_dir} holds converted files for another world size, not {name}; "
                                f"run with torchrun --nproc-per-node {world} matching its mp")
    from deepinfer.weights.convert import convert_checkpoint

    convert_checkpoint(model_dir, scratch, world, expert_dtype="fp4", progress=False)
    return scratch / name


class OfficialReference:
    """The official Transformer with this package's reference interface: `forward(ids [B, S], start_pos)`
    -> last-position logits [B, V] (fp32); `tap(name, x)` receives the full residual state per sublayer;
    `embed_transform(e)` (optional) replaces the embedding output (the layers floor perturbs it)."""

    def __init__(self, folder: str | Path, model_dir: str | Path, max_batch_size: int = 1,
                 max_seq_len: int = 4096) -> None:
        folder, model_dir = Path(folder), Path(model_dir)
        if ModelConfig.from_checkpoint(model_dir).is_v41:
            raise OfficialLoadError("--ref official: only the V4 family's inference/ code is supported (V4.1's "
                                    "Transformer takes a tokenizer and its engram; not wired up yet)")
        self.module, self.kernel = load_official_module(folder)
        self.kernel_source = "shim" if getattr(self.kernel, "DEEPINFER_SHIM", False) else str(folder / "kernel.py")
        config_path = find_config(model_dir, folder)
        args, self.ignored_config_keys = _model_args(self.module, json.loads(config_path.read_text()),
                                                     max_batch_size, max_seq_len)
        self.rank, self.world = rank_and_world()
        _join_process_group(self.world)
        self.device = torch.device("cuda") if self.kernel_source != "shim" else torch.device("cpu")
        with self._running(), torch.device(self.device):
            self.model = self.module.Transformer(args)
        with tempfile.TemporaryDirectory(prefix="deepinfer-official-") as scratch:
            self._load_weights(converted_file(model_dir, self.rank, self.world, Path(scratch)))
        self.model.eval()
        self.tap: Callable[[str, torch.Tensor], None] | None = None
        self.embed_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._install_hooks()

    def _running(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_official_modules(self.kernel))
        stack.enter_context(_default_dtype(torch.bfloat16))  # generate.py's global default
        return stack

    def _load_weights(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(str(path), device=str(self.device))
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(state))
        if missing:  # load_model(strict=False) would leave these uninitialised: refuse instead
            raise OfficialLoadError(f"{path}: {len(missing)} parameters of the official model are not in the "
                                    f"checkpoint, e.g. {missing[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                t = state[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise OfficialLoadError(f"{path}: {name} has shape {tuple(t.shape)}, the official model "
                                            f"expects {tuple(p.shape)}")
                p.copy_(t)  # what load_state_dict does: bf16 -> fp32 promotions, same-dtype copies
        self.unused_checkpoint_tensors = sorted(set(state) - set(params))

    def _install_hooks(self) -> None:
        hc = self.model.hc_mult

        def on_embed(_module, _inputs, out):
            if self.embed_transform is not None:
                out = self.embed_transform(out)
            if self.tap:
                self.tap("embed", out.unsqueeze(2).repeat(1, 1, hc, 1))
            return out

        self.model.embed.register_forward_hook(on_embed)
        for i, block in enumerate(self.model.layers):
            self._hook_block(block, f"layers.{i}")

    def _hook_block(self, block: torch.nn.Module, name: str) -> None:
        """Block.forward calls hc_post twice: its results are the residual after attn, then after ffn. No
        module returns the residual after attention, so the bound method is wrapped on this instance."""
        calls = {"n": 0}
        hc_post = block.hc_post

        def reset(_module, _inputs):
            calls["n"] = 0

        def tapped_hc_post(*args, **kwargs):
            y = hc_post(*args, **kwargs)
            if self.tap:
                self.tap(f"{name}.{('attn', 'ffn')[calls['n']]}", y)
            calls["n"] += 1
            return y

        def check(_module, _inputs, out):
            if calls["n"] != 2:
                raise RuntimeError(f"{name}: the official Block called hc_post {calls['n']} times, expected 2 "
                                   "(model.py changed: the residual hooks need updating)")

        block.register_forward_pre_hook(reset)
        block.hc_post = tapped_hc_post
        block.register_forward_hook(check)

    def forward(self, ids: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        with self._running():
            logits = self.model.forward(ids.to(self.device), start_pos)
        return logits.float().cpu()
