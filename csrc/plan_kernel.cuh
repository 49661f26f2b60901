// moonplan fused GPU planner: selection primitives shared by the kernels of plan_kernel.cu
// and choice_kernel.cu.
//
// Legend: R ranks, E experts, X[r] = load[r] - target[r] (> 0 donor, < 0 receiver).
// Keys are (value, id) with a total order (lowest id on ties), so a warp reduction gives
// the same winner whatever the lane layout. No #include: NVRTC compiles this as given.

#pragma once


typedef long long mp_i64;

#define MP_FULL_MASK 0xffffffffu
#define MP_WARP 32
#define MP_I64_MAX 0x7fffffffffffffffLL
#define MP_I64_MIN (-MP_I64_MAX - 1)

// ---- home map (moonplan/plan/home.py) ---------------------------------------------------

// First expert owned by rank r (E past the last owner).
__device__ __forceinline__ mp_i64 mp_home_start(mp_i64 r, mp_i64 E, mp_i64 R) {
    const mp_i64 base = E / R, extra = E % R;
    return r * base + (r < extra ? r : extra);
}

// Home rank of expert e: the first E mod R ranks own base+1 experts.
__device__ __forceinline__ mp_i64 mp_home_of(mp_i64 e, mp_i64 E, mp_i64 R) {
    const mp_i64 base = E / R, extra = E % R, cut = extra * (base + 1);
    return e < cut ? e / (base + 1) : extra + (e - cut) / base;
}

// Exact target of rank r (r < R) for N records: N/R, one more for the first N mod R ranks.
__device__ __forceinline__ mp_i64 mp_target(mp_i64 N, mp_i64 R, mp_i64 r) {
    return N / R + (r < N % R ? 1 : 0);
}

// ---- warp reductions over (value, id) keys; id < 0 means "no candidate" -----------------

// (v, i) beats (bv, bi) for a maximum: larger value, then lower id.
__device__ __forceinline__ bool mp_beats_max(mp_i64 v, int i, mp_i64 bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// (v, i) beats (bv, bi) for a minimum: smaller value, then lower id.
__device__ __forceinline__ bool mp_beats_min(mp_i64 v, int i, mp_i64 bv, int bi) {
    return i >= 0 && (bi < 0 || v < bv || (v == bv && i < bi));
}

// Butterfly arg-best: every lane ends with the warp's best (v, i), the largest value when
// MAX, else the smallest (ties: the lowest valid id either way).
template <bool MAX>
__device__ __forceinline__ void mp_warp_best(mp_i64& v, int& i) {
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const mp_i64 ov = __shfl_xor_sync(MP_FULL_MASK, v, off);
        const int oi = __shfl_xor_sync(MP_FULL_MASK, i, off);
        if (MAX ? mp_beats_max(ov, oi, v, i) : mp_beats_min(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

__device__ __forceinline__ void mp_warp_argmax(mp_i64& v, int& i) { mp_warp_best<true>(v, i); }
__device__ __forceinline__ void mp_warp_argmin(mp_i64& v, int& i) { mp_warp_best<false>(v, i); }

// A warm pair (d, r) beats another: reference key min(X[r], -X[d], r, d).
__device__ __forceinline__ bool mp_pair_beats(mp_i64 xr, mp_i64 xd, int r, int d, mp_i64 bxr,
                                              mp_i64 bxd, int br, int bd) {
    if (r < 0) return false;
    if (br < 0) return true;
    if (xr != bxr) return xr < bxr;
    if (xd != bxd) return xd > bxd;
    if (r != br) return r < br;
    return d < bd;
}

__device__ __forceinline__ void mp_warp_pair_min(mp_i64& xr, mp_i64& xd, int& r, int& d) {
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const mp_i64 oxr = __shfl_xor_sync(MP_FULL_MASK, xr, off);
        const mp_i64 oxd = __shfl_xor_sync(MP_FULL_MASK, xd, off);
        const int orr = __shfl_xor_sync(MP_FULL_MASK, r, off);
        const int od = __shfl_xor_sync(MP_FULL_MASK, d, off);
        if (mp_pair_beats(oxr, oxd, orr, od, xr, xd, r, d)) {
            xr = oxr;
            xd = oxd;
            r = orr;
            d = od;
        }
    }
}

// Warp sum (MAX false) or maximum (MAX true) of an int64, on every lane (exact in any order).
template <bool MAX>
__device__ __forceinline__ mp_i64 mp_warp_reduce(mp_i64 v) {
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const mp_i64 o = __shfl_xor_sync(MP_FULL_MASK, v, off);
        v = MAX ? (o > v ? o : v) : v + o;
    }
    return v;
}

__device__ __forceinline__ mp_i64 mp_warp_sum(mp_i64 v) { return mp_warp_reduce<false>(v); }
__device__ __forceinline__ mp_i64 mp_warp_max(mp_i64 v) { return mp_warp_reduce<true>(v); }

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ mp_i64 mp_warp_incl_scan(mp_i64 v, int lane) {
    for (int off = 1; off < MP_WARP; off <<= 1) {
        const mp_i64 t = __shfl_up_sync(MP_FULL_MASK, v, off);
        if (lane >= off) v += t;
    }
    return v;
}

// ---- block-wide helpers (every thread of the block must call them) ------------------------

// Sum (MAX false) or maximum (MAX true, MP_I64_MIN for none) of v over the block; red must
// hold 33 values of shared memory.
template <bool MAX>
__device__ mp_i64 mp_block_reduce(mp_i64 v, mp_i64* red) {
    const int lane = threadIdx.x % MP_WARP, warp = threadIdx.x / MP_WARP;
    const int nwarps = blockDim.x / MP_WARP;
    v = mp_warp_reduce<MAX>(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const mp_i64 w = mp_warp_reduce<MAX>(lane < nwarps ? red[lane] : (MAX ? MP_I64_MIN : 0));
        if (lane == 0) red[MP_WARP] = w;
    }
    __syncthreads();
    const mp_i64 total = red[MP_WARP];
    __syncthreads();
    return total;
}

__device__ mp_i64 mp_block_sum(mp_i64 v, mp_i64* red) { return mp_block_reduce<false>(v, red); }
__device__ mp_i64 mp_block_max(mp_i64 v, mp_i64* red) { return mp_block_reduce<true>(v, red); }

// Exclusive prefix sum of v over the threads of the block (in thread order); red holds 33
// ints of shared memory; *total receives the sum.
__device__ int mp_block_excl_scan(int v, int* red, int* total) {
    const int lane = threadIdx.x % MP_WARP, warp = threadIdx.x / MP_WARP;
    const int nwarps = blockDim.x / MP_WARP;
    int incl = v;
    for (int off = 1; off < MP_WARP; off <<= 1) {
        const int t = __shfl_up_sync(MP_FULL_MASK, incl, off);
        if (lane >= off) incl += t;
    }
    if (lane == MP_WARP - 1) red[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < nwarps ? red[lane] : 0;
        int wi = w;
        for (int off = 1; off < MP_WARP; off <<= 1) {
            const int t = __shfl_up_sync(MP_FULL_MASK, wi, off);
            if (lane >= off) wi += t;
        }
        if (lane < nwarps) red[lane] = wi - w;
        if (lane == MP_WARP - 1) red[MP_WARP] = wi;
    }
    __syncthreads();
    const int out = red[warp] + incl - v;
    *total = red[MP_WARP];
    __syncthreads();
    return out;
}

// ---- balance_groups picks (warp 0) ------------------------------------------------------

// Best warm pair (d, r): d a donor, r a receiver, r holds an expert of d's group in a
// previous slot (warm_d[r*B + j] = home of that expert, -1 if none). Returns r (-1: none).
__device__ int mp_best_warm_pair(const mp_i64* X, const int* warm_d, int R, int B, int* d_out) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 bxr = 0, bxd = 0;
    int br = -1, bd = -1;
    const mp_i64 n = (mp_i64)R * B;
    for (mp_i64 i = lane; i < n; i += MP_WARP) {
        const int d = warm_d[i];
        if (d < 0) continue;
        const int r = (int)(i / B);
        const mp_i64 xr = X[r], xd = X[d];
        if (xr < 0 && xd > 0 && mp_pair_beats(xr, xd, r, d, bxr, bxd, br, bd)) {
            bxr = xr;
            bxd = xd;
            br = r;
            bd = d;
        }
    }
    mp_warp_pair_min(bxr, bxd, br, bd);
    *d_out = bd;
    return br;
}

// Largest donor (max X, lowest rank) and largest receiver (min X, lowest rank) with
// (value, id) pairs: exact for any int64 X.
__device__ void mp_pick_wide(const mp_i64* X, int R, int* d, int* r) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 dv = 0, rv = 0;
    int di = -1, ri = -1;
    for (int i = lane; i < R; i += MP_WARP) {
        const mp_i64 x = X[i];
        if (x > 0 && mp_beats_max(x, i, dv, di)) {
            dv = x;
            di = i;
        }
        if (x < 0 && mp_beats_min(x, i, rv, ri)) {
            rv = x;
            ri = i;
        }
    }
    mp_warp_argmax(dv, di);
    mp_warp_argmin(rv, ri);
    *d = di;
    *r = ri;
}

#define MP_RANK_BITS 11  // ranks < 2048
#define MP_RANK_MASK ((1LL << MP_RANK_BITS) - 1)
#ifndef MP_PACK_LIMIT
#define MP_PACK_LIMIT (1LL << 51)  // (a test build may lower it to exercise mp_pick_wide)
#endif

// The same picks with one packed int64 key per candidate, valid while |X| < 2^51:
// a donor's key X*2048 + (2047 - r) orders (X desc, r asc) under max; a receiver's key
// X*2048 + r orders (X asc, r asc) under min.
__device__ void mp_pick_packed(const mp_i64* X, int R, int* d, int* r) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 dk = MP_I64_MIN, rk = MP_I64_MAX;
    for (int i = lane; i < R; i += MP_WARP) {
        const mp_i64 x = X[i];
        if (x > 0) {
            const mp_i64 k = x * (MP_RANK_MASK + 1) + (MP_RANK_MASK - i);
            dk = k > dk ? k : dk;
        }
        if (x < 0) {
            const mp_i64 k = x * (MP_RANK_MASK + 1) + i;
            rk = k < rk ? k : rk;
        }
    }
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const mp_i64 od = __shfl_xor_sync(MP_FULL_MASK, dk, off);
        const mp_i64 orr = __shfl_xor_sync(MP_FULL_MASK, rk, off);
        dk = od > dk ? od : dk;
        rk = orr < rk ? orr : rk;
    }
    *d = dk == MP_I64_MIN ? -1 : (int)(MP_RANK_MASK - (dk & MP_RANK_MASK));
    *r = rk == MP_I64_MAX ? -1 : (int)(rk & MP_RANK_MASK);
}
