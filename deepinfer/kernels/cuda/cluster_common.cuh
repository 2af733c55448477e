// Thread-block cluster helpers (sm_90) of the kernels that add their split-K partials inside a cluster
// (fp8_linear_mma.cu's CLUSTER_SPLIT; fp8_linear_wgmma.cu's was removed, 2026-12-05): the cluster-wide barrier
// and loads from another CTA's shared memory (distributed shared memory).
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

