// Device helpers shared by the mma.sync kernels of this package (fp4_moe_mma.cu, fp8_linear_mma.cu).
// runtime.read_source inlines this file where a kernel says #include "mma_common.cuh" (one source string per
// kernel: NVRTC needs no include path and the cubin cache key covers the header).
// (inlined once per kernel by read_source: no include guard needed)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

__device__ __forceinline__ uint4 ld_stream(const void* p) {
    // weights are read once: do not keep them in L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) {
    // activations are read by every CTA that multiplies them: keep them cached
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// both halves of a times both halves of b in bf16, round to nearest even (sm_90); keeps subnormals
__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (lo, hi) rounded to bf16 (nearest even) as one register, lo in the low half (the lower address in memory)
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// byte permute of the pair (lo, hi): the activations' bf16 pairs regrouped to match the weights' K pairs
__device__ __forceinline__ u32 prmt(u32 lo, u32 hi, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(sel));
    return d;
}

// c (fp32 [4]) += A (16 x 16 bf16, four registers) @ B (16 x 8 bf16, two registers): the m16n8k16 fragments
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word_of(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// FP4 (E2M1) codes c and c + 4 of a packed word w (c = 0..3; code i = nibble i) as bf16 bit patterns
// E2M1 x 2^-126, low half code c, high half c + 4 (the derivation: fp4_moe_mma.cu's header)
template <int C>
__device__ __forceinline__ u32 e2m1_pair(u32 w) {
    // nibbles c and c + 4 at bits 4c.. and 16 + 4c..; for c = 0 / 1 masked in place, for 2 / 3 shifted down by 8
    const u32 v = (C >= 2) ? (w >> 8) : w;
    const u32 nib = (C & 1) ? (v & 0x00F000F0u) : (v & 0x000F000Fu);
    // magnitude (nibble bits 0..2) to bits 6..8 and sign (bit 3) to bit 15 of each half: (nib << 6) + (nib << 12)
    // (the two copies never overlap), or (nib << 2) + (nib << 8) for the upper nibble of a byte
    const u32 spread = (C & 1) ? nib * 0x104u : nib * 0x1040u;
    return spread & 0x81C081C0u;
}
