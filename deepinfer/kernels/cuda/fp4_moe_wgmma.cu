// Routed-expert GEMM of the prefill regime on Hopper's warpgroup MMA (wgmma), fed by TMA: the FP4 weights
// are expanded in registers and enter wgmma as its register operand A, the routed tokens' activations enter as
// its shared-memory operand B. sm_90a only (wgmma does not exist on other architectures).
//
// Contract: out[slot, n] for every routed slot of every routing block of BT slots of one expert
// (`fp4_moe.route_slots(..., BT)`), from a[p, k] = the activation row of the slot at sorted position p
// (act_quant's exact q * s in bf16, rows gathered into the routing's sorted order and each 128-K group's
// columns in `act_quant.wgmma_k_order`, written by `act_quant.act_quant_gather`), and the exact weights W[e, n, k] = E2M1 x 2^(S-127):
// * GATED 0: out = bf16 (or fp32 with OUT_F32) of the fp32 sum over K of a . W  (the w2 GEMM's rows);
// * GATED 1: gate = row n, up = row N + n of the [2N, K] bank; out[slot, n] = bf16(route_w[slot] *
//   silu(g) * u) with g, u the bf16-rounded sums, up clamped to +-limit and gate to <= limit when limit > 0
//   (the official expert epilogue; `expert_tile.swiglu_bf16` is the Triton kernels' copy).
// Math: exact bf16 products, fp32 sums in the tensor cores, as fp4_moe_mma.cu / fp4_moe_tma.cu.
//
// Per CTA: one routing block (BT tokens = the wgmma's N) x ROWS = 64 CWG weight rows (CWG consumer
// warpgroups of 64 rows each: the wgmma's M), K in stages of 128 through a STAGES-deep shared-memory ring
// filled by one producer warp:
// * Weights: a 3-D TMA box [64 bytes, ROWS rows, 1 expert] per stage (GATED: two boxes of ROWS/2 rows, the
//   gate rows then the matching up rows), a dense [ROWS][64] tile. Warp w of warpgroup c owns 16 rows: GATED,
//   rows 0-7 the gate rows and 8-15 the up rows of the same 8 features (so each lane holds a feature's gate
//   and up sums and the SwiGLU runs in registers); else 16 consecutive rows.
// * The A fragment (m16n8k16 layout per warp: lane (g, t) holds rows g and g + 8, logical K pairs
//   {2t, 2t + 1} and {2t + 8, 2t + 9} of each 16-K step) comes from ONE 16-byte shared-memory read per row and
//   stage: lane t takes the physical K 32t..32t+31 of its rows (one E8M0 scale per row and stage) and step
//   s = 2q + u uses word q (physical 32t + 8q .. + 7): e2m1_pair<2u> gives logical (2t, 2t + 1) = physical
//   (32t + 8q + 2u, + 4), e2m1_pair<2u + 1> logical (2t + 8, 2t + 9) = physical (32t + 8q + 2u + 1, + 5).
//   So logical L = 16s + 8h + 2t + e holds physical P = 32t + 8(s >> 1) + 2(s & 1) + h + 4e; the activations
//   are stored in that order (act_quant.wgmma_k_order), the weights stay the checkpoint's bytes.
// * Activations: two 2-D TMA boxes [BT rows, 128 bytes] (logical K 0-63, 64-127) with the 128-byte swizzle,
//   the K-major layout wgmma's descriptor reads (leading byte offset unused, stride 1024 bytes per 8 rows);
//   16-K step s starts 32 (s & 3) bytes into box s >> 2.
// * Accumulator pins (keep_all(acc)) only where no wgmma is in flight: with FRAG_BUFS 2 a stage's group is issued
//   while the previous one runs, and an asm "+f" on the accumulators there is a non-wgmma definition inside an
//   open stage, for which ptxas serializes every wgmma (C7515 at BT 64 x 2 warpgroups; read offline,
//   scripts/wgmma_advisories.py). The wgmmas' own "+f" operands order them; the pin after the last wait stays.
// * Pipeline: full[s] (the producer's expect_tx; the TMA completes it), empty[s] (one arrival per consumer
//   warp once the wgmmas reading stage s are done). With FRAG_BUFS 2 a warpgroup expands stage i + 1 while
//   stage i's 8 wgmmas run (wgmma.wait_group 1), the A registers of two stages alive. With FRAG_BUFS 1 and
//   HALVES 1 it expands each half stage (4 16-K steps) while the previous half's 4 wgmmas run: the same 32
//   A registers as one whole stage (what fits beside the accumulators at 4 consumer warpgroups, 96 registers).
// * TRIM 1: a block's real slots come first and its padding last, so its wgmmas span only the smallest N of
//   16, 32, .., BT holding the real ones (the m64nW fragment is the m64nBT one's first W / 2 registers; the
//   pipeline is instantiated per width, the block picks one). The same per-element sums: the same bits.
// * PRODUCER_WARP 0: no producer warp; thread 0 (a consumer) issues the TMA loads, polling the empty barriers
//   without blocking once a stage (it blocks only when the stage it is about to consume was never loaded). Why:
//   the register file is split among the SM's 4 schedulers and a CTA's warps are dealt to them in turn, so 4
//   consumer warpgroups plus one producer warp put 5 warps on one scheduler and cap a thread at 96 registers
//   (16384 / (5 x 32), rounded down to 8), too few for the wgmma pipeline (ptxas advisory C7511 serializes it);
//   16 warps get 128.
// Launch: grid (ceil(N / (GATED ? ROWS / 2 : ROWS)), routing blocks), block 128 CWG (+ 32 with PRODUCER_WARP),
// dynamic shared memory `fp4_moe_wgmma.smem_bytes` (1024 bytes of it slack for the swizzle's alignment).
// Requires: K % 256 == 0 (FRAG_BUFS 2) or % 128; E8M0 bytes <= 128 (the exact bf16x2 expansion's range).

#include "mma_common.cuh"
#include "pdl_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef BT
#define BT 128  // the launcher passes every constant (fp4_moe_wgmma.DEFAULT_TILES)
#endif
#ifndef CWG
#define CWG 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef FRAG_BUFS
#define FRAG_BUFS 2
#endif
#ifndef HALVES
#define HALVES 0
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1  // CTAs an SM must fit (__launch_bounds__: caps the registers a thread may use)
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef OUT_F32
#define OUT_F32 0
#endif
#ifndef PRODUCER_WARP
#define PRODUCER_WARP 1  // 1: a producer warp issues the TMA loads; 0: consumer thread 0 does (header)
#endif
#ifndef TRIM
#define TRIM 1  // 1: a routing block's wgmmas span only the smallest N (16, 32, .., BT) that holds its real slots
#endif
#define KSTEP 128
#define ROWS (64 * CWG)
#define W_STAGE (ROWS * KSTEP / 2)  // bytes of weights per stage
#define A_HALF (BT * 128)           // one 64-K box of activations: BT rows x 128 bytes
#define A_STAGE (2 * A_HALF)
#define NACC (BT / 2)               // fp32 accumulators per lane: 64 x BT / 128 threads
#define THREADS (128 * CWG + 32 * PRODUCER_WARP)


#if BT != 64 && BT != 128
#error "BT must be 64 or 128 (256 would need 128 accumulators a lane: it spills)"
#endif


// A fragments of the 16-K steps that words q0 .. q0 + NQ - 1 of the lane's two rows feed (its 16 bytes of
// each row a stage): step 2q takes e2m1_pair<0> / <1> of word q (logical K pairs 2t and 2t + 8), step 2q + 1
// e2m1_pair<2> / <3>; registers 0 / 2 row g, 1 / 3 row g + 8 (the header's K order); m0 / m1 the rows' bf16x2
// 2^(S-1)
template <int NQ>
__device__ __forceinline__ void expand_fragments(u32 (&fr)[2 * NQ][4], const uint4& w0, const uint4& w1, u32 m0,
                                                 u32 m1, int q0) {
#pragma unroll
    for (int qq = 0; qq < NQ; ++qq) {
        const u32 x0 = word_of(w0, q0 + qq), x1 = word_of(w1, q0 + qq);
        fr[2 * qq][0] = bmul2(e2m1_pair<0>(x0), m0);
        fr[2 * qq][1] = bmul2(e2m1_pair<0>(x1), m1);
        fr[2 * qq][2] = bmul2(e2m1_pair<1>(x0), m0);
        fr[2 * qq][3] = bmul2(e2m1_pair<1>(x1), m1);
        fr[2 * qq + 1][0] = bmul2(e2m1_pair<2>(x0), m0);
        fr[2 * qq + 1][1] = bmul2(e2m1_pair<2>(x1), m1);
        fr[2 * qq + 1][2] = bmul2(e2m1_pair<3>(x0), m0);
        fr[2 * qq + 1][3] = bmul2(e2m1_pair<3>(x1), m1);
    }
}

template <int V>
struct Width {
    static constexpr int value = V;
};

// wgmma_rs over the first W tokens of the accumulator fragment: the m64nW fragment is the m64nBT one's first W / 2
// registers (d[4j + ..] holds tokens 8j + 2t + e, j < W / 8), so the same array serves every width
template <int W, int NA>
__device__ __forceinline__ void wgmma_rs_w(float (&d)[NA], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    static_assert(W % 16 == 0 && W / 2 <= NA, "W: 16, 32, 64 or 128 tokens within the fragment");
    wgmma_rs(*reinterpret_cast<float(*)[W / 2]>(&d[0]), a0, a1, a2, a3, desc);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
fp4_expert_gemm_wgmma(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_a,
                      const u8* __restrict__ ws, i64 stride_wse, i64 stride_wsn,
                      void* __restrict__ out, i64 stride_om, const float* __restrict__ route_w,
                      const int* __restrict__ sorted_slots, const int* __restrict__ block_expert,
                      int n_slots, int N, int K, float limit) {
    pdl_enter();  // before any access to memory an earlier kernel writes (pdl_common.cuh)
    const int blk = blockIdx.y;  // row tiles on x (launched first): a block's tiles run together and share its
    const int expert = block_expert[blk];  // activations in L2, and the next block (often the same expert) its weights
    if (expert < 0) return;  // the whole CTA: no barrier has been touched yet
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int steps = K / KSTEP;
#if GATED
    const int f0 = blockIdx.x * (ROWS / 2);  // the CTA's first output feature (gate row f0, up row N + f0)
    const int w_rows = 2 * N;
#else
    const int f0 = blockIdx.x * ROWS;
    const int w_rows = N;
#endif

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);  // the swizzled boxes need 1024-byte alignment
    unsigned char* a_ring = smem;                     // [STAGES][2][BT][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][ROWS][64]
    u64* bars = reinterpret_cast<u64*>(w_ring + STAGES * W_STAGE);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);

    if (threadIdx.x == 0) ring_init(full0, empty0, STAGES, 4 * CWG);  // empty: one arrival per consumer warp
    __syncthreads();

    // the TMA loads of step `step` into its ring slot (one thread): the weight box(es), the two activation boxes
    auto load_stage = [&](int step) {
        const int s = step % STAGES;
        const u32 full = full0 + 8 * s;
        mbar_expect_tx(full, W_STAGE + A_STAGE);
        const u32 w_dst = smem_u32(w_ring + s * W_STAGE);
#if GATED
        tma_load_3d(w_dst, &tmap_w, step * (KSTEP / 2), f0, expert, full);
        tma_load_3d(w_dst + W_STAGE / 2, &tmap_w, step * (KSTEP / 2), N + f0, expert, full);
#else
        tma_load_3d(w_dst, &tmap_w, step * (KSTEP / 2), f0, expert, full);
#endif
        const u32 a_dst = smem_u32(a_ring + s * A_STAGE);
        tma_load_2d(a_dst, &tmap_a, step * (2 * KSTEP), blk * BT, full);
        tma_load_2d(a_dst + A_HALF, &tmap_a, step * (2 * KSTEP) + 128, blk * BT, full);
    };
    // the parity an empty barrier completes with once the wgmmas that read step - STAGES (same slot) are done
    auto empty_parity = [](int step) { return ((step / STAGES) & 1) ^ 1; };

#if PRODUCER_WARP
    if (warp == 4 * CWG) {
        // ---- producer warp (lane 0) ----
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_a) : "memory");
            for (int step = 0; step < steps; ++step) {
                if (step >= STAGES) mbar_wait(empty0 + 8 * (step % STAGES), empty_parity(step));
                load_stage(step);
            }
        }
        return;
    }
    auto produce = [&](int) {};
#else
    // ---- thread 0 is also the producer: the first STAGES loads now, then each step refills the slots the
    // consumers have released (a non-blocking test of their empty barriers); it waits only when step `step`
    // itself was never loaded (the ring ran dry) ----
    int next_load = 0;
    if (threadIdx.x == 0) {
        for (; next_load < steps && next_load < STAGES; ++next_load) load_stage(next_load);
    }
    auto produce = [&](int step) {
        if (threadIdx.x == 0) {
            while (next_load < steps && next_load < step + STAGES) {
                const u32 empty = empty0 + 8 * (next_load % STAGES);
                if (next_load > step) {
                    if (!mbar_test(empty, empty_parity(next_load))) break;
                } else {
                    mbar_wait(empty, empty_parity(next_load));
                }
                load_stage(next_load++);
            }
        }
        __syncwarp();
    };
#endif

    // ---- consumer warpgroups ----
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t = lane & 3;
#if GATED
    const int lr0 = wg * 32 + wi * 8 + g;  // the gate row of feature f0 + lr0 in the stage's tile
    const int lr1 = ROWS / 2 + lr0;        // its up row
    const int gr0 = f0 + lr0, gr1 = N + f0 + lr0;
#else
    const int lr0 = wg * 64 + wi * 16 + g, lr1 = lr0 + 8;
    const int gr0 = f0 + lr0, gr1 = f0 + lr1;
#endif
    // the lane's scale bytes: row, K/32 block 4 step + t (rows past the bank read its last row: their
    // weights are the TMA's zero fill, so any finite multiplier gives 0)
    const u8* ws0 = ws + (i64)expert * stride_wse + (i64)min(gr0, w_rows - 1) * stride_wsn + t;
    const u8* ws1 = ws + (i64)expert * stride_wse + (i64)min(gr1, w_rows - 1) * stride_wsn + t;
    u32 sc0 = ws0[0], sc1 = ws1[0];

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // stage `step` arrived: its weight words of the lane's two rows and their bf16x2 2^(S-1) multipliers; the
    // next stage's scale bytes are loaded now, a stage ahead of their use
    struct Stage {
        uint4 w0, w1;
        u32 m0, m1, a_base;
    };
    auto take = [&](int step) {
        const int s = step % STAGES;
        Stage st;
        st.m0 = (sc0 + 126u) * 0x00800080u;
        st.m1 = (sc1 + 126u) * 0x00800080u;
        if (step + 1 < steps) {
            sc0 = ws0[(step + 1) * (KSTEP / 32)];
            sc1 = ws1[(step + 1) * (KSTEP / 32)];
        }
        produce(step);
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        st.w0 = *reinterpret_cast<const uint4*>(w_ring + s * W_STAGE + lr0 * (KSTEP / 2) + 16 * t);
        st.w1 = *reinterpret_cast<const uint4*>(w_ring + s * W_STAGE + lr1 * (KSTEP / 2) + 16 * t);
        st.a_base = smem_u32(a_ring + s * A_STAGE);
        return st;
    };
    // NK 16-K steps from k16 over the block's first W tokens: A fragments fr[0..NK), B in activation box k16 >> 2,
    // 32 bytes a step; one group
    auto issue = [&](auto width, auto& fr, u32 a_base, int k16, int nk) {
#if FRAG_BUFS == 1
        keep_all(acc);
#endif
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < nk; ++kk)
            wgmma_rs_w<decltype(width)::value>(acc, fr[kk][0], fr[kk][1], fr[kk][2], fr[kk][3],
                                                desc_sw128(a_base + ((k16 + kk) >> 2) * A_HALF + ((k16 + kk) & 3) * 32));
        wgmma_commit();
    };
    // the wgmmas reading stage `step` are done: its ring slot goes back to the producer (one arrival a warp)
    auto release = [&](int step) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * (step % STAGES));
    };

    // the pipeline over the block's first `width` tokens (a compile-time Width<W>)
    auto run = [&](auto width) {
#if HALVES
        static_assert(FRAG_BUFS == 1, "HALVES pipelines half stages within one stage's registers");
        u32 h0[4][4], h1[4][4];
        for (int step = 0; step < steps; ++step) {
            const Stage st = take(step);
            wgmma_wait<1>();  // the previous stage's first half is done: h0 is free
            keep_all(h0);
            expand_fragments<2>(h0, st.w0, st.w1, st.m0, st.m1, 0);
            issue(width, h0, st.a_base, 0, 4);
            wgmma_wait<1>();  // the previous stage's second half is done: h1 and that stage's ring slot are free
            keep_all(h1);
            if (step > 0) release(step - 1);
            expand_fragments<2>(h1, st.w0, st.w1, st.m0, st.m1, 2);
            issue(width, h1, st.a_base, 4, 4);
        }
#else
        // one whole stage: with FRAG_BUFS 2 `prev` (the previous stage's fragments) is freed after the wait
        auto stage = [&](u32 (&fr)[8][4], u32 (&prev)[8][4], int step) {
            const Stage st = take(step);
            expand_fragments<4>(fr, st.w0, st.w1, st.m0, st.m1, 0);
            issue(width, fr, st.a_base, 0, 8);
#if FRAG_BUFS == 2
            wgmma_wait<1>();  // stage step - 1's wgmmas are done: its A registers and its ring slot are free
            keep_all(prev);
            if (step > 0) release(step - 1);
#else
            wgmma_wait<0>();
            keep_all(fr);
            release(step);
            keep_all(acc);
#endif
        };
        u32 fa[8][4], fb[8][4];
#if FRAG_BUFS == 2
        for (int step = 0; step < steps; step += 2) {  // steps is even (K % 256 == 0)
            stage(fa, fb, step);
            stage(fb, fa, step + 1);
        }
#else
        for (int step = 0; step < steps; ++step) stage(fa, fb, step);
#endif
#endif
    };
#if TRIM
    // the block's real slots come first and its padding (slot n_slots) last (`align_by_expert`): the wgmmas span
    // the smallest N that holds the real ones (a block's uniform choice; the epilogue skips padding slots)
    const int* bslots = sorted_slots + blk * BT;
    int width = BT;
    while (width > 16 && bslots[width / 2] >= n_slots) width /= 2;
    if (width == BT) {
        run(Width<BT>{});
    } else if (width == BT / 2) {
        run(Width<BT / 2>{});
    } else if (width == BT / 4) {
        run(Width<BT / 4>{});
#if BT == 128
    } else if (width == 16) {
        run(Width<16>{});
#endif
    }
#else
    run(Width<BT>{});
#endif
    wgmma_wait<0>();
    keep_all(acc);

    store_tile<BT, GATED, OUT_F32>(acc, out, stride_om, route_w, sorted_slots + blk * BT, n_slots, N, gr0, gr1, t, limit);
}
