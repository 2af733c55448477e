"""rope32 with a precomputed `rope_table32` (one table per step shared by its layers) gives the same bits as
rope32 building its table itself, and rope32(inplace=True) the same bits as the new tensor out of place (x
itself rotated, its leading channels untouched): the torch twin on CPU, the Triton kernel under the
interpreter and on cuda (-m gpu); `rms_norm_bf16` is `rms_norm(x.float(), w).to(bf16)` bit for bit
(twin on CPU, kernel on cuda); and the Triton `head_rms_norm` (V4's per-head q norm as the official bf16 torch
ops) is within two bf16 ulps of those ops and nearly always the same bits (interpreter and cuda)."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_ran_ok, run_interpreted
from deepinfer.kernels import official, torch_ops

BF16_BOUND = 2e-3  # tests/test_kernels_attn.py's kernel-vs-twin bound for bf16 outputs
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(1, 64, 512), (7, 4, 256), (33, 512), (5, 8, 128), (4, 64)]
FREQS = [(64, 65536, 160000.0, 16.0, 32, 1), (64, 0, 10000.0, 1.0, 32, 1)]  # YaRN (compressed) / plain


def _inputs(shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).bfloat16()
    pos = torch.randint(0, 1_000_000, (shape[0],), generator=g)
    return x.to(device), pos.to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and signed zeros included)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("fi", range(len(FREQS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_twin_rope32_with_table_is_bit_identical(shape, inverse, fi, dtype):
    freqs = official.rope_freqs32(*FREQS[fi])
    x, pos = _inputs(shape, "cpu", shape[0] * 7 + fi)
    x = x.to(dtype)
    table = official.rope_table32(pos, freqs)
    assert table.dtype == torch.complex64 and tuple(table.shape) == (shape[0], freqs.shape[0])
    assert _same(official.rope32(x, pos, freqs, inverse, table=table), official.rope32(x, pos, freqs, inverse))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_twin_rope32_in_place_is_the_same_bits(shape, inverse):
    freqs = official.rope_freqs32(*FREQS[0])
    x, pos = _inputs(shape, "cpu", shape[0] * 3 + 1)
    want = official.rope32(x, pos, freqs, inverse)
    y = x.clone()
    got = official.rope32(y, pos, freqs, inverse, table=official.rope_table32(pos, freqs), inplace=True)
    assert got is y and _same(y, want)


def test_twin_rope32_one_table_for_several_calls_and_shapes():
    """One step's table serves q [T, H, d], kv [T, d] and the inverse rotation of o alike."""
    freqs = official.rope_freqs32(*FREQS[0])
    q, pos = _inputs((6, 8, 128), "cpu", 1)
    kv = torch.randn(6, 128).bfloat16()
    table = official.rope_table32(pos, freqs)
    for t in (q, kv):
        for inv in (False, True):
            assert _same(official.rope32(t, pos, freqs, inv, table=table), official.rope32(t, pos, freqs, inv))


def test_twin_rope32_rejects_a_foreign_table():
    freqs = official.rope_freqs32(*FREQS[0])
    x, pos = _inputs((3, 128), "cpu", 2)
    with pytest.raises(ValueError):
        official.rope32(x, pos, freqs, table=torch.zeros(2, 3, 32))  # the cuda kernel's (cos, sin) layout
    with pytest.raises(ValueError):
        official.rope32(x, pos, freqs, table=official.rope_table32(pos[:2], freqs))


@pytest.mark.parametrize("shape", [(4, 512), (3, 7, 64), (1, 1024)])
def test_twin_rms_norm_bf16_is_the_two_casts(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = torch.randn(shape[-1], generator=g)
    want = torch_ops.rms_norm(x.float(), w, 1e-6).to(torch.bfloat16)
    assert _same(official.rms_norm_bf16(x, w, 1e-6), want)


# ------------------------------------------------------------------------- Triton, interpreter on CPU
# head_rms_norm's bound, shared by the interpreter and the cuda test: at most two bf16 ulps from the torch ops'
# result (same sign), >= 99% of the elements identical. A row's mean can round the other way when its fp32
# sum of squares runs in another order; its bf16 rsqrt then moves by one ulp and the row's products x * r by
# one or two (H200, 2026-12-02: (8192, 64, 512) showed a 2; the smaller shapes at most 1)
_HEAD_NORM_CHECK = """
def head_norm_close(got, want, what):
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, what
    assert bool(torch.isfinite(got).all()), what
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    same = float((ulps == 0).float().mean())
    assert bool((torch.signbit(got) == torch.signbit(want)).all()) and int(ulps.max()) <= 2, (what, int(ulps.max()))
    assert same >= 0.99, (what, same)
    return same


def head_norm_steps(x, eps):
    # the bf16 ops' roundings one by one, with an exact fp32 rsqrt: what torch's ops do on cuda (torch's CPU
    # bf16 rsqrt is a 14-bit SIMD approximation, one bf16 ulp off at times, so the CPU ops are not the reference)
    xf = x.float()
    mean = ((xf * xf).bfloat16().float().sum(-1, keepdim=True) * (1.0 / x.shape[-1])).bfloat16().float()
    r = torch.rsqrt((mean + eps).bfloat16().float()).bfloat16().float()
    return (xf * r).bfloat16()
"""
_INTERPRET_CHECK = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch

from test_kernels_rope_table import FREQS, _HEAD_NORM_CHECK, _inputs, _same
from deepinfer.kernels import official, torch_ops
from deepinfer.kernels.triton import norm_hc, rope
for shape in [(1, 64, 512), (9, 4, 256), (33, 512), (5, 8, 128)]:
    for fa in FREQS:
        freqs = official.rope_freqs32(*fa)
        x, pos = _inputs(shape, "cpu", shape[0])
        table = rope.rope_table32(pos, freqs)
        for inv in (False, True):
            want = rope.rope32(x, pos, freqs, inv)
            # against the complex64 twin: within one bf16 ulp (fp32 products and sums in another order
            # can round a value the other way), the pass-through channels identical
            ulps = (want.view(torch.int16).int() - official.rope32(x, pos, freqs, inv).view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 1 and int(ulps[..., :-2 * freqs.numel()].max()) == 0, (shape, fa, inv)
            assert _same(rope.rope32(x, pos, freqs, inv, table=table), want), (shape, fa, inv)
            y = x.clone()
            assert rope.rope32(y, pos, freqs, inv, table=table, inplace=True) is y and _same(y, want), (shape, fa, inv)
x, pos = _inputs((4, 2, 3, 128), "cpu", 3)
x = x.transpose(1, 2)  # [4, 3, 2, 128]: its middle dims cannot merge without a copy
before = x.clone()
try:  # refused (a rotation of a copy would be lost), x untouched
    rope.rope32(x, pos, official.rope_freqs32(*FREQS[0]), inplace=True)
    raise SystemExit("a non-viewable x was rotated in place")
except ValueError as err:
    assert "inplace" in str(err) and _same(x, before)
g = torch.Generator().manual_seed(0)
for shape in [(1, 512), (4, 1024), (5, 3, 128)]:
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    for w in (torch.randn(shape[-1], generator=g), None):
        want = norm_hc.rms_norm(x.float(), w, 1e-6).to(torch.bfloat16)
        assert _same(norm_hc.rms_norm_bf16(x, w, 1e-6), want), (shape, w is None)
exec(_HEAD_NORM_CHECK)
for shape in [(3, 4, 512), (2, 64, 512), (5, 128), (1, 1, 96)]:
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    head_norm_close(norm_hc.head_rms_norm(x, 1e-6), head_norm_steps(x, 1e-6), shape)
print("ok")
"""


def test_triton_kernels_under_the_interpreter():
    """The Triton rope32 within one bf16 ulp of the complex64 twin (measured: equal at these shapes), with its
    own table == without one, rms_norm_bf16 == the two-cast form, bit for bit (TRITON_INTERPRET=1 in a fresh
    process: the flag is read at import)."""
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=600)
    assert_ran_ok(res)


# ---------------------------------------------------------------------------------------------- cuda
def _triton():
    from deepinfer.kernels.triton import norm_hc, rope

    return rope, norm_hc


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 64, 512), (2000, 64, 512), (9, 4, 256), (300, 512), (5, 8, 128)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("fi", range(len(FREQS)))
def test_triton_rope32_with_table(shape, inverse, fi):
    """With the kernel's own table: bit-identical to the kernel building it (what the step did before), and
    as close to the twin as the kernel without a table (tests/test_kernels_attn.py's bound)."""
    rope, _ = _triton()
    freqs = official.rope_freqs32(*FREQS[fi]).cuda()
    x, pos = _inputs(shape, "cuda", shape[0] * 7 + fi)
    table = rope.rope_table32(pos, freqs)
    assert table.dtype == torch.float32 and tuple(table.shape) == (2, shape[0], freqs.shape[0])
    got = rope.rope32(x, pos, freqs, inverse, table=table)
    assert _same(got, rope.rope32(x, pos, freqs, inverse))
    y = x.clone()
    assert rope.rope32(y, pos, freqs, inverse, table=table, inplace=True) is y and _same(y, got)  # in place
    twin = official.rope32(x, pos, freqs, inverse)
    err = ((got.double() - twin.double()).norm() / twin.double().norm().clamp(min=1e-30)).item()
    assert err <= BF16_BOUND


@gpu
@needs_cuda
@pytest.mark.parametrize("fi", range(len(FREQS)))
def test_triton_rope_table_is_torchs_bit_for_bit(fi):
    """The one-launch table == torch's cast, outer, cos and sin (`rope_table32_torch`) bit for bit, positions
    0 .. 2**20 (libdevice's accurate cosf / sinf are the CUDA math library's, which torch calls)."""
    rope, _ = _triton()
    freqs = official.rope_freqs32(*FREQS[fi]).cuda()
    g = torch.Generator().manual_seed(fi)
    pos = torch.cat([torch.arange(300), torch.randint(0, 1 << 20, (5000,), generator=g), torch.tensor([1 << 20])])
    pos = pos.cuda()
    got, want = rope.rope_table32(pos, freqs), rope.rope_table32_torch(pos, freqs)
    assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), \
        int((got != want).sum())


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 64, 512), (1, 64, 512), (37, 64, 512), (5, 3, 128)])
def test_triton_head_rms_norm_is_the_bf16_torch_ops(shape):
    """The V4 q head norm in one kernel against the official bf16 torch ops on cuda (what model.py runs)."""
    _, norm_hc = _triton()
    ns: dict = {"torch": torch}
    exec(_HEAD_NORM_CHECK, ns)
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 3).bfloat16().cuda()
    same = ns["head_norm_close"](norm_hc.head_rms_norm(x, 1e-6), torch_ops.head_rms_norm(x, 1e-6), shape)
    print(f"head_rms_norm {shape}: {same:.4%} identical")


@gpu
@needs_cuda
def test_triton_rope32_rejects_the_twins_table():
    rope, _ = _triton()
    freqs = official.rope_freqs32(*FREQS[0]).cuda()
    x, pos = _inputs((3, 128), "cuda", 2)
    with pytest.raises(ValueError):
        rope.rope32(x, pos, freqs, table=official.rope_table32(pos, freqs))


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 512), (4, 1024), (300, 512), (5, 3, 128)])
@pytest.mark.parametrize("weighted", [True, False])
def test_triton_rms_norm_bf16_is_the_two_casts(shape, weighted):
    """The decode/extend q/kv norms: one kernel, within one bf16 ulp of rms_norm(x.float(), w).to(bf16) on
    cuda and nearly always the same bits (not always: the fp32 sum of squares runs in another order for a
    bf16 input, see norm_hc.rms_norm_bf16; on the H200 (300, 512) unweighted differed)."""
    _, norm_hc = _triton()
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).bfloat16().cuda()
    w = torch.randn(shape[-1], generator=g).cuda() if weighted else None
    want = norm_hc.rms_norm(x.float(), w, 1e-6).to(torch.bfloat16)
    got = norm_hc.rms_norm_bf16(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype and bool(torch.isfinite(got).all())
    same_sign = torch.signbit(got) == torch.signbit(want)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert bool(same_sign.all()) and int(ulps.max()) <= 1
    assert float((ulps == 0).float().mean()) >= 0.99
