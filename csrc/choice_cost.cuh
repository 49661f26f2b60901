// moonplan fused GPU planner: the step-cost formula of moonplan/stepcost/batch.py in CUDA,
// for the choice kernel (csrc/choice_kernel.cu).
//
// Legend:
//   R ranks, E experts, B slots per rank, G ranks per fast-link domain (ranks [g*G, (g+1)*G)
//   share one; G = R: one domain), T[e] records of expert e, N records in all
//   McCost   StepCost's rates (seconds, doubles) and options, and three seconds of the bound
//            computed on the host (bound.copy_min_s, bound.link_rates)
//   McRank   one rank's integer sums: busiest directions of dispatch rows and weight copies,
//            all and fetched rows of its expert sections, the copies it sends or receives
//
// Floats: every product and sum of the Python formula in its order, through __dmul_rn /
// __dadd_rn (never contracted into an FMA), so the scores equal the reference's bit for bit;
// maxima are exact in any order. Integer quantities are int64 sums, exact in any order.

#pragma once
#include "plan_kernel.cuh"

#define MC_INF __longlong_as_double(0x7ff0000000000000LL)
#define MC_RED_F64 (8 * MP_WARP)  // doubles of shared memory for mc_block_max
#define MC_ACC 13                 // per-rank integer sums of the score (McAcc)
#define MC_MARGIN (1.0 - 1.0 / 1099511627776.0)  // bound.MARGIN = 1 - 2**-40

// ---- the cost model ----------------------------------------------------------------------

__device__ __forceinline__ double mc_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double mc_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double mc_sub(double a, double b) { return __dadd_rn(a, -b); }

// StepCost's rates (seconds) and options; round_s = StepCost.round_s (one round of one
// rounding of the resident candidate: mc_least_units), exit_build = rent.exit_build_s
// (exit_s + roundings * round_s: the charge of bound.nocopy_s, the exit's test of whether to
// build the resident candidate); copy_min = bound.copy_min_s (inf: no copy possible),
// (h_disp, h_comb) = bound.link_rates (a row's least link seconds).
struct McCost {
    double row_flop, weight_read, row_mem, copy_intra, copy_inter, disp_intra, disp_inter;
    double comb_intra, comb_inter, base, per_peer, plan, exit_s, round_s, exit_build, copy_min;
    double h_disp, h_comb;
    mp_i64 tile, G;
    bool overlap;
};

#define MC_COST_PARAMS                                                                          \
    mp_i64 tile, mp_i64 G, mp_i64 overlap, double row_flop, double weight_read, double row_mem, \
        double copy_intra, double copy_inter, double disp_intra, double disp_inter,            \
        double comb_intra, double comb_inter, double base, double per_peer, double plan_s,     \
        double exit_s, double round_s, double copy_min, double h_disp, double h_comb
#define MC_COST_ARGS                                                                       \
    tile, G, overlap, row_flop, weight_read, row_mem, copy_intra, copy_inter, disp_intra, \
        disp_inter, comb_intra, comb_inter, base, per_peer, plan_s, exit_s, round_s, copy_min, \
        h_disp, h_comb

// McCost from the launcher's arguments (in its field order; overlap: non-zero is true).
__device__ McCost mc_cost(MC_COST_PARAMS) {
    // rent.exit_build_s: exit_s + roundings * round_s, roundings = rent.roundings (2 where the
    // tile is over one row: whole records and whole tiles), the same float product and sum
    const double roundings = tile > 1 ? 2.0 : 1.0;
    const double build = mc_add(exit_s, mc_mul(roundings, round_s));
    return {row_flop,   weight_read, row_mem,  copy_intra, copy_inter, disp_intra, disp_inter,
            comb_intra, comb_inter,  base,     per_peer,   plan_s,     exit_s,     round_s,
            build,      copy_min,    h_disp,   h_comb,     tile,       G,          overlap != 0};
}

__device__ __forceinline__ double mc_max(double a, double b) { return a > b ? a : b; }
__device__ __forceinline__ double mc_min(double a, double b) { return a < b ? a : b; }
__device__ __forceinline__ mp_i64 mc_max_i(mp_i64 a, mp_i64 b) { return a > b ? a : b; }
__device__ __forceinline__ mp_i64 mc_min_i(mp_i64 a, mp_i64 b) { return a < b ? a : b; }

// rows (>= 0) padded up to a multiple of the GEMM tile.
__device__ __forceinline__ mp_i64 mc_padded(const McCost& k, mp_i64 rows) {
    return k.tile == 1 ? rows : (rows + (k.tile - 1)) / k.tile * k.tile;
}

// StepCost._roofline of one rank's integer sums: max(flop, weight reads + row memory
// [+ one weight read per copy the rank sends or receives beside the section: copies >= 0]).
__device__ double mc_roofline(const McCost& k, mp_i64 padded, mp_i64 experts, mp_i64 rows,
                              mp_i64 copies = -1) {
    const double flop = mc_mul((double)padded, k.row_flop);
    double mem = mc_add(mc_mul((double)experts, k.weight_read), mc_mul((double)rows, k.row_mem));
    if (copies >= 0) mem = mc_add(mem, mc_mul((double)copies, k.weight_read));
    return mc_max(flop, mem);
}

// bound._pair_roofline: the least slower section of two ranks that run (padded rows, experts,
// rows) between them: at least half the tiles, rounded up, and half the reads and rows.
__device__ double mc_pair_roofline(const McCost& k, mp_i64 padded, mp_i64 experts, mp_i64 rows) {
    const mp_i64 half = (padded + (2 * k.tile - 1)) / (2 * k.tile) * k.tile;
    const double flop = mc_mul((double)half, k.row_flop);
    const double mem = mc_add(mc_mul((double)experts, k.weight_read), mc_mul((double)rows, k.row_mem));
    return mc_max(flop, mc_mul(mem, 0.5));
}

// The latency of one all-to-all of R > 1 ranks.
__device__ __forceinline__ double mc_lat(const McCost& k, int R) {
    return mc_add(k.base, mc_mul(k.per_peer, (double)(R - 1)));
}

// Length of the overlap of [a_lo, a_hi) and [b_lo, b_hi) (0 when disjoint).
__device__ __forceinline__ mp_i64 mc_overlap(mp_i64 a_lo, mp_i64 a_hi, mp_i64 b_lo, mp_i64 b_hi) {
    const mp_i64 v = mc_min_i(a_hi, b_hi) - mc_max_i(a_lo, b_lo);
    return v > 0 ? v : 0;
}

__device__ __forceinline__ void mc_atomic_add(mp_i64* p, mp_i64 v) {
    atomicAdd((unsigned long long*)p, (unsigned long long)v);
}

// ---- warp-aggregated sums into shared memory (all 32 lanes call them, converged) ----------
//
// A 64-bit shared-memory atomicAdd is a compare-and-swap loop (ATOMS.CAS on sm_90): lanes
// and warps adding to one address retry one after another. These helpers sum a warp's
// values with shuffles first, so one lane adds once per address (integer sums: exact in
// any order).

// Adds the warp's sum of v to *p.
__device__ __forceinline__ void mc_warp_add(mp_i64* p, mp_i64 v) {
    v = mp_warp_sum(v);
    if (threadIdx.x % MP_WARP == 0 && v != 0) mc_atomic_add(p, v);
}

// Adds each lane's v to base[key] (lanes with v == 0 add nothing): one atomic per distinct
// key among the warp's lanes, the lanes of a key summed by shuffles.
__device__ void mc_warp_add_keyed(mp_i64* base, int key, mp_i64 v) {
    const int lane = threadIdx.x % MP_WARP;
    unsigned pending = __ballot_sync(MP_FULL_MASK, v != 0);
    while (pending != 0) {  // warp-uniform
        const int lead = __popc((pending & (0u - pending)) - 1u);  // the lowest pending lane
        const int k = __shfl_sync(MP_FULL_MASK, key, lead);
        const bool mine = ((pending >> lane) & 1u) != 0 && key == k;
        const mp_i64 sum = mp_warp_sum(mine ? v : 0);
        if (lane == lead) mc_atomic_add(&base[k], sum);
        pending &= ~__ballot_sync(MP_FULL_MASK, mine);
    }
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

// Warp minimum of a double, on every lane.
__device__ double mc_warp_min(double v) {
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const mp_i64 o = __shfl_xor_sync(MP_FULL_MASK, __double_as_longlong(v), off);
        v = mc_min(v, __longlong_as_double(o));
    }
    return v;
}

// ---- the step time of one allocation (moonplan/stepcost/batch.py) ------------------------

// One rank's integer sums: busiest directions of dispatch rows (d_*) and weight copies
// (w_*) inside and across domains, all rows and the fetched rows of the expert sections,
// and the copies it sends or receives (beside its home section: StepCost.copies_beside).
struct McRank {
    mp_i64 d_in, d_out, w_in, w_out;
    mp_i64 pad, busy, rows, wpad, wbusy, wrows, beside;
};

// The parts of the total that do not depend on the planning charge.
struct McParts {
    double vmax, D, experts, Cb, alone_s;
};

// batch_step_time's phases from each rank's sums (rank = threadIdx.x < R, `active`).
__device__ McParts mc_parts(const McCost& k, const McRank& s, bool active, int R, double* red) {
    const double d_in = (double)s.d_in, d_out = (double)s.d_out;
    const double w_in = (double)s.w_in, w_out = (double)s.w_out;
    const mp_i64 beside = k.overlap ? s.beside : -1;  // copies run beside it when overlapped
    const double home = mc_roofline(k, s.pad - s.wpad, s.busy - s.wbusy, s.rows - s.wrows, beside);
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
    const double lat = mc_lat(k, R);
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

// ---- the early-exit bound (moonplan/plan/choice/bound.py) -----------------------------------

// bound.exit_bound's experts_lb: the slowest rank's experts phase in any plan, at least the
// ranks' mean of tiles and of reads and rows, and the kz = ceil(Z / R) experts (a tile, a
// weight read and a row each) that some rank runs (busy = Z, experts with records; R >= 1).
__device__ double mc_experts_lb(const McCost& k, int R, mp_i64 tiles, mp_i64 busy, mp_i64 N) {
    const mp_i64 kz = (busy + (R - 1)) / R, tiles_R = (mp_i64)R * k.tile;
    const mp_i64 rows = mc_max_i((tiles + (tiles_R - 1)) / tiles_R * k.tile, kz * k.tile);
    const double flop_lb = mc_mul((double)rows, k.row_flop);
    const double mem = mc_add(mc_mul((double)busy, k.weight_read), mc_mul((double)N, k.row_mem));
    const double per_k = mc_add(mc_mul((double)kz, k.weight_read), mc_mul((double)kz, k.row_mem));
    return mc_max(mc_max(flop_lb, mem / (double)R), per_k);
}

// bound.exit_bound's reads: a copying plan's experts phase, with the overlapped schedule at
// least one weight read per home expert with records and no resident replica on the rank
// that has the most of them (`kept`).
__device__ double mc_reads(const McCost& k, double experts_lb, mp_i64 kept) {
    return k.overlap ? mc_max(experts_lb, mc_mul((double)kept, k.weight_read)) : experts_lb;
}

// bound._link_time: the least dispatch (comb = false) or combine seconds of a rank sending
// n rows, x of them bound for the slow link (x counts only with several domains).
__device__ double mc_link(const McCost& k, int R, mp_i64 n, mp_i64 x, bool comb) {
    const double a = mc_mul((double)n, comb ? k.h_comb : k.h_disp);
    if (R <= k.G) return a;
    return mc_max(a, mc_mul((double)x, comb ? k.comb_inter : k.disp_inter));
}

// bound._total: a copying plan's least time from its least dispatch, experts phase, combine
// and copy wait.
__device__ double mc_copy_total(const McCost& k, double D, double reads, double Cb, double wait) {
    if (k.overlap) return mc_add(mc_add(k.plan, mc_max(mc_add(D, reads), wait)), Cb);
    return mc_add(mc_add(mc_add(mc_add(k.plan, D), reads), Cb), wait);
}

// bound.exit_bound's copying(j, n, x): the least time of a plan in which a rank receives j
// copies and sends n rows, x of them bound for the slow link (R > 1).
__device__ double mc_copying(const McCost& k, int R, double reads, mp_i64 j, mp_i64 n, mp_i64 x) {
    const double lat = mc_lat(k, R);
    const double D = mc_add(lat, mc_link(k, R, n, x, false));
    const double Cb = mc_add(lat, mc_link(k, R, n, x, true));
    const double wait = mc_add(k.base, mc_mul((double)mc_max_i(j, 1), k.copy_min));
    return mc_copy_total(k, D, reads, Cb, wait);
}

// bound.fetched_min_s: the least fetched section a copy with records brings its receiver.
__device__ double mc_fetched_min(const McCost& k) {
    return mc_max(mc_mul((double)k.tile, k.row_flop), mc_add(k.weight_read, k.row_mem));
}

// bound._received: a copying plan's least time from a rank that receives copies, its least
// dispatch D and combine Cb, every rank's reads, its home section's and its copy wait and
// fetched section.
__device__ double mc_received(const McCost& k, double D, double Cb, double every, double home,
                              double wait, double section) {
    if (k.overlap) {
        const double run = mc_add(D, mc_max(every, mc_add(home, section)));
        return mc_add(mc_add(k.plan, mc_max(run, mc_add(wait, section))), Cb);
    }
    return mc_add(mc_add(mc_add(mc_add(k.plan, D), mc_max(every, section)), Cb), wait);
}

// bound.exit_bound's receiving(j, n, x, kept): the least time of a plan in which a rank with
// `kept` kept reads receives j >= 1 copies and sends n rows, x of them bound for the slow link.
__device__ double mc_receiving(const McCost& k, int R, double reads, mp_i64 j, mp_i64 n,
                               mp_i64 x, mp_i64 kept) {
    const double lat = mc_lat(k, R);
    const double D = mc_add(lat, mc_link(k, R, n, x, false));
    const double Cb = mc_add(lat, mc_link(k, R, n, x, true));
    const double wait = mc_add(k.base, mc_mul((double)j, k.copy_min));
    const double home = mc_mul((double)(kept + j), k.weight_read);
    return mc_received(k, D, Cb, reads, home, wait, mc_mul((double)j, mc_fetched_min(k)));
}

// bound.exit_bound: the least time of a plan that copies, or, where no replica is resident,
// of static EP charged plan_s (`static_full`: the only plan that copies nothing); where
// replicas are resident the resident candidate stands for the plans that copy nothing, so
// the bound is `copies` alone. Into *buy its part for plans that copy (rent.exit_rent reads
// it). `copies`: the largest over ranks of the least over j of mc_copying, or less for a
// copy over the slow link (mc_first_links).
__device__ double mc_bound(int R, double copies, bool resident, double static_full,
                           double* buy) {
    *buy = R <= 1 ? MC_INF : mc_mul(copies, MC_MARGIN);
    if (R <= 1) return MC_INF;
    return mc_mul(!resident && static_full < copies ? static_full : copies, MC_MARGIN);
}

// bound.nocopy_s: the least time of a plan that copies nothing, charged `plan`: every rank
// sends at least its rows of sends[s][0] (rows: the most dispatch and combine link seconds
// of any rank's, mc_link), the experts phase at least experts_lb and the slowest rank's kept
// section (kept_s, bound.kept_section_s); scaled by MARGIN. Python's order:
// ((plan + D) + experts) + Cb.
__device__ double mc_nocopy(const McCost& k, int R, double experts_lb, double kept_s,
                            const double* rows, double plan) {
    const double lat = mc_lat(k, R);
    const double D = mc_add(lat, rows[0]), Cb = mc_add(lat, rows[1]);
    const double experts = mc_max(experts_lb, kept_s);
    return mc_mul(mc_add(mc_add(mc_add(plan, D), experts), Cb), MC_MARGIN);
}

// ---- the rent-or-buy rule (moonplan/plan/choice/rent.py) ------------------------------------

// rent.exit_rent: whether the early exit is taken (the credit plus the exit plan's experts
// phase over experts_lb short of a buy's least extra time, and the plan within the bound or
// the most a full call could have saved since the last one short of the call's price);
// *credit becomes the exit's credit, or the one the full call settles from; *pending the
// most a call could have saved since the last one (0 after a call).
__device__ bool mc_exit_rent(double t_exit, double gap, double bound, double buy,
                             double checking, double* credit, double* pending) {
    const bool within = t_exit <= bound;
    const double after = mc_add(*credit, gap > 0.0 ? gap : 0.0);
    const double over = mc_sub(t_exit, bound);
    const double owed = mc_add(*pending, over > 0.0 ? over : 0.0);
    if (after < mc_sub(buy, t_exit) && (within || owed < checking)) {
        *credit = after;
        *pending = owed;
        return true;
    }
    *credit = mc_add(*credit, within ? checking : 0.0);
    *pending = 0.0;
    return false;
}

// rent.settle: b the first least score, c the first least free score (copies resident); c is
// bought when the credit plus this step's rent covers its price. Returns the winner; *credit
// becomes the credit carried to the next step.
__device__ int mc_settle(const double* scores, const double* free_C, int C, double* credit) {
    int b = 0, c = 0;
    for (int i = 1; i < C; ++i) {
        b = scores[i] < scores[b] ? i : b;
        c = free_C[i] < free_C[c] ? i : c;
    }
    if (c == b) {
        *credit = 0.0;
        return b;
    }
    const double rent = mc_sub(scores[b], free_C[c]), price = mc_sub(scores[c], scores[b]);
    if (mc_add(*credit, rent) >= price) {
        *credit = 0.0;
        return c;
    }
    *credit = mc_add(*credit, rent > 0.0 ? rent : 0.0);
    return b;
}

// ---- the score of one candidate's allocation ------------------------------------------------

struct McStep {  // the step's inputs and the first kernel's results (global memory)
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

// Where one lane's expert e runs on rank r: its x > 0 records there, from source offset s
// (c records of rank r) and destination offset d of its interval; [S, S1) the sources of
// r's domain; h its home, near: r is in h's domain. Lanes with x == 0 add nothing.
struct McHold {
    mp_i64 e, h, s, c, d, x, S, S1;
    bool near;
};

// The warp's holders on rank r (every lane calls it, converged) added to r's sums, each sum
// one atomic a warp (mc_warp_add); returns whether this lane's expert is fetched onto r (not
// its home, not resident there: its weights arrive this step).
__device__ bool mc_score_rank(const McStep& st, const McCost& k, const McAcc& acc, int r,
                              const McHold& o) {
    const bool on = o.x > 0;
    const bool fetched = on && r != o.h && !mc_is_resident(st, o.e, r);
    const mp_i64 padded = on ? mc_padded(k, o.x) : 0;
    mc_warp_add(&acc.loc[r], on ? mc_overlap(o.s, o.s + o.c, o.d, o.d + o.x) : 0);
    mc_warp_add(&acc.rdom[r], on ? mc_overlap(o.d, o.d + o.x, o.S, o.S1) : 0);
    mc_warp_add(&acc.recv[r], on ? o.x : 0);
    mc_warp_add(&acc.pad[r], padded);
    mc_warp_add(&acc.wpad[r], fetched ? padded : 0);
    mc_warp_add(&acc.wrows[r], fetched ? o.x : 0);
    // four counts of at most 32 a warp, in 16-bit fields of one sum: busy, wbusy, cn_r, cf_r
    const mp_i64 one = on ? 1 : 0, got = fetched ? 1 : 0;
    const mp_i64 n = mp_warp_sum(one | got << 16 | (o.near ? got : 0) << 32 |
                                 (o.near ? 0 : got) << 48);
    if (threadIdx.x % MP_WARP == 0) {
        const mp_i64 field[4] = {n & 0xffff, n >> 16 & 0xffff, n >> 32 & 0xffff, n >> 48};
        mp_i64* to[4] = {&acc.busy[r], &acc.wbusy[r], &acc.cn_r[r], &acc.cf_r[r]};
        for (int i = 0; i < 4; ++i) {
            if (field[i] != 0) mc_atomic_add(to[i], field[i]);
        }
    }
    return fetched;
}

#define MC_STAGE 8                         // ranks of a warp's staged alloc tile
#define MC_TILE (MP_WARP * (MC_STAGE + 1))  // int64 of one warp's tile (+ 1 a row: banks)
#define MC_STAGE_MAX_R 1024  // the most ranks staged: more read alloc directly (their 13 R
                             // int64 sums leave no room for 32 tiles under 227 KiB)

// Entries [r0, r0 + n) (n <= MC_STAGE) of the rows of the warp's 32 experts e0 .. e0 + 31 of
// alloc [E, R] into the warp's tile xs [32][MC_STAGE + 1] (shared memory), 0 past E: the
// lanes load consecutive entries of each row's segment (a few cache lines an access, where a
// lane reading its own row R apart touches one line a lane); then lane q reads row q from
// the tile (mc_staged). Every lane of the warp calls it; without a tile (xs null) it does
// nothing.
__device__ void mc_stage_rows(const mp_i64* a, mp_i64 E, int R, mp_i64 e0, mp_i64 r0, int n,
                              mp_i64* xs) {
    if (xs == nullptr) return;  // warp-uniform
    __syncwarp();  // the tile's last reads are done
    for (int i = threadIdx.x % MP_WARP; i < MP_WARP * n; i += MP_WARP) {
        const int q = i / n, j = i % n;
        xs[q * (MC_STAGE + 1) + j] = e0 + q < E ? a[(e0 + q) * R + r0 + j] : 0;
    }
    __syncwarp();
}

// Entry r0 + j of expert e's row of alloc [E, R] (0 past E): from the warp's tile where
// staged (mc_stage_rows), else from alloc.
__device__ __forceinline__ mp_i64 mc_staged(const mp_i64* xs, const mp_i64* a, mp_i64 E, int R,
                                            mp_i64 e, mp_i64 r0, int j) {
    if (xs != nullptr) return xs[(threadIdx.x % MP_WARP) * (MC_STAGE + 1) + j];
    return e < E ? a[e * R + r0 + j] : 0;
}

// Expert e0 + lane's contribution (a lane each; every lane of the warp calls it; experts past
// E add nothing): its source intervals (rows in source-rank order) and destination intervals
// (alloc's row, staged MC_STAGE ranks at a time into the warp's tile xs), domain by domain
// (traffic.dispatch_traffic). In-domain sends are static EP's plus a correction, non-zero
// only for an expert whose records leave its home domain. The rank loop is warp-uniform, so
// each rank's sums are added once a warp (mc_score_rank), and only where some lane's expert
// runs there.
__device__ void mc_score_expert(const McStep& st, const McCost& k, const mp_i64* a, mp_i64 e0,
                                const McAcc& acc, mp_i64* xs) {
    const int R = st.R;
    const mp_i64 E = st.E, e = e0 + threadIdx.x % MP_WARP;
    const bool valid = e < E;
    const mp_i64 h = valid ? mp_home_of(e, E, R) : 0, gh = h / k.G;
    mp_i64 S = 0, D = 0, sn = 0, sf = 0;
    for (mp_i64 g0 = 0; g0 < R; g0 += k.G) {
        const mp_i64 g1 = mc_min_i(g0 + k.G, R);
        const bool near = g0 / k.G == gh;  // this domain is the expert's home domain
        mp_i64 S1 = S, D1 = D;
        for (mp_i64 r0 = g0; r0 < g1; r0 += MC_STAGE) {  // the domain's sums
            const int n = (int)mc_min_i(MC_STAGE, g1 - r0);
            mc_stage_rows(a, E, R, e0, r0, n, xs);
            for (int j = 0; j < n; ++j) {
                S1 += valid ? st.counts[(r0 + j) * E + e] : 0;
                D1 += mc_staged(xs, a, E, R, e, r0, j);
            }
        }
        McHold o = {e, h, S, 0, D, 0, S, S1, near};
        for (mp_i64 r0 = g0; r0 < g1; r0 += MC_STAGE) {
            const int n = (int)mc_min_i(MC_STAGE, g1 - r0);
            mc_stage_rows(a, E, R, e0, r0, n, xs);
            for (int j = 0; j < n; ++j) {  // warp-uniform
                const mp_i64 r = r0 + j;
                o.c = valid ? st.counts[r * E + e] : 0;
                o.x = mc_staged(xs, a, E, R, e, r0, j);
                if (__ballot_sync(MP_FULL_MASK, o.x > 0) != 0) {  // warp-uniform
                    const bool fetched = mc_score_rank(st, k, acc, (int)r, o);
                    sn += fetched && near ? 1 : 0;
                    sf += fetched && !near ? 1 : 0;
                }
                const mp_i64 corr = mc_overlap(o.s, o.s + o.c, D, D1) - (near ? o.c : 0);
                if (__ballot_sync(MP_FULL_MASK, corr != 0) != 0) mc_warp_add(&acc.sdc[r], corr);
                o.s += o.c;
                o.d += o.x;
            }
        }
        S = S1;
        D = D1;
    }
    mc_warp_add_keyed(acc.cn_s, (int)h, sn);  // copies sent, by the expert's home
    mc_warp_add_keyed(acc.cf_s, (int)h, sf);
}

struct McOut {  // where mc_score leaves one allocation's results (global memory)
    double *score, *free;  // its seconds charged plan_s, and with nothing fetched
    mp_i64* recv;          // [R] its records per rank
};

// An allocation's predicted seconds charged plan_s into *o.score, the same with nothing
// fetched (its copies resident: rent.py's free score) into *o.free, its per-rank records
// into o.recv; returns its phases (block-uniform). Dynamic shared memory: MC_ACC int64
// arrays of R, red[MC_RED_F64] (double), and where R <= MC_STAGE_MAX_R a tile of MC_TILE
// int64 a warp (mc_stage_rows).
__device__ McParts mc_score(const McStep& st, const McCost& k, const mp_i64* a, const McOut& o,
                            unsigned char* smem) {
    const int R = st.R, tid = threadIdx.x, nthreads = blockDim.x;
    mp_i64* base = (mp_i64*)smem;
    McAcc acc;
    mp_i64** at[MC_ACC] = {&acc.loc,  &acc.rdom, &acc.recv, &acc.pad,  &acc.busy,
                           &acc.wpad, &acc.wbusy, &acc.wrows, &acc.cn_r, &acc.cf_r,
                           &acc.cn_s, &acc.cf_s, &acc.sdc};
    for (int i = 0; i < MC_ACC; ++i) *at[i] = base + (mp_i64)i * R;
    double* red = (double*)(base + (mp_i64)MC_ACC * R);
    mp_i64* xs = nullptr;  // this warp's tile; none past MC_STAGE_MAX_R ranks (block-uniform)
    if (R <= MC_STAGE_MAX_R) xs = (mp_i64*)(red + MC_RED_F64) + (mp_i64)(tid / MP_WARP) * MC_TILE;
    for (mp_i64 i = tid; i < (mp_i64)MC_ACC * R; i += nthreads) base[i] = 0;
    __syncthreads();
    const int lane = tid % MP_WARP;
    for (mp_i64 e0 = tid - lane; e0 < st.E; e0 += nthreads) {  // warp-uniform: a lane an expert
        mc_score_expert(st, k, a, e0, acc, xs);
    }
    __syncthreads();
    const int r = tid;
    McRank s = {};
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
        s.beside = acc.cn_s[r] + acc.cf_s[r] + acc.cn_r[r] + acc.cf_r[r];
        o.recv[r] = acc.recv[r];
    }
    const McParts p = mc_parts(k, s, r < R, R, red);
    McRank none = s;  // nothing fetched: no wait section, no copy
    none.w_in = none.w_out = none.wpad = none.wbusy = none.wrows = none.beside = 0;
    const McParts f = mc_parts(k, none, r < R, R, red);
    if (tid == 0) {
        *o.score = mc_total(k, p, k.plan);
        *o.free = mc_total(k, f, k.plan);
    }
    return p;
}
