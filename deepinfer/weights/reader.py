"""Lazy, memory-mapped access to the tensors of a checkpoint directory.

Owns: `CheckpointReader` over the three on-disk layouts of a V4 checkpoint —
  (a) HF shards listed in `model.safetensors.index.json` (weight_map: name -> file),
  (b) a single `model.safetensors`,
  (c) the official convert.py output `model{rank}-mp{n}.safetensors`, ranks 0..n-1;
plus `read_header`, our own parse of a safetensors header (8-byte little-endian length + JSON).
Every file's header is parsed and validated when the reader is built, so a missing shard, a truncated
data section or a corrupt header is reported at open — naming the file — and never surfaces later as
garbage or a crash inside the mmap. Data is read only by `get`, one tensor at a time, through one
`safe_open` handle per file opened on first use.

Must not: know tensor semantics (shapes per config, scales, sharding rules: `schema.py`, `check.py`,
`loader.py`), or modify files.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MP_FILE = re.compile(r"^model(\d+)-mp(\d+)\.safetensors$")
# A real header is a few MB at most (69k tensors ~ 10 MB); anything larger is a corrupt length field.
_MAX_HEADER_BYTES = 256 * 1024 * 1024

# safetensors dtype string -> (torch dtype, bits per stored element). F4 is special: the header counts
# 4-bit elements, torch's float4_e2m1fn_x2 counts bytes, so its last dimension is half the header's.
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 8),
    "U8": (torch.uint8, 8),
    "I8": (torch.int8, 8),
    "U16": (torch.uint16, 16),
    "I16": (torch.int16, 16),
    "U32": (torch.uint32, 32),
    "I32": (torch.int32, 32),
    "U64": (torch.uint64, 64),
    "I64": (torch.int64, 64),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "F32": (torch.float32, 32),
    "F64": (torch.float64, 64),
    "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E5M2": (torch.float8_e5m2, 8),
    "F8_E8M0": (torch.float8_e8m0fnu, 8),
    "F4": (torch.float4_e2m1fn_x2, 4),
}


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupt or does not match the model; the message names the file
    and, where one is involved, the tensor."""


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header: torch dtype/shape plus where its bytes live in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # torch's shape (for F4: bytes along the last dim, i.e. header shape / 2)
    begin: int
    end: int
    data_start: int = 0  # absolute file offset of the data section (8 + header length)


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """Parse and validate the header of one safetensors file with plain Python (no data read).

    Raises CheckpointError (naming the file) when the file is too short, the header is not valid JSON,
    an entry is malformed, or the file is shorter than the largest data offset (a truncated download).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file has {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header length field says {n} bytes but the file has {size} bytes"
                    " (truncated or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_size = size - 8 - n
    entries: dict[str, HeaderEntry] = {}
    largest_end, largest_name = 0, ""
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = dataclasses.replace(_parse_entry(path, name, info), data_start=8 + n)
        entries[name] = entry
        if entry.end > largest_end:
            largest_end, largest_name = entry.end, name
    if largest_end > data_size:
        raise CheckpointError(
            f"{path}: truncated: data section has {data_size} bytes but tensor {largest_name} ends at byte"
            f" {largest_end} of it"
        )
    return entries


def _parse_entry(path: Path, name: str, info: Any) -> HeaderEntry:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt header entry for tensor {name}: {why}")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad("needs dtype, shape and data_offsets")
    dtype_str, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype_str not in _DTYPES:
        raise bad(f"unsupported dtype {dtype_str!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise bad(f"data_offsets {offsets!r}")
    begin, end = offsets
    dtype, bits = _DTYPES[dtype_str]
    nbytes = math.prod(shape) * bits // 8
    if begin < 0 or end - begin != nbytes:
        raise bad(f"data_offsets {offsets} hold {end - begin} bytes, {dtype_str} {shape} needs {nbytes}")
    torch_shape = tuple(shape)
    if bits == 4:
        if not shape or shape[-1] % 2:
            raise bad(f"F4 tensor needs an even last dimension, got {shape}")
        torch_shape = (*shape[:-1], shape[-1] // 2)
    return HeaderEntry(dtype, torch_shape, begin, end)


class CheckpointReader:
    """Read-only view of a checkpoint directory; see the module docstring for the layouts.

    `format` is "hf" (index or single file) or "mp" (converted); `mp` is the number of rank files
    (1 for "hf"). In "mp" checkpoints a name may live in several rank files (replicated or sharded
    tensors): `get`/`shape_dtype` then need `rank=`; `loader.load_tensors` reassembles full tensors.
    """

    def __init__(self, path: str | Path, format: str | None = None) -> None:
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        if format not in (None, "hf", "mp"):
            raise ValueError(f"format must be 'hf', 'mp' or None, got {format!r}")
        self.format, self.mp, self.files, index = self._detect(format)
        self._headers: list[dict[str, HeaderEntry]] = [read_header(f) for f in self.files]
        # name -> indices into self.files (one for hf; one per holding rank for mp, in rank order)
        self._where: dict[str, list[int]] = {}
        self.unindexed: dict[str, Path] = {}  # tensors in an HF shard that the index does not list
        if index is not None:
            self._map_index(index)
        else:
            for i, header in enumerate(self._headers):
                for name in sorted(header, key=lambda n: header[n].begin):
                    self._where.setdefault(name, []).append(i)
        self._handles: dict[int, Any] = {}

    # ------------------------------------------------------------------ layout detection
    def _detect(self, forced: str | None) -> tuple[str, int, list[Path], dict[str, str] | None]:
        """(format, mp, files, HF index weight_map or None); precedence: index, single file, mp files."""
        index_path, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if forced != "mp" and index_path.exists():
            index = _read_index(index_path)
            names = sorted(set(index.values()))
            missing = [n for n in names if not (self.dir / n).is_file()]
            if missing:
                raise CheckpointError(f"{index_path} lists shard file(s) that do not exist: {', '.join(missing)}")
            return "hf", 1, [self.dir / n for n in names], index
        if forced != "mp" and single.exists():
            return "hf", 1, [single], None
        ranks: dict[int, set[int]] = {}
        for p in self.dir.iterdir():
            m = _MP_FILE.match(p.name)
            if m:
                ranks.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        if forced != "hf" and ranks:
            if len(ranks) > 1:
                raise CheckpointError(
                    f"{self.dir} mixes converted files of several model-parallel sizes: mp={sorted(ranks)}"
                )
            (n, present), = ranks.items()
            missing = [f"model{r}-mp{n}.safetensors" for r in range(n) if r not in present]
            extra = sorted(r for r in present if r >= n)
            if missing:
                raise CheckpointError(f"{self.dir}: converted checkpoint is missing rank file(s) {', '.join(missing)}")
            if extra:
                raise CheckpointError(f"{self.dir}: rank file(s) {extra} are out of range for mp={n}")
            return "mp", n, [self.dir / f"model{r}-mp{n}.safetensors" for r in range(n)], None
        raise CheckpointError(
            f"{self.dir} has no {INDEX_FILE}, {SINGLE_FILE} or model{{rank}}-mp{{n}}.safetensors files"
            + (f" (format={forced!r} was requested)" if forced else "")
        )

    def _map_index(self, index: dict[str, str]) -> None:
        file_idx = {p.name: i for i, p in enumerate(self.files)}
        absent: list[str] = []
        for name, fname in index.items():
            i = file_idx[fname]
            if name not in self._headers[i]:
                absent.append(f"{name} (in {self.files[i]})")
            self._where[name] = [i]
        if absent:
            shown = "; ".join(absent[:20]) + (f"; and {len(absent) - 20} more" if len(absent) > 20 else "")
            raise CheckpointError(
                f"{self.dir / INDEX_FILE} lists {len(absent)} tensor(s) absent from their shard: {shown}"
            )
        for i, header in enumerate(self._headers):
            for name in header:
                if index.get(name) != self.files[i].name:
                    self.unindexed.setdefault(name, self.files[i])
        # order by (file, offset) so that reading in names() order streams through each mmap
        def position(item: tuple[str, list[int]]) -> tuple[int, int]:
            name, (i,) = item
            return i, self._headers[i][name].begin

        self._where = dict(sorted(self._where.items(), key=position))

    # ------------------------------------------------------------------ queries (headers only)
    def names(self) -> list[str]:
        """Every tensor name (for mp: the union over ranks), in file/offset order."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def ranks_of(self, name: str) -> list[int]:
        """Rank files holding `name` (always [0] for hf)."""
        where = self._locate(name)
        return list(where) if self.format == "mp" else [0]

    def file_of(self, name: str, rank: int | None = None) -> Path:
        """The file holding `name` (for mp without `rank`: the lowest rank holding it)."""
        return self.files[self._pick(name, rank, strict=False)]

    def shape_dtype(self, name: str, rank: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
        """(torch shape, torch dtype) from the header; no tensor data is read."""
        i = self._pick(name, rank, strict=True)
        e = self._headers[i][name]
        return e.shape, e.dtype

    def nbytes(self, name: str, rank: int | None = None) -> int:
        i = self._pick(name, rank, strict=True)
        e = self._headers[i][name]
        return e.end - e.begin

    # ------------------------------------------------------------------ data
    def get(self, name: str, rank: int | None = None) -> torch.Tensor:
        """Read exactly one tensor (for mp, from rank file `rank`; required when several ranks hold it)."""
        i = self._pick(name, rank, strict=True)
        path = self.files[i]
        handle = self._handles.get(i)
        try:
            if handle is None:
                handle = self._handles[i] = safe_open(str(path), framework="pt", device="cpu")
            t = handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types; re-raise ours with the names
            raise CheckpointError(f"{path}: cannot read tensor {name}: {e}") from None
        e = self._headers[i][name]
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise CheckpointError(
                f"{path}: tensor {name} read as {t.dtype} {tuple(t.shape)}, header says {e.dtype} {e.shape}"
            )
        return t

    def get_mapped(self, name: str, rank: int | None = None) -> torch.Tensor:
        """The tensor as a read-only memory map of its bytes in the file: nothing is read until used.

        For tables far larger than memory (V4.1's engram tables, ~183 GiB): index it to touch only the
        rows needed (`index_select`), and the OS pages in just those.
        """
        i = self._pick(name, rank, strict=True)
        e = self._headers[i][name]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        raw = np.memmap(self.files[i], dtype=np.uint8, mode="r", offset=e.data_start + e.begin,
                        shape=(e.end - e.begin,))
        with warnings.catch_warnings():  # torch warns that the array is read-only: we never write to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw)
        return flat.view(e.dtype).view(e.shape)

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mmap when dropped

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.dir)!r}, format={self.format!r}, mp={self.mp}, tensors={len(self)})"

    # ------------------------------------------------------------------ helpers
    def _locate(self, name: str) -> list[int]:
        where = self._where.get(name)
        if where is None:
            raise CheckpointError(f"{self.dir}: unknown tensor {name!r} (not in any checkpoint file)")
        return where

    def _pick(self, name: str, rank: int | None, strict: bool) -> int:
        where = self._locate(name)
        if rank is None:
            if strict and len(where) > 1:
                raise CheckpointError(
                    f"{self.dir}: tensor {name} lives in {len(where)} rank files; pass rank= or use"
                    " load_tensors() to reassemble it"
                )
            return where[0]
        if self.format == "hf":
            if rank != 0:
                raise CheckpointError(f"{self.dir}: an HF checkpoint has only rank 0, got rank={rank}")
            return where[0]
        if rank not in where:
            raise CheckpointError(f"{self._rank_file(rank)}: has no tensor {name}")
        return rank

    def _rank_file(self, rank: int) -> Path:
        if not 0 <= rank < len(self.files):
            raise CheckpointError(f"{self.dir}: rank {rank} out of range for mp={self.mp}")
        return self.files[rank]


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse index: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: index has no weight_map of tensor name -> file name")
    return weight_map
