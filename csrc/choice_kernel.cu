// moonplan fused GPU planner: policy="auto" (moonplan/plan/choice/reference.py) in CUDA.
//
// Legend:
//   R ranks, E experts, B slots per rank, M = ceil(E/R), K levels, C = K + 3 candidates
//   G ranks per fast-link domain (ranks [g*G, (g+1)*G) share one; G = R: one domain)
//   T[e]  records of expert e          L[r]  static load of rank r (its home experts' T)
//   N     records in all               X[r]  L[r] - target[r] (> 0 donor, < 0 receiver)
//   candidates in table order (moonplan/plan/choice/table.py), index c:
//     0 static, 1 exact, 2 resident, 3 .. K+1 level-(K-1) .. level-1, K+2 greedy
//   alloc_C [C, E, R]  each candidate's allocation (scratch; static's slice is not used)
//   flow_C  [C, R-1, 3] the flows each construction recorded (scratch)
//
// Three kernels, launched by moonplan/plan/choice_cuda.py on torch's stream, no host sync:
//   moonplan_choice_first   ONE block: T, L, static EP's scores charged exit_s and plan_s,
//                           the early-exit bound (choice/bound.py) and the exit flag
//   moonplan_choice_build   C-1 blocks, one per candidate 1..C-1: returns at once when the
//                           exit flag is set; else builds its allocation into alloc_C[c]
//                           (group-flow construction or resident rounds) and scores it
//   moonplan_choice_layout  ONE block: the first least score (static on exit), the winner's
//                           plan fields (slots with residents kept, rows, padded offsets)
//
// Floats: the step-cost formula (moonplan/stepcost/batch.py) with every product and sum in
// the Python order, through __dmul_rn / __dadd_rn (never contracted into an FMA; the
// launcher also compiles with --fmad=false), so the scores equal the reference's bit for
// bit. Integer quantities (rows, overlaps, copies) are int64 sums, exact in any order.
//
// It includes the exact planner's source for its construction and placement steps
// (mp_balance, mp_split_group, mp_place_rank); NVRTC gets both files as named headers.

#include "plan_kernel.cu"

#define MC_INF __longlong_as_double(0x7ff0000000000000LL)
#define MC_RED_F64 (8 * MP_WARP)  // doubles of shared memory for mc_block_max
#define MC_ACC 13                 // per-rank integer sums of the score (McAcc)

// ---- the cost model ----------------------------------------------------------------------

// StepCost's rates (seconds) and options; wait = base_latency_s + bound.copy_min_s.
struct McCost {
    double row_flop, weight_read, row_mem, copy_intra, copy_inter, disp_intra, disp_inter;
    double comb_intra, comb_inter, base, per_peer, plan, exit_s, wait;
    mp_i64 tile, G;
    bool overlap;
};

#define MC_COST_PARAMS                                                                          \
    mp_i64 tile, mp_i64 G, mp_i64 overlap, double row_flop, double weight_read, double row_mem, \
        double copy_intra, double copy_inter, double disp_intra, double disp_inter,            \
        double comb_intra, double comb_inter, double base, double per_peer, double plan_s,     \
        double exit_s, double wait_s
#define MC_COST_ARGS                                                                       \
    tile, G, overlap, row_flop, weight_read, row_mem, copy_intra, copy_inter, disp_intra, \
        disp_inter, comb_intra, comb_inter, base, per_peer, plan_s, exit_s, wait_s

__device__ McCost mc_cost(MC_COST_PARAMS) {
    McCost k;
    k.row_flop = row_flop;
    k.weight_read = weight_read;
    k.row_mem = row_mem;
    k.copy_intra = copy_intra;
    k.copy_inter = copy_inter;
    k.disp_intra = disp_intra;
    k.disp_inter = disp_inter;
    k.comb_intra = comb_intra;
    k.comb_inter = comb_inter;
    k.base = base;
    k.per_peer = per_peer;
    k.plan = plan_s;
    k.exit_s = exit_s;
    k.wait = wait_s;
    k.tile = tile;
    k.G = G;
    k.overlap = overlap != 0;
    return k;
}

__device__ __forceinline__ double mc_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double mc_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double mc_max(double a, double b) { return a > b ? a : b; }
__device__ __forceinline__ mp_i64 mc_max_i(mp_i64 a, mp_i64 b) { return a > b ? a : b; }
__device__ __forceinline__ mp_i64 mc_min_i(mp_i64 a, mp_i64 b) { return a < b ? a : b; }

// rows (>= 0) padded up to a multiple of the GEMM tile.
__device__ __forceinline__ mp_i64 mc_padded(const McCost& k, mp_i64 rows) {
    return k.tile == 1 ? rows : (rows + (k.tile - 1)) / k.tile * k.tile;
}

// StepCost._roofline of one rank's integer sums: max(flop, weight reads + row memory).
__device__ double mc_roofline(const McCost& k, mp_i64 padded, mp_i64 experts, mp_i64 rows) {
    const double flop = mc_mul((double)padded, k.row_flop);
    const double mem = mc_add(mc_mul((double)experts, k.weight_read), mc_mul((double)rows, k.row_mem));
    return mc_max(flop, mem);
}

// Length of the overlap of [a_lo, a_hi) and [b_lo, b_hi) (0 when disjoint).
__device__ __forceinline__ mp_i64 mc_overlap(mp_i64 a_lo, mp_i64 a_hi, mp_i64 b_lo, mp_i64 b_hi) {
    const mp_i64 v = mc_min_i(a_hi, b_hi) - mc_max_i(a_lo, b_lo);
    return v > 0 ? v : 0;
}

__device__ __forceinline__ void mc_atomic_add(mp_i64* p, mp_i64 v) {
    atomicAdd((unsigned long long*)p, (unsigned long long)v);
}

// ---- block reductions (every thread of the block calls them) -----------------------------

// Block maximum of each of v[0..n) (n <= 8), in place; red holds MC_RED_F64 shared doubles.
__device__ void mc_block_max(double* v, int n, double* red) {
    const int lane = threadIdx.x % MP_WARP, warp = threadIdx.x / MP_WARP;
    const int nwarps = blockDim.x / MP_WARP;
    for (int i = 0; i < n; ++i) {
        for (int off = MP_WARP / 2; off > 0; off >>= 1) {
            const mp_i64 o = __shfl_xor_sync(MP_FULL_MASK, __double_as_longlong(v[i]), off);
            v[i] = mc_max(v[i], __longlong_as_double(o));
        }
        if (lane == 0) red[i * MP_WARP + warp] = v[i];
    }
    __syncthreads();
    for (int i = 0; i < n; ++i) {
        double m = red[i * MP_WARP];
        for (int w = 1; w < nwarps; ++w) m = mc_max(m, red[i * MP_WARP + w]);
        v[i] = m;
    }
    __syncthreads();
}

// Block maximum of an int64 (MP_I64_MIN for none); red holds 33 shared values.
__device__ mp_i64 mc_block_max_i(mp_i64 v, mp_i64* red) {
    const int lane = threadIdx.x % MP_WARP, warp = threadIdx.x / MP_WARP;
    const int nwarps = blockDim.x / MP_WARP;
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        v = mc_max_i(v, __shfl_xor_sync(MP_FULL_MASK, v, off));
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    mp_i64 m = red[0];
    for (int w = 1; w < nwarps; ++w) m = mc_max_i(m, red[w]);
    __syncthreads();
    return m;
}

// ---- the step time of one allocation (moonplan/stepcost/batch.py) ------------------------

// One rank's integer sums: busiest directions of dispatch rows (d_*) and weight copies
// (w_*) inside and across domains, all rows and the fetched rows of the expert sections.
struct McRank {
    mp_i64 d_in, d_out, w_in, w_out;
    mp_i64 pad, busy, rows, wpad, wbusy, wrows;
};

// The parts of the total that do not depend on the planning charge.
struct McParts {
    double vmax, D, experts, Cb, alone_s;
};

// batch_step_time's phases from each rank's sums (rank = threadIdx.x < R, `active`).
__device__ McParts mc_parts(const McCost& k, const McRank& s, bool active, int R, double* red) {
    const double d_in = (double)s.d_in, d_out = (double)s.d_out;
    const double w_in = (double)s.w_in, w_out = (double)s.w_out;
    const double home = mc_roofline(k, s.pad - s.wpad, s.busy - s.wbusy, s.rows - s.wrows);
    const double wait = mc_roofline(k, s.wpad, s.wbusy, s.wrows);
    double v[6] = {-MC_INF, -MC_INF, -MC_INF, -MC_INF, -MC_INF, -MC_INF};
    if (active) {
        v[0] = mc_max(mc_mul(d_in, k.disp_intra), mc_mul(d_out, k.disp_inter));
        v[1] = mc_max(mc_mul(d_in, k.comb_intra), mc_mul(d_out, k.comb_inter));
        v[2] = mc_max(mc_mul(w_in, k.copy_intra), mc_mul(w_out, k.copy_inter));
        const double intra = mc_add(mc_mul(d_in, k.disp_intra), mc_mul(w_in, k.copy_intra));
        const double inter = mc_add(mc_mul(d_out, k.disp_inter), mc_mul(w_out, k.copy_inter));
        v[3] = mc_max(intra, inter);
        v[4] = (s.w_in > 0 || s.w_out > 0) ? 1.0 : 0.0;
        v[5] = mc_add(home, wait);
    }
    mc_block_max(v, 6, red);
    McParts p;
    const double lat = mc_add(k.base, mc_mul(k.per_peer, (double)(R - 1)));
    p.D = R <= 1 ? 0.0 : mc_add(lat, v[0]);
    p.Cb = R <= 1 ? 0.0 : mc_add(lat, v[1]);
    const bool copies = v[4] > 0.0;
    const double shared = mc_max(v[2], v[3]);
    p.alone_s = copies ? mc_add(v[2], k.base) : 0.0;
    const double ready = copies ? mc_add(shared, k.base) : 0.0;
    p.experts = v[5];
    p.vmax = 0.0;
    if (k.overlap) {
        double w = active ? mc_add(mc_max(mc_add(p.D, home), ready), wait) : -MC_INF;
        mc_block_max(&w, 1, red);
        p.vmax = w;
    }
    return p;
}

// The step's total charged `plan` seconds of planning (batch._schedule).
__device__ double mc_total(const McCost& k, const McParts& p, double plan) {
    if (k.overlap) return mc_add(mc_add(plan, p.vmax), p.Cb);
    const double without = mc_add(mc_add(mc_add(plan, p.D), p.experts), p.Cb);
    return mc_add(without, p.alone_s);
}

// ---- kernel 1: counts, static EP, the bound, the exit flag --------------------------------

struct McFirstSums {  // one rank's static sums, in shared memory
    mp_i64 *loc, *rdom, *pad, *busy, *kpad, *kbusy, *krows;
};

// bound.exit_bound: the least time a candidate other than static EP can reach.
__device__ double mc_bound(const McCost& k, int R, mp_i64 tiles, mp_i64 busy, mp_i64 N,
                           double home_lb, bool resident, double static_full) {
    if (R <= 1) return MC_INF;
    const double lat = mc_add(k.base, mc_mul(k.per_peer, (double)(R - 1)));
    const double flop_lb = mc_mul((double)((tiles + (R - 1)) / R), k.row_flop);
    const double mem = mc_add(mc_mul((double)busy, k.weight_read), mc_mul((double)N, k.row_mem));
    const double experts_lb = mc_max(flop_lb, mem / (double)R);
    double copying;
    if (k.overlap) {
        copying = mc_add(mc_add(k.plan, mc_max(mc_add(lat, experts_lb), k.wait)), lat);
    } else {
        copying = mc_add(mc_add(mc_add(mc_add(k.plan, lat), experts_lb), lat), k.wait);
    }
    const double kept = mc_add(mc_add(mc_add(k.plan, lat), mc_max(experts_lb, home_lb)), lat);
    const double other = resident ? kept : static_full;
    const double margin = 1.0 - 1.0 / 1099511627776.0;  // bound.MARGIN = 1 - 2**-40
    return mc_mul(other < copying ? other : copying, margin);
}

// Warp per rank: static EP's traffic sums (row r of counts), its home experts' sums, and
// those of the home experts without a resident replica (for bound's home_lb).
__device__ void mc_first_ranks(const mp_i64* counts, const mp_i64* T, const int* moved, int R,
                               mp_i64 E, const McCost& k, const McFirstSums& f, mp_i64* load_R,
                               mp_i64* send_R, mp_i64* sdom_R) {
    const int lane = threadIdx.x % MP_WARP, warp = threadIdx.x / MP_WARP;
    const int nwarps = blockDim.x / MP_WARP;
    for (int r = warp; r < R; r += nwarps) {
        const mp_i64* row = counts + (mp_i64)r * E;
        const mp_i64 h0 = mp_home_start(r, E, R), h1 = mp_home_start(r + 1, E, R);
        const mp_i64 g0 = r / k.G * k.G, g1 = mc_min_i(g0 + k.G, R);
        const mp_i64 e0 = mp_home_start(g0, E, R), e1 = mp_home_start(g1, E, R);
        mp_i64 v[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};  // send, sdom, loc, L, rdom, pad..krows
        for (mp_i64 e = lane; e < E; e += MP_WARP) {
            const mp_i64 c = row[e];
            v[0] += c;
            if (e >= e0 && e < e1) v[1] += c;
            if (e >= h0 && e < h1) v[2] += c;
        }
        for (mp_i64 e = h0 + lane; e < h1; e += MP_WARP) {
            const mp_i64 t = T[e];
            v[3] += t;
            for (mp_i64 s = g0; s < g1 && g1 - g0 < R; ++s) v[4] += counts[s * E + e];
            v[5] += mc_padded(k, t);
            v[6] += t > 0;
            if (!moved[e]) {
                v[7] += mc_padded(k, t);
                v[8] += t > 0;
                v[9] += t;
            }
        }
        for (int i = 0; i < 10; ++i) v[i] = mp_warp_sum(v[i]);
        if (lane == 0) {
            send_R[r] = v[0];
            sdom_R[r] = v[1];
            f.loc[r] = v[2];
            load_R[r] = v[3];
            f.rdom[r] = g1 - g0 < R ? v[4] : v[3];  // one domain: every home record stays in it
            f.pad[r] = v[5];
            f.busy[r] = v[6];
            f.kpad[r] = v[7];
            f.kbusy[r] = v[8];
            f.krows[r] = v[9];
        }
    }
}

// Dynamic shared memory: loc, rdom, pad, busy, kpad, kbusy, krows [R] and red64[33]
// (int64), red[MC_RED_F64] (double), moved[E] (int32).
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_choice_first(const mp_i64* counts, const mp_i64* prev, mp_i64 R_, mp_i64 E, mp_i64 B,
                          mp_i64 has_prev, mp_i64 C, MC_COST_PARAMS, double* scores,
                          unsigned char* exited, mp_i64* total_E, mp_i64* load_R, mp_i64* send_R,
                          mp_i64* sdom_R, mp_i64* misc, int* warm_d) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const McCost k = mc_cost(MC_COST_ARGS);
    const int R = (int)R_, tid = threadIdx.x, nthreads = blockDim.x;
    McFirstSums f;
    f.loc = (mp_i64*)mp_smem;
    f.rdom = f.loc + R;
    f.pad = f.rdom + R;
    f.busy = f.pad + R;
    f.kpad = f.busy + R;
    f.kbusy = f.kpad + R;
    f.krows = f.kbusy + R;
    mp_i64* red64 = f.krows + R;
    double* red = (double*)(red64 + MP_WARP + 1);
    int* moved = (int*)(red + MC_RED_F64);

    for (mp_i64 e = tid; e < E; e += nthreads) moved[e] = 0;
    __syncthreads();
    mp_i64 tiles = 0, busy = 0, N = 0, nres = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) {
        mp_i64 t = 0;
        for (mp_i64 r = 0; r < R; ++r) t += counts[r * E + e];
        total_E[e] = t;
        tiles += mc_padded(k, t);
        busy += t > 0;
        N += t;
    }
    if (has_prev) {  // resident replicas: their experts (moved) and warm donors
        for (mp_i64 i = tid; i < (mp_i64)R * B; i += nthreads) {
            const mp_i64 e = prev[i];
            const bool valid = e >= 0 && e < E;
            if (valid) atomicAdd(&moved[e], 1);  // several slots may hold e
            warm_d[i] = valid ? (int)mp_home_of(e, E, R) : -1;
            nres += valid;
        }
    }
    tiles = mp_block_sum(tiles, red64);  // each ends with __syncthreads
    busy = mp_block_sum(busy, red64);
    N = mp_block_sum(N, red64);
    nres = mp_block_sum(nres, red64);
    mc_first_ranks(counts, total_E, moved, R, E, k, f, load_R, send_R, sdom_R);
    __syncthreads();

    const int r = tid;
    McRank s = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    double home_lb = -MC_INF;
    if (r < R) {
        s.d_in = mc_max_i(sdom_R[r] - f.loc[r], f.rdom[r] - f.loc[r]);
        s.d_out = mc_max_i(send_R[r] - sdom_R[r], load_R[r] - f.rdom[r]);
        s.pad = f.pad[r];
        s.busy = f.busy[r];
        s.rows = load_R[r];
        home_lb = mc_roofline(k, f.kpad[r], f.kbusy[r], f.krows[r]);
    }
    const McParts p = mc_parts(k, s, r < R, R, red);
    mc_block_max(&home_lb, 1, red);
    if (tid == 0) {
        const double t_exit = mc_total(k, p, k.exit_s), full = mc_total(k, p, k.plan);
        const double bound = mc_bound(k, R, tiles, busy, N, home_lb, nres > 0, full);
        const bool ex = t_exit <= bound;
        scores[0] = ex ? t_exit : full;
        for (mp_i64 c = 1; c < C && ex; ++c) scores[c] = MC_INF;
        exited[0] = ex ? 1 : 0;
        misc[0] = N;
    }
}

// ---- kernel 2: one block per candidate -----------------------------------------------------

struct McStep {  // the step's inputs and kernel 1's results (global memory)
    const mp_i64* counts;
    const mp_i64* prev;       // [R, B] (has_prev)
    const mp_i64* prev_flow;  // [n_prev_flow, 3]
    const mp_i64* T;          // [E]
    const mp_i64* L;          // [R]
    const mp_i64* send_R;     // [R] records each source sends
    const mp_i64* sdom_R;     // [R] static EP's rows each source sends inside its domain
    const int* warm_d;        // [R, B]
    mp_i64 N, E, B, M;
    int R, levels, n_prev_flow;
    bool has_prev;
};

// level_caps(L, K)[k-1] and water_fill(L, cap) of targets.py; returns rank tid's target.
// The lowest i sorted loads need f = sum_j max(0, l_i - L[j]) records to reach l_i: the
// level's ranks are those at or below cap with f <= S (targets.water_fill_torch).
__device__ mp_i64 mc_level_target(const McStep& st, const mp_i64* L, int k, mp_i64* red64,
                                  int* red32) {
    const int r = threadIdx.x, R = st.R;
    const mp_i64 Lr = r < R ? L[r] : 0;
    const mp_i64 m = (st.N + (R - 1)) / R;
    const mp_i64 gap = mc_block_max_i(r < R ? Lr : MP_I64_MIN, red64) - m;  // >= 0
    const mp_i64 cap = m + (gap / st.levels) * k + (gap % st.levels) * k / st.levels;
    const mp_i64 S = mp_block_sum(r < R && Lr > cap ? Lr - cap : 0, red64);
    if (S == 0) return Lr;  // block-uniform: nothing above the cap
    mp_i64 f = 0;
    for (int j = 0; j < R && r < R; ++j) f += mc_max_i(0, Lr - L[j]);
    const bool qual = r < R && Lr <= cap && f <= S;
    const mp_i64 n = mp_block_sum(qual ? 1 : 0, red64);  // >= 1: the lowest load qualifies
    const mp_i64 l_at = mc_block_max_i(qual ? Lr : MP_I64_MIN, red64);
    const mp_i64 f_at = mc_block_max_i(qual ? f : MP_I64_MIN, red64);
    const mp_i64 level = l_at + (S - f_at) / n, extra = (S - f_at) % n;
    const bool low = r < R && Lr <= cap && Lr <= level;
    int total = 0;
    const int before = mp_block_excl_scan(low ? 1 : 0, red32, &total);
    if (r >= R) return 0;
    if (Lr > cap) return cap;
    return low ? level + (before < extra ? 1 : 0) : Lr;
}

// Receivers grouped by donor (moonplan_plan_main's phase 3): counts, block scan, scatter.
__device__ void mc_dest_lists(int R, const int* in_donor, int* dest_list, int* dest_start,
                              int* dest_cur, int* red32) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (int r = tid; r < R; r += nthreads) {
        if (in_donor[r] >= 0) atomicAdd(&dest_cur[in_donor[r]], 1);
    }
    __syncthreads();
    int n_flows = 0;
    const int start = mp_block_excl_scan(tid < R ? dest_cur[tid] : 0, red32, &n_flows);
    if (tid < R) dest_start[tid] = start;
    if (tid == 0) dest_start[R] = n_flows;
    __syncthreads();
    if (tid < R) dest_cur[tid] = dest_start[tid];
    __syncthreads();
    for (int r = tid; r < R; r += nthreads) {
        if (in_donor[r] >= 0) dest_list[atomicAdd(&dest_cur[in_donor[r]], 1)] = r;
    }
    __syncthreads();
}

// The group-flow construction (moonplan_plan_main's phases 0-4) towards the exact targets
// (level 0) or level `level`'s, replaying `previous` or not, into alloc [E, R] and flow.
// Dynamic shared memory: as moonplan_plan_main's (rem, X, q_in, avail, red64 | ints).
__device__ void mc_construct(const McStep& st, int level, bool replay, mp_i64* alloc,
                             mp_i64* flow, mp_i64* rep_c, int* rep_e, unsigned char* smem) {
    const int R = st.R, tid = threadIdx.x, nthreads = blockDim.x;
    const int warp = tid / MP_WARP, nwarps = nthreads / MP_WARP;
    const mp_i64 E = st.E;
    mp_i64* rem = (mp_i64*)smem;
    mp_i64* X = rem + E;
    mp_i64* q_in = X + R;
    mp_i64* avail = q_in + R;
    mp_i64* red64 = avail + R;
    int* in_donor = (int*)(red64 + MP_WARP + 1);
    int* dest_list = in_donor + R;
    int* dest_start = dest_list + R;
    int* dest_cur = dest_start + R + 1;
    int* rep_n = dest_cur + R;
    int* red32 = rep_n + R;

    for (mp_i64 i = tid; i < E * R; i += nthreads) alloc[i] = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) rem[e] = st.T[e];
    for (int r = tid; r < R; r += nthreads) {
        q_in[r] = 0;
        in_donor[r] = -1;
        dest_cur[r] = 0;
        rep_n[r] = 0;
        avail[r] = st.L[r];
    }
    __syncthreads();
    mp_i64 target = tid < R ? st.N / R + (tid < st.N % R ? 1 : 0) : 0;
    if (level > 0) target = mc_level_target(st, avail, level, red64, red32);
    if (tid < R) X[tid] = avail[tid] - target;
    __syncthreads();

    const bool warm = replay && st.has_prev;
    MpBalance bal;
    bal.X = X;
    bal.q_in = q_in;
    bal.in_donor = in_donor;
    bal.avail = avail;
    bal.warm_d = st.warm_d;
    bal.prev_flow = st.prev_flow;
    bal.flow = flow;
    bal.R = R;
    bal.B = (int)st.B;
    bal.n_prev_flow = replay ? st.n_prev_flow : 0;
    bal.has_prev = warm;
    bal.packed = st.N < MP_PACK_LIMIT;
    if (warp == 0) mp_balance(bal);
    __syncthreads();
    mc_dest_lists(R, in_donor, dest_list, dest_start, dest_cur, red32);

    MpSplit s;
    s.rem = rem;
    s.q_in = q_in;
    s.dest_list = dest_list;
    s.dest_start = dest_start;
    s.rep_n = rep_n;
    s.rep_e = rep_e;
    s.rep_c = rep_c;
    s.alloc = alloc;
    s.prev = st.prev;
    s.R = R;
    s.E = E;
    s.B = st.B;
    s.M = st.M;
    s.has_prev = warm;
    for (int d = warp; d < R; d += nwarps) mp_split_group(s, d);
    __syncthreads();
}

// ---- the resident candidate (moonplan/plan/choice/resident.py) -----------------------------

#define MC_ROUNDS 4  // resident.ROUNDS

// Pair p = r*B + j (previous slot j < M of rank r holding e) is live: its donor home(e)
// still above target, its receiver r below, records of e left at home.
__device__ bool mc_live(const McStep& st, const mp_i64* X, const mp_i64* left, mp_i64 p,
                        mp_i64* e_out, int* d_out, int* r_out) {
    const mp_i64 e = st.prev[p], j = p % st.B;
    if (e < 0 || e >= st.E || j >= st.M) return false;
    const int r = (int)(p / st.B), d = (int)mp_home_of(e, st.E, st.R);
    *e_out = e;
    *d_out = d;
    *r_out = r;
    return X[d] > 0 && X[r] < 0 && left[e] > 0;
}

// One round: count each donor's, receiver's and expert's live pairs, then every live pair
// moves the least of the three even shares (all computed before any move is applied).
__device__ void mc_resident_round(const McStep& st, mp_i64* X, mp_i64* left, int* n_d, int* n_r,
                                  int* n_e, mp_i64* alloc, mp_i64* q_P) {
    const int tid = threadIdx.x, nthreads = blockDim.x, R = st.R;
    const mp_i64 P = (mp_i64)R * st.B;
    for (int r = tid; r < R; r += nthreads) n_d[r] = n_r[r] = 0;
    for (mp_i64 e = tid; e < st.E; e += nthreads) n_e[e] = 0;
    __syncthreads();
    mp_i64 e = 0;
    int d = 0, r = 0;
    for (mp_i64 p = tid; p < P; p += nthreads) {
        if (!mc_live(st, X, left, p, &e, &d, &r)) continue;
        atomicAdd(&n_d[d], 1);
        atomicAdd(&n_r[r], 1);
        atomicAdd(&n_e[e], 1);
    }
    __syncthreads();
    for (mp_i64 p = tid; p < P; p += nthreads) {
        mp_i64 q = 0;
        if (mc_live(st, X, left, p, &e, &d, &r)) {
            q = mc_min_i(mc_min_i(X[d] / n_d[d], -X[r] / n_r[r]), left[e] / n_e[e]);
        }
        q_P[p] = q;
    }
    __syncthreads();
    for (mp_i64 p = tid; p < P; p += nthreads) {
        const mp_i64 q = q_P[p];
        if (q == 0) continue;
        e = st.prev[p];
        r = (int)(p / st.B);
        d = (int)mp_home_of(e, st.E, R);
        mc_atomic_add(&X[d], -q);
        mc_atomic_add(&X[r], q);
        mc_atomic_add(&left[e], -q);
        mc_atomic_add(&alloc[e * R + d], -q);
        mc_atomic_add(&alloc[e * R + r], q);
    }
    __syncthreads();
}

// Static EP, then MC_ROUNDS rounds of moves to replicas resident in previous's slots.
// Dynamic shared memory: left[E], X[R] (int64), n_d[R], n_r[R], n_e[E] (int32).
__device__ void mc_resident(const McStep& st, mp_i64* alloc, mp_i64* q_P, unsigned char* smem) {
    const int R = st.R, tid = threadIdx.x, nthreads = blockDim.x;
    const mp_i64 E = st.E;
    mp_i64* left = (mp_i64*)smem;
    mp_i64* X = left + E;
    int* n_d = (int*)(X + R);
    int* n_r = n_d + R;
    int* n_e = n_r + R;
    for (mp_i64 i = tid; i < E * R; i += nthreads) alloc[i] = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) left[e] = st.T[e];
    for (int r = tid; r < R; r += nthreads) X[r] = st.L[r] - (st.N / R + (r < st.N % R ? 1 : 0));
    __syncthreads();
    for (mp_i64 e = tid; e < E; e += nthreads) alloc[e * R + mp_home_of(e, E, R)] = st.T[e];
    __syncthreads();
    if (!st.has_prev || st.B == 0) return;
    for (int round = 0; round < MC_ROUNDS; ++round) {
        mc_resident_round(st, X, left, n_d, n_r, n_e, alloc, q_P);
    }
}

// ---- the score of one candidate ----------------------------------------------------------

// Per-rank integer sums (shared memory, MC_ACC arrays of R): records kept local, received
// from the rank's domain, received; padded rows, experts with rows, and the same of the
// fetched rows; copies received inside / across domains, sent inside / across (by home);
// the correction of static EP's in-domain sends (sdom_R).
struct McAcc {
    mp_i64 *loc, *rdom, *recv, *pad, *busy, *wpad, *wbusy, *wrows;
    mp_i64 *cn_r, *cf_r, *cn_s, *cf_s, *sdc;
};

__device__ bool mc_is_resident(const McStep& st, mp_i64 e, mp_i64 r) {
    if (!st.has_prev) return false;
    const mp_i64* row = st.prev + r * st.B;
    for (mp_i64 j = 0; j < st.B; ++j) {
        if (row[j] == e) return true;
    }
    return false;
}

// Expert e's contribution (one thread): its source intervals (rows in source-rank order)
// and destination intervals (alloc's row), domain by domain (traffic.dispatch_traffic).
// In-domain sends are static EP's plus a correction, non-zero only for an expert whose
// records leave its home domain.
__device__ void mc_score_expert(const McStep& st, const McCost& k, const mp_i64* a, mp_i64 e,
                                const McAcc& acc) {
    const int R = st.R;
    const mp_i64 E = st.E, h = mp_home_of(e, E, R), gh = h / k.G;
    const mp_i64* ae = a + e * R;
    mp_i64 S = 0, D = 0, sn = 0, sf = 0;
    for (mp_i64 g0 = 0; g0 < R; g0 += k.G) {
        const mp_i64 g1 = mc_min_i(g0 + k.G, R);
        mp_i64 S1 = S, D1 = D;
        for (mp_i64 r = g0; r < g1; ++r) {
            S1 += st.counts[r * E + e];
            D1 += ae[r];
        }
        mp_i64 s = S, d = D;
        for (mp_i64 r = g0; r < g1; ++r) {
            const mp_i64 c = st.counts[r * E + e], x = ae[r];
            if (x > 0) {
                mc_atomic_add(&acc.loc[r], mc_overlap(s, s + c, d, d + x));
                mc_atomic_add(&acc.rdom[r], mc_overlap(d, d + x, S, S1));
                mc_atomic_add(&acc.recv[r], x);
                mc_atomic_add(&acc.pad[r], mc_padded(k, x));
                mc_atomic_add(&acc.busy[r], 1);
                if (r != h && !mc_is_resident(st, e, r)) {  // fetched: weights arrive this step
                    mc_atomic_add(&acc.wpad[r], mc_padded(k, x));
                    mc_atomic_add(&acc.wbusy[r], 1);
                    mc_atomic_add(&acc.wrows[r], x);
                    const bool near = r / k.G == gh;
                    mc_atomic_add(near ? &acc.cn_r[r] : &acc.cf_r[r], 1);
                    sn += near ? 1 : 0;
                    sf += near ? 0 : 1;
                }
            }
            const mp_i64 corr = mc_overlap(s, s + c, D, D1) - (g0 / k.G == gh ? c : 0);
            if (corr != 0) mc_atomic_add(&acc.sdc[r], corr);
            s += c;
            d += x;
        }
        S = S1;
        D = D1;
    }
    if (sn) mc_atomic_add(&acc.cn_s[h], sn);
    if (sf) mc_atomic_add(&acc.cf_s[h], sf);
}

// Candidate c's predicted seconds charged plan_s into scores[c], its per-rank records into
// recv_C[c]. Dynamic shared memory: MC_ACC int64 arrays of R, red[MC_RED_F64] (double).
__device__ void mc_score(const McStep& st, const McCost& k, const mp_i64* a, int c,
                         double* scores, mp_i64* recv_C, unsigned char* smem) {
    const int R = st.R, tid = threadIdx.x, nthreads = blockDim.x;
    mp_i64* base = (mp_i64*)smem;
    McAcc acc;
    mp_i64** at[MC_ACC] = {&acc.loc,  &acc.rdom, &acc.recv, &acc.pad,  &acc.busy,
                           &acc.wpad, &acc.wbusy, &acc.wrows, &acc.cn_r, &acc.cf_r,
                           &acc.cn_s, &acc.cf_s, &acc.sdc};
    for (int i = 0; i < MC_ACC; ++i) *at[i] = base + (mp_i64)i * R;
    double* red = (double*)(base + (mp_i64)MC_ACC * R);
    for (mp_i64 i = tid; i < (mp_i64)MC_ACC * R; i += nthreads) base[i] = 0;
    __syncthreads();
    for (mp_i64 e = tid; e < st.E; e += nthreads) mc_score_expert(st, k, a, e, acc);
    __syncthreads();
    const int r = tid;
    McRank s = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    if (r < R) {
        const mp_i64 sdom = st.sdom_R[r] + acc.sdc[r];
        s.d_in = mc_max_i(sdom - acc.loc[r], acc.rdom[r] - acc.loc[r]);
        s.d_out = mc_max_i(st.send_R[r] - sdom, acc.recv[r] - acc.rdom[r]);
        s.w_in = mc_max_i(acc.cn_s[r], acc.cn_r[r]);
        s.w_out = mc_max_i(acc.cf_s[r], acc.cf_r[r]);
        s.pad = acc.pad[r];
        s.busy = acc.busy[r];
        s.rows = acc.recv[r];
        s.wpad = acc.wpad[r];
        s.wbusy = acc.wbusy[r];
        s.wrows = acc.wrows[r];
        recv_C[(mp_i64)c * R + r] = acc.recv[r];
    }
    const McParts p = mc_parts(k, s, r < R, R, red);
    if (tid == 0) scores[c] = mc_total(k, p, k.plan);
}

// Dynamic shared memory: the largest of mc_construct's, mc_resident's and mc_score's layouts
// (choice_cuda.build_shared_bytes); each phase ends with __syncthreads before the next reuses it.
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_choice_build(const mp_i64* counts, const mp_i64* prev, const mp_i64* prev_flow,
                          mp_i64 R_, mp_i64 E, mp_i64 B, mp_i64 has_prev, mp_i64 n_prev_flow,
                          mp_i64 levels, MC_COST_PARAMS, const unsigned char* exited,
                          double* scores, const mp_i64* total_E, const mp_i64* load_R,
                          const mp_i64* send_R, const mp_i64* sdom_R, const mp_i64* misc,
                          const int* warm_d, mp_i64* alloc_C, mp_i64* flow_C, mp_i64* recv_C,
                          mp_i64* rep_c, int* rep_e, mp_i64* q_P) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    if (exited[0]) return;  // the early exit: static EP, nothing built
    const McCost k = mc_cost(MC_COST_ARGS);
    const int R = (int)R_, C = (int)levels + 3, c = blockIdx.x + 1;
    McStep st;
    st.counts = counts;
    st.prev = prev;
    st.prev_flow = prev_flow;
    st.T = total_E;
    st.L = load_R;
    st.send_R = send_R;
    st.sdom_R = sdom_R;
    st.warm_d = warm_d;
    st.N = misc[0];
    st.E = E;
    st.B = B;
    st.M = (E + R - 1) / R;
    st.R = R;
    st.levels = (int)levels;
    st.n_prev_flow = (int)n_prev_flow;
    st.has_prev = has_prev != 0;
    mp_i64* alloc = alloc_C + (mp_i64)c * E * R;
    if (c == 2) {
        mc_resident(st, alloc, q_P, mp_smem);
    } else {
        const int level = (c >= 3 && c <= C - 2) ? (int)levels - 1 - (c - 3) : 0;
        const mp_i64 RM = (mp_i64)R * st.M;
        mc_construct(st, level, c != C - 1, alloc, flow_C + (mp_i64)c * 3 * (R - 1),
                     rep_c + c * RM, rep_e + c * RM, mp_smem);
    }
    mc_score(st, k, alloc, c, scores, recv_C, mp_smem);
}

// ---- kernel 3: the winner's plan fields ------------------------------------------------------

// The winner's allocation into the plan's alloc (static EP's from T for c = 0), its home
// records into rem, its replicas (e, records) appended to each rank's list (any order: the
// placement sorts them by a total order); home, target and flow.
__device__ void mc_layout_alloc(int c, int R, mp_i64 E, mp_i64 M, const mp_i64* T,
                                const mp_i64* L, const mp_i64* alloc_C, const mp_i64* flow_C,
                                const mp_i64* recv_C, mp_i64* rem, int* rep_n, int* rep_e,
                                mp_i64* rep_c, mp_i64* alloc, mp_i64* home, mp_i64* target,
                                mp_i64* flow, int C) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const mp_i64* a = alloc_C + (mp_i64)c * E * R;
    for (mp_i64 i = tid; i < E * R; i += nthreads) {
        const mp_i64 e = i / R, r = i - e * R, h = mp_home_of(e, E, R);
        const mp_i64 x = c == 0 ? (r == h ? T[e] : 0) : a[i];
        alloc[i] = x;
        if (r == h) {
            rem[e] = x;
        } else if (x > 0) {
            const int j = atomicAdd(&rep_n[r], 1);
            if (j < M) {  // at most M: every candidate's receiver takes one donor group
                rep_e[r * M + j] = (int)e;
                rep_c[r * M + j] = x;
            }
        }
    }
    for (mp_i64 e = tid; e < E; e += nthreads) home[e] = mp_home_of(e, E, R);
    for (int r = tid; r < R; r += nthreads) target[r] = c == 0 ? L[r] : recv_C[(mp_i64)c * R + r];
    const bool constructed = c == 1 || (c >= 3 && c < C);  // exact, levels, greedy
    const mp_i64 F3 = 3 * (mp_i64)(R - 1);
    for (mp_i64 i = tid; i < F3; i += nthreads) {
        flow[i] = constructed ? flow_C[c * F3 + i] : (i % 3 == 2 ? 0 : -1);
    }
}

// Dynamic shared memory: rem[E] (int64), rep_n[R], win (int32).
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_choice_layout(const mp_i64* prev, mp_i64 R_, mp_i64 E, mp_i64 B, mp_i64 align,
                           mp_i64 has_prev, mp_i64 C, const unsigned char* exited,
                           const double* scores, mp_i64* index, mp_i64* alloc, mp_i64* home,
                           mp_i64* target, mp_i64* flow, mp_i64* slot_expert, mp_i64* slot_new,
                           mp_i64* row_expert, mp_i64* row_count, mp_i64* row_offset,
                           const mp_i64* total_E, const mp_i64* load_R, const mp_i64* alloc_C,
                           const mp_i64* flow_C, const mp_i64* recv_C, mp_i64* rep_c, int* rep_e,
                           int* srt_e) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const int R = (int)R_, tid = threadIdx.x, nthreads = blockDim.x;
    const int warp = tid / MP_WARP, nwarps = nthreads / MP_WARP;
    const mp_i64 M = (E + R - 1) / R, W = M + (B > M ? B : M);
    mp_i64* rem = (mp_i64*)mp_smem;
    int* rep_n = (int*)(rem + E);
    int* win = rep_n + R;
    if (tid == 0) {  // the first least score (argmin); static EP on the early exit
        int best = 0;
        for (int c = 1; c < C && !exited[0]; ++c) best = scores[c] < scores[best] ? c : best;
        index[0] = best;
        win[0] = best;
    }
    for (int r = tid; r < R; r += nthreads) rep_n[r] = 0;
    __syncthreads();
    const int c = win[0];
    mc_layout_alloc(c, R, E, M, total_E, load_R, alloc_C, flow_C, recv_C, rem, rep_n, rep_e,
                    rep_c, alloc, home, target, flow, (int)C);
    __syncthreads();
    for (int r = tid; r < R; r += nthreads) rep_n[r] = rep_n[r] < M ? rep_n[r] : (int)M;
    __syncthreads();

    MpPlace p;
    p.rep_n = rep_n;
    p.rep_e = rep_e;
    p.rep_c = rep_c;
    p.srt_e = srt_e;
    p.prev = prev;
    p.alloc = alloc;
    p.rem = rem;
    p.slot_expert = slot_expert;
    p.slot_new = slot_new;
    p.row_expert = row_expert;
    p.row_count = row_count;
    p.row_offset = row_offset;
    p.R = R;
    p.E = E;
    p.B = B;
    p.M = M;
    p.W = W;
    p.align = align;
    p.has_prev = has_prev != 0;
    for (int r = warp; r < R; r += nwarps) mp_place_rank(p, r);
}
