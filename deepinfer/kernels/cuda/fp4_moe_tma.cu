// Routed-expert GEMM at decode, warp-specialised: one producer warp streams the packed FP4 weights into a
// shared-memory ring with the Tensor Memory Accelerator (TMA), consumer warps expand and multiply on mma.sync.
//
// Same contract and math as fp4_moe_mma.cu (read its header for the fragment mapping and the E2M1 -> bf16
// expansion, `e2m1_pair<C>` in mma_common.cuh): out[split, slot, n] = fp32 sum over the split's K range of
// a[row(slot), k] W[e, n, k] for the <= 8 slots of one routing block, exact products, fp32 sums in the
// tensor cores.
//
// Why a second kernel: fp4_moe_mma.cu loads into registers, so a warp has one stage of loads in flight while
// it expands and multiplies the previous one, and its math does not overlap its loads (the LOAD_ONLY
// diagnostic: the loads alone reach 81-87% of the copy bandwidth, the GEMM 65-70%; 4 register stages were
// slower). Here the loads are issued by a warp that does nothing else, STAGES ahead of the math, and land
// in shared memory; HBM sees up to STAGES x ROWS x 64 bytes in flight per CTA whatever the consumers do.
// Measured (H200, BENCHMARKS.md): the two GEMM launches at 75-81% of the copy rate against 62-69% for
// fp4_moe_mma.cu; what limits this kernel now is its consumers' expansion (13 integer instructions and 4
// bf16x2 multiplies per 8 weights): more or longer consumer warps won the tile sweep, more stages lost.
//
// Per CTA: ROWS = 16 MT CWARPS weight rows of one expert, K per stage 128 (64 bytes per row).
// * Weights: one 3-D TMA box [64 bytes, ROWS rows, 1 expert] per stage into a dense [ROWS][64] tile. Lane
//   (g, t) reads 16 bytes at (row, 16t): 8 lanes of a shared-memory phase cover 128 contiguous bytes, no
//   bank conflict. Rows past N are zero-filled by the TMA (out of bounds) and never stored.
// * Scales: the whole split's E8M0 bytes of the ROWS rows, one 3-D box [SB, ROWS, 1] at the start, from the
//   16-byte aligned column at or before the split's first (a box start inside a 16-byte group faults), SB =
//   (K split / 32 rounded up to 16) + 16 (+ 16 where the start can be unaligned): the extra 16 bytes make the
//   row stride land rows g = 0..7 in different banks (the TMA fills them with the neighbouring K's bytes,
//   or zeros past K; never read).
// * Activations: each valid token's 128 bf16 of the stage by two 128-byte bulk copies (cp.async.bulk: a
//   gather, which a tiled TMA cannot do on sm_90) to token g at 400 g, pieces at +0 and +160: lane (g, t)
//   reads 16 bytes at 400 g + (64t or 160 + 64(t - 2)) + 16q, and the 8 lanes of a phase (g = 2p, 2p + 1)
//   hit 8 different 16-byte bank groups. Padding slots copy nothing; their lanes use zeros.
// * Synchronisation: mbarriers. full[s] (1 arrival, the producer's expect_tx of the stage's bytes; the
//   copies complete it), empty[s] (one arrival per consumer warp once it holds the stage in registers).
//
// Compile-time constants (-D): MT m16 tiles per consumer warp, CWARPS consumer warps, STAGES ring depth.
// Tried on the H200 and removed as slower at every T (in git history, 2026-12-02, BENCHMARKS.md): an L2
// evict-first hint on the weights, consumers reading the next stage into registers before multiplying, and
// per-stage 16-byte scale boxes in the ring instead of the split's scales once.
// Launch: grid (routing blocks, ceil(N / ROWS), splits), block 32 (CWARPS + 1), dynamic shared memory
// `fp4_moe_tma.smem_bytes`. Parameters: the weights' and scales' tensor maps (uint8, 3-D: [K/2 | K/32, N, E],
// boxes [64, ROWS, 1] and [SB, ROWS, 1]; `fp4_moe_tma.py` encodes them), then as fp4_moe_mma.cu without w/ws.
// Requires: K split % 128 == 0, SB <= 256; a's rows 16-byte aligned.

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "tma_common.cuh"

#ifndef MT
#define MT 4  // the launcher passes every constant (fp4_moe_tma.DEFAULT_TILES); these match its defaults
#endif
#ifndef CWARPS
#define CWARPS 4
#endif
#ifndef STAGES
#define STAGES 3
#endif
#define TOKENS 8
#define KSTEP 128
#define ROWS (16 * MT * CWARPS)
#define W_STAGE (ROWS * KSTEP / 2)      // bytes of weights per stage
#define TOK_STRIDE 400                  // bytes per token in a stage's activation tile (see the header)
#define PIECE_GAP 160                   // offset of a token's second 128-byte piece
#define A_STAGE (TOKENS * TOK_STRIDE)   // bytes of activations per stage (3200 = 25 x 128)

extern "C" __global__ void __launch_bounds__(32 * (CWARPS + 1))
fp4_expert_gemm_tma(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_s,
                    const unsigned short* __restrict__ a, i64 stride_am,
                    float* __restrict__ out, i64 stride_os, i64 stride_om,
                    const int* __restrict__ sorted_slots, const int* __restrict__ block_expert,
                    int n_slots, int N, int k_split, int a_row_div) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int blk = blockIdx.x;
    const int expert = block_expert[blk];
    if (expert < 0) return;  // the whole CTA: no barrier has been touched yet
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int row0 = blockIdx.y * ROWS;
    const int k_lo = blockIdx.z * k_split;
    const int steps = k_split / KSTEP;
    // the scales' box starts at a 16-byte aligned K/32 column (a TMA box whose innermost start is not 16-byte
    // aligned faults: "illegal instruction"); the split's first scale byte sits s_off bytes into each row
    const int s_lo = k_lo / 32;
    const int s_c0 = s_lo & ~15;
    const int s_off = s_lo - s_c0;
    // scale bytes per row in shared memory: the split's, rounded up to 16, + 16 (bank spread; + 16 more where
    // a split's start can fall inside a 16-byte group) = fp4_moe_tma.scale_row_bytes
    const int sb = ((k_split / 32 + 15) / 16) * 16 + 16 + ((k_split / 32) % 16 ? 16 : 0);

    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* w_ring = smem;                          // [STAGES][ROWS][64]
    unsigned char* a_ring = smem + STAGES * W_STAGE;       // [STAGES][TOKENS][TOK_STRIDE]
    unsigned char* scales = a_ring + STAGES * A_STAGE;     // [ROWS][sb]
    // full[STAGES], empty[STAGES], the scales' barrier: after the tiles (ROWS x sb is a multiple of 16), so the
    // dynamic block is the only shared memory and starts where the TMA's 128-byte alignment holds
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(scales + ROWS * sb);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]), scale_bar = smem_u32(&bars[2 * STAGES]);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, CWARPS);
        }
        mbar_init(scale_bar, 1);
        // make the initialised barriers visible to the async proxy (the TMA engine) before any copy uses them
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        fence_async_smem();
    }
    __syncthreads();

    if (warp == CWARPS) {
        // ---- producer warp: lane j < 8 copies token j's activations, lane 0 also the weights and scales ----
        const int slot = lane < TOKENS ? sorted_slots[blk * TOKENS + lane] : n_slots;
        const bool valid = slot < n_slots;
        const unsigned short* src = a + (valid ? (i64)(slot / a_row_div) * stride_am : 0) + k_lo;
        const u32 n_valid = __popc(__ballot_sync(0xFFFFFFFFu, valid));
        const u32 stage_bytes = W_STAGE + n_valid * (KSTEP * 2);
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            mbar_expect_tx(scale_bar, ROWS * sb);
            tma_load_3d(smem_u32(scales), &tmap_s, s_c0, row0, expert, scale_bar);
        }
        for (int step = 0; step < steps; ++step) {
            const int s = step % STAGES;
            if (step >= STAGES) mbar_wait(empty0 + 8 * s, ((step / STAGES) & 1) ^ 1);  // the consumers let go
            if (lane == 0) {
                mbar_expect_tx(full0 + 8 * s, stage_bytes);
                tma_load_3d(smem_u32(w_ring + s * W_STAGE), &tmap_w, k_lo / 2 + step * (KSTEP / 2), row0, expert,
                            full0 + 8 * s);
            }
            __syncwarp();  // the expect_tx precedes the activation copies' completions
            if (valid) {
                const u32 dst = smem_u32(a_ring + s * A_STAGE + lane * TOK_STRIDE);
                const unsigned short* from = src + step * KSTEP;
                bulk_load(dst, from, KSTEP, full0 + 8 * s);                    // bf16 0..63 of the stage
                bulk_load(dst + PIECE_GAP, from + KSTEP / 2, KSTEP, full0 + 8 * s);  // bf16 64..127
            }
        }
        return;
    }

    // ---- consumer warps: lane (g, t) = (row g / g + 8 of each m16 tile, token g; the lane's 32 K per stage) ----
    const int g = lane >> 2;
    const int t = lane & 3;
    const bool tok_ok = sorted_slots[blk * TOKENS + g] < n_slots;
    const int a_off = g * TOK_STRIDE + (t < 2 ? 64 * t : PIECE_GAP + 64 * (t - 2));
    int rows[MT][2];  // CTA-local weight rows of this lane
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        rows[m][0] = warp * (16 * MT) + 16 * m + g;
        rows[m][1] = rows[m][0] + 8;
    }
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
        acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;

    struct Held {        // one stage in a consumer lane's registers
        uint4 w[MT][2];  // packed codes of rows g and g + 8 of each m16 tile (32 K)
        u32 mult[MT][2]; // their E8M0 bytes, then bf16x2 2^(S-1)
        uint4 x[4];      // token g's 32 bf16
    };
    // wait for stage `step`, copy the lane's part into registers, let the producer have the slot back
    auto take = [&](Held& st, int step) {
        const int s = step % STAGES;
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                st.w[m][h] = *reinterpret_cast<const uint4*>(w_ring + s * W_STAGE + rows[m][h] * (KSTEP / 2) + 16 * t);
                st.mult[m][h] = scales[rows[m][h] * sb + s_off + step * (KSTEP / 32) + t];
            }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (tok_ok) {
                st.x[q] = *reinterpret_cast<const uint4*>(a_ring + s * A_STAGE + a_off + 16 * q);
            } else {
                st.x[q].x = st.x[q].y = st.x[q].z = st.x[q].w = 0u;
            }
        }
        __syncwarp();  // every lane's reads of the stage precede the warp's release (mbarrier.arrive: release)
        if (lane == 0) mbar_arrive(empty0 + 8 * s);
    };
    auto multiply = [&](Held& st) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            st.mult[m][0] = (st.mult[m][0] + 126u) * 0x00800080u;  // exponent field S + 126 in both halves
            st.mult[m][1] = (st.mult[m][1] + 126u) * 0x00800080u;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            // token g's K (8q + c, 8q + c + 4) pairs, matching `e2m1_pair<c>` (fp4_moe_mma.cu)
            const uint4 xv = st.x[q];
            const u32 b00 = prmt(xv.x, xv.z, 0x5410u), b01 = prmt(xv.x, xv.z, 0x7632u);
            const u32 b10 = prmt(xv.y, xv.w, 0x5410u), b11 = prmt(xv.y, xv.w, 0x7632u);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const u32 wg = word_of(st.w[m][0], q), wg8 = word_of(st.w[m][1], q);
                const u32 m0 = st.mult[m][0], m1 = st.mult[m][1];
                mma_bf16(acc[m], bmul2(e2m1_pair<0>(wg), m0), bmul2(e2m1_pair<0>(wg8), m1),
                         bmul2(e2m1_pair<1>(wg), m0), bmul2(e2m1_pair<1>(wg8), m1), b00, b01);
                mma_bf16(acc[m], bmul2(e2m1_pair<2>(wg), m0), bmul2(e2m1_pair<2>(wg8), m1),
                         bmul2(e2m1_pair<3>(wg), m0), bmul2(e2m1_pair<3>(wg8), m1), b10, b11);
            }
        }
    };

    mbar_wait(scale_bar, 0);
    for (int step = 0; step < steps; ++step) {
        Held held;
        take(held, step);
        multiply(held);
    }

    // C fragment: c0 / c1 = row g, tokens 2t / 2t + 1; c2 / c3 = row g + 8
    const int slot0 = sorted_slots[blk * TOKENS + 2 * t];
    const int slot1 = sorted_slots[blk * TOKENS + 2 * t + 1];
    float* o = out + (i64)blockIdx.z * stride_os;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + rows[m][h];
            if (r >= N) continue;
            if (slot0 < n_slots) o[(i64)slot0 * stride_om + r] = acc[m][2 * h];
            if (slot1 < n_slots) o[(i64)slot1 * stride_om + r] = acc[m][2 * h + 1];
        }
    }
}
