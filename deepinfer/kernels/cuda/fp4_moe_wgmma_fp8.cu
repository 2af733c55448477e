// Routed-expert GEMM of the prefill regime on Hopper's FP8 warpgroup MMA: the FP4 weights are expanded in
// registers to E4M3 (exactly: their per-32 E8M0 scales folded into the codes' exponents against one scale per
// row and 128-K group) and enter wgmma as its register operand A; the routed tokens' E4M3 activation codes
// (act_quant, 128-K groups) enter as its shared-memory operand B. Twice the tensor-core rate of the bf16 form
// (fp4_moe_wgmma.cu), whose layout, routing and epilogue this kernel shares. sm_90a only.
//
// Contract: as fp4_moe_wgmma.cu, with the activations as act_quant's E4M3 codes aq[p, k] (uint8, rows in the
// routing's sorted order, each 128-K group's columns in `act_quant.wgmma_fp8_k_order`) and their pow2 scales
// stored transposed, as_t[k / 128, p] (fp32; `act_quant.act_quant_gather_fp8` writes both).
// Math, per 128-K group kb of weight row r: the four E8M0 bytes S_i of the row's 32-K blocks, m = max S_i,
// W = max(m - 6, 1), j_i = S_i - W. Every weight E2M1 x 2^(S_i - 127) = (E2M1 x 2^j_i) x 2^(W - 127), and
// E2M1 x 2^j is an E4M3 value exactly for j in [-5, 6] (0.5 x 2^-5 is E4M3's smallest normal, 6 x 2^6 = 384 <
// 448); a 32-K block whose codes are all zero may have any j. The launcher runs only banks where that holds
// (`FP4ExpertBank.fp8_fold`). Per group the wgmmas' sum of exact E4M3 products (reduced-precision tensor-core
// accumulation over 128 K, as every FP8 GEMM on Hopper) is promoted into fp32:
// acc += partial * (as_t[kb, token] * 2^(W - 127)). The official fp4_gemm promotes every 32 K (spec §6.4);
// the difference is the tensor cores' accumulation inside a group, not the operands (exact both ways).
//
// Per CTA: one routing block (BT tokens = the wgmma's N) x ROWS = 64 CWG weight rows, K in stages of 128
// through a STAGES-deep ring filled by one producer warp (weights: the bf16 form's TMA boxes; activations: one
// [BT rows, 128 bytes] box with the 128-byte swizzle, k32 step s at byte 32 s; scales: one bulk copy of the
// block's BT floats of group kb).
// * The A fragment (8-bit wgmma RS layout per warp: lane (g, t) holds rows g and g + 8, logical K 4t..4t+3 in
//   registers 0 / 1 and 16 + 4t.. in 2 / 3 of each 32-K step) comes from the lane's 16 bytes of each row, the
//   physical K 32t..32t+31 (one E8M0 byte): step s uses word s; register 0 / 1 its even nibbles (physical
//   32t + 8s + 2i, i = byte), 2 / 3 its odd ones. So logical L = 32s + 16h + 4t + i holds physical
//   P = 32t + 8s + 2i + h. The expansion of 4 nibbles: their 3-bit magnitudes gathered into a byte-permute
//   selector, the byte permute picks from an 8-entry table of E4M3 bytes (E2M1 x 2^j, built per row and stage
//   by one integer multiply-add), the sign bit moved to bit 7: 7 instructions for 4 weights.
// * Pipeline: the bf16 form's full / empty barriers. A warpgroup expands stage i + 1 while stage i's four
//   wgmmas run, then waits, promotes stage i (its scales read from the ring) and releases the slot.
// Launch: grid (ceil(N / (GATED ? ROWS / 2 : ROWS)), routing blocks), block 128 (CWG + 1), dynamic shared
// memory `fp4_moe_wgmma.smem_bytes_fp8`. Requires K % 128 == 0.

#include "mma_common.cuh"
#include "tma_common.cuh"
#include "wgmma_common.cuh"

#ifndef BT
#define BT 128  // the launcher passes every constant (fp4_moe_wgmma.FP8_TILES)
#endif
#ifndef CWG
#define CWG 2
#endif
#ifndef STAGES
#define STAGES 6
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1
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
#define A_STAGE (BT * KSTEP)        // one box of E4M3 codes: BT rows x 128 bytes
#define S_STAGE (BT * 4)            // the block's activation scales of one 128-K group
#define NACC (BT / 2)               // fp32 accumulators per lane: 64 x BT / 128 threads
#define THREADS (128 * (CWG + 1))   // CWG consumer warpgroups and one producer warpgroup (one lane of it works)
// CWG 2: the accumulators and the partials (2 x 64 a lane at BT 128) and two stages of fragments need more
// than the 168 registers a lane that 384 threads get at launch; the producer warpgroup gives its registers back
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232  // (65536 - 128 x 40) / 256, rounded down to a multiple of 8

// d (the m64 x BT fp32 fragment) = A (registers, 8-bit layout) @ B (shared memory, by descriptor) + (accumulate ?
// d : 0), E4M3 inputs
#if BT == 64
__device__ __forceinline__ void wgmma_fp8(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}
#elif BT == 128
__device__ __forceinline__ void wgmma_fp8(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}
#else
#error "BT must be 64 or 128"
#endif

// E4M3 bytes of 4 E2M1 codes of a packed word x through the table (lo, hi) = E4M3 bytes of magnitudes 0..7
// times 2^j: EVEN takes nibbles 0, 2, 4, 6 (the low nibble of each byte), else 1, 3, 5, 7
template <bool EVEN>
__device__ __forceinline__ u32 e2m1x4_e4m3(u32 x, u32 lo, u32 hi) {
    const u32 mag = (EVEN ? x : x >> 4) & 0x07070707u;            // magnitude i at bits 8i..8i+2
    const u32 sel = __byte_perm(mag | (mag >> 4), 0u, 0x0020u);  // magnitudes 0..3 as selector nibbles 0..3
    const u32 val = __byte_perm(lo, hi, sel);
    return val | ((EVEN ? x << 4 : x) & 0x80808080u);             // sign (nibble bit 3) to bit 7 of its byte
}

// the table for exponent offset j (E4M3 of 0, .5, 1, 1.5 and 2, 3, 4, 6 are 0x00, 0x30, 0x38, 0x3C, 0x40, 0x44,
// 0x48, 0x4C; times 2^j adds 8j to each non-zero byte while it stays a normal, j in [-5, 6])
__device__ __forceinline__ void fold_table(int j, u32& lo, u32& hi) {
    lo = 0x3C383000u + (u32)j * 0x08080800u;
    hi = 0x4C484440u + (u32)j * 0x08080808u;
}

__device__ __forceinline__ u32 quad_max(u32 v) {  // the max over the 4 lanes t of one row (lane = 4g + t)
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
fp4_expert_gemm_wgmma_fp8(const __grid_constant__ TensorMap tmap_w, const __grid_constant__ TensorMap tmap_a,
                          const float* __restrict__ a_scale_t, i64 n_rows, const u8* __restrict__ ws, i64 stride_wse,
                          i64 stride_wsn, void* __restrict__ out, i64 stride_om, const float* __restrict__ route_w,
                          const int* __restrict__ sorted_slots, const int* __restrict__ block_expert, int n_slots,
                          int N, int K, float limit) {
    const int blk = blockIdx.y;  // row tiles on x: a routing block's tiles run together (its activations in L2)
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
    const u32 raw = smem_u32(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);  // the swizzled boxes need 1024-byte alignment
    unsigned char* a_ring = smem;                     // [STAGES][BT][128], 128-byte swizzled
    unsigned char* w_ring = smem + STAGES * A_STAGE;  // [STAGES][ROWS][64]
    float* s_ring = reinterpret_cast<float*>(w_ring + STAGES * W_STAGE);  // [STAGES][BT]
    u64* bars = reinterpret_cast<u64*>(s_ring + STAGES * BT);
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

    if (warp >= 4 * CWG) {
        // ---- producer warpgroup (warp 0 of it, lane 0): the stage's weight box(es), activations and scales ----
#if CWG == 2
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#endif
        if (warp == 4 * CWG && lane == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_w) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"(&tmap_a) : "memory");
            for (int step = 0; step < steps; ++step) {
                const int s = step % STAGES;
                if (step >= STAGES) mbar_wait(empty0 + 8 * s, ((step / STAGES) & 1) ^ 1);
                const u32 full = full0 + 8 * s;
                mbar_expect_tx(full, W_STAGE + A_STAGE + S_STAGE);
                const u32 w_dst = smem_u32(w_ring + s * W_STAGE);
#if GATED
                tma_load_3d(w_dst, &tmap_w, step * (KSTEP / 2), f0, expert, full);
                tma_load_3d(w_dst + W_STAGE / 2, &tmap_w, step * (KSTEP / 2), N + f0, expert, full);
#else
                tma_load_3d(w_dst, &tmap_w, step * (KSTEP / 2), f0, expert, full);
#endif
                tma_load_2d(smem_u32(a_ring + s * A_STAGE), &tmap_a, step * KSTEP, blk * BT, full);
                bulk_load(smem_u32(s_ring + s * BT), a_scale_t + step * n_rows + (i64)blk * BT, S_STAGE, full);
            }
        }
        return;
    }

    // ---- consumer warpgroups ----
#if CWG == 2
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
#endif
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
    // the lane's scale bytes: row, K/32 block 4 step + t (rows past the bank read its last row: their weights
    // are the TMA's zero fill, so any finite multiplier gives 0)
    const u8* ws0 = ws + (i64)expert * stride_wse + (i64)min(gr0, w_rows - 1) * stride_wsn + t;
    const u8* ws1 = ws + (i64)expert * stride_wse + (i64)min(gr1, w_rows - 1) * stride_wsn + t;
    u32 sc0 = ws0[0], sc1 = ws1[0];

    float acc[NACC], part[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = part[i] = 0.f;

    // stage `step` arrived: the lane's weight words of its two rows, their E4M3 tables and the rows' group
    // multipliers 2^(W - 127); the next stage's scale bytes are loaded now, a stage ahead of their use
    struct Stage {
        uint4 w0, w1;
        u32 lo0, hi0, lo1, hi1;
        float wm0, wm1;
        int slot;
    };
    auto take = [&](int step) {
        const int s = step % STAGES;
        Stage st;
        const int top0 = max((int)quad_max(sc0) - 6, 1), top1 = max((int)quad_max(sc1) - 6, 1);
        fold_table((int)sc0 - top0, st.lo0, st.hi0);
        fold_table((int)sc1 - top1, st.lo1, st.hi1);
        st.wm0 = __uint_as_float((u32)top0 << 23);
        st.wm1 = __uint_as_float((u32)top1 << 23);
        if (step + 1 < steps) {
            sc0 = ws0[(step + 1) * (KSTEP / 32)];
            sc1 = ws1[(step + 1) * (KSTEP / 32)];
        }
        mbar_wait(full0 + 8 * s, (step / STAGES) & 1);
        st.w0 = *reinterpret_cast<const uint4*>(w_ring + s * W_STAGE + lr0 * (KSTEP / 2) + 16 * t);
        st.w1 = *reinterpret_cast<const uint4*>(w_ring + s * W_STAGE + lr1 * (KSTEP / 2) + 16 * t);
        st.slot = s;
        return st;
    };
    auto expand = [&](u32 (&fr)[4][4], const Stage& st) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 x0 = word_of(st.w0, q), x1 = word_of(st.w1, q);
            fr[q][0] = e2m1x4_e4m3<true>(x0, st.lo0, st.hi0);
            fr[q][1] = e2m1x4_e4m3<true>(x1, st.lo1, st.hi1);
            fr[q][2] = e2m1x4_e4m3<false>(x0, st.lo0, st.hi0);
            fr[q][3] = e2m1x4_e4m3<false>(x1, st.lo1, st.hi1);
        }
    };
    // the stage's four 32-K wgmmas into a fresh partial (the first one does not accumulate); one group
    auto issue = [&](u32 (&fr)[4][4], const Stage& st) {
        const u32 a_base = smem_u32(a_ring + st.slot * A_STAGE);
        keep_all(part);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_fp8(part, fr[kk][0], fr[kk][1], fr[kk][2], fr[kk][3], desc_sw128(a_base + 32 * kk), kk);
        wgmma_commit();
    };
    // the stage's wgmmas are done: promote the partial with the tokens' scales (read from the ring before the
    // slot goes back to the producer: one arrival a warp)
    auto promote = [&](u32 (&fr)[4][4], const Stage& st) {
        wgmma_wait<0>();
        keep_all(part);
        keep_all(fr);
        const float* sa = s_ring + st.slot * BT + 2 * t;
#pragma unroll
        for (int j = 0; j < BT / 8; ++j) {
            const float2 a = *reinterpret_cast<const float2*>(sa + 8 * j);
            acc[4 * j] = fmaf(part[4 * j], a.x * st.wm0, acc[4 * j]);
            acc[4 * j + 1] = fmaf(part[4 * j + 1], a.y * st.wm0, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(part[4 * j + 2], a.x * st.wm1, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(part[4 * j + 3], a.y * st.wm1, acc[4 * j + 3]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * st.slot);
    };

    u32 fa[4][4], fb[4][4];
    Stage sa = take(0), sb;
    expand(fa, sa);
    for (int step = 0; step < steps; step += 2) {
        issue(fa, sa);
        if (step + 1 < steps) {
            sb = take(step + 1);
            expand(fb, sb);  // while stage `step`'s wgmmas run
        }
        promote(fa, sa);
        if (step + 1 >= steps) break;
        issue(fb, sb);
        if (step + 2 < steps) {
            sa = take(step + 2);
            expand(fa, sa);
        }
        promote(fb, sb);
    }

    store_tile<BT, GATED, OUT_F32>(acc, out, stride_om, route_w, sorted_slots + blk * BT, n_slots, N, gr0, gr1, t, limit);
}
