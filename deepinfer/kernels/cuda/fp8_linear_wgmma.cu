// FP8 linear of the batched-decode regime (fp8_linear's auto form: 17..256 rows) on Hopper's warpgroup MMA, fed by TMA:
// the E4M3 weights are expanded in registers and enter wgmma as its register operand A, the step's tokens
// enter as its shared-memory operand B (the tokens are the wgmma's N). sm_90a only.
//
// Contract: out[m, n] = sum over k of a[m, k] W[n, k], where
// * a bf16 [M, K] is act_quant's exact q * s of the activation, each 128-K group's columns in
//   `act_quant.wgmma_k_order` (`act_quant.act_quant_wgmma` writes it; the same order as fp4_moe_wgmma.cu's);
// * W = E4M3 code x its fp32 power-of-two block scale (blocks of 128 x 128 in V4, 32 x 32 in V4.1);
// * SPLIT_OUT 0: out bf16 [M, N] (rounded once); SPLIT_OUT 1: the fp32 partial of split blockIdx.z's K range
//   into out[z, m, n], added in a fixed order by the caller (fp8_gemm's `_split_sum_kernel`). (A cluster form
//   that added the split partials over distributed shared memory, as fp8_linear_mma.cu's CLUSTER_SPLIT, was
//   bit-identical but slower at 6 of the layer's 7 shapes on the H200 (per layer: M=32 79.5 -> 92.2 us, M=128
//   104.2 -> 125.2): its CTAs fill an SM each, so a cluster waits for S free SMs of one GPC. Removed
//   2026-12-05; in git history before that day's removal commit.)
// SERIAL_SPLIT 1 (with SPLIT_OUT 1): the tile's last split CTA also adds the S partials, in the fixed order
// z = 0, 1, ..., S - 1 from L2, into bf16 fin[m, n] (counted in counters[tile], put back to 0 by that CTA):
// fp8_linear_mma.cu's serial split-K, the bits of `_split_sum_kernel` without its launch.
// Math: both operands are exact in bf16 (4 significant bits x a power of two), so the tensor cores' products
// are exact and their sums fp32: fp8_gemm's "bf16" / "swap" forms and the mma.sync kernel (fp8_linear_mma.cu),
// up to fp32 summation order (the torch twin `quant_weights.fp8_linear_torch`).
//
// Why a fourth form: the Triton "swap" form (the same roles) reached ~1 TB/s of weights at 32..128 rows
// (BENCHMARKS.md): Triton loads the weight tile into registers, converts it and waits for each wgmma in
// turn, so a CTA's loads, expansion and MMAs do not overlap. Here one producer warp streams weights and
// tokens with TMA into a STAGES-deep shared-memory ring and the consumer warpgroups expand stage i + 1 while
// stage i's wgmmas run.
//
// Per CTA: BT tokens (token tile blockIdx.x) x ROWS = 64 CWG weight rows (row tile blockIdx.y) x one split's
// K range, in stages of 128 K:
// * Weights: one 2-D TMA box [128 bytes, ROWS rows] per stage with the 128-byte swizzle (16-byte chunk c of
//   row r lands at chunk c ^ (r & 7)). Warp w of warpgroup c owns rows 64c + 16w + g and + 8 (g = lane / 4);
//   lane t = lane % 4 reads the PHYSICAL K 32t .. 32t + 31 of both rows (two 16-byte chunks each, no bank
//   conflict: the 8 lanes of a phase hit 8 different chunks). Rows g and g + 8 lie in one 16-aligned group
//   and K 32t.. in one 32-aligned group: one weight scale per lane and stage for 32 and for 128 blocks.
// * A fragments: wgmma's logical K L = 16s + 8h + 2t + e (16-K step s, fragment half h, pair element e) is
//   physical P = 32t + 8(s >> 1) + 2(s & 1) + h + 4e (`wgmma_k_order`): with lo / hi the lane's words 2q / 2q + 1
//   (q = s >> 1; physical 32t + 8q ..), register a0 (row g, h 0) of step s takes byte j = 2(s & 1) of lo and
//   of hi, a2 (h 1) byte j + 1; rows g + 8 the same (a1 / a3). `e4m3_pair<j>` builds one register from the two
//   bytes with one byte permute, one shift and one mask as E4M3 x 2^-120 bf16 bit patterns (fp8_linear_mma.cu's
//   expansion); one bf16x2 multiply by 2^120 x scale makes them E4M3 x scale exactly (scales up to 2^7: the
//   launcher checks the range once per weight).
// * Activations: two 2-D TMA boxes [BT rows, 128 bytes] (logical K 0-63, 64-127) with the 128-byte swizzle, the
//   K-major layout wgmma's descriptor reads (fp4_moe_wgmma.cu's); rows past M are the TMA's zero fill.
// * Pipeline: full[s] (the producer's expect_tx; the TMA completes it), empty[s] (one arrival per consumer warp
//   once the wgmmas reading stage s are done). Two fragment buffers: a warpgroup expands stage i + 1 while
//   stage i's 8 wgmmas run; with HALVES, half stages (16 registers each: what fits beside the accumulators
//   of 4 consumer warpgroups), one half expanded while the previous half's 4 wgmmas run.
// Launch: grid (ceil(M / BT), ceil(N / ROWS), S), block 128 CWG + 32, dynamic shared memory
// `fp8_linear_wgmma.smem_bytes` (1024 bytes of it slack for the swizzle's alignment).
// Requires (the launcher checks): K split % 128 == 0; weight block 32 or 128; rows 16-byte aligned.
// The grouped output LoRA (GROUP_ROWS R > 0): V4's wo_a at 9..256 tokens, `einsum("tgd,grd->tgr", o, wo_a)` on
// bf16 operands (the official block's; wo_a's bf16 is convert.py's exact dequantisation of these FP8 bytes):
// W is [G R, K] and a is o [M, G K] in `wgmma_k_order` (`act_quant.act_quant_wgmma(..., quant=False)`: o's bf16
// values, not quantised); weight rows [g R, (g + 1) R) multiply a's columns [g K, (g + 1) K), so a CTA (whose
// rows lie in one group: R a multiple of ROWS) reads its group's K columns. The products stay exact (o's 8
// significant bits x the weight's 4) and the sums fp32: the einsum's math up to fp32 summation order, as
// fp8_linear_mma.cu's RAW_ACT / GROUP_ROWS form at up to 8 tokens.

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef BT
#define BT 128  // the launcher passes every constant (fp8_linear_wgmma.tiles)
#endif
#ifndef CWG
#define CWG 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef SPLIT_OUT
#define SPLIT_OUT 0
#endif
#ifndef SERIAL_SPLIT
#define SERIAL_SPLIT 0  // 1: the tile's last split CTA adds the fp32 partials into bf16 fin (see above)
#endif
#ifndef GROUP_ROWS
#define GROUP_ROWS 0  // > 0: weight rows [g GROUP_ROWS, (g + 1) GROUP_ROWS) multiply a's group g of K columns
#endif
#ifndef HALVES
#define HALVES 0  // 1: half-stage fragment buffers (16 registers each), what fits 4 consumer warpgroups
#endif
#ifndef DIAG
#define DIAG 0  // diagnostics, not the GEMM (benchmarks time them against it): 1 the ring alone (the producer's
#endif          // copies; consumers release each stage unread), 2 the math alone (no copies: stale shared memory),
                // 3 the wgmmas alone (no copies, no expansion: the same registers every stage)
#if DIAG == 3 && HALVES
#error "DIAG 3 (the wgmmas alone) exists for whole-stage fragment buffers only (HALVES 0)"
#endif
#if BT != 16 && BT != 32 && BT != 64 && BT != 128
#error "BT must be 16, 32, 64 or 128"
#endif
#define KSTEP 128
#define ROWS (64 * CWG)
#define W_STAGE (ROWS * KSTEP)  // bytes of weights per stage (one E4M3 byte a weight)
#define A_HALF (BT * 128)       // one 64-K box of activations: BT rows x 128 bytes
#define A_STAGE (2 * A_HALF)
#define NACC (BT / 2)           // fp32 accumulators per lane: 64 x BT / 128 threads
static_assert(GROUP_ROWS % ROWS == 0, "GROUP_ROWS: whole CTA tiles of weight rows per group");
static_assert(!SERIAL_SPLIT || SPLIT_OUT, "SERIAL_SPLIT: the fp32 partials' form only");
__device__ __forceinline__ u32 bf16_bits(float x) { return __float_as_uint(bf16_round(x)) >> 16; }  // RNE
#if SPLIT_OUT
typedef float OutT;  // the fp32 partial
__device__ __forceinline__ float out_value(float x) { return x; }
#else
typedef u16 OutT;    // bf16, rounded once
__device__ __forceinline__ u16 out_value(float x) { return (u16)bf16_bits(x); }
#endif
// a token's output row in the epilogue's staging tile: ROWS outputs + 16 bytes, so the 4 tokens a warp's
// store instruction covers (t = 0..3, tokens 2 apart) start 32 bytes apart in the banks
#define LINE (ROWS * (int)sizeof(OutT) + 16)
static_assert(BT * LINE <= STAGES * (A_STAGE + W_STAGE), "the epilogue's staging tile must fit in the ring");

// bytes J of lo and of hi (E4M3 codes) as a bf16x2 of E4M3 x 2^-120, lo's in the low half: the byte permute
// puts each byte in the low byte of its half and its sign, replicated, in the high byte; << 4 moves the
// magnitude to bits 4..10 and a sign copy to bit 15, the mask drops the rest
template <int J>
__device__ __forceinline__ u32 e4m3_pair(u32 lo, u32 hi) {
    return prmt(lo, hi, (u32)(J | ((8 + J) << 4) | ((4 + J) << 8) | ((12 + J) << 12))) << 4 & 0x87F087F0u;
}

// A fragments of the 16-K steps 4h .. 4h + 2 NQ - 1 of a stage (h = 0 / 1: the lane's first / second 16 bytes)
// from the 16 bytes of rows g (r0) and g + 8 (r1) that feed them, times m = bf16x2 of 2^120 x the weight
// scale: words 2q and 2q + 1 of the chunk (lo, hi) feed steps 4h + 2q and 4h + 2q + 1
template <int NQ>
__device__ __forceinline__ void expand_chunk(u32 (&fr)[2 * NQ][4], const uint4& r0, const uint4& r1, u32 m) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
        const u32 lo0 = word_of(r0, 2 * q), hi0 = word_of(r0, 2 * q + 1);
        const u32 lo1 = word_of(r1, 2 * q), hi1 = word_of(r1, 2 * q + 1);
        fr[2 * q][0] = bmul2(e4m3_pair<0>(lo0, hi0), m);
        fr[2 * q][1] = bmul2(e4m3_pair<0>(lo1, hi1), m);
        fr[2 * q][2] = bmul2(e4m3_pair<1>(lo0, hi0), m);
        fr[2 * q][3] = bmul2(e4m3_pair<1>(lo1, hi1), m);
        fr[2 * q + 1][0] = bmul2(e4m3_pair<2>(lo0, hi0), m);
        fr[2 * q + 1][1] = bmul2(e4m3_pair<2>(lo1, hi1), m);
        fr[2 * q + 1][2] = bmul2(e4m3_pair<3>(lo0, hi0), m);
        fr[2 * q + 1][3] = bmul2(e4m3_pair<3>(lo1, hi1), m);
    }
}

extern "C" __global__ void __launch_bounds__(128 * CWG + 32, 1)
fp8_linear_wgmma(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_a,
                 const float* __restrict__ ws, i64 stride_wsn, int block,
                 void* __restrict__ out, i64 stride_os, i64 stride_om, int M, int N, int k_split,
                 u16* __restrict__ fin, i64 stride_fm, int* __restrict__ counters) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int tok0 = blockIdx.x * BT;  // token tiles on x (launched first): the tiles sharing a weight tile run
    const int row0 = blockIdx.y * ROWS;  // together, so the weights come from HBM once
    const int k_lo = blockIdx.z * k_split;
    const int steps = k_split / KSTEP;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);  // the swizzled boxes need 1024-byte alignment
    unsigned char* a_ring = smem;                     // [STAGES][2][BT][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][ROWS][128], 128-byte swizzled
    u64* bars = reinterpret_cast<u64*>(w_ring + STAGES * W_STAGE);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);

    if (threadIdx.x == 0) ring_init(full0, empty0, STAGES, 4 * CWG);  // empty: one arrival per consumer warp
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
#if DIAG >= 2
                mbar_arrive(full);
                continue;
#endif
                mbar_expect_tx(full, W_STAGE + A_STAGE);
                const int k = k_lo + step * KSTEP;
                tma_load_2d(smem_u32(w_ring + s * W_STAGE), &tmap_w, k, row0, full);
                const u32 a_dst = smem_u32(a_ring + s * A_STAGE);
#if GROUP_ROWS
                const int ka = (row0 / GROUP_ROWS) * k_split * (int)gridDim.z + k;  // the CTA's group of a (K long)
#else
                const int ka = k;
#endif
                tma_load_2d(a_dst, &tmap_a, 2 * ka, tok0, full);
                tma_load_2d(a_dst + A_HALF, &tmap_a, 2 * ka + 128, tok0, full);
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    const int lr0 = wg * 64 + wi * 16 + g;  // the lane's rows lr0 and lr0 + 8 of the tile; (lr0 & 7) == g
    const int gr0 = row0 + lr0;
    // the lane's scale: block row of its rows (rows past N read the last block row: their weights are the
    // TMA's zero fill, so any finite multiplier gives 0), the block column of its 32 K at each stage
    const float* wsr = ws + (i64)(min(gr0, N - 1) / block) * stride_wsn;
    const int kcol0 = k_lo + 32 * t;
    auto multiplier = [&](int step) {  // bf16x2 of 2^120 x scale: exact for power-of-two scales up to 2^7
        const u32 b = __float_as_uint(wsr[(kcol0 + step * KSTEP) / block] * 0x1p120f) >> 16;
        return b | (b << 16);
    };
    u32 m_next = multiplier(0);

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // the swizzled offsets of the lane's two 16-byte chunks (physical K 32t.. and 32t + 16..) in its rows
    const int c0 = ((2 * t) ^ g) << 4, c1 = ((2 * t + 1) ^ g) << 4;
    auto issue = [&](u32 (&fr)[4][4], u32 a_base, int k16_0) {  // 4 16-K steps from k16_0 as one group
        keep_all(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_rs(acc, fr[kk][0], fr[kk][1], fr[kk][2], fr[kk][3],
                     desc_sw128(a_base + ((k16_0 + kk) >> 2) * A_HALF + ((k16_0 + kk) & 3) * 32));
        wgmma_commit();
    };
    auto release = [&](int step) {  // the wgmmas reading stage `step` are done: its slot back to the producer
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * (step % STAGES));
    };
    // stage `step` arrived: its scale multiplier (the next one is loaded now, a stage ahead of its use), the
    // addresses of the lane's rows and of the activation boxes
    struct Stage {
        const unsigned char *w0, *w1;
        u32 m, a_base;
    };
    auto take = [&](int step) {
        const int s = step % STAGES;
        Stage st;
        st.m = m_next;
        if (step + 1 < steps) m_next = multiplier(step + 1);
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        st.w0 = w_ring + s * W_STAGE + lr0 * KSTEP;
        st.w1 = st.w0 + 8 * KSTEP;
        st.a_base = smem_u32(a_ring + s * A_STAGE);
        return st;
    };
    auto chunk = [](const unsigned char* row, int c) { return *reinterpret_cast<const uint4*>(row + c); };
#if DIAG == 1
    for (int step = 0; step < steps; ++step) {
        take(step);
        release(step);
    }
#elif HALVES
    // half stages: a warpgroup expands one half (4 16-K steps, 16 registers) while the previous half's wgmmas run
    u32 h0[4][4], h1[4][4];
    for (int step = 0; step < steps; ++step) {
        const Stage st = take(step);
        wgmma_wait<1>();  // the previous stage's first half is done: h0 is free
        keep_all(h0);
        expand_chunk<2>(h0, chunk(st.w0, c0), chunk(st.w1, c0), st.m);
        issue(h0, st.a_base, 0);
        wgmma_wait<1>();  // the previous stage's second half is done: h1 and that stage's ring slot are free
        keep_all(h1);
        if (step > 0) release(step - 1);
        expand_chunk<2>(h1, chunk(st.w0, c1), chunk(st.w1, c1), st.m);
        issue(h1, st.a_base, 4);
    }
#else
    // whole stages, two buffers: a warpgroup expands stage i + 1 while stage i's 8 wgmmas run
    auto stage = [&](u32 (&fr)[2][4][4], u32 (&prev)[2][4][4], int step) {
        const Stage st = take(step);
#if DIAG != 3
        expand_chunk<2>(fr[0], chunk(st.w0, c0), chunk(st.w1, c0), st.m);
        expand_chunk<2>(fr[1], chunk(st.w0, c1), chunk(st.w1, c1), st.m);
#endif
        issue(fr[0], st.a_base, 0);
        issue(fr[1], st.a_base, 4);
        wgmma_wait<2>();  // stage step - 1's two groups are done: its A registers and its ring slot are free
        keep_all(prev[0]);
        keep_all(prev[1]);
        if (step > 0) release(step - 1);
        keep_all(acc);
    };
    u32 fa[2][4][4], fb[2][4][4];
#if DIAG == 3
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        (&fa[0][0][0])[i] = m_next ^ i;
        (&fb[0][0][0])[i] = m_next ^ (i + 7);
    }
#endif
    int step = 0;
    for (; step + 1 < steps; step += 2) {
        stage(fa, fb, step);
        stage(fb, fa, step + 1);
    }
    if (step < steps) stage(fa, fb, step);
#endif
    wgmma_wait<0>();
    keep_all(acc);

    // epilogue: acc[4j + e] = (tile row lr0, token tok0 + 8j + 2t + e), acc[4j + 2 + e] = (row lr0 + 8, the same
    // token). Staged through shared memory (the ring is free: every stage was waited for and every wgmma is
    // done once all consumer warps pass the barrier), then copied out as 16-byte vectors along each token's
    // output row instead of 2- / 4-byte stores from the fragment layout (H200: M=128 wq_b 26.7 -> 26.4 us).
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");  // consumer threads only (the producer exited)
    const int lr1 = lr0 + 8;
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            OutT* line = reinterpret_cast<OutT*>(smem + (8 * j + 2 * t + e) * LINE);
            line[lr0] = out_value(acc[4 * j + e]);
            line[lr1] = out_value(acc[4 * j + 2 + e]);
        }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");
    constexpr int PER_CHUNK = 16 / (int)sizeof(OutT);  // outputs per 16-byte chunk
    constexpr int CHUNKS = ROWS / PER_CHUNK;            // chunks per token line
    OutT* base = static_cast<OutT*>(out) + (i64)blockIdx.z * stride_os;
    for (int c = threadIdx.x; c < BT * CHUNKS; c += 128 * CWG) {
        const int tl = c / CHUNKS, row = row0 + (c % CHUNKS) * PER_CHUNK;
        const int tok = tok0 + tl;
        if (tok >= M || row >= N) continue;
        const OutT* src = reinterpret_cast<const OutT*>(smem + tl * LINE) + (row - row0);
        OutT* dst = base + (i64)tok * stride_om + row;
        if (row + PER_CHUNK <= N && (reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int i = 0; i < PER_CHUNK && row + i < N; ++i) dst[i] = src[i];
        }
    }
#if SERIAL_SPLIT
    // the consumer threads only (the producer warp has exited): named barrier 1, as above
    __shared__ int last;  // this CTA is the tile's S-th to finish
    __threadfence();      // this thread's partial stores are visible to every SM before the count below
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");
    if (threadIdx.x == 0) {
        int* c = counters + blockIdx.x * gridDim.y + blockIdx.y;
        last = atomicAdd(c, 1) == (int)gridDim.z - 1;
        if (last) *c = 0;  // every split has counted: back to 0 for the next launch
    }
    asm volatile("bar.sync 1, %0;" ::"n"(128 * CWG) : "memory");
    if (!last) return;
    __threadfence();  // the other splits' partials, counted before our add, are read after it
    const int S = (int)gridDim.z;
    const int tokens = min(BT, M - tok0);
    for (int c = threadIdx.x; c < tokens * CHUNKS; c += 128 * CWG) {  // 4 outputs of one token a thread
        const int tok = tok0 + c / CHUNKS, row = row0 + (c % CHUNKS) * 4;
        if (row >= N) continue;
        const float* p = static_cast<const float*>(out) + (i64)tok * stride_om + row;
        u16* dst = fin + (i64)tok * stride_fm + row;
        if (row + 4 <= N && ((reinterpret_cast<unsigned long long>(p) | (unsigned long long)stride_os * 4) & 15) == 0) {
            float4 part[16];  // every split's load in flight at once (S <= 16, the launcher's MAX_SPLIT)
#pragma unroll
            for (int z = 0; z < 16; ++z) part[z] = z < S ? __ldcg(reinterpret_cast<const float4*>(p + (i64)z * stride_os))
                                                         : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 sum = part[0];
#pragma unroll
            for (int z = 1; z < 16; ++z) {
                if (z < S) {
                    sum.x += part[z].x;
                    sum.y += part[z].y;
                    sum.z += part[z].z;
                    sum.w += part[z].w;
                }
            }
            const u16 v[4] = {(u16)bf16_bits(sum.x), (u16)bf16_bits(sum.y), (u16)bf16_bits(sum.z), (u16)bf16_bits(sum.w)};
            for (int i = 0; i < 4; ++i) dst[i] = v[i];
        } else {
            for (int i = 0; i < 4 && row + i < N; ++i) {
                float sum = __ldcg(p + i);
                for (int z = 1; z < S; ++z) sum += __ldcg(p + i + (i64)z * stride_os);
                dst[i] = (u16)bf16_bits(sum);
            }
        }
    }
#endif
}
