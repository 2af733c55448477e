// Routed-expert GEMM at decode: packed FP4 (E2M1 + per-32 E8M0) weights x bf16 activations on mma.sync.
//
// out[split, slot, n] = sum over k in the split's K range of a[row(slot), k] * W[e, n, k]   (fp32)
// for the <= 8 slots of one routing block (all of expert e), every weight row n of the CTA's tile.
// The products are exact (bf16 activation = act_quant's q * s; the weight E2M1 x 2^(S-127) is exact in
// bf16) and the tensor cores add them in fp32: the official fp4_gemm math up to fp32 summation order,
// the same as the Triton kernels (fp4_moe.py). A reduce kernel adds the splits in a fixed order.
//
// Fragments (mma.m16n8k16, A = 16 weight rows "row", B = 8 tokens "col"): lane = 4g + t holds A rows g and
// g + 8 at logical K pairs (2t, 2t+1) and (2t+8, 2t+9), B token g at the same K pairs. A dot product does
// not care in which order K is visited, so each lane feeds the MMA its OWN K positions, the same for A
// and B: per step of 128 K the lane owns K [32t, 32t + 32) of it (one uint4 of packed codes per weight
// row, one E8M0 scale byte: exactly one scale block), as four words of 8 codes. A word's code c (nibble
// c, K offset c) and code c + 4 (nibble c + 4) form one bf16x2 register: nibbles c and c + 4 sit 16 bits
// apart, so ONE shift-mask-multiply places both (`e2m1_pair`, mma_common.cuh), no per-byte unpacking. Word q's registers:
// pair 0 / 1 feed MMA step (q, 0) as its (2t, 2t+1) / (2t+8, 2t+9) pairs, pair 2 / 3 step (q, 1). The
// activations' bf16 pairs are regrouped to match with one byte permute each (`prmt`).
// E2M1 -> bf16: magnitude bits e1 e0 m to bf16 bits 8..6, sign to bit 15 gives 2^(e-127) (1 + m/2) for
// e > 0 and the subnormal m * 2^-127 for e = 0: E2M1 x 2^-126. One bf16x2 multiply by 2^(S-1) (exponent
// field S + 126) makes it E2M1 x 2^(S-127), exact for S <= 128 (the caller checks the bank's scale_max).
// Same trick and bound as fp4_moe._e2m1_bytes_bf16x2_scaled (Triton "expand 6").
//
// Compile-time constants (-D): MT m16 tiles per warp, WARPS warps per CTA, STAGES register pipeline depth,
// KSTEP K per pipeline stage (128: a lane reads 16 bytes of a weight row per stage, the quad 64; 256: 32
// bytes, the quad a whole 128-byte line; the lane then owns two 32-K scale blocks per stage).
// Launch: grid (routing blocks, ceil(N / (16 MT WARPS)), splits), block 32 WARPS.
// Requires: K_split % (KSTEP STAGES) == 0; row strides of W / a multiples of 16 bytes; a bf16 [rows, >= K].
// Padding slots of a routing block (at decode most of its 8: b1 has one token per expert) load no
// activations: their B columns are zeros and are never stored.

#include "mma_common.cuh"
#include "pdl_common.cuh"

#ifndef MT
#define MT 2
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef KSTEP
#define KSTEP 128
#endif
#ifndef ASYNC
#define ASYNC 0              // 1: stages land in a shared-memory ring by cp.async (registers hold one stage)
#endif
#ifndef LOAD_ONLY
#define LOAD_ONLY 0          // 1: a diagnostic (benchmarks/bench_moe_load_bound.py), not the GEMM: the same loads,
#endif                       // folded into the accumulator by an XOR instead of the expansion and the MMAs
#define TOKENS 8
#define WV (KSTEP / 128)     // uint4 of packed codes per weight row per lane and stage (32 K each)
#define W_CHUNKS (MT * 2 * WV)  // ASYNC: 16-byte weight chunks per lane and stage
#define X_CHUNKS (4 * WV)       // ASYNC: 16-byte activation chunks per lane and stage
#define LANE_K (KSTEP / 4)   // K a lane owns per stage

struct Stage {
    uint4 w[MT][2][WV];  // packed codes of rows g and g + 8 of each m16 tile: 32 K per uint4
    u32 s[MT][2][WV];    // their E8M0 scale bytes (one per 32 K)
    uint4 x[4 * WV];     // token g's bf16 activations over the lane's K (8 per uint4)
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

template <int BYTES>
__device__ __forceinline__ void cp_async(u32 dst, const void* src) {
    // 16 bytes bypass L1 (.cg: the weights are read once); 4 / 8 (scale words) go through it (.ca)
    if (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

extern "C" __global__ void __launch_bounds__(32 * WARPS)
fp4_expert_gemm_mma(const unsigned short* __restrict__ a, i64 stride_am,
                    const u8* __restrict__ w, i64 stride_we, i64 stride_wn,
                    const u8* __restrict__ ws, i64 stride_wse, i64 stride_wsn,
                    float* __restrict__ out, i64 stride_os, i64 stride_om,
                    const int* __restrict__ sorted_slots, const int* __restrict__ block_expert,
                    int n_slots, int N, int k_split, int a_row_div) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int blk = blockIdx.x;
    const int expert = block_expert[blk];
    if (expert < 0) return;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int k_lo = blockIdx.z * k_split;
    const int steps = k_split / KSTEP;

    // this lane's token (B column g) and its activation row; a padding slot loads nothing (zeros, never stored)
    const int my_slot = sorted_slots[blk * TOKENS + g];
    const bool tok_ok = my_slot < n_slots;
    const i64 a_row = tok_ok ? (i64)(my_slot / a_row_div) : 0;
    const unsigned short* a_ptr = a + a_row * stride_am + k_lo + LANE_K * t;

    // the lane's weight rows: row g and g + 8 of each m16 tile (clamped to N - 1; their outputs are not stored)
    const int row0 = blockIdx.y * (16 * MT * WARPS) + warp * (16 * MT);
    const u8* w_ptr[MT][2];
    const u8* s_ptr[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = row0 + 16 * m + g + 8 * h;
            r = r < N ? r : N - 1;
            w_ptr[m][h] = w + (i64)expert * stride_we + (i64)r * stride_wn + k_lo / 2 + (LANE_K / 2) * t;
            s_ptr[m][h] = ws + (i64)expert * stride_wse + (i64)r * stride_wsn + k_lo / 32 + WV * t;
        }
    }

    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
        acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;

    Stage buf[ASYNC ? 1 : STAGES];
    auto load = [&](Stage& st, int step) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int v = 0; v < WV; ++v) {
                    st.w[m][h][v] = ld_stream(w_ptr[m][h] + step * (KSTEP / 2) + 16 * v);
                    st.s[m][h][v] = s_ptr[m][h][step * (KSTEP / 32) + v];
                }
            }
        }
#pragma unroll
        for (int q = 0; q < 4 * WV; ++q) {
            if (tok_ok) {
                st.x[q] = ld_cached(a_ptr + step * KSTEP + 8 * q);
            } else {
                st.x[q].x = st.x[q].y = st.x[q].z = st.x[q].w = 0u;
            }
        }
    };
    auto compute = [&](const Stage& st) {
#if LOAD_ONLY
        u32 fold = 0u;  // every loaded register feeds it: no load is dead code
#pragma unroll
        for (int v = 0; v < WV; ++v)
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    fold ^= st.w[m][h][v].x ^ st.w[m][h][v].y ^ st.w[m][h][v].z ^ st.w[m][h][v].w ^ st.s[m][h][v];
#pragma unroll
        for (int q = 0; q < 4 * WV; ++q) fold ^= st.x[q].x ^ st.x[q].y ^ st.x[q].z ^ st.x[q].w;
        acc[0][0] += __uint_as_float(fold & 0x007FFFFFu);  // a denormal-range float: finite whatever the bits
        return;
#endif
#pragma unroll
        for (int v = 0; v < WV; ++v) {
            u32 mult[MT][2];  // bf16x2 2^(S-1): exponent field S + 126 in both halves
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mult[m][0] = (st.s[m][0][v] + 126u) * 0x00800080u;
                mult[m][1] = (st.s[m][1][v] + 126u) * 0x00800080u;
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                // token g's K (8q + c, 8q + c + 4) pairs, matching `e2m1_pair<c>`: bf16 x[0..7] = words (0,1) (2,3) (4,5) (6,7)
                const uint4 xv = st.x[4 * v + q];
                const u32 b00 = prmt(xv.x, xv.z, 0x5410u), b01 = prmt(xv.x, xv.z, 0x7632u);  // c = 0, 1
                const u32 b10 = prmt(xv.y, xv.w, 0x5410u), b11 = prmt(xv.y, xv.w, 0x7632u);  // c = 2, 3
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const u32 wg = word_of(st.w[m][0][v], q), wg8 = word_of(st.w[m][1][v], q);
                    mma_bf16(acc[m], bmul2(e2m1_pair<0>(wg), mult[m][0]), bmul2(e2m1_pair<0>(wg8), mult[m][1]),
                             bmul2(e2m1_pair<1>(wg), mult[m][0]), bmul2(e2m1_pair<1>(wg8), mult[m][1]), b00, b01);
                    mma_bf16(acc[m], bmul2(e2m1_pair<2>(wg), mult[m][0]), bmul2(e2m1_pair<2>(wg8), mult[m][1]),
                             bmul2(e2m1_pair<3>(wg), mult[m][0]), bmul2(e2m1_pair<3>(wg8), mult[m][1]), b10, b11);
                }
            }
        }
    };

#if ASYNC
    // Each lane copies its own chunks into its own slots and reads back only those, so a lane's
    // cp.async.wait_group is the only synchronisation (no barrier). Slot layout [stage][warp][chunk][lane]:
    // a warp's 16-byte reads of one chunk are 512 contiguous bytes (no bank conflicts). Scale words: the
    // aligned 4 (KSTEP 128) or 8 (256) bytes holding the lane's scale bytes, [stage][warp][row][lane].
    extern __shared__ uint4 ring[];
    uint4* my_chunks = ring + (size_t)warp * (W_CHUNKS + X_CHUNKS) * 32 + lane;
    const int stage_chunks = WARPS * (W_CHUNKS + X_CHUNKS) * 32;  // uint4 per stage
    unsigned char* scale_base = (unsigned char*)(ring + (size_t)STAGES * stage_chunks);
    const int scale_bytes = 4 * WV;  // per lane and weight row
    unsigned char* my_scales = scale_base + ((size_t)warp * MT * 2 * 32 + lane) * scale_bytes;
    const int stage_scale_bytes = WARPS * MT * 2 * 32 * scale_bytes;
    auto issue = [&](int slot, int step) {
        uint4* c = my_chunks + (size_t)slot * stage_chunks;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int v = 0; v < WV; ++v)
                    cp_async<16>(smem_addr(c + ((m * 2 + h) * WV + v) * 32), w_ptr[m][h] + step * (KSTEP / 2) + 16 * v);
                // the scale word: this row's bytes of the stage for all four lanes of the quad, aligned
                cp_async<4 * WV>(smem_addr(my_scales + (size_t)slot * stage_scale_bytes + (m * 2 + h) * 32 * scale_bytes),
                                 s_ptr[m][h] - WV * t + step * (KSTEP / 32));
            }
        if (tok_ok) {
#pragma unroll
            for (int q = 0; q < X_CHUNKS; ++q)
                cp_async<16>(smem_addr(c + (W_CHUNKS + q) * 32), a_ptr + step * KSTEP + 8 * q);
        }
    };
    auto fetch = [&](Stage& st, int slot) {
        const uint4* c = my_chunks + (size_t)slot * stage_chunks;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned char* sc = my_scales + (size_t)slot * stage_scale_bytes + (m * 2 + h) * 32 * scale_bytes;
#pragma unroll
                for (int v = 0; v < WV; ++v) {
                    st.w[m][h][v] = c[((m * 2 + h) * WV + v) * 32];
                    st.s[m][h][v] = sc[WV * t + v];
                }
            }
#pragma unroll
        for (int q = 0; q < X_CHUNKS; ++q) {
            if (tok_ok) {
                st.x[q] = c[(W_CHUNKS + q) * 32];
            } else {
                st.x[q].x = st.x[q].y = st.x[q].z = st.x[q].w = 0u;
            }
        }
    };
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
        if (j < steps) issue(j, j);
        cp_async_commit();
    }
    for (int i = 0; i < steps; i += STAGES) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            cp_async_wait<STAGES - 2>();  // this lane's copies of step i + j have landed
            const int nxt = i + j + STAGES - 1;
            if (nxt < steps) issue((j + STAGES - 1) % STAGES, nxt);
            cp_async_commit();  // an empty group past the end keeps the count uniform
            fetch(buf[0], j);
            compute(buf[0]);
        }
    }
#else
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) load(buf[j], j);
    for (int i = 0; i < steps; i += STAGES) {
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            const int nxt = i + j + STAGES - 1;
            if (nxt < steps) load(buf[(j + STAGES - 1) % STAGES], nxt);
            compute(buf[j]);
        }
    }
#endif

    // C fragment: c0 / c1 = row g, tokens 2t / 2t + 1; c2 / c3 = row g + 8
    const int slot0 = sorted_slots[blk * TOKENS + 2 * t];
    const int slot1 = sorted_slots[blk * TOKENS + 2 * t + 1];
    float* o = out + (i64)blockIdx.z * stride_os;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + 16 * m + g + 8 * h;
            if (r >= N) continue;
            if (slot0 < n_slots) o[(i64)slot0 * stride_om + r] = acc[m][2 * h];
            if (slot1 < n_slots) o[(i64)slot1 * stride_om + r] = acc[m][2 * h + 1];
        }
    }
}
