// One-token products of quantized matrices, in CUDA C (compiled at run time
// with NVRTC by cuda_mv.py; no headers). Each warp owns a few output rows;
// its lanes walk the rows' 32-value blocks (a Q8_0 block, an IQ4_XS
// sub-block), each lane loading its block's weight bytes with plain 4- or
// 8-byte loads, its 32 activations once (reused for every row of the warp)
// and accumulating in float32; a warp reduction ends the row. Decoding goes
// through byte permutes into the float 2^23's low byte (see ptx_decode.py),
// not the conversion unit.
//
// Programmatic dependent launch (sm_90+; cuda_mv.py launches with it when
// FLE_PDL is on): a kernel may start while the one before it in the
// stream ends. Until griddepcontrol.wait returns a kernel reads only what
// was complete before the kernel in front of it started (weights, and for
// the down product the routed ids and the slot map, which the gate+up
// launch in front of it waited for) and writes nothing; each kernel lets
// its own dependents start (launch_dependents) only after its wait, so
// that rule holds down the chain. Without the launch attribute both
// instructions return at once. PRE: the row iterations whose weight words a
// lane loads into registers before any product (and, but for gate+up,
// before the wait); the rest stream in a loop.
//
// KV0..KV3 (the IQ4 code book + 128, as four words) are defined by the
// loader in front of this source.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define MAGIC 0x4B000000u

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// every sum of a [A][B] array of per-lane partial sums, warp-reduced in place
template <int A, int B>
__device__ __forceinline__ void warp_sum_all(float (&acc)[A][B]) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[a][b] = warp_sum(acc[a][b]);
}

// eight IQ4 values of one word (byte j: value j in its low nibble, value j + 16 in its high one)
// dotted with the activations: lo[0..3] for the low nibbles of bytes 0..3, hi[0..3] for the high ones
__device__ __forceinline__ float iq4_dot(u32 q, const float4 lo, const float4 hi) {
    const float bias = __int_as_float(0x4B000080);
    u32 lh = ((q & 0x88888888u) >> 1) | 0x32103210u;
    u32 s = q & 0x7777u;
    u32 v0 = __byte_perm(__byte_perm(KV0, KV1, s), __byte_perm(KV2, KV3, s), lh);
    s = (q >> 16) & 0x7777u;
    lh >>= 16;
    u32 v1 = __byte_perm(__byte_perm(KV0, KV1, s), __byte_perm(KV2, KV3, s), lh);
    // v0 = (lo0, hi0, lo1, hi1), v1 = (lo2, hi2, lo3, hi3)
    float r = (__int_as_float(__byte_perm(v0, MAGIC, 0x7540)) - bias) * lo.x;
    r = fmaf(__int_as_float(__byte_perm(v0, MAGIC, 0x7542)) - bias, lo.y, r);
    r = fmaf(__int_as_float(__byte_perm(v1, MAGIC, 0x7540)) - bias, lo.z, r);
    r = fmaf(__int_as_float(__byte_perm(v1, MAGIC, 0x7542)) - bias, lo.w, r);
    r = fmaf(__int_as_float(__byte_perm(v0, MAGIC, 0x7541)) - bias, hi.x, r);
    r = fmaf(__int_as_float(__byte_perm(v0, MAGIC, 0x7543)) - bias, hi.y, r);
    r = fmaf(__int_as_float(__byte_perm(v1, MAGIC, 0x7541)) - bias, hi.z, r);
    r = fmaf(__int_as_float(__byte_perm(v1, MAGIC, 0x7543)) - bias, hi.w, r);
    return r;
}

// four int8 values of one word dotted with four activations
__device__ __forceinline__ float q8_dot(u32 q, const float4 x) {
    const float bias = __int_as_float(0x4B000080);
    q ^= 0x80808080u;
    float r = (__int_as_float(__byte_perm(q, MAGIC, 0x7540)) - bias) * x.x;
    r = fmaf(__int_as_float(__byte_perm(q, MAGIC, 0x7541)) - bias, x.y, r);
    r = fmaf(__int_as_float(__byte_perm(q, MAGIC, 0x7542)) - bias, x.z, r);
    r = fmaf(__int_as_float(__byte_perm(q, MAGIC, 0x7543)) - bias, x.w, r);
    return r;
}

// the 32 activations of block b (CG: from L2, not L1: written by other blocks of the same launch)
template <bool CG = false>
__device__ __forceinline__ void load_x32(const float* x, int b, float4 (&xv)[8]) {
    const float4* xp = (const float4*)(x + 32 * b);
#pragma unroll
    for (int i = 0; i < 8; ++i) xv[i] = CG ? __ldcg(xp + i) : xp[i];
}

// How a product waits for its inputs. PdlWait: the kernel in front (programmatic dependent
// launch; at once without it). NoWait: already waited. RowWait (the fused gate+up+down launch
// below): lane 0 of each warp spins until the gate+up blocks of its row have all published their
// outputs (ready[r] == need), acquiring them at GPU scope; no block barrier, since the warps of a
// block may have left the product early.
struct PdlWait {
    __device__ __forceinline__ void operator()() const {
        grid_wait();
        grid_release();
    }
};
struct NoWait {
    __device__ __forceinline__ void operator()() const {}
};
struct RowWait {
    const int* ready;
    int need;
    __device__ __forceinline__ void operator()() const {
        if ((threadIdx.x & 31) == 0) {
            int v;
            while (true) {
                asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");
                if (v >= need) break;
                __nanosleep(64);
            }
        }
        __syncwarp();
    }
};

// ---------------------------------------------------------------------------
// IQ4_XS super-block (136 bytes): f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]; sub-block ib
// (32 values) has scale d * (ls - 32), ls = 4 bits of scales_l[ib / 2] | 2 bits of scales_h << 4,
// and its 16 bytes of qs at 8 + 16 ib. A row's sub-block `it` (the row 8-byte aligned): its
// super-block's head and its 16 bytes of quants, loaded, then dotted with 32 activations.
struct Iq4Sub {
    uint2 hd, qa, qb;
};

__device__ __forceinline__ Iq4Sub iq4xs_load(const char* row, int it) {
    const int sb = it >> 3, ib = it & 7;
    const char* p = row + (i64)sb * 136;
    Iq4Sub w;
    w.hd = __ldg((const uint2*)p);
    w.qa = __ldg((const uint2*)(p + 8 + 16 * ib));
    w.qb = __ldg((const uint2*)(p + 16 + 16 * ib));
    return w;
}

// (xv: the sub-block's 32 activations; xv[0..3] meet the low nibbles, xv[4..7] the high ones)
__device__ __forceinline__ float iq4xs_dot(const Iq4Sub& w, int it, const float4 (&xv)[8]) {
    const int ib = it & 7;
    const u32 ls = ((w.hd.y >> (4 * ib)) & 0xFu) | (((w.hd.x >> (16 + 2 * ib)) & 3u) << 4);
    const float dl = h2f((u16)(w.hd.x & 0xFFFFu)) * (float)((int)ls - 32);
    float s = iq4_dot(w.qa.x, xv[0], xv[4]);
    s += iq4_dot(w.qa.y, xv[1], xv[5]);
    s += iq4_dot(w.qb.x, xv[2], xv[6]);
    s += iq4_dot(w.qb.y, xv[3], xv[7]);
    return dl * s;
}

__device__ __forceinline__ float iq4xs_sub(const char* row, int it, const float4 (&xv)[8]) {
    return iq4xs_dot(iq4xs_load(row, it), it, xv);
}

// Whether routed row r (t * n_used + k), a miss, is the CPU's (runtime.split): the last
// round(n_miss * share / 256) misses of its token t are.
__device__ __forceinline__ bool cpu_owned(const int* slot_of, const i64* ids, int r, int n_used, int cpu_share) {
    const int t = r / n_used;
    int n_miss = 0, rank = 0;
    for (int k = 0; k < n_used; ++k) {
        const int miss = slot_of[ids[t * n_used + k]] < 0;
        n_miss += miss;
        rank += miss && (t * n_used + k < r);
    }
    const int n_cpu = (n_miss * cpu_share + 128) >> 8;
    return rank >= n_miss - n_cpu;
}

// A warp's OPW outputs of one routed row (lane 0 writes them): silu(gate) * up from the (gate, up)
// sums of gate+up, else the down sums scaled by the routing weight w.
template <int GU, int OPW>
__device__ __forceinline__ void store_outputs(const float (&acc)[GU ? 2 * OPW : OPW], float w, float* yr, int o0,
                                              int n_out) {
#pragma unroll
    for (int j = 0; j < OPW; ++j) {
        const int o = o0 + j;
        if (o < n_out) {
            float v;
            if (GU) {
                const float g = acc[2 * j], u = acc[2 * j + 1];
                v = g / (1.0f + __expf(-g)) * u;
            } else {
                v = acc[j] * w;
            }
            yr[o] = v;
        }
    }
}

// The routed experts of one step (any number of tokens T, rows r = t * n_used + k), one matrix
// product: with GU, silu(gate x) * up x of the gate rows and the up rows that follow them, else the
// down product scaled by the routing weight. Expert e's bytes are in slot slot_of[e] of the slot
// buffer at `base` when it has one, else host_delta bytes from `base` (page-locked host memory, read
// over PCIe). cpu_share (0..256): the last round(n_miss * share / 256) misses of each token are the
// CPU's (runtime.split), skipped here (their down rows written as zeros). A missed expert reads its
// activations x_miss_delta elements away from x (their rounded copy) when that is not 0.
// bx, r: the block's column of output rows and its routed row (the grid's x and y in a launch of
// one product). CG: activations from L2 (the fused launch's down part reads what its gate+up
// part wrote).
template <int GU, int OPW, int PRE, bool CG = false, class Wait = PdlWait>
__device__ __forceinline__ void iq4xs_experts(const char* base, i64 host_delta, i64 part_bytes, i64 expert_bytes,
                                              const int* slot_of, const i64* ids, const float* wts, const float* x,
                                              float* y, int n_out, int n_sub, i64 row_bytes, int n_used,
                                              int stride_x, int stride_y, int cpu_share, i64 x_miss_delta,
                                              int bx, int r, Wait wait = Wait()) {
    constexpr bool EARLY = !GU && PRE > 0;       // the down product's weights are read before the wait
    if (!EARLY) wait();
    const int lane = threadIdx.x & 31;
    const int o0 = (bx * (blockDim.x >> 5) + (threadIdx.x >> 5)) * OPW;
    if (o0 >= n_out) return;
    const i64 e = ids[r];
    const int s = slot_of[e];
    if (cpu_share > 0 && s < 0 && cpu_owned(slot_of, ids, r, n_used, cpu_share)) {
        if (EARLY) wait();
        if (!GU && lane < OPW && o0 + lane < n_out) y[(i64)r * stride_y + o0 + lane] = 0.0f;
        return;
    }
    const char* ex = (s >= 0) ? base + (i64)s * expert_bytes : base + host_delta + e * expert_bytes;
    const char* m = ex + part_bytes;
    constexpr int NR = GU ? 2 * OPW : OPW;
    Iq4Sub pre[PRE > 0 ? PRE : 1][NR];
#pragma unroll
    for (int j = 0; j < PRE; ++j) {
        const int it = lane + 32 * j;
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const int o = o0 + (GU ? (i >> 1) : i);
            if (it < n_sub && o < n_out) {
                const i64 row = GU ? (i64)o + (i & 1) * (i64)n_out : (i64)o;
                pre[j][i] = iq4xs_load(m + row * row_bytes, it);
            }
        }
    }
    if (EARLY) wait();
    const float* xr = x + (i64)(GU ? r / n_used : r) * stride_x + (s < 0 ? x_miss_delta : 0);
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < PRE; ++j) {
        const int it = lane + 32 * j;
        if (it < n_sub) {
            float4 xv[8];
            load_x32<CG>(xr, it, xv);
#pragma unroll
            for (int i = 0; i < NR; ++i)
                if (o0 + (GU ? (i >> 1) : i) < n_out) acc[i] += iq4xs_dot(pre[j][i], it, xv);
        }
    }
#pragma unroll 2
    for (int it = lane + 32 * PRE; it < n_sub; it += 32) {
        float4 xv[8];
        load_x32<CG>(xr, it, xv);
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const int o = o0 + (GU ? (i >> 1) : i);
            if (o < n_out) {
                const i64 row = GU ? (i64)o + (i & 1) * (i64)n_out : (i64)o;
                acc[i] += iq4xs_sub(m + row * row_bytes, it, xv);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = warp_sum(acc[i]);
    if (lane == 0) store_outputs<GU, OPW>(acc, GU ? 1.0f : wts[r], y + (i64)r * stride_y, o0, n_out);
}

#define EXPERTS(NAME, GU, OPW, PRE)                                                                                 \
    extern "C" __global__ void NAME(const char* base, i64 host_delta, i64 part_bytes, i64 expert_bytes,            \
                                    const int* slot_of, const i64* ids, const float* wts, const float* x, float* y, \
                                    int n_out, int n_sub, i64 row_bytes, int n_used, int stride_x, int stride_y,   \
                                    int cpu_share, i64 x_miss_delta) {                                             \
        iq4xs_experts<GU, OPW, PRE>(base, host_delta, part_bytes, expert_bytes, slot_of, ids, wts, x, y, n_out,     \
                                    n_sub, row_bytes, n_used, stride_x, stride_y, cpu_share, x_miss_delta,         \
                                    blockIdx.x, blockIdx.y);                                                       \
    }

#define EXPERTS_PRE(GU_OR_DN, GU, OPW)                      \
    EXPERTS(iq4xs_##GU_OR_DN##_##OPW##_p0, GU, OPW, 0)      \
    EXPERTS(iq4xs_##GU_OR_DN##_##OPW##_p1, GU, OPW, 1)      \
    EXPERTS(iq4xs_##GU_OR_DN##_##OPW##_p2, GU, OPW, 2)

#ifndef FLE_ONLY_FFN        // the fused kernels alone are their own module (cuda_mv.py)
EXPERTS_PRE(gu, 1, 1)
EXPERTS_PRE(gu, 1, 2)
EXPERTS_PRE(gu, 1, 4)
EXPERTS_PRE(dn, 0, 1)
EXPERTS_PRE(dn, 0, 2)
EXPERTS_PRE(dn, 0, 4)
EXPERTS_PRE(dn, 0, 8)
#endif

// The routed experts of a T-row step (a verify step's tokens, batched lanes: rows r = t * n_used + k),
// each distinct expert read once for every row routed to it (triton_engine.experts_union's rule):
// the blocks of row r compute only when r is the first row of its expert, then for all of that
// expert's rows (up to UMAX, UT at a time with the weights of a sub-block loaded once for them).
// cpu_share: runtime.split's union rule, the last round(n_d * share / 256) of the step's n_d
// distinct missed experts (in the order of their first rows) are the CPU's, skipped here (their
// down rows written as zeros).
#define UMAX 16
#define UT 4
// The union kernels' common part for routed row r (the block's y): -1 when an earlier row routes
// to the same expert (that row's blocks compute it), -2 when the expert is a miss that the CPU
// takes (its down rows written as zeros here), else the number of rows routed to it (up to UMAX),
// listed in order in rows[] (the same list in every lane).
template <int GU, int OPW>
__device__ __forceinline__ int union_rows(const int* slot_of, const i64* ids, float* y, int n_out, int stride_y,
                                          int cpu_share, int n_rows, int r, int o0, int lane, int (&rows)[UMAX]) {
    const i64 e = ids[r];
    // owner: no earlier row routes to e
    bool earlier = false;
    for (int j = lane; j < r; j += 32) earlier |= ids[j] == e;
    if (__any_sync(0xFFFFFFFFu, earlier)) return -1;
    int cnt = 0;
    for (int j0 = r; j0 < n_rows; j0 += 32) {
        const int j = j0 + lane;
        unsigned m = __ballot_sync(0xFFFFFFFFu, j < n_rows && ids[j] == e);
        while (m) {
            const int b = __ffs(m) - 1;
            m &= m - 1;
            if (cnt < UMAX) rows[cnt] = j0 + b;
            ++cnt;
        }
    }
    cnt = cnt < UMAX ? cnt : UMAX;          // cuda_mv.py gives these kernels no step with more
    if (cpu_share > 0 && slot_of[e] < 0) {
        // distinct missed experts: rows that are the first of their expert and miss; e's place among them
        int n_d = 0, before = 0;
        for (int j0 = 0; j0 < n_rows; j0 += 32) {
            const int j = j0 + lane;
            bool dm = false;
            if (j < n_rows) {
                const i64 ej = ids[j];
                bool first = true;
                for (int i = 0; i < j; ++i) first &= ids[i] != ej;
                dm = first && slot_of[ej] < 0;
            }
            const unsigned m = __ballot_sync(0xFFFFFFFFu, dm);
            n_d += __popc(m);
            before += __popc(m & (j0 + 32 <= r ? 0xFFFFFFFFu : (r > j0 ? (1u << (r - j0)) - 1u : 0u)));
        }
        const int n_cpu = (n_d * cpu_share + 128) >> 8;
        if (before >= n_d - n_cpu) {
            if (!GU && lane < OPW && o0 + lane < n_out)
                for (int q = 0; q < cnt; ++q) y[(i64)rows[q] * stride_y + o0 + lane] = 0.0f;
            return -2;
        }
    }
    return cnt;
}

template <int GU, int OPW>
__device__ __forceinline__ void iq4xs_union(const char* base, i64 host_delta, i64 part_bytes, i64 expert_bytes,
                                            const int* slot_of, const i64* ids, const float* wts, const float* x,
                                            float* y, int n_out, int n_sub, i64 row_bytes, int n_used,
                                            int stride_x, int stride_y, int cpu_share, i64 x_miss_delta, int n_rows) {
    grid_wait();
    grid_release();
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * OPW;
    if (o0 >= n_out) return;
    const int r = blockIdx.y;
    int rows[UMAX];
    const int cnt = union_rows<GU, OPW>(slot_of, ids, y, n_out, stride_y, cpu_share, n_rows, r, o0, lane, rows);
    if (cnt < 0) return;
    const i64 e = ids[r];
    const int s = slot_of[e];
    const char* ex = (s >= 0) ? base + (i64)s * expert_bytes : base + host_delta + e * expert_bytes;
    const char* m = ex + part_bytes;
    const i64 xd = s < 0 ? x_miss_delta : 0;
    constexpr int NR = GU ? 2 * OPW : OPW;
    for (int g = 0; g < cnt; g += UT) {
        const int ng = cnt - g < UT ? cnt - g : UT;
        const float* xr[UT];
#pragma unroll
        for (int q = 0; q < UT; ++q) {
            const int row = rows[g + (q < ng ? q : 0)];
            xr[q] = x + (i64)(GU ? row / n_used : row) * stride_x + xd;
        }
        float acc[UT][NR];
#pragma unroll
        for (int q = 0; q < UT; ++q)
#pragma unroll
            for (int i = 0; i < NR; ++i) acc[q][i] = 0.0f;
        for (int it = lane; it < n_sub; it += 32) {
            Iq4Sub w[NR];
#pragma unroll
            for (int i = 0; i < NR; ++i) {
                const int o = o0 + (GU ? (i >> 1) : i);
                const i64 row = GU ? (i64)o + (i & 1) * (i64)n_out : (i64)o;
                if (o < n_out) w[i] = iq4xs_load(m + row * row_bytes, it);
            }
#pragma unroll
            for (int q = 0; q < UT; ++q) {
                if (q < ng) {
                    float4 xv[8];
                    load_x32(xr[q], it, xv);
#pragma unroll
                    for (int i = 0; i < NR; ++i)
                        if (o0 + (GU ? (i >> 1) : i) < n_out) acc[q][i] += iq4xs_dot(w[i], it, xv);
                }
            }
        }
        warp_sum_all(acc);
        if (lane == 0) {
#pragma unroll
            for (int q = 0; q < UT; ++q)
                if (q < ng)
                    store_outputs<GU, OPW>(acc[q], GU ? 1.0f : wts[rows[g + q]], y + (i64)rows[g + q] * stride_y, o0,
                                           n_out);
        }
    }
}

#define UNION(NAME, GU, OPW)                                                                                        \
    extern "C" __global__ void NAME(const char* base, i64 host_delta, i64 part_bytes, i64 expert_bytes,            \
                                    const int* slot_of, const i64* ids, const float* wts, const float* x, float* y, \
                                    int n_out, int n_sub, i64 row_bytes, int n_used, int stride_x, int stride_y,   \
                                    int cpu_share, i64 x_miss_delta, int n_rows) {                                 \
        iq4xs_union<GU, OPW>(base, host_delta, part_bytes, expert_bytes, slot_of, ids, wts, x, y, n_out, n_sub,    \
                             row_bytes, n_used, stride_x, stride_y, cpu_share, x_miss_delta, n_rows);              \
    }

#ifndef FLE_ONLY_FFN
UNION(iq4xs_ugu_1, 1, 1)
UNION(iq4xs_ugu_2, 1, 2)
UNION(iq4xs_ugu_4, 1, 4)
UNION(iq4xs_udn_1, 0, 1)
UNION(iq4xs_udn_2, 0, 2)
UNION(iq4xs_udn_4, 0, 4)
UNION(iq4xs_udn_8, 0, 8)
#endif

// Gate+up and down of a layer's routed experts in one launch (h = silu(gate x) * up x, then
// y = w * down h per routed row), so that the down part's blocks start, and read their weights,
// while the last gate+up blocks run, with no launch between. Blocks take tickets in the order
// they start (sync[0]): the first gu_bpr * n_rows do gate+up (gu_bpr blocks per routed row), the
// rest down; a gate+up block publishes its outputs by counting itself into ready[r] = sync[2 + r],
// and a down warp waits for its row's count (RowWait). A down block's ticket comes after every
// gate+up ticket, each taken by a block that is running or done, so the wait ends. The last
// block to finish (sync[1] counts them) sets the counters back to zero for the next launch;
// launches that share `sync` must not run at the same time (one stream).
template <int GO, int DO, int PRE>
__device__ __forceinline__ void iq4xs_ffn(const char* base, i64 host_delta, i64 down_part, i64 expert_bytes,
                                          const int* slot_of, const i64* ids, const float* wts, const float* x,
                                          float* h, float* y, int n_ff, int n_embd, int n_sub_gu, int n_sub_dn,
                                          i64 gu_row_bytes, i64 dn_row_bytes, int n_used, int stride_x,
                                          int stride_h, int stride_y, int cpu_share, i64 x_miss_delta, int* sync,
                                          int gu_bpr, int dn_bpr, int n_rows) {
    grid_wait();
    grid_release();
    __shared__ int ticket_s;
    if (threadIdx.x == 0) ticket_s = atomicAdd(sync, 1);
    __syncthreads();
    const int ticket = ticket_s;
    const int n_gu = gu_bpr * n_rows;
    int* ready = sync + 2;
    if (ticket < n_gu) {
        const int r = ticket / gu_bpr;
        iq4xs_experts<1, GO, 0, false, NoWait>(base, host_delta, 0, expert_bytes, slot_of, ids, wts, x, h, n_ff,
                                               n_sub_gu, gu_row_bytes, n_used, stride_x, stride_h, cpu_share,
                                               x_miss_delta, ticket - r * gu_bpr, r);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(ready + r, 1);
    } else {
        const int t = ticket - n_gu, r = t / dn_bpr;
        iq4xs_experts<0, DO, PRE, true, RowWait>(base, host_delta, down_part, expert_bytes, slot_of, ids, wts, h, y,
                                                 n_embd, n_sub_dn, dn_row_bytes, n_used, stride_h, stride_y,
                                                 cpu_share, 0, t - r * dn_bpr, r, RowWait{ready + r, gu_bpr});
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync + 1, 1) == n_gu + dn_bpr * n_rows - 1) {
            for (int i = 0; i < n_rows + 2; ++i) sync[i] = 0;
            __threadfence();
        }
    }
}

#define FFN(GO, DO, PRE)                                                                                             \
    extern "C" __global__ void iq4xs_ffn_##GO##_##DO##_p##PRE(                                                      \
        const char* base, i64 host_delta, i64 down_part, i64 expert_bytes, const int* slot_of, const i64* ids,     \
        const float* wts, const float* x, float* h, float* y, int n_ff, int n_embd, int n_sub_gu, int n_sub_dn,    \
        i64 gu_row_bytes, i64 dn_row_bytes, int n_used, int stride_x, int stride_h, int stride_y, int cpu_share,   \
        i64 x_miss_delta, int* sync, int gu_bpr, int dn_bpr, int n_rows) {                                         \
        iq4xs_ffn<GO, DO, PRE>(base, host_delta, down_part, expert_bytes, slot_of, ids, wts, x, h, y, n_ff, n_embd, \
                               n_sub_gu, n_sub_dn, gu_row_bytes, dn_row_bytes, n_used, stride_x, stride_h,         \
                               stride_y, cpu_share, x_miss_delta, sync, gu_bpr, dn_bpr, n_rows);                   \
    }

#define FFN_PRE(GO, DO) FFN(GO, DO, 0) FFN(GO, DO, 1) FFN(GO, DO, 2)

#ifdef FLE_ONLY_FFN
FFN_PRE(2, 4)
FFN_PRE(2, 8)
FFN_PRE(4, 8)
#endif

// ---------------------------------------------------------------------------
// Q8_0 (34-byte blocks: f16 d, 32 int8): y[o] = sum over the row's blocks of d * (q . x). A block
// at an even index starts 4-byte aligned, at an odd one 2 bytes past; the nine words from the
// aligned address below the block hold it whole.
__device__ __forceinline__ void q8_0_load(const char* row, int b, u32 (&v)[9]) {
    const u32* w = (const u32*)(row + 34 * b - 2 * (b & 1));
#pragma unroll
    for (int i = 0; i < 9; ++i) v[i] = __ldg(w + i);
}

__device__ __forceinline__ float q8_0_dot(const u32 (&v)[9], int b, const float4 (&xv)[8]) {
    const int odd = b & 1;
    const float d = h2f((u16)(odd ? (v[0] >> 16) : (v[0] & 0xFFFFu)));
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        // the quants' word i: bytes 2 + 4 i .. 5 + 4 i of the block
        const u32 q = odd ? v[i + 1] : __funnelshift_r(v[i], v[i + 1], 16);
        s += q8_dot(q, xv[i]);
    }
    return d * s;
}

// block b of the warp's rows (their words v[i]) dotted with each of T activation rows (x rows
// stride_x floats apart): acc[t][i] += row i . x row t
template <int OPW, int T>
__device__ __forceinline__ void q8_0_rows(float (&acc)[T][OPW], const u32 (&v)[OPW][9], const float* x, int stride_x,
                                          int b, int o0, int n_out) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
        float4 xv[8];
        load_x32(x + (i64)t * stride_x, b, xv);
#pragma unroll
        for (int i = 0; i < OPW; ++i)
            if (o0 + i < n_out) acc[t][i] += q8_0_dot(v[i], b, xv);
    }
}

// the warp's [T][OPW] partial sums reduced, and written by lane 0 (output rows o0.. below n_out)
template <int OPW, int T>
__device__ __forceinline__ void store_rows(float (&acc)[T][OPW], float* y, int stride_y, int o0, int n_out,
                                           int lane) {
    warp_sum_all(acc);
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
            for (int i = 0; i < OPW; ++i)
                if (o0 + i < n_out) y[(i64)t * stride_y + o0 + i] = acc[t][i];
    }
}

// T rows of activations (x and y T rows apart by stride_x / stride_y floats): each weight block is
// loaded once and dotted with every row's activations. T = 1 loads a block's words row by row as
// they are used; T > 1 loads the warp's rows' words first, then walks the activation rows.
template <int OPW, int PRE, int T>
__device__ __forceinline__ void q8_0_mv(const char* w, const float* x, float* y, int n_out, int n_blocks,
                                        i64 row_bytes, int stride_x, int stride_y) {
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * OPW;
    if (o0 >= n_out) return;
    u32 pre[PRE > 0 ? PRE : 1][OPW][9];             // weights only: read before the wait
#pragma unroll
    for (int j = 0; j < PRE; ++j) {
        const int b = lane + 32 * j;
#pragma unroll
        for (int i = 0; i < OPW; ++i)
            if (b < n_blocks && o0 + i < n_out) q8_0_load(w + (i64)(o0 + i) * row_bytes, b, pre[j][i]);
    }
    grid_wait();
    grid_release();
    float acc[T][OPW];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int i = 0; i < OPW; ++i) acc[t][i] = 0.0f;
#pragma unroll
    for (int j = 0; j < PRE; ++j) {
        const int b = lane + 32 * j;
        if (b < n_blocks) q8_0_rows<OPW, T>(acc, pre[j], x, stride_x, b, o0, n_out);
    }
    if constexpr (T == 1) {
#pragma unroll 2
        for (int b = lane + 32 * PRE; b < n_blocks; b += 32) {
            float4 xv[8];
            load_x32(x, b, xv);
#pragma unroll
            for (int i = 0; i < OPW; ++i)
                if (o0 + i < n_out) {
                    u32 v[9];
                    q8_0_load(w + (i64)(o0 + i) * row_bytes, b, v);
                    acc[0][i] += q8_0_dot(v, b, xv);
                }
        }
    } else {
        for (int b = lane + 32 * PRE; b < n_blocks; b += 32) {
            u32 v[OPW][9];
#pragma unroll
            for (int i = 0; i < OPW; ++i)
                if (o0 + i < n_out) q8_0_load(w + (i64)(o0 + i) * row_bytes, b, v[i]);
            q8_0_rows<OPW, T>(acc, v, x, stride_x, b, o0, n_out);
        }
    }
    store_rows(acc, y, stride_y, o0, n_out, lane);
}

// Q8_0 rows staged through shared memory ("stage"): the warp copies a chunk of up to Q8S_CHUNK
// blocks of each of its OPW rows into its own part of shared memory with 16-byte asynchronous
// copies (consecutive lanes, consecutive 16 bytes: each copy instruction moves 512 bytes), then
// the lanes walk the chunk four blocks (128 values) at a time, lane L on values 4 (L % 8) .. +3 of
// block L / 8: its four quants from two shared words (a block's quants start 2 bytes past a
// 4-byte boundary when the block's index is even), the block's scale as a 16-bit shared load,
// and its four activations of each of the T rows as one 16-byte load that the warp's 32 lanes
// make contiguous (512 bytes). The one-block-per-lane kernel above loads a lane's 34 weight bytes
// and 32 activations with lanes 34 and 128 bytes apart, so that each of its load instructions
// touches about as many cache lines as it has lanes; here an instruction touches 4 (copies and
// activations) or about 1 (shared loads). Rows are 16-byte aligned: n_blocks % 8 == 0 (Q8S_CHUNK
// too), w 16-byte aligned (cuda_mv.py checks); the launch's shared memory has 16 bytes past the
// last warp's rows (a lane's second word may lie past its row). Weights are copied before the
// wait (PDL).
#define Q8S_CHUNK 128

__device__ __forceinline__ void cp_async16(void* smem, const void* g) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g) : "memory");
#else
    *(uint4*)smem = __ldg((const uint4*)g);
#endif
}

__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

template <int OPW, int T>
__device__ __forceinline__ void q8_0_mvs(const char* w, const float* x, float* y, int n_out, int n_blocks,
                                         i64 row_bytes, int stride_x, int stride_y) {
    extern __shared__ __align__(16) unsigned char q8s_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int o0 = (blockIdx.x * (blockDim.x >> 5) + warp) * OPW;
    if (o0 >= n_out) return;                 // no block-wide barrier below: a warp may leave
    const int chunk = n_blocks < Q8S_CHUNK ? n_blocks : Q8S_CHUNK;
    char* sm = (char*)q8s_smem + (i64)warp * OPW * chunk * 34;
    const int n_rows = n_out - o0 < OPW ? n_out - o0 : OPW;
    float acc[T][OPW];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int i = 0; i < OPW; ++i) acc[t][i] = 0.0f;
    const int sub = lane >> 3, q = lane & 7;            // block of the group, word of its quants
    for (int c0 = 0; c0 < n_blocks; c0 += chunk) {
        const int nb = n_blocks - c0 < chunk ? n_blocks - c0 : chunk;
        const int nv = nb * 34 / 16, rb = nb * 34;      // 16-byte copies per row, bytes per staged row
        for (int i = 0; i < n_rows; ++i) {
            const char* src = w + (i64)(o0 + i) * row_bytes + (i64)c0 * 34;
            for (int v = lane; v < nv; v += 32) cp_async16(sm + i * rb + 16 * v, src + 16 * v);
        }
        if (c0 == 0) {
            grid_wait();
            grid_release();
        }
        cp_async_wait();
        __syncwarp();
        const float* xc = x + (i64)c0 * 32 + 4 * lane;
        for (int g = 0; g < nb; g += 4) {
            float4 xv[T];
#pragma unroll
            for (int t = 0; t < T; ++t) xv[t] = *(const float4*)(xc + (i64)t * stride_x + 32 * g);
            const int off = 34 * (g + sub) + 2 + 4 * q;          // the lane's quants in a staged row
            const int sh = (off & 3) * 8;                        // 0 or 16
#pragma unroll
            for (int i = 0; i < OPW; ++i) {
                if (i < n_rows) {
                    const char* r = sm + i * rb;
                    const u32* wp = (const u32*)(r + (off & ~3));
                    const u32 qv = __funnelshift_r(wp[0], wp[1], sh);
                    const float d = h2f(*(const u16*)(r + 34 * (g + sub)));
#pragma unroll
                    for (int t = 0; t < T; ++t) acc[t][i] = fmaf(d, q8_dot(qv, xv[t]), acc[t][i]);
                }
            }
        }
        __syncwarp();                            // the next chunk overwrites what the lanes read
    }
    store_rows(acc, y, stride_y, o0, n_out, lane);
}

#define Q8MS(OPW, T)                                                                                              \
    extern "C" __global__ void q8_0_ms_##OPW##_t##T(const char* w, const float* x, float* y, int n_out,          \
                                                    int n_blocks, i64 row_bytes, int stride_x, int stride_y) {   \
        q8_0_mvs<OPW, T>(w, x, y, n_out, n_blocks, row_bytes, stride_x, stride_y);                                \
    }
#define Q8MS_T(OPW) Q8MS(OPW, 1) Q8MS(OPW, 2) Q8MS(OPW, 3) Q8MS(OPW, 4)

#ifndef FLE_ONLY_FFN
Q8MS_T(1)
Q8MS_T(2)
Q8MS_T(4)
#endif

#define Q8MV(NAME, OPW, PRE, T)                                                                          \
    extern "C" __global__ void NAME(const char* w, const float* x, float* y, int n_out, int n_blocks,   \
                                    i64 row_bytes, int stride_x, int stride_y) {                         \
        q8_0_mv<OPW, PRE, T>(w, x, y, n_out, n_blocks, row_bytes, stride_x, stride_y);                   \
    }

// one activation row: every loads-first variant; 2..4 rows (the verify step, batched lanes): none
#define Q8MV_PRE(OPW)                               \
    Q8MV(q8_0_mv_##OPW##_p0, OPW, 0, 1)             \
    Q8MV(q8_0_mv_##OPW##_p1, OPW, 1, 1)             \
    Q8MV(q8_0_mv_##OPW##_p2, OPW, 2, 1)             \
    Q8MV(q8_0_mv_##OPW##_p4, OPW, 4, 1)             \
    Q8MV(q8_0_mv_##OPW##_p0_t2, OPW, 0, 2)          \
    Q8MV(q8_0_mv_##OPW##_p0_t3, OPW, 0, 3)          \
    Q8MV(q8_0_mv_##OPW##_p0_t4, OPW, 0, 4)

#ifndef FLE_ONLY_FFN
Q8MV_PRE(1)
Q8MV_PRE(2)
Q8MV_PRE(4)
#endif
