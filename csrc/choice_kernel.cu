// moonplan fused GPU planner: policy="auto" (moonplan/plan/choice/reference.py) in CUDA.
//
// Legend:
//   R ranks, E experts, B slots per rank, M = ceil(E/R), K levels, C = K + 4 candidates
//   G ranks per fast-link domain (ranks [g*G, (g+1)*G) share one; G = R: one domain)
//   T[e]  records of expert e          L[r]  static load of rank r (its home experts' T)
//   N     records in all               X[r]  L[r] - target[r] (> 0 donor, < 0 receiver)
//   candidates in table order (moonplan/plan/choice/table.py), index c:
//     0 static, 1 exact, 2 resident, 3 .. K+1 level-(K-1) .. level-1, K+2 greedy, K+3 placed
//   alloc_C [C, E, R]  each candidate's allocation (scratch; static's slice, which static
//                      does not use, holds the resident's rounding to tiles: mc_spare)
//   flow_C  [C, R-1, 3] the flows each construction recorded (scratch)
//   rest_RE [R, E]      each rank's records less those of its home experts and resident
//                       replicas, then its M largest, sorted (scratch of the bound)
//   top_RM  [R, M]      the entries above the M-th largest of a rank's rest (scratch)
//   res_a   [2, Hmax]   the resident rounds' units per holder, two snapshots (scratch; Hmax =
//                       E + R * min(B, M) holders at most)
//   res_i   [E+1+3Hmax] the resident holders' lists: first holder of each expert, each
//                       holder's expert, rank and live pairs out (scratch, int32)
//   free_C  [C + 2]     each candidate's free score: nothing fetched (rent.py), then the
//                       spare's score and free score (scratch, double)
//   misc    [5]         N, the bits of the bound's two parts (the emulated test reads them),
//                       previous's slots that hold an expert (> 0: kernel 1 built placed),
//                       1 where kernel 1 built resident (else 0)
//   credit  0-d double  the rent-or-buy credit: previous's in (carry_in[0]), this step's out
//   pending 0-d double  what a full call could have saved since the last: previous's in
//                       (carry_in[1]), this step's out (rent.exit_rent)
//   rounds  0-d int64   the rounds of the resident build this call ran, its roundings
//                       together (Choice.rounds, reference._resident): kernel 1's where it
//                       built it; else 0 from kernel 1, then, in a full call, candidate 2's
//                       block writes its own build's (stream order: the later write wins)
//
// Three kernels, launched by moonplan/plan/choice_cuda.py on torch's stream, no host sync:
//   moonplan_choice_first   ONE block: T, L, static EP's scores charged exit_s and plan_s;
//                           the early-exit bound (choice/bound.py: a warp per rank for its
//                           link rows, bound.links_reference) and bound.nocopy_s; where
//                           previous has resident replicas, the placed candidate built into
//                           alloc_C[K+3] and scored (charged plan_s, and free), and the
//                           resident one into alloc_C[2] only where static and placed, charged
//                           exit_s, both exceed nocopy_s charged rent.exit_build_s (exit_s and
//                           one round_s a rounding; else it cannot beat them by its least
//                           build); the exit's plans charged exit_s, the least (ties to the
//                           earlier index), the rent-or-buy exit test (choice/rent.py:
//                           exit_rent), the exit flag, the exit's index, the credit and the
//                           rounds of its resident build
//   moonplan_choice_build   C-1 blocks, one per candidate 1..C-1: returns at once when the
//                           exit flag is set, and candidate 2's or K+3's when kernel 1 built
//                           it; else builds its allocation into alloc_C[c] (group-flow
//                           construction, resident rounds or placed) and scores it, with its
//                           copies charged and free; candidate 2's block writes rounds
//   moonplan_choice_layout  ONE block: the rent-or-buy winner (rent.settle; on exit kernel
//                           1's index) and the credit, the winner's plan fields (slots with
//                           residents kept, rows, padded offsets)
//
// Floats: the step-cost formula (moonplan/stepcost/batch.py) with every product and sum in
// the Python order, through __dmul_rn / __dadd_rn (never contracted into an FMA; the
// launcher also compiles with --fmad=false), so the scores equal the reference's bit for
// bit. Integer quantities (rows, overlaps, copies) are int64 sums, exact in any order.
//
// It includes the exact planner's source for its construction and placement steps
// (mp_balance, mp_split_group, mp_place_rank) and choice_cost.cuh for the step-cost formula;
// NVRTC gets the three files as named headers.

#include "plan_kernel.cu"
#include "choice_cost.cuh"

// ---- kernel 1: counts, static EP, the bound, the exit flag --------------------------------

struct McFirstSums {  // one rank's static sums, in shared memory
    mp_i64 *loc, *rdom, *pad, *busy, *kbusy, *kpad, *krows;
};

// Warp per rank: static EP's traffic sums (row r of counts), its home experts' sums, and
// kbusy, its home experts with records and no resident replica (the bound's kept reads),
// with kpad and krows their padded rows and rows (the kept section, bound.kept_section_s).
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
        mp_i64 v[10] = {};  // send, sdom, loc, L, rdom, pad, busy, kbusy, kpad, krows
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
            const mp_i64 padded = mc_padded(k, t);
            v[5] += padded;
            v[6] += t > 0;
            const bool kept = t > 0 && !moved[e];
            v[7] += kept;
            v[8] += kept ? padded : 0;
            v[9] += kept ? t : 0;
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
            f.kbusy[r] = v[7];
            f.kpad[r] = v[8];
            f.krows[r] = v[9];
        }
    }
}

struct McTotals {  // the bound's sums: tile-padded rows, experts with records, records;
    mp_i64 tiles, busy, N, nres;  // and previous's slots that hold an expert
};

// Whether slot i = r * B + j is the first of rank r's slots to hold prev[i] (a rank holding
// an expert twice is one resident pair).
__device__ bool mc_first_on_rank(const mp_i64* prev, mp_i64 B, mp_i64 i) {
    const mp_i64 r0 = i / B * B;
    for (mp_i64 x = r0; x < i; ++x) {
        if (prev[x] == prev[i]) return false;
    }
    return true;
}

// The slowest pair's kept section this thread sees (bound.kept_section_s): over the slots it
// visits, an expert with records resident on that slot's rank alone (moved[e] == 1), not its
// home, runs there or on its home, beside both ranks' kept experts. 0 where none.
__device__ double mc_pair_kept(const McCost& k, const McStep& st, const mp_i64* T,
                               const int* moved, const McFirstSums& f) {
    double out = 0.0;
    const mp_i64 R = st.R, B = st.B;
    for (mp_i64 i = threadIdx.x; st.has_prev && i < R * B; i += blockDim.x) {
        const mp_i64 e = st.prev[i], g = i / B;
        if (e < 0 || e >= st.E || moved[e] != 1 || T[e] <= 0) continue;
        const mp_i64 h = mp_home_of(e, st.E, st.R);
        if (h == g || !mc_first_on_rank(st.prev, B, i)) continue;
        const mp_i64 padded = f.kpad[h] + f.kpad[g] + mc_padded(k, T[e]);
        out = mc_max(out, mc_pair_roofline(k, padded, f.kbusy[h] + f.kbusy[g] + 1,
                                           f.krows[h] + f.krows[g] + T[e]));
    }
    return out;
}

// T[e] (column sums of counts), the ranks holding each expert in a previous slot (moved[e]) and
// the warm donor home(prev[r, j]) of every slot; block sums of the bound's totals.
__device__ McTotals mc_first_totals(const mp_i64* counts, const mp_i64* prev, int R, mp_i64 E,
                                    mp_i64 B, bool has_prev, const McCost& k, mp_i64* total_E,
                                    int* moved, int* warm_d, mp_i64* red64) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (mp_i64 e = tid; e < E; e += nthreads) moved[e] = 0;
    __syncthreads();
    McTotals t = {0, 0, 0, 0};
    for (mp_i64 e = tid; e < E; e += nthreads) {
        mp_i64 x = 0;
        for (mp_i64 r = 0; r < R; ++r) x += counts[r * E + e];
        total_E[e] = x;
        t.tiles += mc_padded(k, x);
        t.busy += x > 0;
        t.N += x;
    }
    for (mp_i64 i = tid; has_prev && i < (mp_i64)R * B; i += nthreads) {
        const mp_i64 e = prev[i];
        const bool valid = e >= 0 && e < E;
        if (valid && mc_first_on_rank(prev, B, i)) atomicAdd(&moved[e], 1);  // ranks holding e
        warm_d[i] = valid ? (int)mp_home_of(e, E, R) : -1;
        t.nres += valid;
    }
    t.tiles = mp_block_sum(t.tiles, red64);  // each ends with __syncthreads
    t.busy = mp_block_sum(t.busy, red64);
    t.N = mp_block_sum(t.N, red64);
    t.nres = mp_block_sum(t.nres, red64);
    return t;
}

// ---- kernel 1: the bound's link rows (bound.links_reference), a warp per rank --------------

// Row s of counts less the records of s's home experts and of the replicas resident in its
// previous slots, into rest [E] (global scratch); on every lane, left = the row's sum and
// the largest entry.
__device__ void mc_rest_row(const mp_i64* counts, const mp_i64* prev, bool has_prev, int s, int R,
                            mp_i64 E, mp_i64 B, mp_i64* rest, mp_i64* left, mp_i64* vmax) {
    const int lane = threadIdx.x % MP_WARP;
    const mp_i64 h0 = mp_home_start(s, E, R), h1 = mp_home_start(s + 1, E, R);
    for (mp_i64 e = lane; e < E; e += MP_WARP) {
        rest[e] = (e >= h0 && e < h1) ? 0 : counts[(mp_i64)s * E + e];
    }
    __syncwarp();
    for (mp_i64 j = lane; has_prev && j < B; j += MP_WARP) {
        const mp_i64 e = prev[(mp_i64)s * B + j];
        if (e >= 0 && e < E) rest[e] = 0;  // resident on s: its records may stay local
    }
    __syncwarp();
    mp_i64 sum = 0, mx = 0;
    for (mp_i64 e = lane; e < E; e += MP_WARP) {
        sum += rest[e];
        mx = mc_max_i(mx, rest[e]);
    }
    *left = mp_warp_sum(sum);
    *vmax = mp_warp_max(mx);
}

// bound.links_reference's far[s]: row s's records of experts homed in another domain and
// resident in no slot of s's domain (rest [E]: scratch), on every lane (R > G only).
__device__ mp_i64 mc_far_row(const mp_i64* counts, const mp_i64* prev, bool has_prev, int s,
                             int R, mp_i64 E, mp_i64 B, int G, mp_i64* rest) {
    const int lane = threadIdx.x % MP_WARP, d = s / G;
    const mp_i64 r0 = (mp_i64)d * G, r1 = mc_min_i(r0 + G, R), n = (r1 - r0) * B;
    // the experts homed in d are [e0, e1): a range test, not a 64-bit division an entry
    const mp_i64 e0 = mp_home_start(r0, E, R), e1 = mp_home_start(r1, E, R);
    for (mp_i64 e = lane; e < E; e += MP_WARP) {
        rest[e] = e < e0 || e >= e1 ? counts[(mp_i64)s * E + e] : 0;
    }
    __syncwarp();
    for (mp_i64 i = lane; has_prev && i < n; i += MP_WARP) {
        const mp_i64 e = prev[r0 * B + i];
        if (e >= 0 && e < E) rest[e] = 0;  // resident in s's domain (lanes may write alike)
    }
    __syncwarp();
    mp_i64 sum = 0;
    for (mp_i64 e = lane; e < E; e += MP_WARP) sum += rest[e];
    return mp_warp_sum(sum);
}

#define MC_CUTS 7  // cuts a pass of mc_mth_largest: it narrows the interval 8-fold

// The M-th largest entry of rest [E] (M <= E), on every lane: the largest v with at least M
// entries >= v, by an 8-way search over [0, vmax]: each pass counts the entries at or above
// MC_CUTS evenly spaced cuts of the interval left (one pass over the row for 3 bits of vmax,
// where halving took one a bit; the row lies in global scratch, so passes are the cost).
__device__ mp_i64 mc_mth_largest(const mp_i64* rest, mp_i64 E, mp_i64 M, mp_i64 vmax) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 lo = 0, hi = vmax + 1;  // at least M entries >= lo (all E >= 0), fewer >= hi
    while (hi - lo > 1) {          // warp-uniform
        const mp_i64 step = (hi - lo + MC_CUTS) / (MC_CUTS + 1);  // >= 1; cut i: lo + i * step
        mp_i64 n[MC_CUTS] = {};
        for (mp_i64 e = lane; e < E; e += MP_WARP) {
            const mp_i64 x = rest[e];
#pragma unroll
            for (int i = 0; i < MC_CUTS; ++i) n[i] += x >= lo + (i + 1) * step;
        }
        mp_i64 best = 0;  // the last cut with at least M entries at or above it (0: lo itself)
#pragma unroll
        for (int i = 0; i < MC_CUTS; ++i) {
            if (lo + (i + 1) * step < hi && mp_warp_sum(n[i]) >= M) best = i + 1;
        }
        hi = mc_min_i(lo + (best + 1) * step, hi);  // the next cut has fewer than M
        lo += best * step;
    }
    return lo;
}

// The M largest entries of rest [E], sorted from the largest, into rest[0..M) (v: the M-th
// largest): the fewer than M above v gathered into top [M] (global scratch) and each placed
// by its rank (ties by position), the rest of the M filled with v.
__device__ void mc_top_sorted(mp_i64* rest, mp_i64* top, mp_i64 E, mp_i64 M, mp_i64 v) {
    const int lane = threadIdx.x % MP_WARP;
    mp_i64 g = 0;
    for (mp_i64 base = 0; base < E; base += MP_WARP) {  // warp-uniform: the ballot needs all
        const mp_i64 e = base + lane;
        const mp_i64 x = e < E ? rest[e] : 0;
        const bool above = e < E && x > v;
        const unsigned mask = __ballot_sync(MP_FULL_MASK, above);
        if (above) top[g + __popc(mask & ((1u << lane) - 1u))] = x;
        g += __popc(mask);
    }
    __syncwarp();
    for (mp_i64 i = lane; i < g; i += MP_WARP) {
        mp_i64 at = 0;
        for (mp_i64 q = 0; q < g; ++q) at += top[q] > top[i] || (top[q] == top[i] && q < i);
        rest[at] = top[i];
    }
    for (mp_i64 i = g + lane; i < M; i += MP_WARP) rest[i] = v;
    __syncwarp();
}

// The least over j <= M of mc_copying(j, left - the sum of the j largest), and the least
// over 1 <= j <= M of mc_receiving with the same rows (kept: the rank's kept reads), on every
// lane (top [M]: the M largest, sorted from the largest).
__device__ void mc_least_copying(const McCost& k, int R, double reads, const mp_i64* top,
                                 mp_i64 M, mp_i64 left, mp_i64 far, mp_i64 kept, double* out) {
    const int lane = threadIdx.x % MP_WARP;
    double best = mc_copying(k, R, reads, 0, left, far), recv = MC_INF;
    mp_i64 carry = 0;
    for (mp_i64 base = 0; base < M; base += MP_WARP) {  // warp-uniform: the scan needs all
        const mp_i64 j = base + lane + 1;                 // this lane's j
        const mp_i64 incl = mp_warp_incl_scan(j <= M ? top[j - 1] : 0, lane);
        if (j <= M) {
            const mp_i64 n = left - (carry + incl);
            best = mc_min(best, mc_copying(k, R, reads, j, n, far));
            recv = mc_min(recv, mc_receiving(k, R, reads, j, n, far, kept));
        }
        carry += __shfl_sync(MP_FULL_MASK, incl, MP_WARP - 1);
    }
    out[0] = mc_warp_min(best);
    out[1] = mc_warp_min(recv);
}

// bound.exit_bound's `copies` (block-uniform): bound.links_reference's rows, a warp per
// rank (R > 1), the largest over ranks of the least copying time, at least the least over
// ranks of the least receiving time (kept_R: each rank's kept reads, kmin their least), or
// less for a copy over the slow link. Into rows [2] the most dispatch and combine link
// seconds of any rank's sends[s][0] (bound.nocopy_s). Every thread of the block calls it.
__device__ double mc_first_links(const McStep& st, const McCost& k, double reads,
                                 const mp_i64* kept_R, mp_i64 kmin, mp_i64* rest_RE,
                                 mp_i64* top_RM, double* red, double* rows) {
    const int warp = threadIdx.x / MP_WARP, nwarps = blockDim.x / MP_WARP;
    // the largest copying, less the least receiving, the largest sends[s][0] link seconds
    double v4[4] = {-MC_INF, -MC_INF, -MC_INF, -MC_INF};
    for (int s = warp; s < st.R; s += nwarps) {
        mp_i64* rest = rest_RE + (mp_i64)s * st.E;
        mp_i64 left = 0, vmax = 0;
        const mp_i64 far = st.R > k.G
                               ? mc_far_row(st.counts, st.prev, st.has_prev, s, st.R, st.E, st.B,
                                            k.G, rest)
                               : 0;
        mc_rest_row(st.counts, st.prev, st.has_prev, s, st.R, st.E, st.B, rest, &left, &vmax);
        const mp_i64 v = mc_mth_largest(rest, st.E, st.M, vmax);
        mc_top_sorted(rest, top_RM + (mp_i64)s * st.M, st.E, st.M, v);
        double least[2];
        mc_least_copying(k, st.R, reads, rest, st.M, left, far, kept_R[s], least);
        v4[0] = mc_max(v4[0], least[0]);
        v4[1] = mc_max(v4[1], -least[1]);
        v4[2] = mc_max(v4[2], mc_link(k, st.R, left, far, false));
        v4[3] = mc_max(v4[3], mc_link(k, st.R, left, far, true));
    }
    mc_block_max(v4, 4, red);
    rows[0] = v4[2];
    rows[1] = v4[3];
    double copies = mc_max(v4[0], -v4[1]);
    if (st.R > k.G) {  // bound.exit_bound: a plan that copies over the slow link waits for it
        const double lat = mc_lat(k, st.R);
        const double wait = mc_add(k.base, k.copy_inter);
        const double one = mc_mul((double)(kmin + 1), k.weight_read);
        copies = mc_min(copies, mc_received(k, lat, lat, reads, one, wait, mc_fetched_min(k)));
    }
    return copies;
}

// ---- the resident candidate (moonplan/plan/choice/resident.py): kernel 1 or 2 ------------
//
// Built by the first kernel where the early exit may take it (previous has a resident
// replica and static and placed exceed bound.nocopy_s), else by candidate 2's block of the
// build kernel. Each rounding (records; whole tiles where tile > 1) runs its own rounds: while
// the last round lowered the largest load by at least mc_least_units, or left it where it was
// with fewer ranks at it, at most MC_ROUND_LIMIT (resident.py, "How many rounds"); the kernel
// that builds it reports them (rounds).
// A holder h is (e, r): r is expert e's home, or e is in one of r's first M previous slots.
// The holders lie in expert order, then rank order, in global scratch (McHolders); at most
// Hmax = E + R * min(B, M) of them (choice_cuda.resident_holders). The rule balances whole
// GEMM tiles: expert e has K[e] = ceil(T[e] / tile) of them (mc_tiles). a[h] counts the units
// (1/2^bits tile, bits = mc_scale_bits) on holder h, L[r] (in this section) the units rank
// r holds. Units are int64: with N < 2^46 records a unit is 2^-16 tile (N * 2^16 < 2^62,
// and there are no more tiles than records), with more it is one tile
// (resident.scale_bits), so no sum of units overflows. Every
// round is computed from one snapshot (a) into the next (b): each holder gathers the moves
// over its own pairs, so no two threads write the same entry; the ranks' sums are integer
// atomics, exact in any order.

#define MC_ROUND_LIMIT 32             // resident.ROUND_LIMIT: the most rounds one build runs
#define MC_NEVER ((mp_i64)1 << 62)    // resident.NEVER: mc_least_units where no round can pay
#define MC_SCALE_BITS 16              // resident.SCALE_BITS
#define MC_FINE_LIMIT_BITS 46         // resident.FINE_LIMIT_BITS

// Bits of a unit below one tile: MC_SCALE_BITS while N < 2^MC_FINE_LIMIT_BITS, else 0.
__device__ int mc_scale_bits(const McStep& st) {
    return st.N < ((mp_i64)1 << MC_FINE_LIMIT_BITS) ? MC_SCALE_BITS : 0;
}

// resident.least_units: the least drop of the largest load, in units (2^-bits tile of tile
// rows), for which one more round pays: ceil(round_s * 2^bits / (tile * row_s)), at least 1,
// with row_s = max(row_flop, row_mem); 1 without a round price (the rounds run while the
// largest load falls); MC_NEVER where rows cost nothing (one round only). Float64 in the
// Python order; the ceiling in integers (0 <= q < 2^62: the cast is the floor, exact, and q
// is an integer already from 2^53 on), so it equals Python's bit for bit.
__device__ mp_i64 mc_least_units(const McCost& k, mp_i64 tile, int bits) {
    if (k.round_s <= 0.0) return 1;
    const double row_s = k.row_mem > k.row_flop ? k.row_mem : k.row_flop;  // Python's max(a, b)
    if (row_s <= 0.0) return MC_NEVER;
    const double q = mc_mul(k.round_s, (double)((mp_i64)1 << bits)) / mc_mul((double)tile, row_s);
    if (q >= (double)MC_NEVER) return MC_NEVER;
    const mp_i64 n = (mp_i64)q;
    return mc_max_i((double)n < q ? n + 1 : n, 1);
}

// K[e]: expert e's records in whole GEMM tiles (tile >= 1 rows).
__device__ mp_i64 mc_tiles(const McStep& st, mp_i64 tile, mp_i64 e) {
    return (st.T[e] + (tile - 1)) / tile;
}

struct McHolders {  // global scratch: res_a [2, Hmax] (int64), res_i [E + 1 + 3 Hmax] (int32)
    mp_i64 *a, *b;  // [Hmax] units on each holder: this round's snapshot and the next round's
    int* start;     // [E + 1] expert e's holders are start[e] .. start[e+1]-1
    int *e, *r;     // [Hmax] each holder's expert and rank
    int* out;       // [Hmax] the round's live pairs leaving each holder
    mp_i64 H;       // holders (block-uniform)
};

// Whether rank r holds expert e (home h): r is its home, or e sits in one of r's first J
// previous slots. Every lane of a warp reads the same slots at once (a broadcast).
__device__ bool mc_holds(const McStep& st, mp_i64 J, mp_i64 e, mp_i64 h, mp_i64 r) {
    if (r == h) return true;
    const mp_i64* row = st.prev + r * st.B;
    for (mp_i64 j = 0; j < J; ++j) {
        if (row[j] == e) return true;
    }
    return false;
}

// Previous's slots a rank's holders come from: its first min(B, M) (none without previous).
__device__ mp_i64 mc_holder_slots(const McStep& st) {
    return st.has_prev ? mc_min_i(st.B, st.M) : 0;
}

// hd.start: each expert's first holder (an exclusive scan of its holder count over the
// experts, blockDim at a time; red32: 33 ints of shared memory); returns the holders. A
// thread per expert counts its holders from previous's slots (mc_holds), not from a row of
// alloc (a warp's lanes on 32 rows R apart: one cache line a lane). Ends with __syncthreads.
__device__ mp_i64 mc_holders_start(const McStep& st, int* start, int* red32) {
    const int tid = threadIdx.x, nthreads = blockDim.x, R = st.R;
    const mp_i64 E = st.E, J = mc_holder_slots(st);
    int carry = 0;
    for (mp_i64 base = 0; base < E; base += nthreads) {  // block-uniform: the scan needs all
        const mp_i64 e = base + tid;
        const mp_i64 h = e < E ? mp_home_of(e, E, R) : 0;
        int n = 0;
        for (mp_i64 r = 0; e < E && r < R; ++r) n += mc_holds(st, J, e, h, r) ? 1 : 0;
        int total = 0;
        const int before = mp_block_excl_scan(n, red32, &total);  // ends with __syncthreads
        if (e < E) start[e] = carry + before;
        carry += total;
    }
    if (tid == 0) start[E] = carry;
    __syncthreads();
    return carry;
}

// The holder lists and the even start: a thread per expert lists its holders by rank
// (mc_holds), and the first K[e]*S mod n of them get one unit more than K[e]*S / n; alloc
// [E, R] zeroed (coalesced) for the rows of mc_rows_of_tiles. Ends with __syncthreads.
__device__ void mc_holders_list(const McStep& st, mp_i64 tile, mp_i64* alloc,
                                const McHolders& hd) {
    const int tid = threadIdx.x, nthreads = blockDim.x, R = st.R;
    const mp_i64 E = st.E, J = mc_holder_slots(st);
    for (mp_i64 i = tid; i < E * R; i += nthreads) alloc[i] = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) {
        const mp_i64 h = mp_home_of(e, E, R);
        const int h0 = hd.start[e], n = hd.start[e + 1] - h0;
        const mp_i64 units = mc_tiles(st, tile, e) << mc_scale_bits(st);
        int k = 0;
        for (int r = 0; r < R; ++r) {
            if (!mc_holds(st, J, e, h, r)) continue;
            hd.e[h0 + k] = (int)e;
            hd.r[h0 + k] = r;
            hd.a[h0 + k] = units / n + (k < units % n ? 1 : 0);
            ++k;
        }
    }
    __syncthreads();
}

// Holder h's live pairs (e, r, g) as the sender r (out: L[r] > L[g], records on h) and as
// the receiver g (in: L[r] > L[g], records on the other holder), from the snapshot hd.a.
__device__ void mc_live(const McHolders& hd, const mp_i64* L, mp_i64 h, int* out, int* in) {
    const mp_i64 Lh = L[hd.r[h]];
    const int h1 = hd.start[hd.e[h] + 1];
    *out = *in = 0;
    for (int j = hd.start[hd.e[h]]; j < h1; ++j) {
        const mp_i64 Lj = L[hd.r[j]];
        *out += Lh > Lj && hd.a[h] > 0;
        *in += Lj > Lh && hd.a[j] > 0;
    }
}

// The units holder h holds after the round: less its moves out, plus its moves in; a live
// pair (e, r, g) moves min((L[r] - L[g]) / (max(deg[r], deg[g]) + 1), a[e][r] / out[e][r])
// (the + 1: two ranks sharing one expert meet halfway, resident.py step 2).
__device__ mp_i64 mc_after_round(const McHolders& hd, const mp_i64* L, const int* deg, mp_i64 h) {
    const int rh = hd.r[h], h1 = hd.start[hd.e[h] + 1];
    const mp_i64 ah = hd.a[h];
    mp_i64 next = ah;
    for (int j = hd.start[hd.e[h]]; j < h1; ++j) {
        const int rj = hd.r[j];
        const mp_i64 most = mc_max_i(deg[rh], deg[rj]) + 1;  // >= 2 for a live pair
        if (L[rh] > L[rj] && ah > 0) next -= mc_min_i((L[rh] - L[rj]) / most, ah / hd.out[h]);
        if (L[rj] > L[rh] && hd.a[j] > 0) {
            next += mc_min_i((L[rj] - L[rh]) / most, hd.a[j] / hd.out[j]);
        }
    }
    return next;
}

struct McTop {  // the largest rank load (units) and how many ranks hold exactly it
    mp_i64 top, ties;
};

// (a, b) combined: the larger top, with the ties of every side that holds it.
__device__ __forceinline__ McTop mc_top_join(McTop a, McTop b) {
    const mp_i64 top = mc_max_i(a.top, b.top);
    return {top, (a.top == top ? a.ties : 0) + (b.top == top ? b.ties : 0)};
}

// The largest of L [R] and the ranks at it, on every thread: each warp joins its lanes' by
// shuffles, then every thread joins the warps' (red64, red32: a maximum and a count a warp).
// Two __syncthreads, where a block maximum and then a block sum took six.
__device__ McTop mc_top_of(const mp_i64* L, int R, mp_i64* red64, int* red32) {
    const int tid = threadIdx.x, lane = tid % MP_WARP, warp = tid / MP_WARP;
    McTop t = {MP_I64_MIN, 0};
    for (int r = tid; r < R; r += blockDim.x) t = mc_top_join(t, {L[r], 1});
    for (int off = MP_WARP / 2; off > 0; off >>= 1) {
        const McTop o = {__shfl_xor_sync(MP_FULL_MASK, t.top, off),
                         __shfl_xor_sync(MP_FULL_MASK, t.ties, off)};
        t = mc_top_join(t, o);
    }
    if (lane == 0) {
        red64[warp] = t.top;
        red32[warp] = (int)t.ties;  // at most R ranks
    }
    __syncthreads();
    t = {MP_I64_MIN, 0};
    for (int w = 0; w < (int)(blockDim.x / MP_WARP); ++w) {
        t = mc_top_join(t, {red64[w], red32[w]});
    }
    __syncthreads();  // red64, red32 read before any reuse
    return t;
}

// The ranks' loads L [R] of the snapshot hd.a and deg [R] = 0 (shared memory); returns the
// largest load and the ranks at it, on every thread (mc_top_of, exact integers; red64,
// red32: 33 of shared memory each). The holders lie by expert, so a warp's 32 holders sit on
// a few ranks: each rank's share is one atomic a warp (mc_warp_add_keyed), not one a holder
// contending on a 64-bit compare-and-swap. Ends with __syncthreads.
__device__ McTop mc_resident_loads(const McHolders& hd, int R, mp_i64* L, int* deg,
                                   mp_i64* red64, int* red32) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (int r = tid; r < R; r += nthreads) {
        L[r] = 0;
        deg[r] = 0;
    }
    __syncthreads();
    const int lane = tid % MP_WARP;
    for (mp_i64 h0 = tid - lane; h0 < hd.H; h0 += nthreads) {  // warp-uniform: a lane a holder
        const mp_i64 h = h0 + lane;
        mc_warp_add_keyed(L, h < hd.H ? hd.r[h] : 0, h < hd.H ? hd.a[h] : 0);  // few ranks a warp
    }
    __syncthreads();
    return mc_top_of(L, R, red64, red32);  // ends with __syncthreads
}

// One round (resident.py, step 2) from the snapshot hd.a and its loads L [R]
// (mc_resident_loads; deg [R] zero): each holder's live pairs out and each rank's deg [R]
// (shared memory), then every holder's units after the round into hd.b. Ends with
// __syncthreads.
__device__ void mc_resident_round(const McHolders& hd, mp_i64* L, int* deg) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (mp_i64 h = tid; h < hd.H; h += nthreads) {
        int out = 0, in = 0;
        mc_live(hd, L, h, &out, &in);
        hd.out[h] = out;
        if (out + in > 0) atomicAdd(&deg[hd.r[h]], out + in);  // a pair counts on both sides
    }
    __syncthreads();
    for (mp_i64 h = tid; h < hd.H; h += nthreads) hd.b[h] = mc_after_round(hd, L, deg, h);
    __syncthreads();
}

// Whole tiles (resident.py, step 3) into hd.b (the last round's scratch): holder h keeps
// a / S tiles, and one more when it ranks below the tiles its expert has left over, by
// (remainder descending, rank ascending). Ends with __syncthreads.
__device__ void mc_whole_tiles(const McStep& st, mp_i64 tile, const McHolders& hd) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int bits = mc_scale_bits(st);
    const mp_i64 mask = ((mp_i64)1 << bits) - 1;
    for (mp_i64 h = tid; h < hd.H; h += nthreads) {
        const int e = hd.e[h], h1 = hd.start[e + 1];
        const mp_i64 rem = hd.a[h] & mask;
        mp_i64 whole = 0, place = 0;
        for (int j = hd.start[e]; j < h1; ++j) {
            const mp_i64 rj = hd.a[j] & mask;
            whole += hd.a[j] >> bits;
            place += rj > rem || (rj == rem && hd.r[j] < hd.r[h]);
        }
        const mp_i64 extra = place < mc_tiles(st, tile, e) - whole ? 1 : 0;
        hd.b[h] = (hd.a[h] >> bits) + extra;
    }
    __syncthreads();
}

// Rows (resident.py, step 4) into alloc (zero): holder h takes tile rows for each of its
// tiles hd.b[h] from what its expert has left after its lower-ranked holders' tiles, at
// least 0. Ends with __syncthreads.
__device__ void mc_rows_of_tiles(const McStep& st, mp_i64 tile, const McHolders& hd,
                                 mp_i64* alloc) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    for (mp_i64 h = tid; h < hd.H; h += nthreads) {
        const int e = hd.e[h];
        mp_i64 before = 0;
        for (int j = hd.start[e]; j < h; ++j) before += hd.b[j];  // holders lie by rank
        const mp_i64 left = mc_max_i(st.T[e] - tile * before, 0);
        alloc[(mp_i64)e * st.R + hd.r[h]] = mc_min_i(left, tile * hd.b[h]);
    }
    __syncthreads();
}

// resident_reference into alloc [E, R]; returns the rounds it ran (block-uniform): the
// holders, the even start (in tiles of tile rows; 1: records), the rounds (top: the largest
// load, ties: the ranks at it; a round runs, then the next only where least < MC_NEVER and
// the round lowered top by at least least, or left top where it was with fewer ties: two
// ranks tied at the top fall one a round; MC_ROUND_LIMIT at most; the last round's result
// is kept), whole tiles, rows. res_a, res_i: global scratch (McHolders), sized by Hmax.
// Dynamic shared memory: L [R] and red64 [33] (int64), deg [R] and red32 [33] (int32):
// 12(R + 33) bytes, less than the construction's. Ends with __syncthreads.
__device__ int mc_resident(const McStep& st, const McCost& k, mp_i64 tile, mp_i64* alloc,
                           mp_i64* res_a, int* res_i, unsigned char* smem) {
    const int R = st.R;
    const mp_i64 Hmax = st.E + (mp_i64)R * mc_min_i(st.B, st.M);
    mp_i64* L = (mp_i64*)smem;
    mp_i64* red64 = L + R;
    int* deg = (int*)(red64 + MP_WARP + 1);
    int* red32 = deg + R;
    McHolders hd = {res_a, res_a + Hmax, res_i, res_i + st.E + 1, res_i + st.E + 1 + Hmax,
                    res_i + st.E + 1 + 2 * Hmax, 0};
    hd.H = mc_holders_start(st, hd.start, red32);
    mc_holders_list(st, tile, alloc, hd);
    const mp_i64 least = mc_least_units(k, tile, mc_scale_bits(st));
    McTop top = mc_resident_loads(hd, R, L, deg, red64, red32);
    int rounds = 0;
    while (rounds < MC_ROUND_LIMIT) {  // block-uniform: top, ties and least are every thread's
        mc_resident_round(hd, L, deg);
        mp_i64* t = hd.a;  // the next round's snapshot (every thread swaps alike)
        hd.a = hd.b;
        hd.b = t;
        ++rounds;
        const McTop last = top;
        top = mc_resident_loads(hd, R, L, deg, red64, red32);
        const bool fell = last.top - top.top >= least;
        const bool untied = top.top == last.top && top.ties < last.ties;
        // this round did not pay (nor lowered a tie at the top): the next would not either
        if (least >= MC_NEVER || !(fell || untied)) break;
    }
    mc_whole_tiles(st, tile, hd);
    mc_rows_of_tiles(st, tile, hd, alloc);
    return rounds;
}

struct McCands {  // every candidate's entries and the resident rounds' scratch (global memory)
    mp_i64 *alloc_C, *recv_C;  // [C, E, R], [C, R]
    double *scores, *free_C;   // [C], [C + 2]
    mp_i64* res_a;
    int* res_i;
    int C;
};

// Candidate c's outputs for mc_score.
__device__ McOut mc_entry(const McCands& m, const McStep& st, int c) {
    return {m.scores + c, m.free_C + c, m.recv_C + (mp_i64)c * st.R};
}

// The spare for the resident's rounding to whole tiles: static's slices of alloc_C and recv_C
// (unused: the layout builds static EP from T and L) and free_C[C], free_C[C + 1]. No other
// block of either kernel writes them, so kernel 1 and candidate 2's block may both use it.
__device__ McOut mc_spare(const McCands& m) {
    return {m.free_C + m.C, m.free_C + m.C + 1, m.recv_C};
}

// The resident candidate rounded to whole tiles, built and scored in the spare, and moved into
// entry 2 where it is predicted faster than the rounding to whole records (parts rec; both
// charged exit_s, ties records: reference._resident). Returns the parts of the one kept and
// adds the rounds of its build to *rounds (this thread's). Block-uniform; ends with
// __syncthreads.
__device__ McParts mc_resident_tiles(const McStep& st, const McCost& k, const McCands& m,
                                     const McParts& rec, int* rounds, unsigned char* smem) {
    const mp_i64 ER = st.E * st.R;
    mp_i64* spare = m.alloc_C;
    *rounds += mc_resident(st, k, k.tile, spare, m.res_a, m.res_i, smem);
    const McOut o = mc_spare(m);
    const McParts til = mc_score(st, k, spare, o, smem);
    if (!(mc_total(k, til, k.exit_s) < mc_total(k, rec, k.exit_s))) {
        __syncthreads();  // block-uniform: mc_score's thread-0 writes before any later read
        return rec;
    }
    for (mp_i64 i = threadIdx.x; i < ER; i += blockDim.x) m.alloc_C[2 * ER + i] = spare[i];
    for (int r = threadIdx.x; r < st.R; r += blockDim.x) {
        m.recv_C[2 * (mp_i64)st.R + r] = o.recv[r];
    }
    if (threadIdx.x == 0) {
        m.scores[2] = *o.score;
        m.free_C[2] = *o.free;
    }
    __syncthreads();
    return til;
}

// The resident candidate (reference._resident) built and scored in entry 2: whole records,
// and where previous has resident replicas (`res`) and tiles are wider than a row, whole tiles
// where faster. Kernel 1 builds it where the exit may take it, else candidate 2's block.
// Returns its parts, and in *rounds (this thread's) the rounds both roundings ran together
// (block-uniform); ends with __syncthreads.
__device__ McParts mc_resident_pick(const McStep& st, const McCost& k, const McCands& m,
                                    bool res, int* rounds, unsigned char* smem) {
    mp_i64* alloc = m.alloc_C + 2 * st.E * st.R;
    *rounds = mc_resident(st, k, 1, alloc, m.res_a, m.res_i, smem);  // no residents: homes only
    const McParts rec = mc_score(st, k, alloc, mc_entry(m, st, 2), smem);
    if (!res || k.tile == 1) {  // block-uniform: the roundings agree, or records are the rule
        __syncthreads();  // mc_score's thread-0 writes before any later read
        return rec;
    }
    return mc_resident_tiles(st, k, m, rec, rounds, smem);
}

// ---- the placed candidate (reference._placed): kernel 1, or candidate K+3's block --------

// Each expert's T[e] records on the lowest rank holding it in previous's slots away from its
// home, else on its home, into alloc [E, R]: alloc zeroed (coalesced) and low[e] = R, each
// away slot lowers low[e] by an atomic minimum, then a thread per expert writes its one
// entry. O(E R / threads + R B), no pass over a row of alloc (a warp's lanes on 32 rows R
// apart: one cache line a lane). Shared memory: low [E] (int32). Ends with __syncthreads.
__device__ void mc_placed(const McStep& st, mp_i64* alloc, unsigned char* smem) {
    const int tid = threadIdx.x, nthreads = blockDim.x, R = st.R;
    const mp_i64 E = st.E, B = st.B;
    int* low = (int*)smem;
    for (mp_i64 i = tid; i < E * R; i += nthreads) alloc[i] = 0;
    for (mp_i64 e = tid; e < E; e += nthreads) low[e] = R;
    __syncthreads();
    for (mp_i64 i = tid; st.has_prev && i < R * B; i += nthreads) {
        const mp_i64 e = st.prev[i], r = i / B;
        if (e >= 0 && e < E && r != mp_home_of(e, E, R)) atomicMin(&low[e], (int)r);
    }
    __syncthreads();
    for (mp_i64 e = tid; e < E; e += nthreads) {
        const mp_i64 at = low[e] < R ? low[e] : mp_home_of(e, E, R);
        alloc[e * R + at] = st.T[e];
    }
    __syncthreads();  // low read before the caller reuses the shared memory
}

// ---- kernel 1: the first kernel itself -----------------------------------------------------

// Static EP's sums of rank r (r < R).
__device__ McRank mc_first_rank(const McFirstSums& f, int r, const mp_i64* load_R,
                                const mp_i64* send_R, const mp_i64* sdom_R) {
    McRank s = {};  // static EP: nothing fetched
    s.d_in = mc_max_i(sdom_R[r] - f.loc[r], f.rdom[r] - f.loc[r]);
    s.d_out = mc_max_i(send_R[r] - sdom_R[r], load_R[r] - f.rdom[r]);
    s.pad = f.pad[r];
    s.busy = f.busy[r];
    s.rows = load_R[r];
    return s;
}

// The step's inputs and the first kernel's sums (global memory) as an McStep; N, previous's
// flows and the levels are the caller's to set.
__device__ McStep mc_step(const mp_i64* counts, const mp_i64* prev, int R, mp_i64 E, mp_i64 B,
                          bool has_prev, const mp_i64* total_E, const mp_i64* load_R,
                          const mp_i64* send_R, const mp_i64* sdom_R, const int* warm_d) {
    McStep st = {};
    st.counts = counts;
    st.prev = prev;
    st.T = total_E;
    st.L = load_R;
    st.send_R = send_R;
    st.sdom_R = sdom_R;
    st.warm_d = warm_d;
    st.E = E;
    st.B = B;
    st.M = (E + R - 1) / R;
    st.R = R;
    st.has_prev = has_prev;
    return st;
}

struct McExitIn {  // what the exit test reads (block-uniform)
    McParts stat;   // static EP's phases
    McParts plc;    // the placed candidate's (when has_res)
    McParts res;    // the resident candidate's (when built)
    bool has_res;   // previous has a resident replica: the placed candidate was built
    bool built;     // the resident candidate was built (has_res, and it may win the exit)
    int rounds;     // the rounds its build ran, both roundings together (0: not built)
    double experts_lb;
    double copies;  // the bound's part for plans that copy (mc_first_links; inf with one rank)
    double nocopy;  // bound.nocopy_s charged rent.exit_build_s (McCost.exit_build)
    mp_i64 nres;    // previous's slots that hold an expert
};

struct McFirstOut {  // the first kernel's outputs (global memory)
    double *scores, *free_C, *credit, *pending;  // credit, pending: previous's on entry
    unsigned char* exited;
    mp_i64 *index, *misc;
};

// T, L, static EP's sums and phases, the bound's terms; st.N set. Dynamic shared memory:
// loc, rdom, pad, busy, kbusy, kpad, krows [R] and red64[33] (int64), red[MC_RED_F64]
// (double), moved[E]
// (int32). Ends with __syncthreads: the caller may reuse it.
__device__ McExitIn mc_first_static(McStep& st, const McCost& k, int* warm_d, mp_i64* total_E,
                                    mp_i64* load_R, mp_i64* send_R, mp_i64* sdom_R,
                                    mp_i64* rest_RE, mp_i64* top_RM, unsigned char* smem) {
    const int R = st.R, r = threadIdx.x;
    McFirstSums f;
    mp_i64** at[7] = {&f.loc, &f.rdom, &f.pad, &f.busy, &f.kbusy, &f.kpad, &f.krows};
    for (int i = 0; i < 7; ++i) *at[i] = (mp_i64*)smem + (mp_i64)i * R;
    mp_i64* red64 = (mp_i64*)smem + 7 * (mp_i64)R;
    double* red = (double*)(red64 + MP_WARP + 1);
    int* moved = (int*)(red + MC_RED_F64);
    const McTotals t = mc_first_totals(st.counts, st.prev, R, st.E, st.B, st.has_prev, k,
                                       total_E, moved, warm_d, red64);
    mc_first_ranks(st.counts, total_E, moved, R, st.E, k, f, load_R, send_R, sdom_R);
    __syncthreads();
    McRank s = {};
    McExitIn x = {};
    if (r < R) s = mc_first_rank(f, r, load_R, send_R, sdom_R);
    x.stat = mc_parts(k, s, r < R, R, red);
    // ends with __syncthreads, as every reduction below
    const mp_i64 kept = mp_block_max(r < R ? f.kbusy[r] : MP_I64_MIN, red64);
    // the least kept reads serve only the slow-link term (several domains): block-uniform
    const mp_i64 kmin = R > k.G ? -mp_block_max(r < R ? -f.kbusy[r] : MP_I64_MIN, red64) : 0;
    x.experts_lb = mc_experts_lb(k, R, t.tiles, t.busy, t.N);
    x.copies = MC_INF;
    // one rank sends nothing: sends[0][0] = 0 rows (the links' pass runs only with several)
    double rows[2] = {mc_link(k, R, 0, 0, false), mc_link(k, R, 0, 0, true)};
    if (R > 1) {  // block-uniform
        const double reads = mc_reads(k, x.experts_lb, kept);
        x.copies = mc_first_links(st, k, reads, f.kbusy, kmin, rest_RE, top_RM, red, rows);
    }
    // the slowest rank's or pair's kept section (every section >= 0: an idle thread offers 0)
    double kept_s = r < R ? mc_roofline(k, f.kpad[r], f.kbusy[r], f.krows[r]) : 0.0;
    kept_s = mc_max(kept_s, mc_pair_kept(k, st, total_E, moved, f));
    mc_block_max(&kept_s, 1, red);
    x.nocopy = mc_nocopy(k, R, x.experts_lb, kept_s, rows, k.exit_build);
    x.nres = t.nres;
    x.has_res = t.nres > 0;
    st.N = t.N;
    return x;
}

struct McExitPlan {  // the exit's plans' seconds charged exit_s, and its pick
    double stat, res, plc;  // static, resident and placed; inf: not scored
    int index;              // the least, ties to the earlier table index (0, 2, C - 1)
    McParts parts;          // the pick's phases
};

// The exit's plans scored (static; with residents placed, and resident where built), each
// charged exit_s (resident's build, where made, is spent whichever plan runs: the caller
// charges its rounds, Choice.rounds), and the least (reference: min by (score, index)).
__device__ McExitPlan mc_exit_plan(const McCost& k, const McExitIn& x, int C) {
    McExitPlan p;
    p.stat = mc_total(k, x.stat, k.exit_s);
    p.res = x.built ? mc_total(k, x.res, k.exit_s) : MC_INF;
    p.plc = x.has_res ? mc_total(k, x.plc, k.exit_s) : MC_INF;
    p.index = 0;
    p.parts = x.stat;
    double t = p.stat;
    if (p.res < t) {  // strict: in table order, an equal score keeps the earlier entry
        p.index = 2;
        p.parts = x.res;
        t = p.res;
    }
    if (p.plc < t) {
        p.index = C - 1;
        p.parts = x.plc;
    }
    return p;
}

// Thread 0: the exit's plan (mc_exit_plan), the exit test (bound.exit_bound, then
// rent.exit_rent) and the outputs: scores (on exit the exit's plans' as charged there, inf
// elsewhere; else static's charged plan_s, also its free score, and placed's and resident's
// as mc_score left them where built here), the exit flag and index, the credit (the exit's,
// or the one the full call settles from), and in misc the bound's two parts' bits (the
// emulated test reads them).
__device__ void mc_first_exit(const McCost& k, const McExitIn& x, int R, mp_i64 C,
                              const McFirstOut& o) {
    const double full = mc_total(k, x.stat, k.plan);
    const McExitPlan p = mc_exit_plan(k, x, (int)C);
    const double t_exit = p.index == 0 ? p.stat : p.index == 2 ? p.res : p.plc;
    double buy = MC_INF;
    const double bound = mc_bound(R, x.copies, x.has_res, full, &buy);
    const double gap = mc_sub(p.parts.experts, x.experts_lb);  // the exit's rent
    const double checking = mc_max(mc_sub(k.plan, k.exit_s), 0.0);
    const bool ex = mc_exit_rent(t_exit, gap, bound, buy, checking, o.credit, o.pending);
    o.scores[0] = ex ? p.stat : full;
    o.free_C[0] = full;  // static EP fetches nothing
    for (mp_i64 c = 1; c < C && ex; ++c) {
        o.scores[c] = c == 2 ? p.res : c == C - 1 ? p.plc : MC_INF;
    }
    o.exited[0] = ex ? 1 : 0;
    if (ex) o.index[0] = p.index;  // else the layout kernel settles it
    o.misc[1] = __double_as_longlong(bound);
    o.misc[2] = __double_as_longlong(buy);
}

// The exit's plans beside static EP, where previous has resident replicas (block-uniform):
// placed built into entry C - 1 and scored, then resident into entry 2 (its rounds into
// x.rounds) only where static and placed, charged exit_s, both exceed nocopy_s (charged
// exit_build): else resident, which copies nothing, cannot beat them by its least build
// (reference.choose_reference). Built here once, not in kernel 2.
__device__ void mc_first_residents(const McStep& st, const McCost& k, const McCands& m,
                                   McExitIn& x, unsigned char* smem) {
    mp_i64* placed = m.alloc_C + (mp_i64)(m.C - 1) * st.E * st.R;
    mc_placed(st, placed, smem);
    x.plc = mc_score(st, k, placed, mc_entry(m, st, m.C - 1), smem);
    const double cheap = mc_min(mc_total(k, x.stat, k.exit_s), mc_total(k, x.plc, k.exit_s));
    x.built = cheap > x.nocopy;
    if (x.built) x.res = mc_resident_pick(st, k, m, true, &x.rounds, smem);
}

// Dynamic shared memory: the largest of mc_first_static's, mc_resident's, mc_score's and
// mc_placed's layouts (choice_cuda.shared_bytes); each phase ends with __syncthreads before
// the next.
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_choice_first(const mp_i64* counts, const mp_i64* prev, mp_i64 R_, mp_i64 E, mp_i64 B,
                          mp_i64 has_prev, mp_i64 C, MC_COST_PARAMS, const double* carry_in,
                          double* scores, double* free_C, unsigned char* exited, mp_i64* index,
                          double* credit, double* pending, mp_i64* rounds, mp_i64* total_E,
                          mp_i64* load_R, mp_i64* send_R, mp_i64* sdom_R, mp_i64* misc,
                          int* warm_d, mp_i64* rest_RE, mp_i64* top_RM, mp_i64* alloc_C,
                          mp_i64* recv_C, mp_i64* res_a, int* res_i) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const McCost k = mc_cost(MC_COST_ARGS);
    const int R = (int)R_;
    McStep st = mc_step(counts, prev, R, E, B, has_prev != 0, total_E, load_R, send_R, sdom_R,
                        warm_d);
    McExitIn x = mc_first_static(st, k, warm_d, total_E, load_R, send_R, sdom_R, rest_RE,
                                 top_RM, mp_smem);
    if (x.has_res) {  // block-uniform
        const McCands m = {alloc_C, recv_C, scores, free_C, res_a, res_i, (int)C};
        mc_first_residents(st, k, m, x, mp_smem);
    }
    if (threadIdx.x == 0) {
        credit[0] = carry_in[0];
        pending[0] = carry_in[1];
        mc_first_exit(k, x, R, C, {scores, free_C, credit, pending, exited, index, misc});
        misc[0] = st.N;
        misc[3] = x.nres;
        misc[4] = x.built ? 1 : 0;
        // 0 where it built no resident (x.built false): in a full call candidate 2's block
        // then writes its own build's (moonplan_choice_build)
        rounds[0] = x.rounds;
    }
}

// ---- kernel 2: one block per candidate -----------------------------------------------------

// level_caps(L, K)[k-1] and water_fill(L, cap) of targets.py; returns rank tid's target.
// The lowest i sorted loads need f = sum_j max(0, l_i - L[j]) records to reach l_i: the
// level's ranks are those at or below cap with f <= S (targets.water_fill_torch).
__device__ mp_i64 mc_level_target(const McStep& st, const mp_i64* L, int k, mp_i64* red64,
                                  int* red32) {
    const int r = threadIdx.x, R = st.R;
    const mp_i64 Lr = r < R ? L[r] : 0;
    const mp_i64 m = (st.N + (R - 1)) / R;
    const mp_i64 gap = mp_block_max(r < R ? Lr : MP_I64_MIN, red64) - m;  // >= 0
    const mp_i64 cap = m + (gap / st.levels) * k + (gap % st.levels) * k / st.levels;
    const mp_i64 S = mp_block_sum(r < R && Lr > cap ? Lr - cap : 0, red64);
    if (S == 0) return Lr;  // block-uniform: nothing above the cap
    mp_i64 f = 0;
    for (int j = 0; j < R && r < R; ++j) f += mc_max_i(0, Lr - L[j]);
    const bool qual = r < R && Lr <= cap && f <= S;
    const mp_i64 n = mp_block_sum(qual ? 1 : 0, red64);  // >= 1: the lowest load qualifies
    const mp_i64 l_at = mp_block_max(qual ? Lr : MP_I64_MIN, red64);
    const mp_i64 f_at = mp_block_max(qual ? f : MP_I64_MIN, red64);
    const mp_i64 level = l_at + (S - f_at) / n, extra = (S - f_at) % n;
    const bool low = r < R && Lr <= cap && Lr <= level;
    int total = 0;
    const int before = mp_block_excl_scan(low ? 1 : 0, red32, &total);
    if (r >= R) return 0;
    if (Lr > cap) return cap;
    return low ? level + (before < extra ? 1 : 0) : Lr;
}

// Phases 0-1 (on moonplan_plan_main's shared state, MpShared): alloc = 0, rem = T, per-rank
// state, the targets (exact, or level `level`'s) and X = L - target.
__device__ void mc_construct_init(const McStep& st, int level, const MpShared& m, mp_i64* alloc) {
    const int R = st.R, tid = threadIdx.x, nthreads = blockDim.x;
    for (mp_i64 i = tid; i < st.E * R; i += nthreads) alloc[i] = 0;
    for (mp_i64 e = tid; e < st.E; e += nthreads) m.rem[e] = st.T[e];
    mp_reset_ranks(m, R);
    for (int r = tid; r < R; r += nthreads) m.avail[r] = st.L[r];
    __syncthreads();
    mp_i64 target = tid < R ? mp_target(st.N, R, tid) : 0;
    if (level > 0) target = mc_level_target(st, m.avail, level, m.red64, m.red32);
    if (tid < R) m.X[tid] = m.avail[tid] - target;
    __syncthreads();
}

// The group-flow construction (moonplan_plan_main's phases 0-4) towards the exact targets
// (level 0) or level `level`'s, with previous's flows and residents (`replay`) or without
// (greedy), into alloc [E, R] and flow [R-1, 3].
__device__ void mc_construct(const McStep& st, int level, bool replay, mp_i64* alloc,
                             mp_i64* flow, mp_i64* rep_c, int* rep_e, unsigned char* smem) {
    const int R = st.R;
    const MpShared m = mp_shared(smem, R, st.E);
    mc_construct_init(st, level, m, alloc);
    const bool warm = replay && st.has_prev;
    const MpPrevious pv = {st.prev, st.warm_d, st.prev_flow, replay ? st.n_prev_flow : 0, warm};
    mp_construct(m, pv, R, st.E, st.B, st.N, flow, alloc, rep_c, rep_e);
}

// Whether candidate c's block has nothing to do: the exit was taken (its plan is built,
// nothing else is), or kernel 1 built and scored c (placed with residents, resident where
// the exit could take it).
__device__ bool mc_build_skips(int c, int C, const unsigned char* exited, const mp_i64* misc) {
    if (exited[0]) return true;
    return (c == 2 && misc[4] != 0) || (c == C - 1 && misc[3] > 0);
}

// Dynamic shared memory: the largest of mc_construct's, mc_resident's, mc_score's and
// mc_placed's layouts (choice_cuda.shared_bytes); each phase ends with __syncthreads before
// the next reuses it.
extern "C" __global__ void __launch_bounds__(1024, 1)
    moonplan_choice_build(const mp_i64* counts, const mp_i64* prev, const mp_i64* prev_flow,
                          mp_i64 R_, mp_i64 E, mp_i64 B, mp_i64 has_prev, mp_i64 n_prev_flow,
                          mp_i64 levels, MC_COST_PARAMS, const unsigned char* exited,
                          double* scores, const mp_i64* total_E, const mp_i64* load_R,
                          const mp_i64* send_R, const mp_i64* sdom_R, const mp_i64* misc,
                          const int* warm_d, mp_i64* alloc_C, mp_i64* flow_C, mp_i64* recv_C,
                          mp_i64* rep_c, int* rep_e, mp_i64* res_a, int* res_i, double* free_C,
                          mp_i64* rounds) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const int R = (int)R_, C = (int)levels + 4, c = blockIdx.x + 1;
    if (mc_build_skips(c, C, exited, misc)) return;
    const McCost k = mc_cost(MC_COST_ARGS);
    McStep st = mc_step(counts, prev, R, E, B, has_prev != 0, total_E, load_R, send_R, sdom_R,
                        warm_d);
    st.prev_flow = prev_flow;
    st.n_prev_flow = (int)n_prev_flow;
    st.levels = (int)levels;
    st.N = misc[0];
    const McCands m = {alloc_C, recv_C, scores, free_C, res_a, res_i, C};
    if (c == 2) {  // residents the exit skipped: the same rounding and rounds rule as kernel 1's
        int n = 0;     // block-uniform: the full call's own build, Choice.rounds
        mc_resident_pick(st, k, m, misc[3] > 0, &n, mp_smem);
        if (threadIdx.x == 0) rounds[0] = n;  // after kernel 1's 0 (stream order)
        return;
    }
    mp_i64* alloc = alloc_C + (mp_i64)c * E * R;
    if (c == C - 1) {  // no resident replica: placed is static EP
        mc_placed(st, alloc, mp_smem);
    } else {
        const int level = (c >= 3 && c <= C - 3) ? (int)levels - 1 - (c - 3) : 0;
        const mp_i64 RM = (mp_i64)R * st.M;
        mc_construct(st, level, c != C - 2, alloc, flow_C + (mp_i64)c * 3 * (R - 1),
                     rep_c + c * RM, rep_e + c * RM, mp_smem);
    }
    mc_score(st, k, alloc, mc_entry(m, st, c), mp_smem);
}

// ---- kernel 3: the winner's plan fields ------------------------------------------------------

// Thread tid's entries of a row-major [E, R] array: the flat index e * R + r runs tid,
// tid + blockDim, ... (consecutive threads on consecutive entries: coalesced), each step's
// (e, r) advanced without a division (de, dr: blockDim's quotient and remainder by R).
struct McWalk {
    mp_i64 e, r, de, dr;
};

__device__ McWalk mc_walk_first(int R) {
    const mp_i64 n = blockDim.x;
    return {threadIdx.x / R, threadIdx.x % R, n / R, n % R};
}

__device__ void mc_walk_next(McWalk& w, int R) {
    w.e += w.de;
    w.r += w.dr;
    if (w.r >= R) {
        w.r -= R;
        ++w.e;
    }
}

// The winner's allocation into the plan's alloc (static EP's from T for c = 0), its home
// records into rem, its replicas (e, records) appended to each rank's list (any order: the
// placement sorts them by a total order); home, target and flow. The [E, R] copy walks the
// flat index (mc_walk: coalesced), not a row per thread (a warp's lanes on 32 rows R apart:
// one cache line a lane, E * R of them at one SM).
__device__ void mc_layout_alloc(int c, int R, mp_i64 E, mp_i64 M, const mp_i64* T,
                                const mp_i64* L, const mp_i64* alloc_C, const mp_i64* flow_C,
                                const mp_i64* recv_C, mp_i64* rem, int* rep_n, int* rep_e,
                                mp_i64* rep_c, mp_i64* alloc, mp_i64* home, mp_i64* target,
                                mp_i64* flow, int C) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const mp_i64* a = alloc_C + (mp_i64)c * E * R;
    const mp_i64 base = E / R, extra = E % R;  // home map: rank r owns [h0(r), h0(r+1))
    for (mp_i64 e = tid; e < E; e += nthreads) home[e] = mp_home_of(e, E, R);
    for (McWalk w = mc_walk_first(R); w.e < E; mc_walk_next(w, R)) {
        const mp_i64 e = w.e, r = w.r, i = e * R + r;
        const mp_i64 h0 = r * base + mc_min_i(r, extra), n = base + (r < extra ? 1 : 0);
        const bool at_home = e >= h0 && e < h0 + n;
        const mp_i64 x = c == 0 ? (at_home ? T[e] : 0) : a[i];
        alloc[i] = x;
        if (at_home) {
            rem[e] = x;
        } else if (x > 0) {
            const int j = atomicAdd(&rep_n[r], 1);
            // at most M: a construction's receiver takes one donor group, a resident
            // holder sits in one of the first M slots; placed may have up to B, all in
            // previous's slots, which keep them whichever M are listed (nothing moves)
            if (j < M) {
                rep_e[r * M + j] = (int)e;
                rep_c[r * M + j] = x;
            }
        }
    }
    for (int r = tid; r < R; r += nthreads) target[r] = c == 0 ? L[r] : recv_C[(mp_i64)c * R + r];
    const bool constructed = c == 1 || (c >= 3 && c <= C - 2);  // exact, levels, greedy
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
                           int* srt_e, const double* free_C, double* credit) {
    extern __shared__ __align__(16) unsigned char mp_smem[];
    const int R = (int)R_, tid = threadIdx.x, nthreads = blockDim.x;
    const int warp = tid / MP_WARP, nwarps = nthreads / MP_WARP;
    const mp_i64 M = (E + R - 1) / R, W = M + (B > M ? B : M);
    mp_i64* rem = (mp_i64*)mp_smem;
    int* rep_n = (int*)(rem + E);
    int* win = rep_n + R;
    if (tid == 0) {  // the rent-or-buy winner (rent.settle); the first kernel's on exit
        const int best = exited[0] ? (int)index[0] : mc_settle(scores, free_C, (int)C, credit);
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

    const MpPlace p = {rep_n, rep_e, rep_c, srt_e, prev, alloc, rem, slot_expert, slot_new,
                       row_expert, row_count, row_offset, R, E, B, M, W, align, has_prev != 0};
    for (int r = warp; r < R; r += nwarps) mp_place_rank(p, r);
}
