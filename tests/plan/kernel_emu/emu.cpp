#include "emu_runtime.h"
#include "plan_kernel.cu"  // compiled as host C++ with -I csrc

typedef long long ll;
extern "C" void emu_prep(ll grid, ll block, const ll* counts, ll R, ll E, ll* alloc, ll* home, ll* total_E) {
    launch((int)grid, (int)block, [=] { moonplan_plan_prep(counts, R, E, alloc, home, total_E); });
}
extern "C" int emu_main(ll block, ll smem, const ll* counts, const ll* prev, const ll* prev_flow,
                         ll R, ll E, ll B, ll align, ll has_prev, ll n_prev_flow, ll fused,
                         ll* alloc, ll* home, ll* target, ll* flow, ll* slot_expert,
                         ll* slot_new, ll* row_expert, ll* row_count, ll* row_offset, ll* total_E,
                         ll* rep_c, int* rep_e, int* srt_e, int* warm_d) {
    return (int)launch(1, (int)block, [=] {
        moonplan_plan_main(counts, prev, prev_flow, R, E, B, align, has_prev, n_prev_flow, fused,
                           alloc, home, target, flow, slot_expert, slot_new, row_expert,
                           row_count, row_offset, total_E, rep_c, rep_e, srt_e, warm_d);
    }, smem);
}
