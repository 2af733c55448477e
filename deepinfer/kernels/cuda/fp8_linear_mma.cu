// FP8 linear at decode: E4M3 weights with fp32 pow2 block scales x the official act_quant of bf16 x, on mma.sync.
//
// out[m, n] = sum over k of act(x)[m, k] * W[n, k]      (S == 1: bf16, rounded once; S > 1: fp32 partial of
// split blockIdx.z's K range into out[z, m, n], added in a fixed order by the caller)
// act(x) = act_quant's exact q * s (E4M3 code x pow2 scale per act_block group of a row), computed here from
// the raw bf16 x, bit-identical to kernels/triton/act_quant.py; W = E4M3 code x scale[n / block, k / block].
// Both are exact in bf16 (4 significant bits x a power of two), so the bf16 MMA's products are exact and it
// adds them in fp32: fp8_gemm's "bf16" form, up to fp32 summation order (the torch twin fp8_linear_torch).
//
// CTA = 8 rows of x (the MMA's n8: decode M <= 8; more rows are more CTAs along grid.x) x 16 MT WARPS weight
// rows x one split's K range. Two phases per chunk of <= 1024 K:
// 1. quantise: all threads turn the chunk of the 8 rows into bf16 q * s in SHARED memory (each element is
//    read by every warp: quantising it once per CTA, not per warp, and reading it as ready-made fragments);
// 2. stream: each warp streams its 16 MT rows' weights from global memory straight into MMA A fragments.
// Fragments (mma.m16n8k16, A = 16 weight rows "row", B = 8 tokens "col"): lane = 4g + t holds A rows g and
// g + 8 at logical K pairs (2t, 2t+1) and (2t+8, 2t+9), B token g at the same pairs. A dot product does not
// care in which order K is visited, so each lane feeds the MMA its OWN K positions, the same for A and B:
// per step of 128 K the lane owns K [32t, 32t + 32) of it: two uint4 (32 E4M3 bytes) per weight row and
// exactly one weight scale block (128 x 128 in V4, 32 x 32 in V4.1: an m16 tile is 16-row aligned, so rows
// g and g + 8 share it too). A word of 4 codes K0..K3 gives two bf16x2 registers: P0 = (K0, K2) = bytes 0
// and 2, P1 = (K1, K3) = bytes 1 and 3: the two bytes of a pair sit 16 bits apart, so one byte permute and
// one shift-mask place both (`pair`). One MMA per word: a0 / a1 = P0 of rows g / g + 8, a2 / a3 = P1, and the
// activations regrouped to match with one byte permute each: b0 = (x0, x2), b1 = (x1, x3) of token g.
// E4M3 -> bf16: magnitude bits (e3..e0 m2..m0) to bf16 bits 10..4 and the sign to bit 15 give exactly
// E4M3 x 2^-120 (E4M3 exponent field e becomes the bf16 exponent field e; e = 0 the matching subnormal).
// One bf16x2 multiply by 2^120 x scale (exact in bf16 for the power-of-two scales up to 2^7: the top half of
// its fp32 bits; the launcher checks the range once per weight) makes it E4M3 x scale, exact while that is a
// bf16: every nonzero value for scales >= 2^-124 (>= 2^-133, the smallest bf16 subnormal; bf16 arithmetic
// keeps subnormals). (NaN codes 0x7F / 0xFF become finite values: checkpoints have none.)
// Activation in shared memory, fragment order: uint4 index ((step * 4 + q) * 8 + g) * 4 + t holds token g's
// bf16 at K step*128 + 32t + 8q .. + 8, so the warp's read of one q is 512 contiguous bytes (no bank conflict).
//
// Compile-time constants (-D): MT m16 tiles per warp, WARPS warps per CTA, STAGES register pipeline depth,
// SPLIT_OUT (1: fp32 partials out[z, m, n]; 0: bf16 out[m, n]), CLUSTER_SPLIT (S > 1: the S CTAs of a tile
// are one thread-block cluster and add their partials themselves, bf16 out[m, n]; 0: no cluster).
// Launch: grid (ceil(M / 8), ceil(N / (16 MT WARPS)), S), block 32 WARPS.
//
// The grouped output LoRA (RAW_ACT 1, GROUP_ROWS R): V4's wo_a, `einsum("tgd,grd->tgr", o, wo_a)` on bf16
// operands with wo_a = convert.py's exact bf16 of its FP8 bytes x block scales: x is o [M, G, K] (a token's
// groups contiguous, each K long), the weight [G R, K], out [M, G R]. A CTA's rows lie in one group g (R is
// whole CTA tiles) and read x's group g as its 8 rows; x enters as the bf16 it is (no act_quant), so the
// products are exact and the sums fp32: the official einsum up to fp32 summation order.
//
// Split-K inside the kernel (CLUSTER_SPLIT = S): at decode a split's partial sum is a whole launch's worth
// of latency to add up afterwards (fp8_gemm._split_sum_kernel: ~1.9 us + a launch gap per projection on the
// H200, 2026-12-05). Instead the S split CTAs of a tile form a cluster (sm_90, compile-time cluster dims
// (1, 1, S): grid.z = S, so a CTA's rank in its cluster is its split z). Each CTA leaves its fp32 partial of
// the 8 x 16 MT WARPS tile in its own shared memory; after a cluster barrier, rank r adds up element slice r
// of the tile over every CTA's shared memory (distributed shared memory), in the fixed order z = 0, 1, ...,
// S - 1 (the order of _split_sum_kernel: the same bits), and writes bf16; a second barrier keeps every
// CTA's shared memory alive until the last read of it. S = 16 is a non-portable cluster size: the launcher
// allows it on the function (cuFuncSetAttribute) before the first launch.
// Split-K finished by the tile's last CTA (SERIAL_SPLIT 1, with SPLIT_OUT 1): the fix-up of CUTLASS's serial
// split-K / stream-K, where a cluster does not pay (S > 4 on the H100, above). Every split CTA stores its fp32
// partial to out[z] as in the plain split form, fences, and counts itself in counters[tile] (one atomic add
// by thread 0); the CTA that counts S adds the tile's S partials in the fixed order z = 0, 1, ..., S - 1 from
// L2 (ld.global.cg: the other CTAs' stores, not L1 lines) and writes bf16 fin[m, n]: the bits of
// _split_sum_kernel without its launch. It also puts the tile's counter back to 0 for the next launch (no CTA
// of this launch touches it after the S-th add; the next kernel in the stream waits for this grid's end). The
// launcher keeps the counters, zeroed once, per weight (fp8_gemm.serial_counters).
// Requires (the launcher checks): k_split % (128 STAGES) == 0; block and act_block in (32, 128) (a step's
// 32 K per lane is whole act groups and one weight block); rows of x and W 16-byte aligned.

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "cluster_common.cuh"

#ifndef MT
#define MT 2
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef SPLIT_OUT
#define SPLIT_OUT 1
#endif
#ifndef CLUSTER_SPLIT
#define CLUSTER_SPLIT 0
#endif
#ifndef SERIAL_SPLIT
#define SERIAL_SPLIT 0  // 1: the tile's last split CTA adds the fp32 partials into bf16 fin (see above)
#endif
#ifndef RAW_ACT
#define RAW_ACT 0  // 1: x enters the MMA as the bf16 it is (no act_quant: the grouped output LoRA's bf16 einsum)
#endif
#ifndef GROUP_ROWS
#define GROUP_ROWS 0  // > 0: weight rows [g GROUP_ROWS, (g + 1) GROUP_ROWS) multiply x's group g (see below)
#endif
#define TILE_ROWS (16 * MT * WARPS)
#define TILE_CELLS (8 * TILE_ROWS)  // outputs of a CTA's tile: 8 tokens x TILE_ROWS weight rows
#define TOKENS 8
// steps of 128 K quantised into shared memory at once: <= 1024 K (16 KB for 8 rows), whole pipeline rounds
#define CHUNK_STEPS ((8 / STAGES) * STAGES)

static_assert(STAGES >= 1 && STAGES <= 8, "STAGES must be 1..8");
static_assert(GROUP_ROWS % (16 * MT * WARPS) == 0, "GROUP_ROWS: whole CTA tiles of weight rows per group");
static_assert(CLUSTER_SPLIT == 0 || (!SPLIT_OUT && CLUSTER_SPLIT >= 2 && CLUSTER_SPLIT <= 16
              && TILE_CELLS % CLUSTER_SPLIT == 0), "CLUSTER_SPLIT: 2..16 dividing the tile, bf16 out only");
static_assert(!SERIAL_SPLIT || (SPLIT_OUT && !CLUSTER_SPLIT), "SERIAL_SPLIT: the fp32 partials' form only");


struct Stage {
    uint4 w[MT][2][2];  // E4M3 codes of rows g and g + 8 of each m16 tile: 32 K each, as two uint4
    float s[MT];        // the tile's weight block scale at this step
};

// two E4M3 bytes of w as bf16 bit patterns E4M3 x 2^-120, the byte that SEL's low nibble names in the low half:
// one byte permute puts each byte in the low byte of its half and its sign, replicated (selector bit 3), in
// the high byte; << 4 moves the magnitude to bits 4..10 and a sign copy to bit 15, the mask drops the rest
// (3 instructions for 2 weights; masks and shifts alone take 4 for bytes 0 and 2). SEL 0xA280: bytes 0 and 2
// (K0, K2) = register P0; 0xB391: bytes 1 and 3 (K1, K3) = P1.
template <u32 SEL>
__device__ __forceinline__ u32 pair(u32 w) {
    u32 d;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(w), "n"(SEL));
    return (d << 4) & 0x87F087F0u;
}

// act_quant of two values of one group (inv = 1 / scale, both powers of two) -> bf16x2 of q * scale (lo low)
__device__ __forceinline__ u32 quant_pair(float lo, float hi, float inv, float scale) {
    lo = fminf(fmaxf(lo * inv, -448.f), 448.f);
    hi = fminf(fmaxf(hi * inv, -448.f), 448.f);
    u16 q;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(q) : "f"(hi), "f"(lo));  // E4M3, round to nearest even
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(q));  // exact: every E4M3 value is an f16
    float qlo, qhi;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
        : "=f"(qlo), "=f"(qhi) : "r"(h2));
    u32 d;  // q * scale is exact in fp32 and, 4 significant bits, in bf16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(qhi * scale), "f"(qlo * scale));
    return d;
}

// Phase 1: rows m0..m0+7 of x (zeros from row M), K [k0, k0 + 8 cells_per_row), quantised into xs (fragment order).
// A thread takes 8 consecutive K (one uint4 of x, one uint4 of xs); a group's act_block / 8 threads are
// consecutive lanes (cells_per_row is a multiple of 16), so its amax is a butterfly of shuffles.
__device__ __forceinline__ void quantise_chunk(uint4* xs, const u16* __restrict__ x, i64 stride_xm, int M, int m0,
                                               int k0, int cells_per_row, int act_block) {
    const int total = TOKENS * cells_per_row;
    for (int base = 0; base < total; base += 32 * WARPS) {  // uniform trip count: every lane reaches the shuffles
        const int c = base + (int)threadIdx.x;
        const bool live = c < total;
        const int r = live ? c / cells_per_row : 0;
        const int kc = c - r * cells_per_row;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (live && m0 + r < M) v = ld_cached(x + (i64)(m0 + r) * stride_xm + k0 + 8 * kc);
        const int kk = kc & 15;  // cell kc: step kc / 16, K offset 8 (kc % 16) = 32 t + 8 q within the step
#if RAW_ACT
        if (live) xs[(kc >> 4) * 128 + (kk & 3) * 32 + r * 4 + (kk >> 2)] = v;  // the bf16 as it is
        continue;
#endif
        const u32 word[4] = {v.x, v.y, v.z, v.w};
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(word[i] << 16);
            f[2 * i + 1] = __uint_as_float(word[i] & 0xFFFF0000u);
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
        for (int o = 1; o < act_block / 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        amax = fmaxf(amax, 1e-4f);
        // scale = 2^ceil(log2(amax * fp32(1/448))) from the product's exponent field (+1 if any mantissa bit)
        const u32 bits = __float_as_uint(amax * 0x1.24924ap-9f);
        const u32 e = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);
        const float scale = __uint_as_float(e << 23), inv = __uint_as_float((254u - e) << 23);
        uint4 q;
        q.x = quant_pair(f[0], f[1], inv, scale);
        q.y = quant_pair(f[2], f[3], inv, scale);
        q.z = quant_pair(f[4], f[5], inv, scale);
        q.w = quant_pair(f[6], f[7], inv, scale);
        if (live) xs[(kc >> 4) * 128 + (kk & 3) * 32 + r * 4 + (kk >> 2)] = q;
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
#if CLUSTER_SPLIT
__cluster_dims__(1, 1, CLUSTER_SPLIT)
#endif
fp8_linear_mma(const u16* __restrict__ x, i64 stride_xm, int M,
               const u8* __restrict__ w, i64 stride_wn, const float* __restrict__ ws, i64 stride_wsn,
               void* __restrict__ out, i64 stride_os, i64 stride_om, int N, int k_split, int block, int act_block,
               u16* __restrict__ fin, i64 stride_fm, int* __restrict__ counters) {
    __shared__ uint4 xs[CHUNK_STEPS * 128];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int m0 = blockIdx.x * TOKENS;
    const int k_lo = blockIdx.z * k_split;
#if GROUP_ROWS
    x += (i64)(blockIdx.y * TILE_ROWS / GROUP_ROWS) * k_split * gridDim.z;  // the CTA's group of x (K long)
#endif
    const int steps = k_split / 128;
    const int s_step = 128 / block;  // scale columns per step of 128 K

    // the lane's weight rows: g and g + 8 of each m16 tile (clamped to N - 1: loads stay in bounds, their
    // outputs are not stored); the tile's scale row from its first row (a tile never straddles a block)
    const int row0 = blockIdx.y * TILE_ROWS + warp * (16 * MT);
    const u8* w_ptr[MT][2];
    const float* s_ptr[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(row0 + 16 * m + g + 8 * h, N - 1);
            w_ptr[m][h] = w + (i64)r * stride_wn + k_lo + 32 * t;
        }
        s_ptr[m] = ws + (i64)(min(row0 + 16 * m, N - 1) / block) * stride_wsn + (k_lo + 32 * t) / block;
    }

    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;

    Stage buf[STAGES];
    auto load = [&](Stage& st) {  // the next step in order: the pointers advance (no per-step address math)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                st.w[m][h][0] = ld_stream(w_ptr[m][h]);
                st.w[m][h][1] = ld_stream(w_ptr[m][h] + 16);
                w_ptr[m][h] += 128;
            }
            st.s[m] = __ldg(s_ptr[m]);
            s_ptr[m] += s_step;
        }
    };
    auto compute = [&](const Stage& st, int ls) {
        u32 mult[MT];  // bf16x2 2^120 x scale: exact (a power of two <= 2^127), the top half of its fp32 bits
#pragma unroll
        for (int m = 0; m < MT; ++m) mult[m] = (__float_as_uint(st.s[m] * 0x1p120f) >> 16) * 0x00010001u;
        uint4 xv[4];  // token g's bf16 activations over the lane's 32 K (8 per uint4)
#pragma unroll
        for (int q = 0; q < 4; ++q) xv[q] = xs[ls * 128 + q * 32 + lane];
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // word j: K 4j .. 4j + 3 of the lane's 32
            const u32 x01 = (j & 1) ? xv[j >> 1].z : xv[j >> 1].x, x23 = (j & 1) ? xv[j >> 1].w : xv[j >> 1].y;
            const u32 b0 = prmt(x01, x23, 0x5410u), b1 = prmt(x01, x23, 0x7632u);  // (x0, x2), (x1, x3)
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const u32 wg = word_of(st.w[m][0][j >> 2], j & 3), wg8 = word_of(st.w[m][1][j >> 2], j & 3);
                mma_bf16(acc[m], bmul2(pair<0xA280u>(wg), mult[m]), bmul2(pair<0xA280u>(wg8), mult[m]),
                         bmul2(pair<0xB391u>(wg), mult[m]), bmul2(pair<0xB391u>(wg8), mult[m]), b0, b1);
            }
        }
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) load(buf[j]);  // in flight while the first chunk is quantised
    // Launched with PDL this kernel starts while the previous one still runs. The loads above read only weights
    // (which no kernel writes), so they MAY precede the wait; in the sm_90 SASS ptxas puts the wait
    // (griddepcontrol.wait, ACQBULK) first all the same (tests/test_kernels_pdl_sass.py). Keeping them before
    // it (a prefetch between them pins the order), or prefetching the CTA's whole weight slice into L2 there,
    // made the b1 step slower on an H100 (2026-12-07, back to back: 1.070 against 1.054 ms, and 1.099 against
    // 1.059 in another run; BENCHMARKS.md).
    pdl_enter();
    for (int i = 0; i < steps; i += STAGES) {
        const int ls0 = i % CHUNK_STEPS;
        if (ls0 == 0) {  // a new chunk of the activations (the same branch in every thread)
            if (i) __syncthreads();  // every warp has read the previous one
            quantise_chunk(xs, x, stride_xm, M, m0, k_lo + i * 128, 16 * min(CHUNK_STEPS, steps - i), act_block);
            __syncthreads();
        }
#pragma unroll
        for (int j = 0; j < STAGES; ++j) {
            if (i + j + STAGES - 1 < steps) load(buf[(j + STAGES - 1) % STAGES]);
            compute(buf[j], ls0 + j);
        }
    }

    // C fragment: c0 / c1 = row g, tokens 2t / 2t + 1; c2 / c3 = row g + 8
#if CLUSTER_SPLIT
    __shared__ float part[TILE_CELLS];  // this split's partial, [token][tile row]
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rl = warp * (16 * MT) + 16 * m + g + 8 * h;
            part[(2 * t) * TILE_ROWS + rl] = acc[m][2 * h];
            part[(2 * t + 1) * TILE_ROWS + rl] = acc[m][2 * h + 1];
        }
    }
    cluster_barrier();  // every split's partial is in its CTA's shared memory
    {
        constexpr int SLICE = TILE_CELLS / CLUSTER_SPLIT;
        for (int i = threadIdx.x; i < SLICE; i += 32 * WARPS) {
            const int c = blockIdx.z * SLICE + i;
            const int r = blockIdx.y * TILE_ROWS + c % TILE_ROWS, tok = m0 + c / TILE_ROWS;
            if (r >= N || tok >= M) continue;
            const u32 local = static_cast<u32>(__cvta_generic_to_shared(&part[c]));
            float sum = ld_cluster(local, 0);
#pragma unroll
            for (int z = 1; z < CLUSTER_SPLIT; ++z) sum += ld_cluster(local, z);
            u16 v;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(sum));
            ((u16*)out)[(i64)tok * stride_om + r] = v;
        }
    }
    cluster_barrier();  // no CTA leaves (freeing its shared memory) while another still reads it
#else
    const int tok0 = m0 + 2 * t, tok1 = tok0 + 1;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + 16 * m + g + 8 * h;
            if (r >= N) continue;
#if SPLIT_OUT
            float* o = (float*)out + (i64)blockIdx.z * stride_os + r;
            if (tok0 < M) o[(i64)tok0 * stride_om] = acc[m][2 * h];
            if (tok1 < M) o[(i64)tok1 * stride_om] = acc[m][2 * h + 1];
#else
            u16* o = (u16*)out + r;
            u16 v0, v1;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v0) : "f"(acc[m][2 * h]));
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v1) : "f"(acc[m][2 * h + 1]));
            if (tok0 < M) o[(i64)tok0 * stride_om] = v0;
            if (tok1 < M) o[(i64)tok1 * stride_om] = v1;
#endif
        }
    }
#if SERIAL_SPLIT
    __shared__ int last;  // this CTA is the tile's S-th to finish
    __threadfence();      // this thread's partial stores are visible to every SM before the count below
    __syncthreads();      // ... for all of the CTA's threads
    if (threadIdx.x == 0) {
        int* c = counters + blockIdx.x * gridDim.y + blockIdx.y;
        last = atomicAdd(c, 1) == (int)gridDim.z - 1;
        if (last) *c = 0;  // every split has counted: back to 0 for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other splits' partials, counted before our add, are read after it
    const int tokens = min(TOKENS, M - m0);
    for (int i = threadIdx.x; i < tokens * TILE_ROWS; i += 32 * WARPS) {
        const int tok = m0 + i / TILE_ROWS, r = blockIdx.y * TILE_ROWS + i % TILE_ROWS;
        if (r >= N) continue;
        const float* p = (const float*)out + (i64)tok * stride_om + r;
        const int S = (int)gridDim.z;
        float part[16];  // every split's load in flight at once (S <= 16, the launcher's MAX_SPLIT), then the adds
#pragma unroll
        for (int z = 0; z < 16; ++z) part[z] = z < S ? __ldcg(p + (i64)z * stride_os) : 0.f;
        float sum = part[0];
#pragma unroll
        for (int z = 1; z < 16; ++z) if (z < S) sum += part[z];
        u16 v;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(sum));
        fin[(i64)tok * stride_fm + r] = v;
    }
#endif
#endif
}
