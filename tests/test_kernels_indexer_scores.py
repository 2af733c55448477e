"""Op "indexer_scores_bf16": the lightning indexer's scores of a prefill / extend (query tokens against one
sequence's decoded index keys), with the optional `visible` counts (token t sees entries [0, visible[t]), the
rest of its row -inf). Twin: `kernels/official.py`; Triton: `kernels/triton/indexer.py` (a program: a pair of
tokens x a chunk of up to 8 key blocks of 64 entries; blocks neither token sees are written -inf unread).

CPU: the twin's `visible` is the official masked_fill of its unmasked scores, bit for bit; bad arguments
raise ValueError naming them (twin and Triton wrapper, no launch).
CPU under TRITON_INTERPRET=1 (GPU roundings): the kernel against the twin at odd and even T (the pair's
missing second token), E inside one block, across blocks and across chunks (E 600: two chunks, the second
partial), one block a program and chunks of up to 8, visible None / random (0 and E among them) / causal,
q plain bf16 and FP4 fake-quantised as the engine's: -inf exactly where hidden, rel_err <= 2e-3 over <= 1%
differing scores (the dot's fp32 sums round in numpy's order in the kernel and torch's in the twin, as in
the paged kernel's test).
Planted bugs fail it (the second token masked by the first's count; a chunk's dead blocks not written).
GPU (-m gpu): V4's shapes (h 64, d 128) up to an 8k prefill's T = 8192 x E = 2048 with its causal counts:
every row bit-identical to the one-token call of the same row (the same `head_sum` tiles, so the paged
decode kernel's bit-identity to this op carries over), -inf exactly where hidden, rel_err <= 2e-3 against
the twin.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import official
from deepinfer.kernels.official_fused import fp4_fake_quant
from interpreted import GPU_ROUNDINGS, assert_check_failed, assert_ran_ok, run_interpreted


def _inputs(g: torch.Generator, T: int, h: int, d: int, E: int, quant_q: bool = False, vis: str = "random",
            device: str = "cpu"):
    q = torch.randn(T, h, d, generator=g).bfloat16()
    q = fp4_fake_quant(q, 32) if quant_q else q
    w = (torch.randn(T, h, generator=g) * h**-0.5).bfloat16()
    keys = (torch.randn(E, d, generator=g) * 2.0 ** torch.randint(-4, 5, (E, 1), generator=g)).bfloat16()
    if vis == "none":
        visible = None
    elif vis == "causal":  # a prefill of T tokens over T // 4 compressed entries (ratio 4)
        visible = (torch.arange(T) + 1) // 4
    else:  # random counts, with a token that sees nothing and one that sees everything
        visible = torch.randint(0, E + 1, (T,), generator=g)
        visible[0] = 0
        visible[-1] = E
        visible = visible.to(torch.int32) if T % 2 else visible
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(q), to(w), to(keys), to(visible)


def _compare(out: torch.Tensor, ref: torch.Tensor, visible: torch.Tensor | None, case: str) -> int:
    """-inf exactly where hidden (and nowhere else), rel_err <= 2e-3 and <= 1% of the scores differing: the
    dot's fp32 sums may round in another order than the twin's. Returns the differing count."""
    T, E = ref.shape
    hidden = (torch.arange(E, device=ref.device) >= visible.unsqueeze(1) if visible is not None
              else torch.zeros(T, E, dtype=torch.bool, device=ref.device))
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, case
    assert torch.equal(torch.isneginf(out), hidden), f"{case}: -inf positions"
    assert torch.equal(torch.isneginf(ref), hidden), f"{case}: twin's -inf positions"
    live = ~hidden
    n = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
    if live.any():
        a, b = out[live].double(), ref[live].double()
        err = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
        assert err <= 2e-3 and n <= 0.01 * out.numel(), f"{case}: {n} differ, rel_err {err:.2e}"
    return n


def test_twin_visible_is_the_official_mask():
    g = torch.Generator().manual_seed(0)
    q, w, keys, visible = _inputs(g, 9, 4, 64, 100)
    full = official.indexer_scores_bf16(q, w, keys)
    masked = official.indexer_scores_bf16(q, w, keys, visible)
    want = full.masked_fill(torch.arange(100) >= visible.unsqueeze(1), float("-inf"))
    assert torch.equal(masked.view(torch.int16), want.view(torch.int16))
    assert torch.isneginf(masked[0]).all() and not torch.isneginf(masked[-1]).any()


@pytest.mark.parametrize("bad,match", [
    (lambda q, w, k, v: (q, w, k, v[:-1]), "visible must be"),
    (lambda q, w, k, v: (q, w, k, v.float()), "visible must be"),
    (lambda q, w, k, v: (q, w[:-1], k, v), "want q"),
    (lambda q, w, k, v: (q, w, k[:, :-1], v), "want q"),
])
def test_bad_arguments_raise_in_twin_and_wrapper(bad, match):
    g = torch.Generator().manual_seed(1)
    args = bad(*_inputs(g, 5, 4, 64, 70))
    with pytest.raises(ValueError, match=match):
        official.indexer_scores_bf16(*args)
    triton_indexer = pytest.importorskip("deepinfer.kernels.triton.indexer")
    with pytest.raises(ValueError, match=match):
        triton_indexer.indexer_scores_bf16(*args)


_CHECK = '''
import itertools
import torch
import test_kernels_indexer_scores as t
from deepinfer.kernels import official
from deepinfer.kernels.triton import indexer

g = torch.Generator().manual_seed(7)
total = 0
cases = itertools.product((1, 2, 5), (37, 130, 600), ("none", "random", "causal"), (False, True), (4, 0))
for T, E, vis, quant_q, per_sm in cases:  # per_sm 4: one block a program at these sizes; 0: chunks of up to 8
    if vis == "causal" and T < 5:
        continue
    indexer.MIN_PROGRAMS_PER_SM = per_sm
    q, w, keys, visible = t._inputs(g, T, 4, 64, E, quant_q, vis)
    out = indexer.indexer_scores_bf16(q, w, keys, visible)
    ref = official.indexer_scores_bf16(q, w, keys, visible)
    total += t._compare(out, ref, visible, f"T={T} E={E} vis={vis} quant_q={quant_q} per_sm={per_sm}")
print("differing", total)
'''


def test_triton_kernel_is_its_twin_under_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(GPU_ROUNDINGS + _CHECK + "print('ok')\n", timeout=600)
    assert_ran_ok(res)
    print(res.stdout.strip())


@pytest.mark.parametrize("plant", [
    # the pair's second token masked by the first token's count
    ("s1 = tl.where(ents < vis1,", "s1 = tl.where(ents < vis0,"),
    # a chunk's blocks that no token sees left unwritten (torch.empty's garbage)
    ("    for j in range(n_live, CHUNK):", "    for j in range(CHUNK, CHUNK):"),
])
def test_planted_bugs_fail_under_the_interpreter(plant, tmp_path):
    """The check above catches a kernel that masks the pair's second token with the first token's count,
    or skips writing the dead blocks: the module's source patched into a file of its own (the interpreter
    reads a kernel's source from its file) and loaded in its place."""
    pytest.importorskip("triton")
    import inspect

    from deepinfer.kernels.triton import indexer

    src = inspect.getsource(indexer)
    old, new = plant
    assert src.count(old) == 1, old
    planted = tmp_path / "indexer_planted.py"
    planted.write_text(src.replace(old, new))
    patch = f'''
import sys, types
mod = types.ModuleType("deepinfer.kernels.triton.indexer")
mod.__file__ = {str(planted)!r}
sys.modules[mod.__name__] = mod
import deepinfer.kernels.triton as pkg
pkg.indexer = mod
exec(compile(open(mod.__file__).read(), mod.__file__, "exec"), mod.__dict__)
'''
    res = run_interpreted(GPU_ROUNDINGS + patch + _CHECK + "print('ok')\n", timeout=600)
    assert_check_failed(res)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,E,vis", [(1, 80, "random"), (7, 2048, "random"), (1000, 1000, "none"),
                                     (8192, 2048, "causal"), (33, 4096, "causal")])
def test_rows_bit_identical_to_one_token_calls(T, E, vis):
    from deepinfer.kernels.triton import indexer

    g = torch.Generator().manual_seed(T + E)
    q, w, keys, visible = _inputs(g, T, 64, 128, E, vis=vis, device="cuda")
    out = indexer.indexer_scores_bf16(q, w, keys, visible)
    ref = official.indexer_scores_bf16(q, w, keys, visible)
    n = _compare(out, ref, visible, f"T={T} E={E} vis={vis}")
    rows = range(T) if T <= 64 else sorted({0, 1, 2, 3, T // 2, T // 2 + 1, T - 2, T - 1})
    for t in rows:  # the one-token program (its pair's second token absent) on the same row
        one = indexer.indexer_scores_bf16(q[t:t + 1], w[t:t + 1], keys)[0]
        if visible is not None:
            one = one.masked_fill(torch.arange(E, device="cuda") >= visible[t], float("-inf"))
        assert torch.equal(out[t].view(torch.int16), one.view(torch.int16)), t
    print(f"indexer_scores T={T} E={E} vis={vis}: {n} of {T * E} differ from the twin")
