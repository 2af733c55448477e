// Sparse attention with the sink for the prefill / extend regime on Hopper's warpgroup MMA (sm_90a only): the
// CUDA form of `kernels/triton/sparse_attn.py` (`_sparse_attn_sink_kernel`), the official kernel's math.
//
// Contract (the twin: kernels.official.sparse_attn_sink_official): for token t and head h,
//   out[t, h] = bf16( acc / (sum + exp(sink[h] - run_max)) ),
// after the online softmax over the index row idx[t, :] in blocks of 64 IN INDEX ORDER: per block,
//   s = (bf16 q . bf16 kv, fp32 sum) * scale, -inf where idx < 0 (or past K),
//   new_max = max(run_max, max_k s), rescale = exp(run_max - new_max), p = exp(s - new_max),
//   sum = sum * rescale + sum_k p, acc = acc * rescale + bf16(p) . kv, run_max = new_max,
// run_max starting at `initial_max` (-inf for V4, -1e30 for V4.1). exp is Triton's tl.exp for fp32:
// ex2.approx(x * log2 e). The kv row is both key and value (one kv head shared by every query head).
// The fp32 sums' order differs from the Triton form's (the tensor cores' own order, the row sums split over
// lanes and warpgroups): the GPU test holds both to the twin at the bf16 level.
//
// A block whose 64 indices are all invalid, once an earlier block had a valid one, is skipped: its step is then
// exactly the identity (rescale exp(0) = 1, p = 0), so the result's bits do not change. With a -inf running max
// (no valid index yet) the step runs, as the official kernel's does.
//
// Work items: (token, block of 64 heads); d = 512. A persistent CTA an SM walks items blockIdx.x, + gridDim.x, ...
// (its ring's run counter going on across them, so the next item's first kv block and q load while this item's
// last block and output finish). Three warpgroups:
// * the producer (warpgroup 2, its registers handed to the consumers by setmaxnreg) gathers each block's 64 kv
//   rows (by index; -1 rows zero-filled) and the item's 64 q rows (once the previous item's S are all done) with
//   16-byte cp.async into shared memory, in wgmma's 128-byte-swizzled K-major layout: 8 planes of 64 dims, each
//   64 rows x 128 bytes. A ring of STAGES blocks; cp.async.mbarrier.arrive.noinc signals a stage (or q) full.
// * consumer warpgroup w in {0, 1} computes S for keys 32w .. 32w + 31 of the block over all 512 dims
//   (m64n32k16, q and the kv rows both from shared memory), and the output's dims 256w .. 256w + 255 (two
//   m64n128 accumulators, 128 registers a lane). The row max is exchanged through shared memory (one named
//   barrier), each warpgroup writes its half of P (bf16) into a shared 64 x 64 tile (the A operand, K-major,
//   swizzled), and both multiply the whole P by their half of V: the same kv tile read MN-major (wgmma's
//   transposed B; the planes are the 64-column groups, LBO 8 KB, the 8-key groups SBO 1 KB).
//   The loop: wait the previous block's P.V and free its stage (the producer starts the next-but-one block while
//   this block's S finishes) -> wait this block's S -> softmax -> P into shared memory -> issue P.V -> wait the
//   next stage, issue its S. Two stages are all that fit beside q (64 KB + 2 x 64 KB + P), so a block's gather
//   overlaps the previous block's S, softmax and P.V.
// Launch: grid min(items, SMs), 384 threads, dynamic shared memory `sparse_attn_wgmma.smem_bytes` (one CTA an SM).
// Requires (the launcher checks): H % 64 == 0, d == 512, 16-byte aligned q / kv rows, idx int32 with unit stride.
//
// QNORM 1: q is the raw query projection. Once an item's q rows have landed, the consumers norm them in shared
// memory before its first S: each head's RMSNorm and the RoPE of its last 2 ROPE_HALF dims at the token (`qcos` /
// `qsin`: rope_table32's rows [T, ROPE_HALF]), the arithmetic of `attn_norm_rope._head_rms_norm_rope_kernel` (the
// separate launch it replaces, a full read and write of q): sq = bf16(x x) per value, their fp32 sum, mean =
// bf16(sum / 512), v = bf16(mean + eps), r = bf16(rsqrt.approx.ftz(v)), y = bf16(x r); the tail's pairs (re, im)
// -> bf16(fma(re, c, -(im s))), bf16(fma(im, c, re s)), as Triton builds `re * c - im * s` / `re * s + im * c`
// there (its sm_90 PTX). The fp32 sum's order is this kernel's (4 lanes a row, 128 dims each in order, then
// (l0 + l1) + (l2 + l3)), not Triton's tile reduction, so a row's bf16 mean may round the other way now and
// then (norm_hc.head_rms_norm's note); everything after it is the same arithmetic.

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef STAGES
#define STAGES 2
#endif
#ifndef PIPELINED_QK
#define PIPELINED_QK 1  // 1: the output accumulators pinned at their zeroing, so ptxas keeps the wgmma pipeline;
#endif                  // 0: the build ptxas serializes (C7515), kept for the detector's test and the bench
#ifndef MN_SWAP
#define MN_SWAP 0  // 1: the transposed operand's LBO and SBO exchanged (a layout check for the GPU test)
#endif
#ifndef QNORM
#define QNORM 0  // 1: the raw q rows normed and rotated in shared memory first (see above)
#endif
#define ROPE_HALF 32  // the query's rope pairs (V4: 64 rope dims of 512, the last plane)
#define HD 512                 // head dim
#define BH 64                  // heads a CTA
#define BK 64                  // indices a block (the official kernel's)
#define PLANE (BH * 128)       // 64 rows x 64 bf16: one swizzle-atom column
#define Q_BYTES (8 * PLANE)    // 64 KB
#define KV_BYTES (8 * PLANE)   // one ring stage: 64 kv rows x 512 bf16
#define P_BYTES (BH * BK * 2)  // 8 KB
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#define BAR_MAX 1  // named barriers of the 256 consumer threads (0 is __syncthreads)
#define BAR_P 2
#define BAR_SUM 3
#define BAR_QN 4
#define NEG_INF (-__int_as_float(0x7f800000))

// d (+)= A (shared: 64 rows x 16 bf16, K-major, swizzled) @ B (shared: 32 rows x 16 bf16, K-major); scale_d 0:
// a fresh sum
__device__ __forceinline__ void wgmma_qk(float (&d)[16], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" WGMMA_REGS16 "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : WGMMA_D16
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d += A (shared: 64 rows x 16 bf16, K-major) @ B (shared: 16 K rows x 128 N, MN-major: transposed)
__device__ __forceinline__ void wgmma_pv(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_REGS64 "}, %64, %65, p, 1, 1, 0, 1;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(1));
}

// the 128-byte-swizzle descriptor of an MN-major operand laid out in planes: 64 N columns a plane (the next at
// LBO = one plane), 8 K rows of 128 bytes an atom (the next at SBO = 1024)
__device__ __forceinline__ u64 desc_sw128_mn(u32 addr) {
    const u64 lbo = MN_SWAP ? 1024 : PLANE, sbo = MN_SWAP ? PLANE : 1024;
    return (u64)((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | ((u64)1 << 62);
}

// Triton's tl.exp for fp32
__device__ __forceinline__ float tl_exp(float x) {
    const float y = x * 1.4426950408889634f;
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(y));
    return r;
}

__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }

// 16 bytes global -> shared, zero-filled when !valid (src must still be a mapped address)
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// the byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled plane (64 rows x 128 bytes, 1024-byte
// aligned): the chunk index XOR the row's place in its 8-row atom, as wgmma's SW128 descriptors read it
__device__ __forceinline__ u32 sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// 16-byte piece `chunk` of each of the 8 planes (64 dims each) of one 512-dim row: src (the row's piece `chunk`)
// -> row `row` of the 8 planes at dst, zero-filled when !valid
__device__ __forceinline__ void copy_row(unsigned char* dst, int row, int chunk, const u16* src, bool valid) {
    const u32 d = smem_u32(dst + sw128(row, chunk));
#pragma unroll
    for (int c = 0; c < 8; ++c) cp16(d + c * PLANE, src + c * 64, valid);
}

// v[rr] (the lane's two rows) reduced over its quad by op, then published by the quad's first lane at dst[r0] and
// dst[r0 + 8]
template <typename Op>
__device__ __forceinline__ void quad_publish(float (&v)[2], Op op, float* dst, int r0, int t) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        v[rr] = op(v[rr], __shfl_xor_sync(0xffffffffu, v[rr], 1));
        v[rr] = op(v[rr], __shfl_xor_sync(0xffffffffu, v[rr], 2));
    }
    if (t == 0) {
        dst[r0] = v[0];
        dst[r0 + 8] = v[1];
    }
}

// an arrival on `bar` once this thread's earlier cp.asyncs have landed (counted in the barrier's init count)
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// block b's validity as two warp ballots: bit l of even = index 2l valid, of odd = index 2l + 1 (every lane of
// the warp gets the same two words)
__device__ __forceinline__ void block_masks(const int* __restrict__ idx_row, int K, int b, int lane, u32& even,
                                            u32& odd) {
    const int k0 = b * BK + 2 * lane;
    const int i0 = k0 < K ? idx_row[k0] : -1;
    const int i1 = k0 + 1 < K ? idx_row[k0 + 1] : -1;
    even = __ballot_sync(0xffffffffu, i0 >= 0);
    odd = __ballot_sync(0xffffffffu, i1 >= 0);
}

// the next block at or after b to run: all-invalid blocks are skipped once `seen` (a valid index earlier)
__device__ __forceinline__ int next_block(const int* __restrict__ idx_row, int K, int nb, int b, bool seen, int lane,
                                          u32& even, u32& odd) {
    for (; b < nb; ++b) {
        block_masks(idx_row, K, b, lane, even, odd);
        if (!seen || (even | odd)) return b;
    }
    return nb;
}

#if QNORM
__device__ __forceinline__ float bf16_rn(float x) {  // cvt.rn to bf16 and back: Triton's .to(tl.bfloat16)
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return __uint_as_float((u32)h << 16);
}

// the 8 bf16 of a 16-byte chunk as fp32
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

// The consumers' pass over the item's q rows (QNORM, above): 256 threads, 4 a row (head), each 2 planes = 128 dims
// of it, read twice from shared memory (the sum of squares, then the normed values written back), so no
// register holds more than a chunk beside the pinned accumulators.
__device__ __forceinline__ void norm_rope_q(unsigned char* q_s, int ctid, const float* __restrict__ cos_row,
                                            const float* __restrict__ sin_row, float eps) {
    const int row = ctid >> 2, part = ctid & 3;
    float ss = 0.f;
#pragma unroll
    for (int pl = 0; pl < 2; ++pl)
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            float f[8];
            unpack8(*reinterpret_cast<const uint4*>(q_s + (2 * part + pl) * PLANE + sw128(row, c)), f);
#pragma unroll
            for (int i = 0; i < 8; ++i) ss += bf16_rn(f[i] * f[i]);
        }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    const float mean = bf16_rn(ss * (1.0f / HD));
    const float v = bf16_rn(mean + eps);
    float r;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    r = bf16_rn(r);
#pragma unroll
    for (int pl = 0; pl < 2; ++pl) {
        const int plane = 2 * part + pl;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            uint4* chunk = reinterpret_cast<uint4*>(q_s + plane * PLANE + sw128(row, c));
            float f[8];
            unpack8(*chunk, f);
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = bf16_rn(f[i] * r);
            if (plane * 64 + 8 * c >= HD - 2 * ROPE_HALF) {  // the rope tail: pairs (2i, 2i + 1) of its dims
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int pair = (plane * 64 + 8 * c - (HD - 2 * ROPE_HALF)) / 2 + j;
                    const float cs = cos_row[pair], sn = sin_row[pair], re = f[2 * j], im = f[2 * j + 1];
                    f[2 * j] = bf16_rn(fmaf(re, cs, -(im * sn)));
                    f[2 * j + 1] = bf16_rn(fmaf(im, cs, re * sn));
                }
            }
            *chunk = make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                                pack_bf16x2(f[6], f[7]));
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(384, 1)
sparse_attn_wgmma(const u16* __restrict__ q, const u16* __restrict__ kv, const float* __restrict__ sink,
                  const int* __restrict__ idx, u16* __restrict__ out, int T, int H, int K, float scale,
                  float initial_max, i64 stride_qt, i64 stride_qh, i64 stride_kvn, i64 stride_it, i64 stride_ot,
                  i64 stride_oh, const float* __restrict__ qcos, const float* __restrict__ qsin, float qnorm_eps) {
    const int hblocks = H / BH, items = T * hblocks;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nb = (K + BK - 1) / BK;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);
    unsigned char* q_s = smem;                                   // [8 planes][64 heads][128 B]
    unsigned char* kv_s = smem + Q_BYTES;                        // [STAGES][8 planes][64 rows][128 B]
    unsigned char* p_s = kv_s + STAGES * KV_BYTES;               // [2][64 heads][128 B]
    float* max_s = reinterpret_cast<float*>(p_s + 2 * P_BYTES);  // [2 warpgroups][64]
    float* sum_s = max_s + 2 * BH;                               // [2][64]
    u64* bars = reinterpret_cast<u64*>(sum_s + 2 * BH);
    const u32 q_full = smem_u32(&bars[0]), q_empty = smem_u32(&bars[1]);
    const u32 full0 = smem_u32(&bars[2]), empty0 = smem_u32(&bars[2 + STAGES]);

    if (threadIdx.x == 0) {
        // q_full and full: the 128 producer threads' cp.async arrivals; q_empty and empty: every consumer thread's
        mbar_init(q_full, 128);
        mbar_init(q_empty, 256);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 128);
            mbar_init(empty0 + 8 * s, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    pdl_enter();  // q, kv and idx are the previous kernels' outputs
    const bool finite_start = initial_max > NEG_INF;  // V4.1: every step is exact even before a valid index

    // A CTA an SM walks the items (token, 64-head block) blockIdx.x, + gridDim.x, ...; the ring's run counter n
    // goes on across them, so the next item's q and first block load while this one's last block and output finish.
    if (warp >= 8) {
        // ---------------------------------------------------------------- producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        const int pt = threadIdx.x - 256, chunk = pt & 7, grp = pt >> 3;  // 16 groups of 8: one 128-byte row piece
        int n = 0, item_no = 0;
        for (int item = blockIdx.x; item < items; item += gridDim.x, ++item_no) {
            const int tok = item / hblocks, h0 = (item % hblocks) * BH;
            const int* idx_row = idx + (i64)tok * stride_it;
            // q once the consumers are done with the previous item's (after this item's first kv block)
            auto load_q = [&]() {
                if (item_no > 0) mbar_wait(q_empty, (item_no - 1) & 1);
                const u16* q_tok = q + (i64)tok * stride_qt + (i64)h0 * stride_qh;
                for (int i = 0; i < 4; ++i) {
                    const int row = 16 * i + grp;
                    copy_row(q_s, row, chunk, q_tok + (i64)row * stride_qh + chunk * 8, true);
                }
                cp_async_arrive(q_full);
            };
            bool seen = finite_start, q_loaded = false;
            u32 even, odd;
            for (int b = next_block(idx_row, K, nb, 0, seen, lane, even, odd); b < nb;
                 b = next_block(idx_row, K, nb, b + 1, seen, lane, even, odd), ++n) {
                const int s = n % STAGES;
                if (n >= STAGES) mbar_wait(empty0 + 8 * s, ((n / STAGES) & 1) ^ 1);
                unsigned char* stage = kv_s + s * KV_BYTES;
                int r[4];
                for (int i = 0; i < 4; ++i) {
                    const int k = b * BK + 16 * i + grp;
                    r[i] = k < K ? idx_row[k] : -1;
                }
                for (int i = 0; i < 4; ++i)
                    copy_row(stage, 16 * i + grp, chunk, kv + (r[i] >= 0 ? (i64)r[i] * stride_kvn : 0) + chunk * 8,
                             r[i] >= 0);
                cp_async_arrive(full0 + 8 * s);
                seen = seen || (even | odd);
                if (!q_loaded) {
                    load_q();
                    q_loaded = true;
                }
            }
            if (!q_loaded) load_q();
        }
        return;
    }

    // -------------------------------------------------------------------- consumer warpgroups
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    const int w = warp >> 2, wi = warp & 3, g = lane >> 2, t = lane & 3;
    const int r0 = wi * 16 + g;  // the lane's rows (heads) r0 and r0 + 8 of the CTA's 64
    const u32 q_base = smem_u32(q_s), kv_base = smem_u32(kv_s), p_base = smem_u32(p_s);
    float o[2][64], sacc[16];

    // S for the n-th block run (stage s): keys 32w .. 32w + 31 over 512 dims (32 k16 steps, one commit group).
    // (Issuing each half of the dims once its planes had landed, two full barriers a stage, was ~3% slower on an
    // H100: BENCHMARKS.md, "thirty-sixth session".)
    auto issue_qk = [&](int s, int n) {
        mbar_wait(full0 + 8 * s, (n / STAGES) & 1);
        fence_async_smem();
        keep_all(sacc);
        wgmma_fence();
        const u32 kb = kv_base + s * KV_BYTES + w * 32 * 128;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            const u32 off = (kk >> 2) * PLANE + (kk & 3) * 32;
            wgmma_qk(sacc, desc_sw128(q_base + off), desc_sw128(kb + off), kk);
        }
        wgmma_commit();
    };
    // O[:, 256w ..] += P (shared tile pb) @ V (stage s's planes 4w .. 4w + 3), 4 k16 steps x 2 N halves
    auto issue_pv = [&](int s, u32 pb) {
        keep_all(o[0]);
        keep_all(o[1]);
        wgmma_fence();
        const u32 vb = kv_base + s * KV_BYTES + 4 * w * PLANE;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            wgmma_pv(o[0], desc_sw128(pb + kk * 32), desc_sw128_mn(vb + kk * 2048));
            wgmma_pv(o[1], desc_sw128(pb + kk * 32), desc_sw128_mn(vb + 2 * PLANE + kk * 2048));
        }
        wgmma_commit();
    };

    int n = 0, item_no = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x, ++item_no) {
        const int tok = item / hblocks, h0 = (item % hblocks) * BH;
        const int* idx_row = idx + (i64)tok * stride_it;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 64; ++i) o[h][i] = 0.f;
#if PIPELINED_QK
        keep_all(o[0]);  // zeroed here, not after the first S is issued (ptxas serializes the wgmmas then, C7515)
        keep_all(o[1]);
#endif
        float run_max[2] = {initial_max, initial_max}, run_sum[2] = {0.f, 0.f};  // run_sum: this lane's columns
        bool seen = finite_start;
        u32 even, odd;
        int b = next_block(idx_row, K, nb, 0, seen, lane, even, odd);
        const int first = n;
        mbar_wait(q_full, item_no & 1);
#if QNORM
        norm_rope_q(q_s, threadIdx.x, qcos + (i64)tok * ROPE_HALF, qsin + (i64)tok * ROPE_HALF, qnorm_eps);
        fence_async_smem();  // the normed rows, visible to the wgmmas (the async proxy) that read them
        named_sync(BAR_QN);  // every row is done before either warpgroup's S reads all 64
#endif
        if (b < nb) issue_qk(n % STAGES, n);
        for (; b < nb; ++n) {
            const int s = n % STAGES;
            wgmma_wait<1>();  // the previous block's P.V (its stage is free once both warpgroups are past this)
            if (n > first) mbar_arrive(empty0 + 8 * ((n - 1) % STAGES));
            wgmma_wait<0>();  // this block's S
            keep_all(sacc);
            keep_all(o[0]);
            keep_all(o[1]);
            // scores, the mask, the row max of this warpgroup's 32 keys
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int l = 16 * w + 4 * j + t;  // the ballot bit of key 32w + 8j + 2t + e
                    const bool ok = (((e ? odd : even) >> l) & 1u) != 0;
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) {
                        float& v = sacc[4 * j + 2 * rr + e];
                        v = ok ? v * scale : NEG_INF;
                        mx[rr] = fmaxf(mx[rr], v);
                    }
                }
            quad_publish(mx, [](float a, float b) { return fmaxf(a, b); }, max_s + w * BH, r0, t);
            named_sync(BAR_MAX);
            float rescale[2];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float nm = fmaxf(run_max[rr], fmaxf(mx[rr], max_s[(1 - w) * BH + r0 + 8 * rr]));
                rescale[rr] = tl_exp(run_max[rr] - nm);
                run_max[rr] = nm;
            }
            // P = exp(s - new_max): this lane's sums, and its bf16 pairs into the shared P tile (row r, key 32w +
            // 8j + 2t: 16-byte chunk 4w + j of the row, swizzled by r % 8 = g)
            const u32 pb = p_base + (n & 1) * P_BYTES;
            float ps[2] = {0.f, 0.f};
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const float p0 = tl_exp(sacc[4 * j + 2 * rr] - run_max[rr]);
                    const float p1 = tl_exp(sacc[4 * j + 2 * rr + 1] - run_max[rr]);
                    ps[rr] += p0 + p1;
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(pb + sw128(r0 + 8 * rr, 4 * w + j) + 4 * t),
                                 "r"(pack_bf16x2(p0, p1)) : "memory");
                }
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) run_sum[rr] = run_sum[rr] * rescale[rr] + ps[rr];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 64; ++i) o[h][i] *= rescale[(i >> 1) & 1];
            fence_async_smem();  // the P stores, visible to the wgmmas that read them
            named_sync(BAR_P);
            issue_pv(s, pb);
            seen = seen || (even | odd);
            b = next_block(idx_row, K, nb, b + 1, seen, lane, even, odd);
            if (b < nb) issue_qk((n + 1) % STAGES, n + 1);
        }
        wgmma_wait<0>();
        keep_all(o[0]);
        keep_all(o[1]);
        if (n > first) mbar_arrive(empty0 + 8 * ((n - 1) % STAGES));  // the item's last stage
        mbar_arrive(q_empty);  // every S of this item is done: the producer may load the next q

        // the row sums: this lane's, its quad's, then both warpgroups' (in one order for both)
        quad_publish(run_sum, [](float a, float b) { return a + b; }, sum_s + w * BH, r0, t);
        named_sync(BAR_SUM);
        float den[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int r = r0 + 8 * rr;
            den[rr] = (sum_s[r] + sum_s[BH + r]) + tl_exp(sink[h0 + r] - run_max[rr]);
        }
        named_sync(BAR_SUM);  // both warpgroups have read sum_s before the next item writes it
        u16* out_tok = out + (i64)tok * stride_ot;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int r = r0 + 8 * rr, col = 256 * w + 128 * h + 8 * j + 2 * t;
                    *reinterpret_cast<u32*>(out_tok + (i64)(h0 + r) * stride_oh + col) =
                        pack_bf16x2(o[h][4 * j + 2 * rr] / den[rr], o[h][4 * j + 2 * rr + 1] / den[rr]);
                }
    }
}
