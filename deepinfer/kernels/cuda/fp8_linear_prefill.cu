// FP8 linear of the prefill regime (fp8_linear's auto form from FP8_MMA_MIN_M rows) on Hopper's warpgroup MMA
// with both operands' E4M3 codes in shared memory, fed by TMA: the official fp8_gemm's math. sm_90a only.
//
// Contract: out bf16 [M, N] = round_bf16(acc), acc[m, n] = sum over K groups kb (128 K each, in order) of
//   P[m, n, kb] * (xs[m, kb] * ws[n / 128, kb]), each term added by one fused multiply-add into fp32, where
//   P[m, n, kb] = the FP8 tensor cores' fp32 dot of x's E4M3 codes [m, 128 kb ..] and W's codes [n, 128 kb ..]
//   (4 wgmma k32 steps chained into a fresh accumulator),
// * x E4M3 codes [M, K] and xs fp32 [M, K / 128]: act_quant's output (the official act_quant, block 128);
// * W E4M3 codes [N, K] and ws fp32 [N / 128, K / 128]: the checkpoint's 128 x 128 block-scaled weight.
// This is `fp8_gemm._fp8_linear_mma_kernel`'s ("fp8" form) math step for step: the same FP8 MMA per 128 K
// (its reduced-precision accumulation inside a group is the hardware's, the same instruction and K order), the
// same promotion (Triton contracts `acc += part * (a_s * b_s)` into one FMA), the same one bf16 rounding;
// the GPU test holds the two to the bit. V4's blocks only (128 x 128 weights, act block 128); V4.1's 32-blocks
// promote every 32 K and stay on the Triton form.
//
// Why: the Triton form reaches ~740 TFLOP/s at the prefill's shapes (BENCHMARKS.md, H100 8k prefill: 9.05 ms of
// FP8 linears): each program issues a group's wgmmas, waits for them, promotes, and only then loads and issues
// the next, so the tensor cores idle through every promotion. Here (the layout DeepGEMM made known) a producer
// warp keeps a STAGES-deep TMA ring full, and CWG consumer warpgroups of 64 rows each run
// issue -> wait -> promote on their own rows: while one warpgroup promotes, the other's wgmmas run.
// PIPE 1 keeps two partials, so a warpgroup issues stage i + 1's wgmmas before it promotes stage i's (the
// promotion hides behind its own MMAs too); its registers come from a producer warpgroup (setmaxnreg).
//
// Per CTA: a BM = 64 CWG x BN output tile (tile order grouped by GROUP_M row tiles, as Triton's programs, so the
// CTAs in flight share weight and activation tiles in L2), the whole K in stages of 128:
// * Stage s: x box [BM rows, 128 bytes] and W box [BN rows, 128 bytes], both with the 128-byte swizzle (the
//   K-major layout wgmma's descriptors read; an FP8 wgmma takes K-major operands only). Rows past M or N are the
//   TMA's zero fill (they count in the transaction bytes).
// * Consumer warpgroup c: rows 64c .. 64c + 63 of the tile; k32 step j of a stage reads both boxes 32 j bytes
//   into their rows (the swizzle atom's start offset, as the bf16 kernels step 16-K halves).
// * Promotion: the lane's accumulator rows are r0 = 64c + 16 w + g and r0 + 8 (the m64nN fragment: d[4j + e] =
//   (r0, 8j + 2t + e), d[4j + 2 + e] = (r0 + 8, ..)); their two activation scales and the tile's weight scale
//   (BN divides 128: one block row) are read before the stage's wait.
// * Epilogue: bf16 rounded (RNE) into a staging tile in the ring's shared memory, then 16-byte vector stores
//   along the output rows.
// Launch: grid (ceil(M / BM) x N / BN), block THREADS (128 CWG + a producer warp, or warpgroup with PIPE), dynamic shared memory `fp8_linear_prefill.smem_bytes`.
// Requires (the launcher checks): K % 128 == 0, N % BN == 0, 16-byte aligned rows.

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef CWG
#define CWG 2  // the launcher passes every constant (fp8_linear_prefill.tiles)
#endif
#ifndef BN
#define BN 128
#endif
#ifndef STAGES
#define STAGES 6
#endif
#ifndef GROUP_M
#define GROUP_M 8
#endif
#ifndef PIPE
#define PIPE 0  // 1: two partials, the next stage's wgmmas in flight while one is promoted
#endif
#ifndef PERSIST
#define PERSIST 0  // 1: the persistent form (fp8_linear_prefill_persistent): a CTA an SM walks the tiles
#endif
#if PERSIST && PIPE
#error "PERSIST takes one partial (PIPE 0)"
#endif
#if BN != 64 && BN != 128
#error "BN must be 64 or 128"
#endif
#if CWG < 1 || CWG > 3
#error "CWG must be 1, 2 or 3"
#endif
#define KSTEP 128
#define BM (64 * CWG)
// PIPE's two partials need more than the 168 registers a thread ptxas allots a CTA of 2 consumer warpgroups and a
// producer warp (it counts whole warpgroups): the producer becomes a warpgroup that hands registers to the
// consumers (setmaxnreg: 128 x 40 + 256 x 232 <= 65536)
#define PRODUCER_THREADS (PIPE && CWG == 2 ? 128 : 32)
#define THREADS (128 * CWG + PRODUCER_THREADS)
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#define A_STAGE (BM * KSTEP)  // bytes: one E4M3 code a value
#define B_STAGE (BN * KSTEP)
#define NACC (BN / 2)         // fp32 accumulators per lane: 64 x BN / 128 threads
#define LINE (BN * 2 + 16)    // a staged output row: BN bf16 + 16 bytes (rows g = 0..7 of a warp 4 banks apart)
static_assert(BM * LINE <= STAGES * (A_STAGE + B_STAGE), "the epilogue's staging tile must fit in the ring");

// the first output row and column of tile `tile` in the grouped order (Triton's `_tile_ids`): GROUP_M row tiles
// walk the N tiles together
__device__ __forceinline__ void tile_origin(int tile, int tiles_m, int tiles_n, int& m0, int& n0) {
    const int per_group = GROUP_M * tiles_n;
    const int first_m = (tile / per_group) * GROUP_M;
    const int group_m = min(tiles_m - first_m, GROUP_M);
    m0 = (first_m + (tile % per_group) % group_m) * BM;
    n0 = ((tile % per_group) / group_m) * BN;
}

// the producer's stage: the activation box (BM rows) and the weight box (BN rows) at K offset k into ring slot s
__device__ __forceinline__ void load_stage(const TensorMap* tmap_x, const TensorMap* tmap_w, unsigned char* x_ring,
                                           unsigned char* w_ring, u32 full0, int s, int k, int m0, int n0) {
    const u32 full = full0 + 8 * s;
    mbar_expect_tx(full, A_STAGE + B_STAGE);
    tma_load_2d(smem_u32(x_ring + s * A_STAGE), tmap_x, k, m0, full);
    tma_load_2d(smem_u32(w_ring + s * B_STAGE), tmap_w, k, n0, full);
}

// one 128-K group into a fresh partial: 4 k32 wgmmas from the warpgroup's activation rows (xa) and the weight
// rows (wa), one commit group
__device__ __forceinline__ void issue_group(float (&part)[NACC], u32 xa, u32 wa) {
    keep_all(part);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < KSTEP / 32; ++j) wgmma_ss_e4m3(part, desc_sw128(xa + 32 * j), desc_sw128(wa + 32 * j), j);
    wgmma_commit();
}

// the official promotion: acc += part x (activation scale x weight scale), one FMA each; p0 for the lane's row
// r0 (fragment entries 4j, 4j + 1), p1 for row r0 + 8 (4j + 2, 4j + 3)
__device__ __forceinline__ void promote(float (&acc)[NACC], const float (&part)[NACC], float p0, float p1) {
#pragma unroll
    for (int j = 0; j < NACC / 4; ++j) {
        acc[4 * j] = fmaf(part[4 * j], p0, acc[4 * j]);
        acc[4 * j + 1] = fmaf(part[4 * j + 1], p0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(part[4 * j + 2], p1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(part[4 * j + 3], p1, acc[4 * j + 3]);
    }
}

// two outputs as one bf16x2 word (each rounded to nearest even), lo's in the low half: adjacent columns
__device__ __forceinline__ u32 bf16x2_bits(float lo, float hi) {
    return (__float_as_uint(bf16_round(lo)) >> 16) | (__float_as_uint(bf16_round(hi)) & 0xFFFF0000u);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
fp8_linear_prefill(const __grid_constant__ TensorMap tmap_x, const __grid_constant__ TensorMap tmap_w,
                   const float* __restrict__ xs, i64 stride_xsm, const float* __restrict__ ws, i64 stride_wsn,
                   u16* __restrict__ out, i64 stride_om, int M, int N, int K) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    int m0, n0;
    tile_origin(blockIdx.x, (M + BM - 1) / BM, N / BN, m0, n0);
    const int steps = K / KSTEP;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);  // the swizzled boxes need 1024-byte alignment
    unsigned char* x_ring = smem;                     // [STAGES][BM][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][BN][128], 128-byte swizzled
    u64* bars = reinterpret_cast<u64*>(w_ring + STAGES * B_STAGE);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);

    if (threadIdx.x == 0) ring_init(full0, empty0, STAGES, 4 * CWG);  // empty: one arrival per consumer warp
    __syncthreads();

    if (warp >= 4 * CWG) {
        // ---- producer warp (lane 0 of the first producer warp): the stage's activation box and weight box ----
#if PRODUCER_THREADS == 128
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#endif
        if (warp == 4 * CWG && lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_x) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(empty0 + 8 * s, ((step / STAGES) & 1) ^ 1);
                load_stage(&tmap_x, &tmap_w, x_ring, w_ring, full0, s, step * KSTEP, m0, n0);
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
#if PRODUCER_THREADS == 128
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
#endif
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = m0 + wg * 64 + wi * 16 + g;  // the lane's output rows r0 and r0 + 8
    // rows past M: their codes are the TMA's zero fill, so any finite scale keeps them 0 (and they are not stored)
    const float* xs0 = xs + (i64)min(r0, M - 1) * stride_xsm;
    const float* xs1 = xs + (i64)min(r0 + 8, M - 1) * stride_xsm;
    const float* wsr = ws + (i64)(n0 / 128) * stride_wsn;

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
    float sa0 = xs0[0], sa1 = xs1[0], sw = wsr[0];
    // stage `step`'s scale products; the next group's scale loads go out now, a stage ahead of their use
    auto scales = [&](int step, float& p0, float& p1) {
        p0 = sa0 * sw;
        p1 = sa1 * sw;
        if (step + 1 < steps) {
            sa0 = xs0[step + 1];
            sa1 = xs1[step + 1];
            sw = wsr[step + 1];
        }
    };
    // wait for stage `step` and issue its 4 k32 wgmmas into a fresh partial (one commit group)
    auto issue = [&](float (&part)[NACC], int step) {
        const int s = step % STAGES;
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        issue_group(part, smem_u32(x_ring + s * A_STAGE + wg * 64 * KSTEP), smem_u32(w_ring + s * B_STAGE));
    };
    auto release = [&](int step) {  // this warp's reads of stage `step` are done: one arrival on its empty barrier
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * (step % STAGES));
    };
#if PIPE
    // two partials: stage i + 1's wgmmas are issued before stage i's partial is promoted, so a warpgroup's own
    // next MMAs run through its promotion (not only the other warpgroup's)
    float pa[NACC], pb[NACC];
    auto stage = [&](float (&cur)[NACC], float (&nxt)[NACC], int step) {
        float p0, p1;
        scales(step, p0, p1);
        if (step + 1 < steps) {
            issue(nxt, step + 1);
            wgmma_wait<1>();  // stage `step`'s group is done; step + 1's stays in flight
        } else {
            wgmma_wait<0>();
        }
        keep_all(cur);
        release(step);
        promote(acc, cur, p0, p1);
    };
    issue(pa, 0);
    int step = 0;
    for (; step + 1 < steps; step += 2) {
        stage(pa, pb, step);
        stage(pb, pa, step + 1);
    }
    if (step < steps) stage(pa, pb, step);
#else
    float part[NACC];
    for (int step = 0; step < steps; ++step) {
        float p0, p1;
        scales(step, p0, p1);
        issue(part, step);
        wgmma_wait<0>();
        keep_all(part);
        release(step);
        promote(acc, part, p0, p1);
    }
#endif

    // epilogue: every stage was waited for and every wgmma is done once all consumer warps pass the barrier,
    // so the ring holds the staging tile [BM rows][LINE bytes]
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");  // consumer threads only (the producer exited)
    const int lr0 = wg * 64 + wi * 16 + g;
#pragma unroll
    for (int j = 0; j < NACC / 4; ++j) {
        const int col = 8 * j + 2 * t;
        *reinterpret_cast<u32*>(smem + lr0 * LINE + 2 * col) = bf16x2_bits(acc[4 * j], acc[4 * j + 1]);
        *reinterpret_cast<u32*>(smem + (lr0 + 8) * LINE + 2 * col) = bf16x2_bits(acc[4 * j + 2], acc[4 * j + 3]);
    }
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");
    constexpr int CHUNKS = BN / 8;  // 16-byte chunks per output row
    for (int c = threadIdx.x; c < BM * CHUNKS; c += 128 * CWG) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        if (m0 + r >= M) continue;
        *reinterpret_cast<uint4*>(out + (i64)(m0 + r) * stride_om + n0 + col) =
            *reinterpret_cast<const uint4*>(smem + r * LINE + 2 * col);
    }
}

#if PERSIST
// The persistent form: gridDim.x CTAs (one an SM) walk the tiles t = blockIdx.x, + gridDim.x, ... in the same
// grouped order. The ring runs on across tiles (one stage counter for the whole walk), so the producer loads the
// next tile's first stages while the consumers finish this one and store it: a short K (wq_b's 8 stages) no
// longer pays a pipeline fill and an epilogue per tile. The epilogue stores from the fragments (the ring is in
// use): per lane two bf16 pairs of rows r0 and r0 + 8 per 8 columns. The math is the kernel above's.
extern "C" __global__ void __launch_bounds__(128 * CWG + 32, 1)
fp8_linear_prefill_persistent(const __grid_constant__ TensorMap tmap_x, const __grid_constant__ TensorMap tmap_w,
                              const float* __restrict__ xs, i64 stride_xsm, const float* __restrict__ ws,
                              i64 stride_wsn, u16* __restrict__ out, i64 stride_om, int M, int N, int K) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = N / BN, n_tiles = tiles_m * tiles_n;
    const int steps = K / KSTEP;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);
    unsigned char* x_ring = smem;                     // [STAGES][BM][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][BN][128], 128-byte swizzled
    u64* bars = reinterpret_cast<u64*>(w_ring + STAGES * B_STAGE);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);
    if (threadIdx.x == 0) ring_init(full0, empty0, STAGES, 4 * CWG);
    __syncthreads();

    if (warp == 4 * CWG) {
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_x) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            int it = 0;  // stages issued over the whole walk
            for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
                int m0, n0;
                tile_origin(tile, tiles_m, tiles_n, m0, n0);
                for (int step = 0; step < steps; ++step, ++it) {
                    const int s = it % STAGES;
                    if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1);
                    load_stage(&tmap_x, &tmap_w, x_ring, w_ring, full0, s, step * KSTEP, m0, n0);
                }
            }
        }
        return;
    }

    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    float acc[NACC], part[NACC];
    int it = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin(tile, tiles_m, tiles_n, m0, n0);
        const int r0 = m0 + wg * 64 + wi * 16 + g;
        const float* xs0 = xs + (i64)min(r0, M - 1) * stride_xsm;
        const float* xs1 = xs + (i64)min(r0 + 8, M - 1) * stride_xsm;
        const float* wsr = ws + (i64)(n0 / 128) * stride_wsn;
#pragma unroll
        for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
        float sa0 = xs0[0], sa1 = xs1[0], sw = wsr[0];
        for (int step = 0; step < steps; ++step, ++it) {
            const float p0 = sa0 * sw, p1 = sa1 * sw;
            if (step + 1 < steps) {
                sa0 = xs0[step + 1];
                sa1 = xs1[step + 1];
                sw = wsr[step + 1];
            }
            const int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            issue_group(part, smem_u32(x_ring + s * A_STAGE + wg * 64 * KSTEP), smem_u32(w_ring + s * B_STAGE));
            wgmma_wait<0>();
            keep_all(part);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * s);
            promote(acc, part, p0, p1);
        }
        u16* row0 = out + (i64)r0 * stride_om + n0 + 2 * t;
        u16* row1 = row0 + 8 * stride_om;
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j) {
            if (r0 < M) *reinterpret_cast<u32*>(row0 + 8 * j) = bf16x2_bits(acc[4 * j], acc[4 * j + 1]);
            if (r0 + 8 < M) *reinterpret_cast<u32*>(row1 + 8 * j) = bf16x2_bits(acc[4 * j + 2], acc[4 * j + 3]);
        }
    }
}
#endif
