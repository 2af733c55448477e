// TMA and mbarrier helpers shared by the warp-specialised kernels of this package (fp4_moe_tma.cu,
// fp4_moe_wgmma.cu, fp8_linear_wgmma.cu): the 128-byte tensor-map parameter, shared-memory addresses and
// alignment, mbarrier init / arrive / expect_tx / wait and a ring's barriers, and the bulk copies that
// complete on an mbarrier's transaction count.
// (inlined once per kernel by runtime.read_source: no include guard needed)

struct __align__(64) TensorMap {
    unsigned long long opaque[16];  // CUtensorMap: 128 bytes, encoded on the host by cuTensorMapEncodeTiled
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    // one arrival that also raises the phase's pending transaction bytes: the phase completes when the
    // copies signalling this barrier have delivered them
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred P;\n"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n\t"
        "@!P bra WAIT_%=;\n}"
        ::"r"(bar), "r"(parity) : "memory");
}

// whether the barrier's phase of `parity` has completed, without waiting (mbarrier.test_wait)
__device__ __forceinline__ bool mbar_test(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n\t.reg .pred P;\n\t"
        "mbarrier.test_wait.parity.shared::cta.b64 P, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, P;\n}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

// shared-memory writes of the generic proxy (st.shared, cp.async, mbarrier init) made visible to the async proxy
// (TMA, wgmma) that reads them next
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// the first 1024-byte aligned address of dynamic shared memory (a 128-byte swizzled TMA box, as wgmma's
// descriptors read it, must start 1024-byte aligned; the launchers allot 1024 bytes of slack for this)
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem_raw) {
    const u32 raw = smem_u32(smem_raw);
    return smem_raw + (((raw + 1023u) & ~1023u) - raw);
}

// a TMA ring's mbarriers, from one thread before the block's first __syncthreads(): full[s] completes on the
// producer's one expect_tx arrival and the copies' bytes, empty[s] on `consumers` arrivals; then made visible
// to the async proxy (the TMA) that will complete them
__device__ __forceinline__ void ring_init(u32 full0, u32 empty0, int stages, u32 consumers) {
    for (int s = 0; s < stages; ++s) {
        mbar_init(full0 + 8 * s, 1);
        mbar_init(empty0 + 8 * s, consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_async_smem();
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}


__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
