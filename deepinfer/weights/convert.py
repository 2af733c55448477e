"""Emulation of the official `inference/convert.py` (spec §5.3) and the layout of its output.

Owns: `convert_checkpoint(src, dst, mp, expert_dtype)` writing `model{rank}-mp{mp}.safetensors`, and the
facts about those files that the checker and the loader share: `native_name` (HF name -> converted
name or None when dropped), `routed_expert_index`, `expert_owner`, and `converted_specs(cfg, mp, rank,
expert_dtype)` (the expected tensor table of one rank file).

The tensor-parallel split axis comes from `schema.expected_tensors(cfg)[name].shard_dim`. For every V4
tensor name that table reproduces convert.py's key -> dim mapping (key = last name component for names
containing hc / attn_sink / tie2eid / ape, else the second-to-last): wq_b 0, wo_a 0, wo_b 1, embed 0,
head 0, attn_sink 0, weights_proj 0, indexer wq_b 0 (its key is wq_b); everything else is replicated.
`official_key_dim` is that rule written out; a test asserts the two agree, and it is the fallback for
names the table does not know (convert.py replicates unmapped keys).

Must not: read or write HF shards any other way than through `reader`/safetensors; change numerics
beyond what convert.py does (wo_a dequantised in fp32 then rounded to bf16; experts reinterpreted as
float4_e2m1fn_x2, or cast FP4 -> FP8 by `formats.fp4_to_fp8_tiles`).
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from deepinfer.config import ModelConfig
from deepinfer.formats import dequant_fp8_blocks, fp4_to_fp8_tiles
from deepinfer.weights.reader import CheckpointError, CheckpointReader
from deepinfer.weights.schema import TensorSpec, expected_tensors

EXPERT_DTYPES = ("fp4", "fp8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Substring renames convert.py applies to legacy (V3-era HF) names; V4 files already use native names.
_LEGACY_RENAMES = (
    ("self_attn", "attn"),
    ("mlp", "ffn"),
    ("weight_scale_inv", "scale"),
    ("e_score_correction_bias", "bias"),
)
# convert.py's key -> (new key, shard dim) table (spec §5.3 step 2)
_KEY_TABLE: dict[str, tuple[str, int | None]] = {
    "embed_tokens": ("embed", 0), "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None), "q_proj": ("wq", 0), "q_a_proj": ("wq_a", None),
    "q_a_layernorm": ("q_norm", None), "q_b_proj": ("wq_b", 0), "kv_a_proj_with_mqa": ("wkv_a", None),
    "kv_a_layernorm": ("kv_norm", None), "kv_b_proj": ("wkv_b", 0), "o_proj": ("wo", 1),
    "gate_proj": ("w1", 0), "down_proj": ("w2", 1), "up_proj": ("w3", 0), "lm_head": ("head", 0),
    "embed": ("embed", 0), "wq_b": ("wq_b", 0), "wo_a": ("wo_a", 0), "wo_b": ("wo_b", 1),
    "head": ("head", 0), "attn_sink": ("attn_sink", 0), "weights_proj": ("weights_proj", 0),
}


def _key(name: str) -> str:
    parts = name.split(".")
    # "tie2eid" (sic) is what convert.py tests for; it never matches the real tid2eid, which therefore
    # takes the second-to-last component ("gate") as its key and is replicated.
    if any(s in name for s in ("hc", "attn_sink", "tie2eid", "ape")):
        return parts[-1]
    return parts[-2] if len(parts) > 1 else parts[-1]


def official_key_dim(name: str) -> int | None:
    """convert.py's split axis for a (native) tensor name, by its key rule."""
    return _KEY_TABLE.get(_key(name), (None, None))[1]


def native_name(hf_name: str) -> str | None:
    """The name convert.py writes for an HF tensor name, or None when convert.py drops it."""
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    if name.startswith("mtp.") and ("emb" in name or name.endswith("head.weight")):
        return None  # the MTP block shares the main embedding and head
    for old, new in _LEGACY_RENAMES:
        name = name.replace(old, new)
    key = _key(name)
    if key in _KEY_TABLE:
        name = name.replace(key, _KEY_TABLE[key][0])
    return name


def routed_expert_index(name: str) -> int | None:
    """E for `...ffn.experts.E.w?.{weight,scale}` (routed experts only; shared experts -> None)."""
    parts = name.split(".")
    if "experts" not in parts or len(parts) < 3:
        return None
    try:
        return int(parts[-3])
    except ValueError:
        return None


def expert_owner(expert: int, n_experts: int, mp: int) -> int:
    """Rank holding routed expert `expert`: experts are split into mp contiguous ranges."""
    return expert // (n_experts // mp)


def is_wo_a(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "wo_a"


def _companion(name: str, suffix: str) -> str:
    return name.rsplit(".", 1)[0] + "." + suffix


def _split_shape(name: str, shape: tuple[int, ...], dim: int, mp: int) -> tuple[int, ...]:
    if shape[dim] % mp:
        raise CheckpointError(f"tensor {name}: dim {dim} of size {shape[dim]} is not divisible by mp={mp}")
    return (*shape[:dim], shape[dim] // mp, *shape[dim + 1:])


def _check_block_aligned(name: str, table: dict[str, TensorSpec], mp: int, block: int) -> None:
    """A split FP8 weight must keep whole scale blocks on each rank, else its scale slice belongs to
    other rows/cols. convert.py only asserts divisibility and would silently mis-scale such a slice."""
    spec = table[name]
    if spec.kind not in ("fp8", "scale") or spec.shard_dim is None:
        return
    weight = table.get(_companion(name, "weight"))
    if weight is None or weight.kind != "fp8":
        return
    size = weight.shape[spec.shard_dim]
    if size % (mp * block):
        raise CheckpointError(
            f"tensor {name}: dim {spec.shard_dim} of its weight ({size}) split {mp} ways does not keep whole"
            f" {block}-element scale blocks per rank"
        )


def converted_specs(
    cfg: ModelConfig, mp: int, rank: int, expert_dtype: str = "fp4", include_mtp: bool = True
) -> dict[str, TensorSpec]:
    """Expected tensors of `model{rank}-mp{mp}.safetensors` as convert.py writes them.

    Shapes are per rank (sliced along shard_dim); routed experts appear only on their owner; wo_a is a
    bf16 slice without scale; FP4 experts stay packed [out, in/2] ("fp4") or become E4M3 [out, in] with
    weight_block x weight_block E8M0 scales ("fp8").
    """
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
    if mp < 1 or cfg.n_routed_experts % mp:
        raise CheckpointError(f"n_routed_experts {cfg.n_routed_experts} is not divisible by mp={mp}")
    hf = expected_tensors(cfg, include_mtp=include_mtp)
    b = cfg.weight_block
    out: dict[str, TensorSpec] = {}
    for name, spec in hf.items():
        if native_name(name) is None:
            continue
        e = routed_expert_index(name)
        if e is not None:
            if expert_owner(e, cfg.n_routed_experts, mp) != rank:
                continue
            weight = hf[_companion(name, "weight")]
            if expert_dtype == "fp8" and weight.kind == "fp4":
                o, i = weight.shape[0], weight.shape[1] * 2
                is_weight = name.endswith(".weight")
                spec = TensorSpec((o, i), "fp8") if is_weight else TensorSpec((-(-o // b), -(-i // b)), "scale")
            out[name] = spec
            continue
        if is_wo_a(name):
            if name.endswith(".scale"):
                continue  # folded into the bf16 weight
            spec = TensorSpec(spec.shape, "bf16", spec.shard_dim)
        if spec.shard_dim is not None:
            _check_block_aligned(name, hf, mp, b)
            spec = TensorSpec(_split_shape(name, spec.shape, spec.shard_dim, mp), spec.kind, spec.shard_dim)
        out[name] = spec
    return out


def convert_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    mp: int,
    expert_dtype: str = "fp4",
    *,
    cfg: ModelConfig | None = None,
    progress: bool = True,
) -> list[Path]:
    """Convert an HF checkpoint to `model{rank}-mp{mp}.safetensors` like the official convert.py.

    `cfg` defaults to `ModelConfig.from_checkpoint(src_dir)`; it supplies n_experts (convert.py's
    --n-experts), the weight block and the shard-dim table. Ranks are written one at a time, each from a
    fresh pass over the lazily read source (peak memory ~ one rank's share). Returns the written files.
    """
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
    src, dst = Path(src_dir), Path(dst_dir)
    cfg = cfg or ModelConfig.from_checkpoint(src)
    n_experts = cfg.n_routed_experts
    if mp < 1 or n_experts % mp:
        raise ValueError(f"n_experts {n_experts} must be divisible by mp={mp}")
    reader = CheckpointReader(src, format="hf")
    table = expected_tensors(cfg, include_mtp=True)

    plan: list[tuple[str, str, int | None, int | None]] = []  # (src name, new name, shard dim, expert)
    seen: dict[str, str] = {}
    for src_name in reader.names():
        new = native_name(src_name)
        if new is None:
            continue
        if new in seen:
            raise CheckpointError(f"{reader.file_of(src_name)}: {src_name} and {seen[new]} both map to {new}")
        seen[new] = src_name
        dim = table[new].shard_dim if new in table else official_key_dim(new)
        if new in table:
            _check_block_aligned(new, table, mp, cfg.weight_block)
        plan.append((src_name, new, dim, routed_expert_index(new)))

    dst.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    bar = tqdm(total=mp * len(plan), desc="converting", unit="tensor", disable=not progress)
    with bar:
        for rank in range(mp):
            state: dict[str, torch.Tensor] = {}
            for src_name, new, dim, expert in plan:
                bar.update(1)
                if expert is not None:
                    if expert_owner(expert, n_experts, mp) == rank:
                        state[new] = reader.get(src_name)
                    continue
                t = reader.get(src_name)
                if dim is not None:
                    if t.shape[dim] % mp:
                        raise CheckpointError(
                            f"{reader.file_of(src_name)}: tensor {src_name} dim {dim} of size {t.shape[dim]}"
                            f" is not divisible by mp={mp}"
                        )
                    size = t.shape[dim] // mp
                    t = t.narrow(dim, rank * size, size).clone()  # own storage: don't pin the whole tensor
                state[new] = t
            _post_process(state, cfg, expert_dtype, rank, mp)
            path = dst / f"model{rank}-mp{mp}.safetensors"
            tmp = dst / (path.name + ".tmp")
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
            tmp.replace(path)
            written.append(path)
            del state
    reader.close()
    for fname in TOKENIZER_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, dst / fname)
    return written


def _post_process(state: dict[str, torch.Tensor], cfg: ModelConfig, expert_dtype: str, rank: int, mp: int) -> None:
    """Per-rank step 4 of spec §5.3, in place: wo_a -> bf16, FP4 experts -> float4 view or FP8 tiles."""
    for name in [n for n in state if n.endswith(".weight")]:
        w = state[name]
        scale_key = _companion(name, "scale")
        if is_wo_a(name) and w.dtype == torch.float8_e4m3fn and scale_key in state:
            # fp32 math (exact: fp8 * pow2), then one rounding to bf16
            state[name] = dequant_fp8_blocks(w, state.pop(scale_key), cfg.weight_block).to(torch.bfloat16)
        elif routed_expert_index(name) is not None and w.dtype in (torch.int8, torch.uint8):
            if expert_dtype == "fp4":
                state[name] = w.view(torch.float4_e2m1fn_x2)
                continue
            if scale_key not in state:
                raise CheckpointError(f"rank {rank}/{mp}: FP4 expert {name} has no {scale_key} to cast to FP8")
            res = fp4_to_fp8_tiles(w, state[scale_key], tile=cfg.weight_block)
            if not res.lossless:
                warnings.warn(
                    f"{name}: FP4->FP8 cast is lossy in {len(res.lossy_tiles)} tile(s) (per-32 scales span more"
                    " than 2**14 within a tile); convert.py does the same silently",
                    stacklevel=3,
                )
            state[name], state[scale_key] = res.weight, res.scale
