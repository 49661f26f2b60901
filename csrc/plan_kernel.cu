// moonplan fused GPU planner: the whole plan of moonplan/plan/reference.py in CUDA.
//
// Legend:
//   R ranks, E experts, B slots per rank, M = ceil(E/R), W = M + max(B, M) rows per rank
//   T[e]   records routed to expert e (column sums of counts)        (scratch total_E)
//   X[r]   load[r] - target[r]: > 0 donor, < 0 receiver              (shared memory)
//   q_in[r]  quota of the one flow that fills receiver r              (shared memory)
//   in_donor[r]  donor rank of that flow, -1 if r receives nothing    (shared memory)
//   flow [R-1, 3]  group flows (donor, receiver, records) in decision order (output)
//
// Two kernels, both launched by moonplan/plan/cuda_backend.py on one stream, no host sync:
//   moonplan_plan_prep  many blocks: T[e], home[e], alloc = 0 (skipped when the main kernel
//                       does it itself: fused_prep = 1, for small E*R)
//   moonplan_plan_main  ONE block (min(1024, max(128, 32 R)) threads: a warp per rank),
//                       phases separated by __syncthreads:
//     0  T -> shared memory, N, warm donor of every previous slot
//     1  static load and X per rank (warp per rank), target
//     2  balance_groups: warp 0 alone: replay of last step's flows (lane 0), then one
//        greedy flow per step (sequential by nature); writes flow [R-1, 3]
//     3  dest lists: receivers grouped by donor (counting sort, block scan)
//     4  split_group: warp per donor group (groups are independent)
//     5  place_slots + row_layout: warp per rank
//
// Every choice uses the reference's total order (value, then lowest id), so the result does
// not depend on thread scheduling. Plain CUDA C++ without system headers (its one include,
// plan_kernel.cuh, is handed to NVRTC by the launcher): NVRTC compiles it at run time, CI
// compiles it with `nvcc -std=c++17 -arch=sm_90 -Icsrc -c`.

#include "plan_kernel.cuh"

// ---- prep: column sums, home map, alloc = 0 ----------------------------------------------

// Threads [tid, tid + stride, ...) of a grid (or of one block) share the work.
__device__ void mp_prep(const mp_i64* counts, mp_i64 R, mp_i64 E, mp_i64* alloc, mp_i64* home,
                        mp_i64* total_E, mp_i64 tid, mp_i64 stride) {
    for (mp_i64 e = tid; e < E; e += stride) {
        mp_i64 s = 0;
        for (mp_i64 r = 0; r < R; ++r) s += counts[r * E + e];
        total_E[e] = s;
        home[e] = mp_home_of(e, E, R);
    }
    for (mp_i64 i = tid; i < E * R; i += stride) alloc[i] = 0;
}

extern "C" __global__ void moonplan_plan_prep(const mp_i64* counts, mp_i64 R, mp_i64 E,
                                              mp_i64* alloc, mp_i64* home, mp_i64* total_E) {
    const mp_i64 tid = (mp_i64)blockIdx.x * blockDim.x + threadIdx.x;
    mp_prep(counts, R, E, alloc, home, total_E, tid, (mp_i64)gridDim.x * blockDim.x);
}

// ---- step 1: balance_groups (warp 0 only) -------------------------------------------------

struct MpBalance {
    mp_i64* X;               // [R] excess (> 0) or deficit (< 0) (shared)
    mp_i64* q_in;            // [R] quota of the flow that fills r (shared)
    int* in_donor;           // [R] donor of that flow, -1: not filled (shared)
    mp_i64* avail;           // [R] load[d] - records d gave in replayed flows (shared)
    const int* warm_d;       // [R, B] home of each previous slot's expert, -1 if none
    const mp_i64* prev_flow; // [n_prev_flow, 3] last step's flows (donor, receiver, records)
    mp_i64* flow;            // [R-1, 3] output: this step's flows in decision order
    int R, B, n_prev_flow;
    bool has_prev, packed;   // packed: every |X| < 2^51 (then mp_pick_packed is exact)
};

// Lane 0 records flow number nf: donor d fills receiver r with quota = its whole deficit.
__device__ __forceinline__ void mp_fill(const MpBalance& b, int d, int r, int nf) {
    const mp_i64 quota = -b.X[r];
    b.in_donor[r] = d;
    b.q_in[r] = quota;
    b.X[d] -= quota;  // may go negative: the donor overshot and is now a receiver
    b.X[r] = 0;
    if (nf < b.R - 1) {
        b.flow[3 * nf] = d;
        b.flow[3 * nf + 1] = r;
        b.flow[3 * nf + 2] = quota;
    }
}

// keep_previous_flows, lane 0 alone (in order: each replay depends on the last). "filled"
// is in_donor[r] >= 0, set only by replays so far. Returns the number of flows.
__device__ int mp_replay(const MpBalance& b) {
    int nf = 0;
    for (int i = 0; i < b.n_prev_flow; ++i) {
        const mp_i64 d = b.prev_flow[3 * i], r = b.prev_flow[3 * i + 1];
        if (d < 0 || d >= b.R || r < 0 || r >= b.R) continue;  // (-1, -1, 0) padding
        const mp_i64 deficit = -b.X[r];
        if (deficit > 0 && b.in_donor[r] < 0 && b.in_donor[d] < 0 && b.avail[d] >= deficit) {
            b.avail[d] -= deficit;
            mp_fill(b, (int)d, (int)r, nf);
            ++nf;
        }
    }
    return nf;
}

// Group-level flows (warp 0): replay last step's flows, then each greedy step fills the
// chosen receiver completely; pads flow with (-1, -1, 0).
__device__ void mp_balance(const MpBalance& b) {
    const int lane = threadIdx.x % MP_WARP;
    int nf = 0;
    if (lane == 0) nf = mp_replay(b);
    nf = __shfl_sync(MP_FULL_MASK, nf, 0);
    __syncwarp();
    for (int step = 0; step < 2 * b.R; ++step) {
        int d = -1, r = -1;
        if (b.packed) {
            mp_pick_packed(b.X, b.R, &d, &r);
        } else {
            mp_pick_wide(b.X, b.R, &d, &r);
        }
        if (d < 0 || r < 0) break;  // no donor left (a donor implies a receiver: sum X = 0)
        if (b.has_prev) {
            int wd = -1;
            const int wr = mp_best_warm_pair(b.X, b.warm_d, b.R, b.B, &wd);
            if (wr >= 0) {
                d = wd;
                r = wr;
            }
        }
        __syncwarp();  // every lane has read X
        if (lane == 0) mp_fill(b, d, r, nf);
        ++nf;
        __syncwarp();
    }
    for (int i = nf + lane; i < b.R - 1; i += MP_WARP) {
        b.flow[3 * i] = -1;
        b.flow[3 * i + 1] = -1;
        b.flow[3 * i + 2] = 0;
    }
}

// ---- step 2: split_group (one warp per donor group) ---------------------------------------

struct MpSplit {
    mp_i64* rem;            // [E] records still unassigned (shared)
    mp_i64* q_in;           // [R] remaining quota of each receiver (shared)
    const int* dest_list;   // receivers grouped by donor (shared)
    const int* dest_start;  // [R+1] offsets into dest_list (shared)
    int* rep_n;             // [R] replicas recorded per rank (shared)
    int* rep_e;             // [R, M] replica experts per rank (scratch)
    mp_i64* rep_c;          // [R, M] replica records per rank (scratch)
    mp_i64* alloc;          // [E, R] output
    const mp_i64* prev;     // [R, B] previous slots (valid when has_prev)
    mp_i64 R, E, B, M;
    bool has_prev;
};

// The destination with the largest remaining quota (lowest rank on ties); -1 when all full.
__device__ int mp_pick_dest(const MpSplit& s, int ds, int nd, mp_i64* quota) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 qv = 0;
    int qi = -1;
    for (int p = lane; p < nd; p += MP_WARP) {
        const int r = s.dest_list[ds + p];
        const mp_i64 q = s.q_in[r];
        if (q > 0 && mp_beats_max(q, r, qv, qi)) {
            qv = q;
            qi = r;
        }
    }
    mp_warp_argmax(qv, qi);
    *quota = qv;
    return qi;
}

// The group's expert to take from for destination r: resident in r's previous slots first,
// then most remaining records, lowest id on ties; -1 when the group is exhausted.
__device__ int mp_pick_expert(const MpSplit& s, int r, mp_i64 first, mp_i64 last, mp_i64* left) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 ev = 0;
    int ei = -1;
    if (s.has_prev) {
        for (mp_i64 j = lane; j < s.B; j += MP_WARP) {
            const mp_i64 e = s.prev[(mp_i64)r * s.B + j];
            if (e >= first && e < last) {
                const mp_i64 v = s.rem[e];
                if (v > 0 && mp_beats_max(v, (int)e, ev, ei)) {
                    ev = v;
                    ei = (int)e;
                }
            }
        }
        mp_warp_argmax(ev, ei);
    }
    if (ei < 0) {
        for (mp_i64 e = first + lane; e < last; e += MP_WARP) {
            const mp_i64 v = s.rem[e];
            if (v > 0 && mp_beats_max(v, (int)e, ev, ei)) {
                ev = v;
                ei = (int)e;
            }
        }
        mp_warp_argmax(ev, ei);
    }
    *left = ev;
    return ei;
}

// Move every outflow of donor group d out of rem; the home keeps the rest.
__device__ void mp_split_group(const MpSplit& s, int d) {
    const int lane = threadIdx.x % MP_WARP;
    const mp_i64 first = mp_home_start(d, s.E, s.R), last = mp_home_start(d + 1, s.E, s.R);
    const int ds = s.dest_start[d], nd = s.dest_start[d + 1] - ds;
    // Each step fills a destination or empties an expert: nd + (last - first) steps suffice.
    const mp_i64 steps = nd + (last - first) + 1;
    for (mp_i64 it = 0; it < steps; ++it) {
        mp_i64 quota = 0, left = 0;
        const int r = mp_pick_dest(s, ds, nd, &quota);
        if (r < 0) break;
        const int e = mp_pick_expert(s, r, first, last, &left);
        if (e < 0) break;  // unreachable for valid counts: the group holds every outflow
        __syncwarp();      // every lane has read rem and q_in
        if (lane == 0) {
            const mp_i64 take = quota < left ? quota : left;
            s.alloc[(mp_i64)e * s.R + r] += take;
            s.rem[e] -= take;
            s.q_in[r] -= take;
            const int k = s.rep_n[r];
            s.rep_n[r] = k + 1;
            s.rep_e[(mp_i64)r * s.M + k] = e;
            s.rep_c[(mp_i64)r * s.M + k] = take;
        }
        __syncwarp();
    }
    for (mp_i64 e = first + lane; e < last; e += MP_WARP) s.alloc[e * s.R + d] += s.rem[e];
}

// ---- step 3: place_slots + row_layout (one warp per rank) ---------------------------------

struct MpPlace {
    const int* rep_n;       // [R] (shared)
    int* rep_e;             // [R, M] replica experts; reused for the non-kept list (scratch)
    const mp_i64* rep_c;    // [R, M] (scratch)
    int* srt_e;             // [R, M] replicas sorted by (records desc, id asc) (scratch)
    const mp_i64* prev;     // [R, B]
    const mp_i64* alloc;    // [E, R]
    const mp_i64* rem;      // [E] home records = alloc[e, home(e)] (shared)
    mp_i64* slot_expert;    // [R, B]
    mp_i64* slot_new;       // [R, B]
    mp_i64* row_expert;     // [R, W]
    mp_i64* row_count;      // [R, W]
    mp_i64* row_offset;     // [R, W+1]
    mp_i64 R, E, B, M, W, align;
    bool has_prev;
};

// Sort rank r's n replicas (largest first, lowest id on ties) into srt by counting ranks.
__device__ void mp_sort_replicas(const int* rep, const mp_i64* repc, int n, int* srt) {
    const int lane = threadIdx.x % MP_WARP;
    for (int k = lane; k < n; k += MP_WARP) {
        const int e = rep[k];
        const mp_i64 c = repc[k];
        int pos = 0;
        for (int j = 0; j < n; ++j) {
            const mp_i64 cj = repc[j];
            pos += (cj > c || (cj == c && rep[j] < e)) ? 1 : 0;
        }
        srt[pos] = e;
    }
}

// Compact the sorted replicas that are not resident in a previous slot into nk (in order).
__device__ int mp_non_kept(const int* srt, int n, const mp_i64* prev_r, mp_i64 B, bool has_prev,
                           int* nk) {
    const int lane = threadIdx.x % MP_WARP;
    const unsigned lower = (1u << lane) - 1u;
    int count = 0;
    for (int k0 = 0; k0 < n; k0 += MP_WARP) {
        const int k = k0 + lane;
        const int e = k < n ? srt[k] : -1;
        bool kept = false;
        if (k < n && has_prev) {
            for (mp_i64 j = 0; j < B; ++j) kept = kept || prev_r[j] == e;
        }
        const bool take = k < n && !kept;
        const unsigned mask = __ballot_sync(MP_FULL_MASK, take);
        if (take) nk[count + __popc(mask & lower)] = e;
        count += __popc(mask);
    }
    return count;
}

// Fill rank r's slots; returns the number of free slots (empty + unused residents).
__device__ int mp_fill_slots(const MpPlace& p, int r, const int* srt, int n, const int* nk,
                             int n_nk) {
    const int lane = threadIdx.x % MP_WARP;
    const unsigned lower = (1u << lane) - 1u;
    const mp_i64* prev_r = p.prev + (mp_i64)r * p.B;
    int n_empty = 0;
    for (mp_i64 j0 = 0; j0 < p.B; j0 += MP_WARP) {
        const mp_i64 j = j0 + lane;
        const bool empty = j < p.B && (!p.has_prev || prev_r[j] == -1);
        n_empty += __popc(__ballot_sync(MP_FULL_MASK, empty));
    }
    int e_seen = 0, u_seen = 0;
    for (mp_i64 j0 = 0; j0 < p.B; j0 += MP_WARP) {
        const mp_i64 j = j0 + lane;
        const bool valid = j < p.B;
        const mp_i64 old = (valid && p.has_prev) ? prev_r[j] : -1;
        bool used = false;
        if (valid && old != -1) {
            for (int k = 0; k < n; ++k) used = used || srt[k] == old;
        }
        const bool empty = valid && old == -1;
        const bool unused = valid && old != -1 && !used;
        const unsigned m_empty = __ballot_sync(MP_FULL_MASK, empty);
        const unsigned m_unused = __ballot_sync(MP_FULL_MASK, unused);
        int f = -1;  // position in the free list: empty slots first, then unused residents
        if (empty) f = e_seen + __popc(m_empty & lower);
        if (unused) f = n_empty + u_seen + __popc(m_unused & lower);
        e_seen += __popc(m_empty);
        u_seen += __popc(m_unused);
        mp_i64 slot = old, fresh = 0;
        if (f >= 0 && f < n_nk) {
            slot = nk[f];
            fresh = 1;
        }
        if (valid) {
            p.slot_expert[(mp_i64)r * p.B + j] = slot;
            p.slot_new[(mp_i64)r * p.B + j] = fresh;
        }
    }
    return n_empty + u_seen;
}

// Rows of rank r: home experts, -1 to M, the B slots, direct replicas, -1 to W; counts and
// align-padded offsets (cu_seqlens).
__device__ void mp_row_layout(const MpPlace& p, int r, const int* direct, int n_direct) {
    const int lane = threadIdx.x % MP_WARP;
    const mp_i64 first = mp_home_start(r, p.E, p.R), last = mp_home_start(r + 1, p.E, p.R);
    mp_i64* off = p.row_offset + (mp_i64)r * (p.W + 1);
    if (lane == 0) off[0] = 0;
    mp_i64 carry = 0;
    for (mp_i64 k0 = 0; k0 < p.W; k0 += MP_WARP) {
        const mp_i64 k = k0 + lane;
        mp_i64 e = -1;
        if (k < p.M) {
            e = first + k < last ? first + k : -1;
        } else if (k < p.M + p.B) {
            e = p.slot_expert[(mp_i64)r * p.B + (k - p.M)];
        } else if (k < p.W) {
            const mp_i64 t = k - p.M - p.B;
            e = t < n_direct ? direct[t] : -1;
        }
        mp_i64 c = 0;  // home rows read shared memory, the others alloc
        if (e >= 0 && e < p.E) c = k < p.M ? p.rem[e] : p.alloc[e * p.R + r];
        const mp_i64 padded = (c + p.align - 1) / p.align * p.align;
        const mp_i64 incl = mp_warp_incl_scan(padded, lane);
        if (k < p.W) {
            p.row_expert[(mp_i64)r * p.W + k] = e;
            p.row_count[(mp_i64)r * p.W + k] = c;
            off[k + 1] = carry + incl;
        }
        carry += __shfl_sync(MP_FULL_MASK, incl, MP_WARP - 1);
    }
}

__device__ void mp_place_rank(const MpPlace& p, int r) {
    const int n = p.rep_n[r];
    int* rep = p.rep_e + (mp_i64)r * p.M;
    int* srt = p.srt_e + (mp_i64)r * p.M;
    mp_sort_replicas(rep, p.rep_c + (mp_i64)r * p.M, n, srt);
    __syncwarp();  // srt complete, rep no longer read
    const int n_nk = mp_non_kept(srt, n, p.prev + (mp_i64)r * p.B, p.B, p.has_prev, rep);
    __syncwarp();
    const int n_free = mp_fill_slots(p, r, srt, n, rep, n_nk);
    __syncwarp();  // slot_expert of rank r written
    const int n_direct = n_nk > n_free ? n_nk - n_free : 0;
    mp_row_layout(p, r, rep + n_free, n_direct);
}

// ---- phases 2-4 on the block's shared state (also the choice kernel's constructions) -------

// The main kernel's dynamic shared memory: rem[E], X, q_in, avail [R], red64[33] (int64),
// then in_donor, dest_list [R], dest_start[R+1], dest_cur, rep_n [R], red32[33] (int32).
struct MpShared {
    mp_i64 *rem, *X, *q_in, *avail, *red64;
    int *in_donor, *dest_list, *dest_start, *dest_cur, *rep_n, *red32;
};

__device__ MpShared mp_shared(unsigned char* smem, int R, mp_i64 E) {
    MpShared m;
    m.rem = (mp_i64*)smem;
    m.X = m.rem + E;
    m.q_in = m.X + R;
    m.avail = m.q_in + R;
    m.red64 = m.avail + R;
    m.in_donor = (int*)(m.red64 + MP_WARP + 1);
    m.dest_list = m.in_donor + R;
    m.dest_start = m.dest_list + R;
    m.dest_cur = m.dest_start + R + 1;
    m.rep_n = m.dest_cur + R;
    m.red32 = m.rep_n + R;
    return m;
}

// Phase 0's per-rank state: no quota, no donor, no receiver listed, no replica.
__device__ void mp_reset_ranks(const MpShared& m, int R) {
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        m.q_in[r] = 0;
        m.in_donor[r] = -1;
        m.dest_cur[r] = 0;
        m.rep_n[r] = 0;
    }
}

// Phase 3: receivers grouped by donor (counts, block scan, scatter). The order inside a
// group is irrelevant: every pick of split_group uses a total order on rank ids.
__device__ void mp_dest_lists(const MpShared& m, int R) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (int r = tid; r < R; r += nthreads) {
        if (m.in_donor[r] >= 0) atomicAdd(&m.dest_cur[m.in_donor[r]], 1);
    }
    __syncthreads();
    int n_flows = 0;
    const int start = mp_block_excl_scan(tid < R ? m.dest_cur[tid] : 0, m.red32, &n_flows);
    if (tid < R) m.dest_start[tid] = start;
    if (tid == 0) m.dest_start[R] = n_flows;
    __syncthreads();
    if (tid < R) m.dest_cur[tid] = m.dest_start[tid];
    __syncthreads();
    for (int r = tid; r < R; r += nthreads) {
        if (m.in_donor[r] >= 0) m.dest_list[atomicAdd(&m.dest_cur[m.in_donor[r]], 1)] = r;
    }
    __syncthreads();
}

// The construction's inputs besides the shared state: previous's slots and flows.
struct MpPrevious {
    const mp_i64* slots;  // [R, B] previous slots (read when warm)
    const int* warm_d;    // [R, B] home of each previous slot's expert, -1 if none (when warm)
    const mp_i64* flow;   // [n_flow, 3] last step's flows (donor, receiver, records)
    int n_flow;           // flows to replay (0: none)
    bool warm;            // prefer warm pairs and experts resident in previous's slots
};

// Phases 2-4 (every thread of the block calls it): balance_groups (warp 0) from m.X, then
// the dest lists, then split_group (a warp per donor group) into alloc [E, R] (zero on
// entry), flow [R-1, 3] and the replica lists rep_e, rep_c [R, M]. On entry m.rem holds T,
// m.X and m.avail each rank's X and load, and the rest of m is reset (mp_reset_ranks).
__device__ void mp_construct(const MpShared& m, const MpPrevious& pv, int R, mp_i64 E, mp_i64 B,
                             mp_i64 N, mp_i64* flow, mp_i64* alloc, mp_i64* rep_c, int* rep_e) {
    const int warp = threadIdx.x / MP_WARP, nwarps = blockDim.x / MP_WARP;
    const bool packed = N < MP_PACK_LIMIT;  // |X| <= N
    const MpBalance bal = {m.X, m.q_in, m.in_donor, m.avail, pv.warm_d, pv.flow, flow, R,
                           (int)B, pv.n_flow, pv.warm, packed};
    if (warp == 0) mp_balance(bal);
    __syncthreads();
    mp_dest_lists(m, R);
    const MpSplit s = {m.rem, m.q_in, m.dest_list, m.dest_start, m.rep_n, rep_e, rep_c, alloc,
                       pv.slots, R, E, B, (E + R - 1) / R, pv.warm};
    for (int d = warp; d < R; d += nwarps) mp_split_group(s, d);
    __syncthreads();
}

// ---- the main kernel ---------------------------------------------------------------------

// Dynamic shared memory: MpShared's layout.
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_plan_main(const mp_i64* counts, const mp_i64* prev, const mp_i64* prev_flow,
                       mp_i64 R_, mp_i64 E, mp_i64 B, mp_i64 align, mp_i64 has_prev_,
                       mp_i64 n_prev_flow, mp_i64 fused_prep, mp_i64* alloc, mp_i64* home,
                       mp_i64* target, mp_i64* flow, mp_i64* slot_expert, mp_i64* slot_new,
                       mp_i64* row_expert, mp_i64* row_count, mp_i64* row_offset,
                       mp_i64* total_E, mp_i64* rep_c, int* rep_e, int* srt_e, int* warm_d) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const int R = (int)R_;
    const bool has_prev = has_prev_ != 0;
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int lane = tid % MP_WARP, warp = tid / MP_WARP, nwarps = nthreads / MP_WARP;
    const mp_i64 M = (E + R - 1) / R;
    const mp_i64 W = M + (B > M ? B : M);
    const MpShared m = mp_shared(mp_smem, R, E);

    // Phase 0: totals, per-rank state, warm donors.
    if (fused_prep) {
        mp_prep(counts, R, E, alloc, home, total_E, tid, nthreads);
        __syncthreads();
    }
    mp_i64 part = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) {
        m.rem[e] = total_E[e];
        part += m.rem[e];
    }
    mp_reset_ranks(m, R);
    if (has_prev) {
        for (mp_i64 i = tid; i < (mp_i64)R * B; i += nthreads) {
            const mp_i64 e = prev[i];
            warm_d[i] = (e >= 0 && e < E) ? (int)mp_home_of(e, E, R) : -1;
        }
    }
    const mp_i64 N = mp_block_sum(part, m.red64);  // ends with __syncthreads

    // Phase 1: static load, X and target per rank.
    for (int r = warp; r < R; r += nwarps) {
        const mp_i64 first = mp_home_start(r, E, R), last = mp_home_start(r + 1, E, R);
        mp_i64 load = 0;
        for (mp_i64 e = first + lane; e < last; e += MP_WARP) load += m.rem[e];
        load = mp_warp_sum(load);
        if (lane == 0) {
            const mp_i64 t = mp_target(N, R, r);
            target[r] = t;
            m.X[r] = load - t;
            m.avail[r] = load;
        }
    }
    __syncthreads();

    // Phases 2-4: balance_groups, dest lists, split_group.
    const MpPrevious pv = {prev, warm_d, prev_flow, (int)n_prev_flow, has_prev};
    mp_construct(m, pv, R, E, B, N, flow, alloc, rep_c, rep_e);

    // Phase 5: place_slots and row_layout, one warp per rank.
    const MpPlace p = {m.rep_n, rep_e, rep_c, srt_e, prev, alloc, m.rem, slot_expert, slot_new,
                       row_expert, row_count, row_offset, R, E, B, M, W, align, has_prev};
    for (int r = warp; r < R; r += nwarps) mp_place_rank(p, r);
}
