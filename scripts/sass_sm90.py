"""Compile a Triton kernel for sm_90 on a machine without a GPU and read its SASS (instruction mix of the
hot loop, registers, shared memory, spills): the no-device-time half of METHOD.md's "read what costs no
device time". Used to compare FP4 expansion forms before spending device time on them.

    python scripts/sass_sm90.py fp4_v2_decode     # a named case below
    python scripts/sass_sm90.py --list

compile_sm90(fn, params, divisible) takes the kernel's parameters as {name: type string ("*u8", "*fp32",
"i32", "fp32") or constexpr value} and the names of pointer / integer parameters the launcher would
specialise as divisible by 16 (Triton does that for 16-aligned pointers and multiples of 16).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, params: dict, divisible: set[str] = frozenset(), num_warps: int = 4, num_stages: int = 3):
    if not isinstance(fn, JITFunction):  # a @fast_launch kernel: the JITFunction under launch.FastLaunch
        fn = fn.fn
    names = list(fn.arg_names)
    if "PDL" in names:  # every launched kernel's last parameter since 2026-12-06: off unless a case sets it
        params = {"PDL": False, **params}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = params[name]
        if isinstance(value, str):
            signature[name] = value
            if name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
            constexprs[name] = value
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")  # Triton's own


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump with `flag` on a cubin (written to a temporary file): also the CUDA kernels'
    NVRTC builds (tests/test_kernels_pdl_sass.py)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([CUOBJDUMP, flag, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def _cuobjdump(compiled, flag: str) -> str:
    return cuobjdump(compiled.asm["cubin"], flag)


def sass(compiled) -> str:
    return _cuobjdump(compiled, "-sass")


def resources(compiled) -> str:
    """cuobjdump's resource line (REG, SHARED, LOCAL = spill stack) of the kernel."""
    return " ".join(line.strip() for line in _cuobjdump(compiled, "-res-usage").splitlines() if "REG" in line)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


_TARGET = re.compile(r"0x([0-9a-f]+)")  # a branch's target address


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, whole line) of every SASS instruction."""
    out = []
    for line in text.splitlines():
        m = _INSTR.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), line.strip()))
    return out


def hottest_loop(ins: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The largest backward-branch body (the K loop, in these kernels)."""
    best = []
    for addr, op, line in ins:
        if op.startswith("BRA"):
            m = _TARGET.search(line.split("BRA", 1)[1])
            if m:
                target = int(m.group(1), 16)
                if target < addr:
                    body = [x for x in ins if target <= x[0] <= addr]
                    if len(body) > len(best):
                        best = body
    return best


def report(compiled, label: str) -> dict:
    text = sass(compiled)
    ins = instructions(text)
    loop = hottest_loop(ins)
    mix = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    meta = compiled.metadata
    res = dict(label=label, total=len(ins), loop=len(loop), shared=meta.shared, mix=dict(mix.most_common()))
    print(f"{label}: {len(ins)} instructions, hot loop {len(loop)}, shared {meta.shared} B; {resources(compiled)}")
    print("  " + ", ".join(f"{k} {v}" for k, v in mix.most_common(24)))
    return res


def _case_fp4_v2(bm, bn, expand, gated=True, num_stages=4):
    from deepinfer.kernels.triton.fp4_moe import _fp4_gemm_v2_kernel
    params = dict(a_ptr="*bf16", as_ptr="*bf16", w_ptr="*u8", ws_ptr="*u8", out_ptr="*bf16", route_w_ptr="*fp32",
                  sorted_slots_ptr="*i32", block_expert_ptr="*i32", n_slots="i32", N="i32", limit="fp32",
                  stride_am="i32", stride_asm="i32", stride_we="i32", stride_wn="i32", stride_wse="i32",
                  stride_wsn="i32", stride_om="i32", stride_os="i32", K_SPLIT=4096, A_ROW_DIV=6, ACT_BLOCK=128,
                  A_BF16=True, GATED=gated, SPLIT_OUT=False, KB=128, BM=bm, BN=bn, EXPAND=expand)
    div = {"a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "route_w_ptr", "sorted_slots_ptr", "block_expert_ptr",
           "N", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om"}
    return compile_sm90(_fp4_gemm_v2_kernel, params, div, num_warps=4, num_stages=num_stages)


def _case_fp4_fp8(bt, bw, gated=True, act_block=128, num_warps=4, num_stages=3, split=False):
    from deepinfer.kernels.triton.fp4_fp8_gemm import _fp4_fp8_gemm_kernel
    params = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*u8", ws_ptr="*u8", out_ptr="*fp32" if split else "*bf16",
                  route_w_ptr="*fp32", sorted_slots_ptr="*i32", block_expert_ptr="*i32", n_slots="i32", N="i32",
                  limit="fp32", stride_am="i32", stride_asm="i32", stride_we="i32", stride_wn="i32", stride_wse="i32",
                  stride_wsn="i32", stride_om="i32", stride_os="i32", K_SPLIT=4096, A_ROW_DIV=6, ACT_BLOCK=act_block,
                  GATED=gated and not split, SPLIT_OUT=split, BT=bt, BW=bw, ASM=True,
                  STEP_SUM=bw * bt // (32 * num_warps) <= 32)
    div = {"a_ptr", "as_ptr", "w_ptr", "ws_ptr", "out_ptr", "route_w_ptr", "sorted_slots_ptr", "block_expert_ptr",
           "N", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om"}
    return compile_sm90(_fp4_fp8_gemm_kernel, params, div, num_warps=num_warps, num_stages=num_stages)


def _case_gemv(m, n):
    """bf16_gemv's GEMV at its tile for M x N (K = 4096). 2026-12-06: x's run-time column stride had made its
    loads 2-byte scalars (32 LDG.U16 a thread at M=1 N=256); with unit stride they are LDG.128."""
    from deepinfer.kernels.triton.bf16_gemv import _gemv_kernel, _gemv_tiles
    t = _gemv_tiles(m, n, 4096)
    params = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32", M="i32", N="i32", K="i32", stride_xm="i32",
                  stride_wn="i32", stride_om="i32", scale="fp32", M_PAD=1 << (m - 1).bit_length(), BN=t["BN"],
                  BK=t["BK"], SCALED=False, PDL=True)
    return compile_sm90(_gemv_kernel, params,
                        {"x_ptr", "w_ptr", "out_ptr", "K", "stride_xm", "stride_wn", "stride_om"},
                        num_warps=t["num_warps"], num_stages=t["num_stages"])


def _case_gather(cols, rows):
    """act_quant's expert-operand gather (`_act_quant_gather_kernel`) for COLS columns and ROWS slots a program.
    2026-12-06: at V4.1's I = 2304 (256-column programs) one slot a program needed 4 barriers and shared-memory
    round trips for the wgmma K order; 4 slots a program (1024 columns' worth) need none (176 instructions)."""
    from deepinfer.kernels.triton.act_quant import _act_quant_gather_kernel
    params = dict(x_ptr="*bf16", out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32", n_slots="i32",
                  stride_xm="i32", stride_om="i32", ROW_DIV=6, BT=128, BLOCK=128, COLS=cols, QUANT=True,
                  DENSE=False, ROWS=rows, PDL=True)
    return compile_sm90(_act_quant_gather_kernel, params, {"x_ptr", "out_ptr", "stride_xm", "stride_om"}, num_warps=4,
                        num_stages=3)


def _case_indexer(has_vis=True):
    """`indexer_scores_bf16`'s kernel at V4's shapes (64 heads, d 128): a token pair x 8 key blocks a program
    (2026-12-06; before, one token x one block: the 8k prefill's 2 calls 3.1 ms on the H100)."""
    from deepinfer.kernels.triton.indexer import _indexer_scores_kernel
    params = dict(q_ptr="*bf16", w_ptr="*bf16", k_ptr="*bf16", vis_ptr="*i64", out_ptr="*bf16", T="i32", NH="i32",
                  E="i32", stride_qt="i32", stride_qh="i32", stride_wt="i32", stride_ke="i32", stride_ot="i32", D=128,
                  BLOCK_H=64, BLOCK_E=64, CHUNK=8, HAS_VIS=has_vis, INTERPRET=False, PDL=True)
    return compile_sm90(_indexer_scores_kernel, params,
                        {"q_ptr", "w_ptr", "k_ptr", "vis_ptr", "out_ptr", "E", "stride_qt", "stride_qh", "stride_wt",
                         "stride_ke", "stride_ot"}, num_warps=4, num_stages=3)


def _case_indexer_paged():
    """`indexer_scores_paged_bf16`'s kernel (the batched decode's scores from the packed FP4 key cache) at V4's
    shapes: one program a sequence's 64 entries, the same `head_sum` as the pair kernel (68-byte rows)."""
    from deepinfer.kernels.triton.indexer import _indexer_scores_paged_kernel
    params = dict(q_ptr="*bf16", w_ptr="*bf16", store_ptr="*u8", rows_ptr="*i64", hidden_ptr="*u8", out_ptr="*bf16",
                  NH="i32", E="i32", stride_qb="i32", stride_qh="i32", stride_wb="i32", stride_rb="i32",
                  stride_hb="i32", stride_ob="i32", STRIDE_S=68, D=128, NB=4, HALF=16, BLOCK_H=64, BLOCK_E=64,
                  INTERPRET=False, PDL=True)
    return compile_sm90(_indexer_scores_paged_kernel, params,
                        {"q_ptr", "w_ptr", "store_ptr", "rows_ptr", "hidden_ptr", "out_ptr", "E", "stride_qb",
                         "stride_qh", "stride_wb", "stride_rb", "stride_hb", "stride_ob"}, num_warps=4)


def _case_stable_topk_rows(kp, wp=128):
    """`stable_topk_rows`' kernel: `_stable_topk_kernel`'s selection and sort, the picks mapped to the attention's
    index rows and the window's copied (V4: k 512, a 128-row window)."""
    from deepinfer.kernels.triton.topk_positions import BLOCK, _stable_topk_rows_kernel
    ptrs = dict(s_ptr="*bf16", win_ptr="*i64", vis_ptr="*i64", entry_ptr="*i64", out_ptr="*i64")
    params = dict(ptrs, E="i32", k="i32", W="i32", n_ring="i32", stride_s="i32", stride_w="i32", stride_e="i32",
                  stride_o="i32", BLOCK=BLOCK, KP=kp, WP=wp, PDL=True)
    return compile_sm90(_stable_topk_rows_kernel, params, set(ptrs) | {"stride_s", "stride_w", "stride_e", "stride_o"},
                        num_warps=4)


def _case_attn_paged(split, qnorm):
    """`_sparse_attn_paged_kernel` (the batched decode's sparse attention from the packed FP8 caches) at V4's
    shapes: 16 heads of 512, a 64-channel rope tail, E8M0 per 64; split (b1's flash-decoding) or not, with the
    query's head norm and RoPE on its load (QNORM) or not."""
    from deepinfer.kernels.triton.sparse_attn_paged import _sparse_attn_paged_kernel
    ptrs = dict(q_ptr="*bf16", ring_ptr="*u8", comp_ptr="*u8", ring16_ptr="*i16", comp16_ptr="*i16", sink_ptr="*fp32",
                idx_ptr="*i64", out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
                cos_ptr="*fp32", sin_ptr="*fp32")
    params = dict(ptrs, H="i32", K="i32", n_ring="i32", scale="fp32", initial_max="fp32", chunk="i32",
                  qnorm_eps="fp32", stride_qt="i32", stride_qh="i32", stride_it="i32", stride_ot="i32",
                  stride_oh="i32", BPT=584, QDIM=448, SBLOCK=64, D=512, BLOCK_H=16, BLOCK_K=64, SPLIT=split,
                  INTERPRET=False, ROPE_HALF=32, QNORM=qnorm, PDL=True)
    return compile_sm90(_sparse_attn_paged_kernel, params,
                        set(ptrs) | {"stride_qt", "stride_qh", "stride_ot", "stride_oh"}, num_warps=8, num_stages=1)


def _case_stable_topk(kp):
    """`stable_topk`'s kernel (selection passes, then the sort of the KP-padded picks) at V4's k = 512 / 1024."""
    from deepinfer.kernels.triton.topk_positions import BLOCK, _stable_topk_kernel
    params = dict(s_ptr="*bf16", out_ptr="*i64", E="i32", k="i32", stride_s="i32", stride_o="i32", BLOCK=BLOCK,
                  KP=kp, PDL=True)
    return compile_sm90(_stable_topk_kernel, params, {"s_ptr", "out_ptr", "stride_s", "stride_o"}, num_warps=4)


def _case_compress_decode(r, w, overlap, block_c, warps, store=False):
    """`_compress_decode_kernel` (one decode row through a compressor) at V4's main compressor (w 512): ratio
    4 with overlap (8 state rows) and ratio 128 (128), the pooling pass's channels BLOCK_C; store: the STORE
    form (the entry's RoPE and packed bytes into the cache: V4's layout, 448 E4M3 channels in 7 blocks of 64, a
    64-channel bf16 tail, 584 bytes a row)."""
    from deepinfer.kernels.triton.compress_decode import _compress_decode_kernel
    c = 2 if overlap else 1
    params = dict(kv_ptr="*fp32", gate_ptr="*fp32", ape_ptr="*fp32", skv_ptr="*fp32", ssc_ptr="*fp32",
                  slot_ptr="*i64", pos_ptr="*i64", done_ptr="*u8", nw_ptr="*bf16", out_ptr="*bf16", eps="fp32",
                  stride_kv="i32", stride_gate="i32", stride_s="i32", stride_r="i32", stride_slot="i32",
                  stride_pos="i32", stride_done="i32", cos_ptr="*fp32", sin_ptr="*fp32", rows_ptr="*i64",
                  out8_ptr="*u8", out16_ptr="*i16", BPT="i32", R=r, W=w, OVERLAP=overlap, BLOCK_R=c * r,
                  BLOCK_C=block_c, BLOCK_S=min(1024, c * w), BLOCK_W=w, STORE=store, QDIM=448 if store else 0,
                  SBLOCK=64 if store else 1, NB=7 if store else 1, HALF=32 if store else 1, PAD=0, PDL=True)
    return compile_sm90(_compress_decode_kernel, params, {"kv_ptr", "gate_ptr", "ape_ptr", "skv_ptr", "ssc_ptr",
                                                          "out_ptr", "stride_kv", "stride_gate", "stride_s",
                                                          "stride_r"}, num_warps=warps, num_stages=1)


def _case_qkv_store(splits):
    """`_qkv_norm_rope_store_kernel` at V4-Flash's shapes (q LoRA 1024; kv 512: 448 E4M3 channels in 7 blocks
    of 64 and a 64-channel bf16 tail, 584 bytes a ring row), its q and kv bf16 (splits 1) or the stacked
    wq_a | wkv's fp32 split-K partials (splits 16: `split_k_load.load_summed`); the parameters a tree without
    the partials does not have are ignored (for before / after builds)."""
    from deepinfer.kernels.triton.attn_norm_rope import _qkv_norm_rope_store_kernel
    op = "*bf16" if splits == 1 else "*fp32"
    params = dict(q_ptr=op, kv_ptr=op, qw_ptr="*bf16", kvw_ptr="*bf16", qr_ptr="*bf16", cos_ptr="*fp32",
                  sin_ptr="*fp32", rows_ptr="*i64", out8_ptr="*u8", out16_ptr="*i16", eps="fp32", stride_q="i32",
                  stride_kv="i32", stride_qr="i32", BPT="i32", stride_s="i32", S=splits, NQ=1024, BLOCK_Q=1024,
                  BLOCK_D=512, QDIM=448, BLOCK=64, NB=7, NB_P2=8, HALF=32, PAD=0, TWO_PROGRAMS=splits > 1, PDL=True)
    return compile_sm90(_qkv_norm_rope_store_kernel, params, {"q_ptr", "kv_ptr", "qw_ptr", "kvw_ptr", "qr_ptr",
                                                              "stride_q", "stride_kv", "stride_s"},
                        num_warps=4, num_stages=3)


def _case_swiglu(splits):
    """`_swiglu_kernel` on the shared expert's w1 | w3 (N 2048) at decode, bf16 (splits 1, 1024 columns a program)
    or fp32 split-K partials (16, 256 columns a program); parameters a tree without them does not have are ignored."""
    from deepinfer.kernels.triton.swiglu import _swiglu_kernel
    op = "*bf16" if splits == 1 else "*fp32"
    params = dict(g_ptr=op, u_ptr=op, w_ptr="*bf16", out_ptr="*bf16", N="i32", stride_g="i32", stride_u="i32",
                  stride_o="i32", limit="fp32", stride_s="i32", S=splits, HAS_WEIGHT=False,
                  BLOCK=1024 if splits == 1 else 256, PDL=True)
    return compile_sm90(_swiglu_kernel, params, {"g_ptr", "u_ptr", "out_ptr", "N", "stride_g", "stride_u", "stride_o",
                                                 "stride_s"}, num_warps=4, num_stages=3)


def _case_hc_post_mix(splits, pin=False):
    """`_hc_post_mix_partial_kernel`'s decode plan (16 tokens a block, one 64-column step a program, D 4096,
    hc 4, 24 mixes; T = 1, as Triton specializes it at b1), its f bf16 (splits 1) or wo_b's fp32 split-K partials (16); parameters a tree without
    them does not have are ignored."""
    from deepinfer.kernels.triton.norm_hc import _hc_post_mix_partial_kernel
    params = dict(f_ptr="*bf16" if splits == 1 else "*fp32", r_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32",
                  x_ptr="*bf16", fn_ptr="*fp32", part_ptr="*fp32", ssq_ptr="*fp32", T=1, D="i32", KD="i32",
                  n_out="i32", k_chunk="i32", stride_f="i32", stride_fs="i32", FS=splits, HC=4, BLOCK_T=16,
                  BLOCK_O=32, BLOCK_K=64, INTERPRET=False, PIN_F=pin, PDL=True)
    return compile_sm90(_hc_post_mix_partial_kernel, params, {"f_ptr", "r_ptr", "x_ptr", "fn_ptr", "part_ptr", "D",
                                                              "KD", "k_chunk", "stride_f", "stride_fs"},
                        num_warps=4, num_stages=1)


def _case_hc_collapse(sp, warps, head=False, deferred=False):
    """`_hc_sinkhorn_collapse_kernel` at D = 4096 with SP split partials and the collapse's warps (decode:
    128-256 splits, prefill: 4; 16 warps): a token's collapse program and its Sinkhorn program."""
    from deepinfer.kernels.triton.norm_hc import _hc_sinkhorn_collapse_kernel
    params = dict(part_ptr="*fp32", ssq_ptr="*fp32", scale_ptr="*fp32", base_ptr="*fp32", x_ptr="*bf16",
                  nw_ptr="*fp32", y_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", pre_in_ptr="*fp32",
                  pre_out_ptr="*fp32", T="i32", D="i32", splits="i32", iters="i32", hc_eps="fp32", norm_eps="fp32",
                  HC=4, BLOCK_D=4096, SP=sp, HEAD=head, DEFERRED=deferred, PDL=True)
    return compile_sm90(_hc_sinkhorn_collapse_kernel, params,
                        {"part_ptr", "ssq_ptr", "x_ptr", "nw_ptr", "y_ptr", "post_ptr", "comb_ptr", "D"},
                        num_warps=warps, num_stages=3)


def _case_indexer_q_rotate(warps):
    """`_indexer_q_rotate_kernel` on V4-Flash's indexer query (64 heads of 128, a 64-channel rope tail): one
    program is the Hadamard tile's 64 rows (at decode b1 the whole call)."""
    from deepinfer.kernels.triton.indexer_rotate import _indexer_q_rotate_kernel
    params = dict(x_ptr="*bf16", h_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", out_ptr="*bf16", M="i32",
                  heads="i32", stride_x="i32", scale="fp32", D=128, HALF=32, BM=64, INTERPRET=False, PDL=True)
    return compile_sm90(_indexer_q_rotate_kernel, params,
                        {"x_ptr", "h_ptr", "cos_ptr", "sin_ptr", "out_ptr", "stride_x"}, num_warps=warps)


def _case_moe_route(d, e, k, ab, hashed=False, packed=False):
    """moe_route's fused decode kernel at one row (GEMV tiles of M=1 N=E, then act_quant, the last program's
    gate and slot blocks); packed: the gate's packed-key top-k (DEEPINFER_GATE_PACKED_KEY)."""
    from deepinfer.kernels.triton import fp4_moe
    from deepinfer.kernels.triton.bf16_gemv import _gemv_tiles
    from deepinfer.kernels.triton.moe_route import FUSED_WARPS, ROUTE_BLOCK_M, _route_kernel
    t = _gemv_tiles(1, e, d)
    n_blocks = fp4_moe.n_routing_blocks(k, e, ROUTE_BLOCK_M)
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", logits_ptr="*fp32", bias_ptr="*fp32", tid_ptr="*i32", ids_ptr="*i64",
                wout_ptr="*fp32", idx_ptr="*i64", sorted_ptr="*i32", block_expert_ptr="*i32", xa_ptr="*bf16",
                counter_ptr="*i32")
    params = dict(ptrs, M="i32", E="i32", D="i32", stride_xm="i32", stride_wn="i32", stride_tid="i32",
                  stride_xam="i32", route_scale="fp32", norm_eps="fp32", n_blocks="i32",
                  n_groups="i32", M_PAD=1, BN=t["BN"], BK=t["BK"], TOPK=k, K_P2=1 << (k - 1).bit_length(),
                  E_P2=1 << (e - 1).bit_length(), AB=ab, ACT_ITERS=1, HASH=hashed, BM=ROUTE_BLOCK_M,
                  PACKED=packed, **fp4_moe.align_small_sizes(k, e, n_blocks, ROUTE_BLOCK_M), PDL=True)
    return compile_sm90(_route_kernel, params, set(ptrs) | {"D", "stride_xm", "stride_wn", "stride_xam"},
                        num_warps=FUSED_WARPS, num_stages=t["num_stages"])


CASES = {
    "indexer_q_rotate_w4": lambda: _case_indexer_q_rotate(4),
    "indexer_q_rotate_w8": lambda: _case_indexer_q_rotate(8),
    "indexer_q_rotate_w16": lambda: _case_indexer_q_rotate(16),
    "qkv_store": lambda: _case_qkv_store(1),
    "qkv_store_split16": lambda: _case_qkv_store(16),
    "swiglu": lambda: _case_swiglu(1),
    "swiglu_split16": lambda: _case_swiglu(16),
    "hc_post_mix": lambda: _case_hc_post_mix(1),
    "hc_post_mix_split16": lambda: _case_hc_post_mix(16),
    "hc_post_mix_pinned": lambda: _case_hc_post_mix(1, pin=True),
    "hc_collapse_decode": lambda: _case_hc_collapse(256, 16),
    "hc_collapse_prefill": lambda: _case_hc_collapse(4, 16),
    "hc_collapse_head": lambda: _case_hc_collapse(4, 16, head=True),
    "indexer_pair": _case_indexer,
    "indexer_paged": _case_indexer_paged,
    "attn_paged_split": lambda: _case_attn_paged(True, False),
    "attn_paged_split_qnorm": lambda: _case_attn_paged(True, True),
    "attn_paged_qnorm": lambda: _case_attn_paged(False, True),
    "compress_decode_r4": lambda: _case_compress_decode(4, 512, True, 512, 8),
    "compress_decode_r4_c128": lambda: _case_compress_decode(4, 512, True, 128, 4),
    "compress_decode_r128": lambda: _case_compress_decode(128, 512, False, 64, 8),
    "compress_decode_r4_store": lambda: _case_compress_decode(4, 512, True, 512, 8, store=True),
    "compress_decode_r128_store": lambda: _case_compress_decode(128, 512, False, 64, 8, store=True),
    "stable_topk_512": lambda: _case_stable_topk(512),
    "stable_topk_rows_512": lambda: _case_stable_topk_rows(512),
    "stable_topk_1024": lambda: _case_stable_topk(1024),
    "stable_topk_4096": lambda: _case_stable_topk(4096),
    "gather_256_rows1": lambda: _case_gather(256, 1),
    "gather_256_rows4": lambda: _case_gather(256, 4),
    "gemv_m1_n256": lambda: _case_gemv(1, 256),
    "moe_route_v4": lambda: _case_moe_route(4096, 256, 6, 128),
    "moe_route_v4_hash": lambda: _case_moe_route(4096, 256, 6, 128, hashed=True),
    "moe_route_v41": lambda: _case_moe_route(5120, 384, 6, 32),
    "moe_route_v4_packed": lambda: _case_moe_route(4096, 256, 6, 128, packed=True),
    "moe_route_v41_packed": lambda: _case_moe_route(5120, 384, 6, 32, packed=True),
    "gemv_m1_n2048": lambda: _case_gemv(1, 2048),
    "fp4_v2_decode": lambda: _case_fp4_v2(16, 128, 6),
    "fp4_v2_decode_e5": lambda: _case_fp4_v2(16, 128, 5),
    "fp4_fp8_decode": lambda: _case_fp4_fp8(16, 128),
    "fp4_fp8_decode_bw64": lambda: _case_fp4_fp8(16, 64),
    "fp4_fp8_decode_8w": lambda: _case_fp4_fp8(16, 256, num_warps=8),
    "fp4_fp8_decode_ab32": lambda: _case_fp4_fp8(16, 128, act_block=32),
    "fp4_fp8_split": lambda: _case_fp4_fp8(16, 128, split=True),
    "fp4_fp8_prefill": lambda: _case_fp4_fp8(128, 128, num_warps=8),
    "fp4_v2_prefill": lambda: _case_fp4_v2(128, 256, 6, num_stages=3),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*")
    p.add_argument("--list", action="store_true")
    p.add_argument("--dump", help="write the SASS of the (single) case here")
    a = p.parse_args(argv)
    if a.list or not a.cases:
        print("\n".join(CASES))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in a.cases:
        compiled = CASES[name]()
        report(compiled, name)
        if a.dump:
            with open(a.dump, "w") as f:
                f.write(sass(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
