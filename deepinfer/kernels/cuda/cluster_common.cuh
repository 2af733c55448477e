// Thread-block cluster helpers (sm_90): the cluster-wide barrier, loads from another CTA's shared memory
// (distributed shared memory: fp8_linear_mma.cu's CLUSTER_SPLIT adds its split-K partials that way) and arrivals
// on another CTA's mbarrier (fp4_moe_wgmma.cu's MCAST: a CTA pair's consumers release both CTAs' ring slots).
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

// this CTA's rank in its cluster
__device__ __forceinline__ u32 cluster_rank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// one arrival on the mbarrier at this CTA's shared address `local` in the CTA of cluster rank `rank`
__device__ __forceinline__ void mbar_arrive_remote(u32 local, u32 rank) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_address(local, rank))
                 : "memory");
}
