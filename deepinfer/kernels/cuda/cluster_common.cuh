// Thread-block cluster helpers (sm_90) shared by the kernels that add their split-K partials inside a cluster
// (fp8_linear_mma.cu, fp8_linear_wgmma.cu: CLUSTER_SPLIT): the cluster-wide barrier and loads from another
// CTA's shared memory (distributed shared memory).
// (inlined once per kernel by runtime.read_source: no include guard needed)

// all threads of every CTA of the cluster: memory before it is visible to the cluster after it
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// this CTA's shared address `local` mapped to the same variable in the shared memory of cluster rank `rank`
__device__ __forceinline__ u32 cluster_address(u32 local, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

__device__ __forceinline__ float ld_cluster(u32 local, u32 rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_address(local, rank)) : "memory");
    return v;
}

// 4 fp32 (16-byte aligned)
__device__ __forceinline__ float4 ld_cluster4(u32 local, u32 rank) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(cluster_address(local, rank)) : "memory");
    return v;
}
