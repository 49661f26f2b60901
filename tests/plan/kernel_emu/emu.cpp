#include "emu.h"
thread_local uint3_ threadIdx;
thread_local uint3_ blockIdx;
uint3_ blockDim;
uint3_ gridDim;
alignas(16) unsigned char mp_smem[1 << 20];
WarpX g_warps[32];
std::barrier<> *g_block_bar;
#include "plan_kernel.cu"  // compiled as host C++ with -I csrc

template <class F> static void launch(int grid, int block, F f, long long smem = 0) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid, 1, 1};
    for (int b = 0; b < grid; ++b) {
        std::barrier<> bb(block);
        g_block_bar = &bb;
        std::vector<std::barrier<>*> wb;
        for (int w = 0; w < block / 32; ++w) { g_warps[w].bar = new std::barrier<>(32); }
        std::memset(mp_smem, 0xCD, sizeof(mp_smem));  // garbage, like real shared memory
        std::vector<std::thread> ts;
        for (int t = 0; t < block; ++t)
            ts.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)b, 0, 0}; f(); });
        for (auto& t : ts) t.join();
        for (int w = 0; w < block / 32; ++w) delete g_warps[w].bar;
    }
}


typedef long long ll;
extern "C" void emu_prep(ll grid, ll block, const ll* counts, ll R, ll E, ll* alloc, ll* home, ll* total_E) {
    launch((int)grid, (int)block, [=] { moonplan_plan_prep(counts, R, E, alloc, home, total_E); });
}
extern "C" int emu_main(ll block, ll smem, const ll* counts, const ll* prev, const ll* prev_flow,
                         ll R, ll E, ll B, ll align, ll has_prev, ll n_prev_flow, ll fused,
                         ll* alloc, ll* home, ll* target, ll* flow, ll* slot_expert,
                         ll* slot_new, ll* row_expert, ll* row_count, ll* row_offset, ll* total_E,
                         ll* rep_c, int* rep_e, int* srt_e, int* warm_d) {
    launch(1, (int)block, [=] {
        moonplan_plan_main(counts, prev, prev_flow, R, E, B, align, has_prev, n_prev_flow, fused,
                           alloc, home, target, flow, slot_expert, slot_new, row_expert,
                           row_count, row_offset, total_E, rep_c, rep_e, srt_e, warm_d);
    }, smem);
    for (size_t i = smem; i < sizeof(mp_smem); ++i) if (mp_smem[i] != 0xCD) return (int)i;
    return -1;
}
