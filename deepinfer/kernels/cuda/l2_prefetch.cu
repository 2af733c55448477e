// L2 prefetch of byte ranges (sm_90): warm the L2 with the weights a later kernel will stream, while the
// kernels before it leave the memory idle (model/l2_prefetch.py says when and which).
//
// Contract: for each range r < 8 with sizes[r] > 0, the bytes [ptrs[r], ptrs[r] + sizes[r]) are requested into
// the L2 in pieces of at most CHUNK bytes. Nothing is written and nothing is returned: a prefetch changes where
// a later read finds its bytes, never a value, so every kernel's results are the same with or without it.
// How: `cp.async.bulk.prefetch.L2.global` hands a whole piece to the SM's bulk-copy (TMA) unit with one
// instruction: no registers, shared memory or completion to wait for, so a thread issues its pieces and exits.
// The pieces of all ranges are numbered in order (range 0's first); thread i of the grid takes pieces i,
// i + threads, i + 2 threads, ..., so the first bytes of every range are asked for first, spread over the SMs.
// EVICT_LAST 1: the pieces carry an L2::evict_last cache policy (createpolicy), so streaming reads in between
// evict them last (the policy protects lines fully only inside the persisting-L2 set-aside, which the CUDA
// driver's default sizes at 0 bytes; an A/B switch, off by default).
// Requires (the launcher checks): each ptrs[r] and sizes[r] a multiple of 16 bytes, CHUNK a multiple of 16.
// Launch: grid (ceil(pieces / 32) capped by the launcher), block 32.

#ifndef CHUNK
#define CHUNK 32768
#endif
#ifndef EVICT_LAST
#define EVICT_LAST 0
#endif
#if CHUNK % 16 || CHUNK <= 0
#error "CHUNK must be a positive multiple of 16 bytes"
#endif
#define RANGES 8

typedef long long i64;

extern "C" __global__ void __launch_bounds__(32)
l2_prefetch(const char* p0, const char* p1, const char* p2, const char* p3, const char* p4, const char* p5,
            const char* p6, const char* p7, i64 n0, i64 n1, i64 n2, i64 n3, i64 n4, i64 n5, i64 n6, i64 n7) {
    const char* const ptrs[RANGES] = {p0, p1, p2, p3, p4, p5, p6, p7};
    const i64 sizes[RANGES] = {n0, n1, n2, n3, n4, n5, n6, n7};
    const i64 threads = (i64)gridDim.x * blockDim.x;
    const i64 me = (i64)blockIdx.x * blockDim.x + threadIdx.x;
#if EVICT_LAST
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
    i64 first = 0;  // the number of range r's first piece
#pragma unroll
    for (int r = 0; r < RANGES; ++r) {
        const i64 bytes = sizes[r];
        const i64 pieces = (bytes + CHUNK - 1) / CHUNK;
        // this thread's first piece of the range: the smallest number >= first that is me modulo threads
        for (i64 g = first + ((me - first) % threads + threads) % threads; g < first + pieces; g += threads) {
            const i64 offset = (g - first) * CHUNK;
            const unsigned size = (unsigned)min((i64)CHUNK, bytes - offset);
            const char* src = ptrs[r] + offset;
#if EVICT_LAST
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                         ::"l"(src), "r"(size), "l"(policy) : "memory");
#else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(size) : "memory");
#endif
        }
        first += pieces;
    }
}
