// FP8 linear for batched decode (M <= 128 rows) on Hopper's warpgroup MMA (wgmma), fed by TMA: E4M3 weights
// with fp32 pow2 block scales (128 x 128 in V4, 32 x 32 in V4.1) x act_quant's exact q * s of the activations.
//
// out[m, n] = bf16 of the fp32 sum over k of a[m, k] * W[n, k], a = act_quant's q * s in bf16 (exact: an E4M3
// code x a power of two), W = E4M3 code x scale[n / block, k / block] expanded to bf16 in registers (exact for
// pow2 scales up to 2^7: `fp8_linear_mma.SCALE_EXP_MAX`, the same expansion as fp8_linear_mma.cu's `pair`).
// Exact bf16 products summed in fp32 by the tensor cores: fp8_gemm's "bf16" form (the official fp8_gemm's math
// up to fp32 summation order; the torch twin fp8_linear_torch).
//
// Per CTA: ROWS = 64 CWG weight rows (the wgmma's M, one m64 tile per consumer warpgroup) x all NT >= M tokens
// (the wgmma's N: every weight byte is read once) x one split's K range, in stages of 128 K through a
// STAGES-deep shared-memory ring filled by one producer warp:
// * Weights: a TMA box [ROWS rows, 128 bytes] with the 128-byte swizzle (16-byte chunk c of row r at chunk
//   c ^ (r & 7): the lanes' 16-byte reads are conflict-free). Lane (g, t) of warp w takes its rows g and g + 8
//   of the warp's 16 and, of each, the physical K 32t .. 32t + 31 (two chunks, one weight scale: a 16-row
//   slice and a lane's 32 K never straddle a 32 x 32 or 128 x 128 block).
// * A fragments (m16n8k16 layout per warp: rows g / g + 8, logical K pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of
//   each 16-K step): step j takes word j of the lane's 32 bytes (physical 32t + 4j .. + 3): `pair` of bytes
//   (0, 2) for the first pair, (1, 3) for the second. So logical L = 16j + 8h + 2t + e holds physical
//   P = 32t + 4j + h + 2e; the activations are stored in that order (act_quant.linear_wgmma_k_order).
// * Activations: two TMA boxes [NT rows, 128 bytes] (logical K 0-63, 64-127) of the bf16 [M, K] operand with the
//   128-byte swizzle; rows >= M are the TMA's zero fill. Step j at box j >> 2, byte 32 (j & 3).
// * Pipeline: full[s] (expect_tx; the TMA completes it), empty[s] (one arrival per consumer warp after its
//   wgmmas of the stage are done).
// * Split-K (SPLIT 1, gridDim.y = S splits): each CTA writes its fp32 partial sums to part[split, m, n]; the
//   last CTA of a row tile to finish (a per-tile arrival counter, reset by that CTA for the next launch) adds
//   the S partials in split order and writes bf16: one launch, deterministic (the order does not depend on
//   which CTA is last), CUDA-graph capturable. Launches that share `counters` must not run concurrently.
// Launch: grid (ceil(N / ROWS), S), block 128 CWG + 32, dynamic shared memory `fp8_linear_wgmma.smem_bytes`.
// Requires: k_split % 128 == 0, M <= NT.

#include "mma_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef NT
#define NT 64  // the launcher passes every constant (fp8_linear_wgmma.plan)
#endif
#ifndef CWG
#define CWG 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef SPLIT
#define SPLIT 0
#endif
#define KSTEP 128
#define ROWS (64 * CWG)
#define W_STAGE (ROWS * KSTEP)  // E4M3 bytes per stage
#define A_HALF (NT * 128)       // one 64-K box of activations: NT rows x 128 bytes
#define A_STAGE (2 * A_HALF)
#define NACC (NT / 2)           // fp32 accumulators per lane: 64 x NT / 128 threads

// d (the m64 x NT fp32 accumulator fragment) += A (registers, m16n8k16 layout per warp) @ B (shared memory, by
// descriptor), bf16 inputs
#if NT == 8
__device__ __forceinline__ void wgmma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3"
        "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
#elif NT == 16
__device__ __forceinline__ void wgmma_bf16(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
#elif NT == 32
__device__ __forceinline__ void wgmma_bf16(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
#elif NT == 64
__device__ __forceinline__ void wgmma_bf16(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
#elif NT == 128
__device__ __forceinline__ void wgmma_bf16(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
#else
#error "NT must be 8, 16, 32, 64 or 128"
#endif

extern "C" __global__ void __launch_bounds__(128 * CWG + 32, 1)
fp8_linear_wgmma(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_a,
                 const float* __restrict__ ws, i64 stride_wsn, int block, u16* __restrict__ out, i64 stride_om,
                 float* __restrict__ part, int* __restrict__ counters, int M, int N, int k_split) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int r0 = blockIdx.x * ROWS;
    const int k0 = blockIdx.y * k_split;
    const int steps = k_split / KSTEP;

    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);  // the swizzled boxes need 1024-byte alignment
    unsigned char* a_ring = smem;                     // [STAGES][2][NT][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][ROWS][128], 128-byte swizzled
    u64* bars = reinterpret_cast<u64*>(w_ring + STAGES * W_STAGE);
    __shared__ int last_flag;
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 4 * CWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();

    if (warp == 4 * CWG) {
        // ---- producer warp (lane 0): the stage's weight box and the two activation boxes ----
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_a) : "memory");
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(empty0 + 8 * s, ((step / STAGES) & 1) ^ 1);
                const u32 full = full0 + 8 * s;
                mbar_expect_tx(full, W_STAGE + A_STAGE);
                const int k = k0 + step * KSTEP;
                tma_load_2d(smem_u32(w_ring + s * W_STAGE), &tmap_w, k, r0, full);
                const u32 a_dst = smem_u32(a_ring + s * A_STAGE);
                tma_load_2d(a_dst, &tmap_a, 2 * k, 0, full);
                tma_load_2d(a_dst + A_HALF, &tmap_a, 2 * k + 128, 0, full);
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    const int lr0 = wg * 64 + wi * 16 + g, lr1 = lr0 + 8;
    const int gr0 = r0 + lr0, gr1 = r0 + lr1;
    // the lane's weight scales: its rows' block row (rows past N read the last one: their weights are the TMA's
    // zero fill), column (k0 + 128 step + 32 t) / block
    const float* sp = ws + (i64)(min(gr0, N - 1) / block) * stride_wsn;
    float sc = sp[(k0 + 32 * t) / block];

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        // bf16x2 2^120 x scale: exact (a power of two <= 2^127), the top half of its fp32 bits
        const u32 mult = (__float_as_uint(sc * 0x1p120f) >> 16) * 0x00010001u;
        if (step + 1 < steps) sc = sp[(k0 + (step + 1) * KSTEP + 32 * t) / block];
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        const unsigned char* wt = w_ring + s * W_STAGE;
        uint4 w0[2], w1[2];
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            w0[v] = *reinterpret_cast<const uint4*>(wt + lr0 * KSTEP + (((2 * t + v) ^ (lr0 & 7)) << 4));
            w1[v] = *reinterpret_cast<const uint4*>(wt + lr1 * KSTEP + (((2 * t + v) ^ (lr1 & 7)) << 4));
        }
        u32 fr[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 x0 = word_of(w0[j >> 2], j & 3), x1 = word_of(w1[j >> 2], j & 3);
            fr[j][0] = bmul2(pair<0xA280u>(x0), mult);
            fr[j][1] = bmul2(pair<0xA280u>(x1), mult);
            fr[j][2] = bmul2(pair<0xB391u>(x0), mult);
            fr[j][3] = bmul2(pair<0xB391u>(x1), mult);
        }
        const u32 a_base = smem_u32(a_ring + s * A_STAGE);
        keep_all(acc);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 8; ++j)
            wgmma_bf16(acc, fr[j][0], fr[j][1], fr[j][2], fr[j][3],
                       desc_sw128(a_base + (j >> 2) * A_HALF + (j & 3) * 32));
        wgmma_commit();
        wgmma_wait<0>();
        keep_all(acc);
        keep_all(fr);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);  // the slot goes back to the producer
    }

    // accumulator fragment: acc[4j + e] = (row gr0, token 8j + 2t + e), acc[4j + 2 + e] = (row gr1, same token)
#if SPLIT
    float* mine = part + (i64)blockIdx.y * M * N;
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * t + e;
            if (tok >= M) continue;
            if (gr0 < N) mine[(i64)tok * N + gr0] = acc[4 * j + e];
            if (gr1 < N) mine[(i64)tok * N + gr1] = acc[4 * j + 2 + e];
        }
    __threadfence();  // this CTA's partials are visible device-wide before its arrival is counted
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");  // the consumer threads only
    if (threadIdx.x == 0) last_flag = atomicAdd(&counters[blockIdx.x], 1) == (int)gridDim.y - 1;
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");
    if (!last_flag) return;
    __threadfence();
    // the last CTA: every split's partial of the lane's own elements, added in split order
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * t + e;
            if (tok >= M) continue;
            float s0 = 0.f, s1 = 0.f;
            for (int sp_i = 0; sp_i < (int)gridDim.y; ++sp_i) {
                const float* p = part + ((i64)sp_i * M + tok) * N;
                if (gr0 < N) s0 += __ldcg(p + gr0);
                if (gr1 < N) s1 += __ldcg(p + gr1);
            }
            acc[4 * j + e] = s0;
            acc[4 * j + 2 + e] = s1;
        }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch (kernel boundary orders it)
#endif
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * t + e;
            if (tok >= M) continue;
            if (gr0 < N) out[(i64)tok * stride_om + gr0] = (u16)(__float_as_uint(bf16_round(acc[4 * j + e])) >> 16);
            if (gr1 < N) out[(i64)tok * stride_om + gr1] = (u16)(__float_as_uint(bf16_round(acc[4 * j + 2 + e])) >> 16);
        }
}
