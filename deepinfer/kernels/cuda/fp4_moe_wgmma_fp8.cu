// Routed-expert GEMM of the prefill regime on Hopper's FP8 warpgroup MMA, the official fp4_gemm math itself:
// the FP4 weights become E4M3 codes in registers (wgmma's register operand A), the routed tokens' activations
// enter as act_quant's E4M3 codes (the shared-memory operand B), and every 32 of K the tensor cores' fp32
// partial sum is promoted into the fp32 accumulator with its weight scale and the token's activation scale.
// sm_90a only. Same contract as fp4_moe_wgmma.cu (the bf16 form) except the activation operand:
// * aq u8 [n_blocks * BT, K]: act_quant's E4M3 codes of the slot at sorted position p, each 32-K block's
//   columns in `act_quant.wgmma_fp8_k_order` (logical L = 16h + 4t + i holds natural P = 8t + 2i + h);
// * as_t fp32 [K / ABLK, n_blocks * BT]: their power-of-two scales, transposed (a block's BT scales of one
//   K group are contiguous: one bulk copy a group and stage);
// both written by `act_quant.act_quant_gather_fp8`. W[e, n, k] = E2M1 x 2^(S-127) as in the bf16 form.
//
// Math (kernel.py's fp4_gemm, v4-spec 6.4): for every 32-K block k32 the tensor cores sum the 32 exact
// products of E4M3 codes in fp32 (scale-d 0: a fresh partial P), then C += P * sb[n, k32] * sa[m, k32 / ASTEPS].
// The FP4 -> E4M3 step is a bit placement (nibble s e1 e0 m -> byte s 0 0 e1 e0 m 0 0), exact for every code
// including the subnormal 0.5: the byte's value is the E2M1 value times 2^-6 (normal: 2^(e-7)(1 + m/2) against
// 2^(e-1)(1 + m/2); subnormal: 2^-6 * m/2 against m/2), so the weight scale used is 2^(S-127+6), built from the
// byte's exponent bits (exact for S <= 248). Because every scale is a power of two, sb[k32] * P is exact and
// the ASTEPS partials that share one activation scale are summed first and multiplied by it once (ASTEPS 4 for
// V4's 128-wide activation blocks, 1 for V4.1's 32): the official sums up to fp32 summation order.
//
// Per CTA: one routing block (BT tokens = the wgmma's N) x ROWS = 64 CWG weight rows (the wgmma's M), K in
// stages of 128 through a STAGES-deep ring filled by one producer warp:
// * Weights: a 3-D TMA box [64 bytes, ROWS rows, 1 expert] per stage (GATED: the gate rows' box, then the
//   matching up rows'), with the 64-byte swizzle (16-byte chunk c of row r lands at chunk c ^ ((r >> 1) & 3)).
//   Warp w of warpgroup c owns 16 rows as in the bf16 form (GATED: rows 0-7 gate, 8-15 the same features' up).
// * The A fragment of 32-K step j (= the stage's 32-K block j, one weight scale a row): lane (g, t) reads one
//   32-bit word of each of its rows, bytes 16j + 4t .. + 3 = natural K 32j + 8t .. + 7 (8 nibbles; with the
//   swizzle the warp's 32 reads hit 32 banks); its even nibbles are register 0 / 1 (logical K 4t + i, natural
//   8t + 2i), its odd nibbles register 2 / 3 (logical 16 + 4t + i, natural 8t + 2i + 1): the m16n8k32 layout
//   per warp (rows g / g + 8, K 4t..4t+3 and 16 + 4t..).
// * Activations: one 2-D TMA box [BT rows, 128 bytes] a stage, the 128-byte swizzle (K-major, as wgmma's
//   descriptor reads it); step j starts 32 j bytes into it. Their scales: GROUPS = 128 / ABLK bulk copies of
//   BT fp32 a stage.
// * Pipeline: full[s] / empty[s] as in the bf16 form. PBUFS 2: step j + 1's wgmma (into the other partial) is
//   issued before step j's promotion, so the tensor cores work while the FMA pipe promotes (the next stage's
//   first step is issued across the stage boundary); PBUFS 1: issue, wait, promote.
// Launch: grid (ceil(N / (GATED ? ROWS / 2 : ROWS)), routing blocks), block 128 CWG + 32, dynamic shared
// memory `fp4_moe_wgmma_fp8.smem_bytes` (1024 bytes of it slack for the swizzles' alignment).
// Requires: K % 128 == 0, E8M0 bytes <= 248, ABLK in 32 / 64 / 128.

#include "mma_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef BT
#define BT 64  // the launcher passes every constant (fp4_moe_wgmma_fp8.DEFAULT_TILES)
#endif
#ifndef CWG
#define CWG 2
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef PBUFS
#define PBUFS 2
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1
#endif
#ifndef ABLK
#define ABLK 128
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef OUT_F32
#define OUT_F32 0
#endif
#define KSTEP 128
#define ROWS (64 * CWG)
#define W_STAGE (ROWS * KSTEP / 2)  // bytes of weights per stage
#define A_STAGE (BT * KSTEP)        // bytes of activation codes per stage
#define GROUPS (KSTEP / ABLK)       // activation scale groups per stage
#define S_STAGE (GROUPS * BT * 4)   // bytes of activation scales per stage
#define ASTEPS (ABLK / 32)          // 32-K steps sharing one activation scale
#define NACC (BT / 2)               // fp32 accumulators per lane: 64 x BT / 128 threads

#if BT != 64 && BT != 128
#error "BT must be 64 or 128"
#endif
#if ABLK != 32 && ABLK != 64 && ABLK != 128
#error "ABLK must be 32, 64 or 128"
#endif
#if PBUFS != 1 && PBUFS != 2
#error "PBUFS must be 1 or 2"
#endif

// a use (not a definition) of an in-flight wgmma's A registers after its wait: they stay allocated to it
__device__ __forceinline__ void hold(const u32 (&r)[1][4]) {
    asm volatile("" ::"r"(r[0][0]), "r"(r[0][1]), "r"(r[0][2]), "r"(r[0][3]) : "memory");
}

template <bool B>
struct Flag {  // a compile-time bool argument of a generic lambda
    static constexpr bool value = B;
};

// E4M3 bytes of the even (low) / odd (high) nibbles of each byte of w: nibble s e1 e0 m -> byte s 0 0 e1 e0 m 0 0
__device__ __forceinline__ u32 e4m3_even(u32 w) { return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u); }
__device__ __forceinline__ u32 e4m3_odd(u32 w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }

// d (m64 x BT fp32) = A (E4M3 registers) @ B (E4M3, shared memory by descriptor): scale-d 0, a fresh partial
__device__ __forceinline__ void wgmma_fp8_fresh(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
          "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
          "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
          "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
}
__device__ __forceinline__ void wgmma_fp8_fresh(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
          "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]),
          "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]),
          "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]),
          "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]),
          "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]),
          "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]),
          "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
}

extern "C" __global__ void __launch_bounds__(128 * CWG + 32, MIN_CTAS)
fp4_expert_gemm_wgmma_fp8(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_a,
                          const float* __restrict__ as_t, const u8* __restrict__ ws, i64 stride_wse,
                          i64 stride_wsn, void* __restrict__ out, i64 stride_om, const float* __restrict__ route_w,
                          const int* __restrict__ sorted_slots, const int* __restrict__ block_expert,
                          int n_slots, int n_rows, int N, int K, float limit) {
    const int blk = blockIdx.y;  // row tiles on x (launched first): a block's tiles share its activations in L2
    const int expert = block_expert[blk];
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
    unsigned char* smem = align_1024(smem_raw);
    unsigned char* a_ring = smem;                      // [STAGES][BT][128], 128-byte swizzled
    unsigned char* w_ring = a_ring + STAGES * A_STAGE;  // [STAGES][ROWS][64], 64-byte swizzled
    unsigned char* s_ring = w_ring + STAGES * W_STAGE;  // [STAGES][GROUPS][BT] fp32
    u64* bars = reinterpret_cast<u64*>(s_ring + STAGES * S_STAGE);
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[STAGES]);

    if (threadIdx.x == 0) ring_init(full0, empty0, STAGES, 4 * CWG);  // empty: one arrival per consumer warp
    __syncthreads();

    if (warp == 4 * CWG) {
        // ---- producer warp (lane 0): the stage's weight box(es), activation box and scale rows ----
        if (lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_a) : "memory");
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(empty0 + 8 * s, ((step / STAGES) & 1) ^ 1);
                const u32 full = full0 + 8 * s;
                mbar_expect_tx(full, W_STAGE + A_STAGE + S_STAGE);
                const u32 w_dst = smem_u32(w_ring + s * W_STAGE);
                tma_load_3d(w_dst, &tmap_w, step * (KSTEP / 2), f0, expert, full);
#if GATED
                tma_load_3d(w_dst + W_STAGE / 2, &tmap_w, step * (KSTEP / 2), N + f0, expert, full);
#endif
                tma_load_2d(smem_u32(a_ring + s * A_STAGE), &tmap_a, step * KSTEP, blk * BT, full);
#pragma unroll
                for (int gi = 0; gi < GROUPS; ++gi)
                    bulk_load(smem_u32(s_ring + s * S_STAGE + gi * BT * 4),
                              as_t + (i64)(step * GROUPS + gi) * n_rows + (i64)blk * BT, BT * 4, full);
            }
        }
        return;
    }

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
    // the rows' byte offsets in a stage and their swizzle phases (the 64-byte swizzle: chunk ^= (row >> 1) & 3)
    const u32 row0 = lr0 * (KSTEP / 2) + 4 * t, row1 = lr1 * (KSTEP / 2) + 4 * t;
    const u32 sw0 = (lr0 >> 1) & 3, sw1 = (lr1 >> 1) & 3;
    // the lane's 4 scale bytes of each row and stage (K/32 blocks 4 step .. + 3), a stage ahead of their use
    // (rows past the bank read its last row: their weights are the TMA's zero fill)
    const u32* ws0 = reinterpret_cast<const u32*>(ws + (i64)expert * stride_wse + (i64)min(gr0, w_rows - 1) * stride_wsn);
    const u32* ws1 = reinterpret_cast<const u32*>(ws + (i64)expert * stride_wse + (i64)min(gr1, w_rows - 1) * stride_wsn);
    u32 sc0 = __ldg(ws0), sc1 = __ldg(ws1);

    float acc[NACC], p0[NACC];
#if PBUFS == 2
    float p1[NACC];
#endif
#if ASTEPS > 1
    float part[NACC];  // the weight-scaled partials of the steps that share one activation scale
#endif
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    struct Stage {
        u32 w, a, s;  // shared addresses of the stage's weights, activation codes and activation scales
        u32 sc0, sc1;  // the rows' 4 scale bytes
    };
    auto take = [&](int step) {
        const int s = step % STAGES;
        Stage st;
        st.sc0 = sc0;
        st.sc1 = sc1;
        if (step + 1 < steps) {
            sc0 = __ldg(ws0 + step + 1);
            sc1 = __ldg(ws1 + step + 1);
        }
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        st.w = smem_u32(w_ring + s * W_STAGE);
        st.a = smem_u32(a_ring + s * A_STAGE);
        st.s = smem_u32(s_ring + s * S_STAGE);
        return st;
    };
    // step j of a stage into partial d: the rows' words of 32-K block j expanded to E4M3 into fr (the wgmma's
    // A registers: the caller keeps them alive until the wgmma is waited for), one wgmma group
    auto issue = [&](float (&d)[NACC], u32 (&fr)[1][4], const Stage& st, int j) {
        u32 x0, x1;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x0) : "r"(st.w + row0 + ((j ^ sw0) << 4)));
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x1) : "r"(st.w + row1 + ((j ^ sw1) << 4)));
        fr[0][0] = e4m3_even(x0);
        fr[0][1] = e4m3_even(x1);
        fr[0][2] = e4m3_odd(x0);
        fr[0][3] = e4m3_odd(x1);
        wgmma_fence();
        wgmma_fp8_fresh(d, fr[0][0], fr[0][1], fr[0][2], fr[0][3], desc_sw128(st.a + 32 * j));
        wgmma_commit();
    };
    // step j's partial d (done) into the accumulators: times the rows' weight scales 2^(S-121); after the last
    // step of an activation group, times the tokens' scales
    auto promote = [&](float (&d)[NACC], const Stage& st, int j) {
        const float s0 = __uint_as_float((((st.sc0 >> (8 * j)) & 0xFFu) + 6u) << 23);
        const float s1 = __uint_as_float((((st.sc1 >> (8 * j)) & 0xFFu) + 6u) << 23);
#if ASTEPS > 1
        const bool first = (j % ASTEPS) == 0, last = (j % ASTEPS) == ASTEPS - 1;
#pragma unroll
        for (int i = 0; i < NACC; ++i) {
            const float sr = (i & 2) ? s1 : s0;
            part[i] = first ? d[i] * sr : fmaf(d[i], sr, part[i]);
        }
        if (!last) return;
#endif
        const u32 sa = st.s + (j / ASTEPS) * BT * 4 + 8 * t;  // tokens 8 jn + 2 t + e of group j / ASTEPS
#pragma unroll
        for (int jn = 0; jn < BT / 8; ++jn) {
            float ta, tb;
            asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(ta), "=f"(tb) : "r"(sa + 32 * jn));
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 4 * jn + r;
                const float ts = (r & 1) ? tb : ta;
#if ASTEPS > 1
                acc[i] = fmaf(part[i], ts, acc[i]);
#else
                acc[i] = fmaf(d[i] * ((r & 2) ? s1 : s0), ts, acc[i]);
#endif
            }
        }
    };
    // the wgmmas reading stage `step` are done and its scales read: its ring slot goes back to the producer
    auto release = [&](int step) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * (step % STAGES));
    };

#if PBUFS == 2
    // steps 0, 2 of a stage run in p0 and 1, 3 in p1 (4 steps a stage: the parity holds across stages). The
    // last stage is peeled (CROSS false: nothing issued past it), so every stage of the loop issues the same
    // wgmmas into the same registers: a conditional issue would make the compiler merge two versions of p0
    // with register copies, which ptxas answers by serialising the wgmmas
    u32 f0r[1][4], f1r[1][4];  // the A registers of the wgmmas into p0 / p1
    auto run_stage = [&](Stage& st, int step, auto cross) {
        constexpr bool CROSS = decltype(cross)::value;
        Stage nx = st;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j < 3) {
                if (j & 1) issue(p0, f0r, st, j + 1); else issue(p1, f1r, st, j + 1);
            } else if constexpr (CROSS) {
                nx = take(step + 1);
                issue(p0, f0r, nx, 0);
            }
            if (j < 3 || CROSS) wgmma_wait<1>(); else wgmma_wait<0>();
            if (j & 1) {
                keep_all(p1);
                hold(f1r);
                promote(p1, st, j);
            } else {
                keep_all(p0);
                hold(f0r);
                promote(p0, st, j);
            }
        }
        release(step);
        st = nx;
    };
    Stage st = take(0);
    issue(p0, f0r, st, 0);
    for (int step = 0; step + 1 < steps; ++step) run_stage(st, step, Flag<true>{});
    run_stage(st, steps - 1, Flag<false>{});
#else
    for (int step = 0; step < steps; ++step) {
        const Stage st = take(step);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 fr[1][4];
            issue(p0, fr, st, j);
            wgmma_wait<0>();
            keep_all(p0);
            hold(fr);
            promote(p0, st, j);
        }
        release(step);
    }
#endif

    store_tile<BT, GATED, OUT_F32>(acc, out, stride_om, route_w, sorted_slots + blk * BT, n_slots, N, gr0, gr1, t, limit);
}
