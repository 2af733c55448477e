"""The Triton arithmetic that CUDA kernels copy instruction by instruction, read off the Triton kernels' sm_90 PTX
offline (no GPU; skipped without Triton's NVIDIA backend).

`sparse_attn_wgmma.cu`'s QNORM pass norms and rotates the raw queries with the arithmetic of
`attn_norm_rope._head_rms_norm_rope_kernel` (the launch it replaces), written out in the .cu as that kernel's PTX
had it: each square rounded to bf16, the mean as the sum times 1/D, rsqrt.approx.ftz, the rotation's
`re * c - im * s` as fma(re, c, -(im * s)) and `re * s + im * c` as fma(im, c, re * s). Its `tl_exp` is Triton's
tl.exp (x * log2 e, then ex2.approx). If a Triton release lowered these otherwise, the CUDA forms would drift from
the launches they stand for by a rounding here and there, which the GPU tests' bounds might not show: this test
names the change instead.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _ptx(kernel, params: dict, divisible: set[str], num_warps: int = 4) -> str:
    pytest.importorskip("triton")
    try:
        from sass_sm90 import compile_sm90
    except ImportError as e:  # Triton without its NVIDIA backend
        pytest.skip(f"no sm_90 compile here: {e}")
    return compile_sm90(kernel, params, divisible, num_warps=num_warps).asm["ptx"]


def _ops(ptx: str) -> list[str]:
    """The PTX instructions, one string each (operands kept, predicates and comments dropped)."""
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line.endswith(":") or line.startswith((".", "{", "}")):
            continue
        out.append(re.sub(r"^@!?%p\d+\s+", "", line))
    return out


def test_head_rms_norm_rope_arithmetic_as_the_cuda_qnorm_pass_copies_it():
    from deepinfer.kernels.triton.attn_norm_rope import _head_rms_norm_rope_kernel

    params = dict(x_ptr="*bf16", out_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", n_rows="i32", heads="i32",
                  D="i32", eps="fp32", stride_x="i32", stride_o="i32", ROWS=8, BLOCK_D=512, HALF=32, PDL=False)
    ops = _ops(_ptx(_head_rms_norm_rope_kernel, params, {"x_ptr", "out_ptr", "cos_ptr", "sin_ptr", "stride_x",
                                                          "stride_o"}))
    names = [op.split()[0] for op in ops]
    assert "rsqrt.approx.ftz.f32" in names, "the factor's rsqrt is no longer rsqrt.approx.ftz"
    assert not any(n.startswith(("sqrt.", "rcp.")) for n in names), "another square root or reciprocal form"
    # the rotation: re * c - im * s = fma(re, c, -(im * s)): a mul, its negation, an fma taking it as the addend
    regs = {}
    for op in ops:
        parts = op.replace(",", " ").split()
        if parts[0] in ("mul.f32", "neg.f32", "fma.rn.f32"):
            regs[parts[1]] = parts
    negated_products = {p[1] for p in regs.values() if p[0] == "neg.f32" and regs.get(p[2], ["?"])[0] == "mul.f32"}
    fmas_on_them = [p for p in regs.values() if p[0] == "fma.rn.f32" and p[4] in negated_products]
    assert fmas_on_them, "re * c - im * s is no longer fma(re, c, -(im * s))"
    products = {p[1] for p in regs.values() if p[0] == "mul.f32"}
    assert [p for p in regs.values() if p[0] == "fma.rn.f32" and p[4] in products], \
        "re * s + im * c is no longer fma(im, c, re * s)"
    # the mean: the fp32 sum times 1/D (div.full of 1 by D: exactly 2^-9 at D = 512), rounded to bf16
    assert "div.full.f32" in names and "cvt.rn.bf16.f32" in names


def test_tl_exp_is_a_multiply_by_log2e_then_ex2_approx():
    """The wgmma attention's `tl_exp` (and the CUDA forms that mirror Triton's softmax) assume this lowering."""
    from deepinfer.kernels.triton.sparse_attn import _sparse_attn_sink_kernel

    params = dict(q_ptr="*bf16", kv_ptr="*bf16", sink_ptr="*fp32", idx_ptr="*i32", out_ptr="*bf16", H="i32",
                  K="i32", scale="fp32", initial_max="fp32", stride_qt="i32", stride_qh="i32", stride_kvn="i32",
                  stride_it="i32", stride_ot="i32", stride_oh="i32", D=128, BLOCK_H=16, BLOCK_K=64, INTERPRET=False,
                  PDL=False)
    ops = _ops(_ptx(_sparse_attn_sink_kernel, params, {"q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "stride_qt",
                                                        "stride_qh", "stride_kvn", "stride_it", "stride_ot",
                                                        "stride_oh"}))
    defs = {op.replace(",", " ").split()[1]: op.replace(",", " ").split() for op in ops if len(op.split()) > 1}
    ex2 = [op.replace(",", " ").split() for op in ops if op.startswith("ex2.approx.f32")]
    assert ex2, "tl.exp no longer lowers to ex2.approx.f32"
    for e in ex2:
        src = defs.get(e[2], ["?"])
        assert src[0] == "mul.f32" and "0f3FB8AA3B" in src[2:], f"ex2's operand is not x * log2(e): {src}"
