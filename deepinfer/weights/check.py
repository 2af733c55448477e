"""Compare a checkpoint's tensors with what the model config says it must hold.

Owns: `check_checkpoint(reader, cfg)` -> `CheckReport` of every problem found from headers alone —
missing / unexpected / unindexed tensors, wrong shape, wrong dtype, an FP8/FP4 weight without its
`.scale`, a scale whose layout does not fit its weight (FP4: one E8M0 per 32 elements *of a row*,
[out, in/32]; the seed project once expanded such scales along `out`) — plus an optional scan of the
scale bytes for E8M0 NaN (0xFF). HF checkpoints are compared with `schema.expected_tensors`; converted
`model{rank}-mp{n}` files rank by rank with `convert.converted_specs`.

Must not: load weights for the model, repair anything, or stop at the first problem (list them all).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.weights.convert import converted_specs, native_name, routed_expert_index
from deepinfer.weights.reader import CheckpointError, CheckpointReader
from deepinfer.weights.schema import TensorSpec, expected_tensors, skipped_prefixes

E8M0_NAN = 0xFF


@dataclass(frozen=True)
class Problem:
    kind: str  # missing | unexpected | unindexed | shape | dtype | no_scale | scale_layout | nan_scale | layout
    tensor: str
    file: str | None  # the file holding (or, for missing tensors of mp files, due to hold) the tensor
    detail: str

    def __str__(self) -> str:
        where = f" in {self.file}" if self.file else ""
        return f"[{self.kind}] {self.tensor}{where}: {self.detail}"


@dataclass
class CheckReport:
    source: str
    format: str
    problems: list[Problem] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # present but deliberately not checked (see check_checkpoint)
    checked: int = 0  # (tensor, file) pairs compared
    expert_dtype: str | None = None  # mp only: "fp4" or "fp8", detected from the expert weights

    @property
    def ok(self) -> bool:
        return not self.problems

    def of_kind(self, kind: str) -> list[Problem]:
        return [p for p in self.problems if p.kind == kind]

    @property
    def missing(self) -> list[str]:
        return [p.tensor for p in self.of_kind("missing")]

    @property
    def unexpected(self) -> list[str]:
        return [p.tensor for p in self.of_kind("unexpected")]

    def summary(self, limit: int = 20) -> str:
        if self.ok:
            return f"{self.source}: {self.checked} tensors OK ({self.format})"
        lines = [f"{self.source} ({self.format}) failed checks with {len(self.problems)} problem(s):"]
        lines += [f"  {p}" for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"  ... and {len(self.problems) - limit} more")
        return "\n".join(lines)

    def raise_if_failed(self, limit: int = 20) -> None:
        if not self.ok:
            raise CheckpointError(self.summary(limit))


def check_checkpoint(
    reader: CheckpointReader | str | Path,
    cfg: ModelConfig,
    include_mtp: bool = True,
    scan_scales: bool = False,
) -> CheckReport:
    """Check every tensor of `reader` against `cfg`'s tensor table; reads headers only unless `scan_scales`.

    Ignored (not unexpected): parts the language model does not use (`schema.skipped_prefixes`, e.g. the
    V4.1 vision tower — present in real checkpoints, skipped on load with a note); in HF files, `mtp.*` tensors that convert.py drops (names with `emb` or
    ending in `head.weight`), and every `mtp.*` tensor when include_mtp is False.
    """
    if not isinstance(reader, CheckpointReader):
        reader = CheckpointReader(reader)
    report = CheckReport(str(reader.dir), reader.format)
    if reader.format == "hf":
        _check_file_set(reader, None, expected_tensors(cfg, include_mtp), include_mtp, report, scan_scales,
                        skipped_prefixes(cfg))
        for name, path in reader.unindexed.items():
            report.problems.append(Problem("unindexed", name, str(path), "present in the shard but not in the index"))
        return report
    report.expert_dtype = _detect_expert_dtype(reader)
    for rank in range(reader.mp):
        try:
            specs = converted_specs(cfg, reader.mp, rank, report.expert_dtype, include_mtp)
        except CheckpointError as e:
            report.problems.append(Problem("layout", "*", str(reader.files[rank]), str(e)))
            continue
        _check_file_set(reader, rank, specs, include_mtp, report, scan_scales, skipped_prefixes(cfg))
    return report


def _detect_expert_dtype(reader: CheckpointReader) -> str:
    for name in reader.names():
        if routed_expert_index(name) is not None and name.endswith(".weight"):
            rank = reader.ranks_of(name)[0]
            return "fp8" if reader.shape_dtype(name, rank)[1] == torch.float8_e4m3fn else "fp4"
    return "fp4"


def _check_file_set(
    reader: CheckpointReader,
    rank: int | None,
    specs: dict[str, TensorSpec],
    include_mtp: bool,
    report: CheckReport,
    scan_scales: bool,
    skipped: tuple[str, ...] = (),
) -> None:
    """Compare the tensors of one HF checkpoint (rank None) or one mp rank file with `specs`."""
    if rank is None:
        present = {n: str(reader.file_of(n)) for n in reader.names()}
        default_file = None
    else:
        present = {n: str(reader.files[rank]) for n in reader.names() if rank in reader.ranks_of(n)}
        default_file = str(reader.files[rank])
    shapes = {n: reader.shape_dtype(n, rank) for n in present}
    problems = report.problems

    for name, spec in specs.items():
        if name in present:
            continue
        if spec.kind == "scale" and _weight_of(name) in present:
            weight = _weight_of(name)
            problems.append(Problem("no_scale", weight, present[weight], f"has no {name} companion"))
        else:
            problems.append(Problem("missing", name, default_file, f"expected {spec.kind} {spec.shape}"))

    for name, file in present.items():
        spec = specs.get(name)
        if spec is None:
            dropped_by_convert = rank is None and native_name(name) is None
            if name.startswith("mtp.") and (not include_mtp or dropped_by_convert):
                report.ignored.append(name)
            elif skipped and name.startswith(skipped):  # e.g. V4.1's vision tower: not loaded
                report.ignored.append(name)
            else:
                shape, dtype = shapes[name]
                problems.append(Problem("unexpected", name, file, f"not part of the model ({dtype} {shape})"))
            continue
        report.checked += 1
        shape, dtype = shapes[name]
        if dtype not in spec.allowed_dtypes():
            allowed = ", ".join(str(d).removeprefix("torch.") for d in spec.allowed_dtypes())
            problems.append(Problem("dtype", name, file, f"dtype {dtype}, expected one of {allowed}"))
        if spec.kind == "scale":
            _check_scale(name, shape, spec, specs, shapes, file, problems)
        elif shape != spec.shape:
            problems.append(Problem("shape", name, file, f"shape {shape}, expected {spec.shape}"))
        if scan_scales and dtype == torch.float8_e8m0fnu:
            nan = int((reader.get(name, rank).view(torch.uint8) == E8M0_NAN).sum())
            if nan:
                problems.append(Problem("nan_scale", name, file, f"{nan} scale byte(s) are 0xFF (E8M0 NaN)"))


def _weight_of(scale_name: str) -> str:
    return scale_name[: -len(".scale")] + ".weight"


def _check_scale(
    name: str,
    shape: tuple[int, ...],
    spec: TensorSpec,
    specs: dict[str, TensorSpec],
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    file: str,
    problems: list[Problem],
) -> None:
    """A scale must fit its weight: explain the layout rule instead of printing two bare shapes."""
    if shape == spec.shape:
        return
    wname = _weight_of(name)
    wspec = specs.get(wname)
    wshape = shapes[wname][0] if wname in shapes else (wspec.shape if wspec else None)
    if wspec is not None and wspec.kind == "fp4":
        out_dim, in_dim = spec.shape[0], spec.shape[1] * 32
        hint = ""
        if shape == (spec.shape[1], spec.shape[0]):
            hint = " (transposed)"
        elif shape == (out_dim // 32, in_dim):
            hint = " (blocked along out instead of in: the seed's wrong-axis expansion)"
        detail = (
            f"FP4 scale shape {shape} does not fit weight {wname} {wshape}: E8M0 scales are per row,"
            f" one per 32 input elements -> [out, in/32] = {spec.shape}{hint}"
        )
    elif wspec is not None and wspec.kind == "fp8":
        detail = (
            f"FP8 block scale shape {shape} does not fit weight {wname} {wshape}: one E8M0 per block"
            f" -> [ceil(out/b), ceil(in/b)] = {spec.shape}"
        )
    else:
        detail = f"shape {shape}, expected {spec.shape}"
    problems.append(Problem("scale_layout", name, file, detail))
