// Routed-expert GEMM at decode in the official fp4_gemm structure: packed FP4 (E2M1 + per-32 E8M0) weights x
// E4M3 activations (act_quant's codes, fp32 power-of-two scales per AB of K), each 32-K block's dot finished
// in the tensor cores and promoted into fp32 with its two scales (spec §6.4):
//
//   out[split, slot, n] = sum over the split's 32-K blocks kb of  sa[row(slot), kb*32 / AB] * sw[e, n, kb] * dot_kb
//   dot_kb = sum over k in kb of q[row(slot), k] * E2M1[e, n, k]
//
// Sm_90 has no FP8 mma.sync (ptxas emulates m16n8k32.e4m3 by converting both operands to f16 on every call),
// so both operands enter m16n8k16 f16 MMAs as f16, exactly: every E4M3 code and every E2M1 value x 2^-14 is
// an f16, the products are exact and the MMA adds them in fp32. Per 8 weights: 7 integer instructions make
// the codes 8-bit floats by bit placement, 4 byte permutes / conversions make them f16 pairs; the weight
// scale is applied once per 32-K block (fp32), not per weight. The bf16 form (fp4_moe_mma.cu) spends ~13
// integer instructions and 4 bf16x2 scale multiplies per 8 weights.
//
// E2M1 -> 8-bit float by bit placement (all 16 codes, exactly): magnitude bits e1 e0 m to E4M3 bits 4..2 and
// the sign to bit 7 give exponent field e, mantissa m00: 2^(e-7) (1 + m/2) for e > 0 and m/2 * 2^-6 for e = 0,
// i.e. E2M1 x 2^-6; to E5M2 bits 3..1 (sign bit 7) the same gives E2M1 x 2^-14, and an E5M2 byte is the high
// byte of the f16 of its value. A 32-bit word of 8 codes (byte j holds codes 2j, 2j + 1, low nibble first):
//   E4M3  lo = codes 0, 2, 4, 6: ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080);  hi = codes 1, 3, 5, 7:
//         ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080);  then cvt.rn.f16x2.e4m3x2 per half (CVT 0)
//   E5M2  lo: ((w << 1) & 0x0E0E0E0E) | ((w << 4) & 0x80808080);  hi: ((w >> 3) & 0x0E0E0E0E) | (w & 0x80808080);
//         then one prmt per f16 pair, the byte into each half's high byte (CVT 1)
// The activations' 8 codes of the same K are regrouped by two byte permutes and converted by cvt (E4M3).
// The weight scale absorbs the operand's 2^-6 / 2^-14: sw = 2^(S - 127 + A_EXP), fp32 bits (S + A_EXP) << 23.
//
// Per-32 promotion with a lane-owned K layout. mma.m16n8k16 (A = 16 weight rows "row", B = 8 columns "col"):
// lane = 4g + t holds A rows g, g + 8 at K slots (2t, 2t+1) and (2t+8, 2t+9), and B column g at the same slots.
// A lane reads its weight rows as whole 16-byte runs: per 128 K of a row, lane t owns the 32-K block t (one
// E8M0 scale), so one MMA mixes the quad's four blocks, whose scales differ. The B columns untangle them:
// column c = 4j + b carries token j of the pass restricted to block b (lane t = b feeds token j's codes, the
// other three lanes feed zeros), so D[row, 4j + b] is block b's partial dot for token j alone. The 8 MMAs of
// a lane's 32 K chain in the tensor core, giving one 32-K block's dot per column; it is then promoted:
// acc[row, c] += D * (sw[row, block] * sa[token, block]) (exact power-of-two scalings, one fp32 rounding). At
// the end a token's four block columns are added (two per lane, then one shuffle) in a fixed order.
// A pass covers 2 tokens (8 columns); PASSES passes share each converted A (routing blocks of 2 PASSES slots).
// Numerics: the products are exact and all sums fp32 - the official math up to fp32 summation order, like the
// bf16 forms (the official kernel's FP8 wgmma adds each block's 32 products at reduced precision instead).
//
// Compile-time constants (-D): MT m16 tiles per warp, WARPS warps per CTA, STAGES register pipeline depth,
// KSTEP K per stage (128: a lane reads 16 bytes of a weight row per stage; 256: 32), PASSES token pairs per
// routing block, AB the activations' scale block (32, 64 or 128), CVT (above).
// Launch: grid (routing blocks, ceil(N / (16 MT WARPS)), splits), block 32 WARPS.
// Requires: K_split % (KSTEP STAGES) == 0; W / a rows 16-byte aligned; a E4M3 [rows, >= K], sa fp32 [rows, K/AB].

#include "mma_common.cuh"

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
#ifndef PASSES
#define PASSES 1
#endif
#ifndef AB
#define AB 128
#endif
#ifndef CVT
#define CVT 1  // how an A register of codes becomes f16x2: 0 E4M3 bytes + cvt (F2FP), 1 E5M2 bytes + byte permute
#endif
#define TOKENS (2 * PASSES)
#define A_EXP (CVT ? 14 : 6)  // the A operand holds E2M1 x 2^-A_EXP
#define WV (KSTEP / 128)  // uint4 of packed codes per weight row per lane and stage (one 32-K block each)

struct Stage {
    uint4 w[MT][2][WV];         // packed codes of rows g and g + 8 of each m16 tile: one 32-K block per uint4
    u32 s[MT][2];               // their scale bytes of blocks WV*b0 .. WV*b0 + 2WV - 1 (the lane's C columns)
    uint4 x[PASSES][WV][2];     // this lane's B token over its blocks (32 codes per block), zeros where not fed
    float sa[PASSES][2][WV];    // activation scales of the lane's C columns (token, block b0 / b0 + 1, uint4 v)
};

__device__ __forceinline__ u32 e4m3_lo(u32 w) { return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ u32 e4m3_hi(u32 w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }
// the same codes as E5M2 bytes (s 000 e1 e0 m 0 = E2M1 x 2^-14), the high byte of that value's f16
__device__ __forceinline__ u32 e5m2_lo(u32 w) { return ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ u32 e5m2_hi(u32 w) { return ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u); }

// two E4M3 bytes (the low / high half of a register) -> f16x2, exactly (every E4M3 value is an f16)
__device__ __forceinline__ void e4m3_to_f16(u32 v, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(v));
}

// c (fp32 [4]) += A (16 x 16 f16, four registers) @ B (16 x 8 f16, two registers): the m16n8k16 fragments
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ld_f32(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// the 2WV scale bytes of a row's stage that the lane's C columns use (aligned: WV * b0 is a multiple of 2WV)
__device__ __forceinline__ u32 ld_scales(const u8* p) {
    if (WV == 1) {
        unsigned short v;
        asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
        return v;
    } else {
        u32 v;
        asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
        return v;
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
fp4_expert_gemm_fp8mma(const u8* __restrict__ a, i64 stride_am, const float* __restrict__ sa, i64 stride_sam,
                       const u8* __restrict__ w, i64 stride_we, i64 stride_wn,
                       const u8* __restrict__ ws, i64 stride_wse, i64 stride_wsn,
                       float* __restrict__ out, i64 stride_os, i64 stride_om,
                       const int* __restrict__ sorted_slots, const int* __restrict__ block_expert,
                       int n_slots, int N, int k_split, int a_row_div) {
    const int blk = blockIdx.x;
    const int expert = block_expert[blk];
    if (expert < 0) return;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int b0 = 2 * (t & 1);  // the block of the lane's C columns 2t / 2t + 1: b0 / b0 + 1
    const int k_lo = blockIdx.z * k_split;
    const int steps = k_split / KSTEP;
    const bool feeds = (g & 3) == t;  // this lane's B column g = 4j + b has b == t: it feeds token j's block t

    // routing blocks fill an expert's slots in order, padding at the end: passes past the last slot are skipped
    int valid = 0;
#pragma unroll
    for (int j = 0; j < TOKENS; ++j) valid += sorted_slots[blk * TOKENS + j] < n_slots;

    // B: token 2p + (g >> 2) of pass p, its K of block t (this lane's weight K); C: token 2p + (t >> 1)
    const u8* x_ptr[PASSES];
    const float* s_act[PASSES];
    bool x_ok[PASSES];
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int bs = sorted_slots[blk * TOKENS + 2 * p + (g >> 2)];
        x_ok[p] = feeds && bs < n_slots;
        x_ptr[p] = a + (x_ok[p] ? (i64)(bs / a_row_div) : 0) * stride_am + k_lo + 32 * WV * t;
        const int cs = sorted_slots[blk * TOKENS + 2 * p + (t >> 1)];
        s_act[p] = sa + (cs < n_slots ? (i64)(cs / a_row_div) : 0) * stride_sam + k_lo / AB;
    }
    // the scale of the C column (block b0 + c, uint4 v) at a stage's K offset: k_lo and the stage start are
    // multiples of KSTEP >= AB, so the offset within the stage divides on its own
    int sa_off[2][WV];
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int v = 0; v < WV; ++v) sa_off[c][v] = (32 * (WV * (b0 + c) + v)) / AB;

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
            w_ptr[m][h] = w + (i64)expert * stride_we + (i64)r * stride_wn + k_lo / 2 + 16 * WV * t;
            s_ptr[m][h] = ws + (i64)expert * stride_wse + (i64)r * stride_wsn + k_lo / 32 + WV * b0;
        }
    }

    float acc[MT][PASSES][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int p = 0; p < PASSES; ++p)
            acc[m][p][0] = acc[m][p][1] = acc[m][p][2] = acc[m][p][3] = 0.f;

    Stage buf[STAGES];
    auto load = [&](Stage& st, int step) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int v = 0; v < WV; ++v) st.w[m][h][v] = ld_stream(w_ptr[m][h] + step * (KSTEP / 2) + 16 * v);
                st.s[m][h] = ld_scales(s_ptr[m][h] + step * (KSTEP / 32));
            }
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const bool live = 2 * p < valid;
#pragma unroll
            for (int v = 0; v < WV; ++v) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    if (live && x_ok[p]) {
                        st.x[p][v][c] = ld_cached(x_ptr[p] + step * KSTEP + 32 * v + 16 * c);
                    } else {
                        st.x[p][v][c].x = st.x[p][v][c].y = st.x[p][v][c].z = st.x[p][v][c].w = 0u;
                    }
                }
#pragma unroll
                for (int c = 0; c < 2; ++c)  // block WV * (b0 + c) + v of the stage
                    st.sa[p][c][v] = live ? ld_f32(s_act[p] + step * (KSTEP / AB) + sa_off[c][v]) : 0.f;
            }
        }
    };
    auto compute = [&](const Stage& st) {
#pragma unroll
        for (int v = 0; v < WV; ++v) {
            float d[MT][PASSES][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int p = 0; p < PASSES; ++p) d[m][p][0] = d[m][p][1] = d[m][p][2] = d[m][p][3] = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                // word q's codes as f16x2: f[m][h][0] = codes (0, 2), [1] = (4, 6), [2] = (1, 3), [3] = (5, 7)
                u32 f[MT][2][4];
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 wq = word_of(st.w[m][h][v], q);
#if CVT
                        const u32 zl = e5m2_lo(wq), zh = e5m2_hi(wq);  // E5M2 byte -> f16: it becomes the high byte
                        f[m][h][0] = prmt(zl, 0u, 0x1404u);
                        f[m][h][1] = prmt(zl, 0u, 0x3424u);
                        f[m][h][2] = prmt(zh, 0u, 0x1404u);
                        f[m][h][3] = prmt(zh, 0u, 0x3424u);
#else
                        e4m3_to_f16(e4m3_lo(wq), f[m][h][0], f[m][h][1]);
                        e4m3_to_f16(e4m3_hi(wq), f[m][h][2], f[m][h][3]);
#endif
                    }
#pragma unroll
                for (int p = 0; p < PASSES; ++p) {
                    if (2 * p >= valid) continue;
                    // the word's 8 activation bytes (K 0..3 in lo, 4..7 in hi) regrouped to the same code pairs
                    const uint4 xv = st.x[p][v][q >> 1];
                    const u32 lo = (q & 1) ? xv.z : xv.x, hi = (q & 1) ? xv.w : xv.y;
                    u32 b[4];
                    e4m3_to_f16(prmt(lo, hi, 0x6420u), b[0], b[1]);
                    e4m3_to_f16(prmt(lo, hi, 0x7531u), b[2], b[3]);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        // MMA K slots (2t, 2t + 1) / (2t + 8, 2t + 9): codes (0, 2) / (4, 6), then (1, 3) / (5, 7)
                        mma_f16(d[m][p], f[m][0][0], f[m][1][0], f[m][0][1], f[m][1][1], b[0], b[1]);
                        mma_f16(d[m][p], f[m][0][2], f[m][1][2], f[m][0][3], f[m][1][3], b[2], b[3]);
                    }
                }
            }
            // promote each column's 32-K block dot: x 2^(S - 121) (the weight scale and the E4M3 form's 2^6) x sa
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                float sw[2][2];
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        sw[h][c] = __uint_as_float((((st.s[m][h] >> (8 * (WV * c + v))) & 0xFFu) + A_EXP) << 23);
#pragma unroll
                for (int p = 0; p < PASSES; ++p) {
                    if (2 * p >= valid) continue;
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int c = 0; c < 2; ++c)
                            acc[m][p][2 * h + c] = fmaf(d[m][p][2 * h + c], sw[h][c] * st.sa[p][c][v], acc[m][p][2 * h + c]);
                }
            }
        }
    };

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

    // a token's four block columns: b0, b0 + 1 here, b0 ^ 2, (b0 ^ 2) + 1 in lane t ^ 1; (b0 + b1) + (b2 + b3)
    // in both lanes (fp32 addition commutes); the even lane stores rows g and g + 8
    float* o = out + (i64)blockIdx.z * stride_os;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        if (2 * p >= valid) continue;
        const int slot = sorted_slots[blk * TOKENS + 2 * p + (t >> 1)];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float s = acc[m][p][2 * h] + acc[m][p][2 * h + 1];
                s += __shfl_xor_sync(0xFFFFFFFFu, s, 1);
                const int r = row0 + 16 * m + g + 8 * h;
                if ((t & 1) == 0 && r < N && slot < n_slots) o[(i64)slot * stride_om + r] = s;
            }
        }
    }
}
