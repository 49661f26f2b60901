// csrc/choice_kernel.cu as host C++ (tests/plan/test_choice_kernel_emulated.py): each wrapper
// launches one kernel with the launcher's argument list and returns the first shared-memory
// byte written past the layout (-1: none).
#include "emu_runtime.h"
#include "choice_kernel.cu"  // compiled as host C++ with -I csrc, -ffp-contract=off

typedef long long ll;
typedef unsigned char u8;
extern "C" ll emu_choice_first(ll block, ll smem, const ll* counts, const ll* prev, ll R, ll E,
                               ll B, ll has_prev, ll C, MC_COST_PARAMS, const double* carry_in,
                               double* scores, double* free_C, u8* exited, ll* index,
                               double* credit, double* pending, ll* rounds, ll* total_E,
                               ll* load_R, ll* send_R, ll* sdom_R, ll* misc, int* warm_d,
                               ll* rest_RE, ll* top_RM, ll* alloc_C, ll* recv_C, ll* res_a,
                               int* res_i) {
    return launch(1, (int)block, [=] {
        moonplan_choice_first(counts, prev, R, E, B, has_prev, C, MC_COST_ARGS, carry_in, scores,
                              free_C, exited, index, credit, pending, rounds, total_E, load_R,
                              send_R, sdom_R, misc, warm_d, rest_RE, top_RM, alloc_C, recv_C,
                              res_a, res_i);
    }, smem);
}
extern "C" ll emu_choice_build(ll grid, ll block, ll smem, const ll* counts, const ll* prev,
                               const ll* prev_flow, ll R, ll E, ll B, ll has_prev, ll n_prev_flow,
                               ll levels, MC_COST_PARAMS, const u8* exited, double* scores,
                               const ll* total_E, const ll* load_R, const ll* send_R,
                               const ll* sdom_R, const ll* misc, const int* warm_d, ll* alloc_C,
                               ll* flow_C, ll* recv_C, ll* rep_c, int* rep_e, ll* res_a,
                               int* res_i, double* free_C, ll* rounds) {
    return launch((int)grid, (int)block, [=] {
        moonplan_choice_build(counts, prev, prev_flow, R, E, B, has_prev, n_prev_flow, levels,
                              MC_COST_ARGS, exited, scores, total_E, load_R, send_R, sdom_R, misc,
                              warm_d, alloc_C, flow_C, recv_C, rep_c, rep_e, res_a, res_i, free_C,
                              rounds);
    }, smem);
}
extern "C" ll emu_choice_layout(ll block, ll smem, const ll* prev, ll R, ll E, ll B, ll align,
                                ll has_prev, ll C, const u8* exited, const double* scores,
                                ll* index, ll* alloc, ll* home, ll* target, ll* flow,
                                ll* slot_expert, ll* slot_new, ll* row_expert, ll* row_count,
                                ll* row_offset, const ll* total_E, const ll* load_R,
                                const ll* alloc_C, const ll* flow_C, const ll* recv_C, ll* rep_c,
                                int* rep_e, int* srt_e, const double* free_C, double* credit) {
    return launch(1, (int)block, [=] {
        moonplan_choice_layout(prev, R, E, B, align, has_prev, C, exited, scores, index, alloc,
                               home, target, flow, slot_expert, slot_new, row_expert, row_count,
                               row_offset, total_E, load_R, alloc_C, flow_C, recv_C, rep_c, rep_e,
                               srt_e, free_C, credit);
    }, smem);
}
