// CPU emulation of the CUDA subset used by csrc/plan_kernel.cu: one std::thread per CUDA thread.
// Lets the tests run the real planner kernel on a machine without a GPU (see
// tests/plan/test_cuda_kernel_emulated.py). Not a general CUDA emulator.
#pragma once
#include <barrier>
#include <thread>
#include <vector>
#include <cstring>
#include <cstdint>
#include <atomic>
struct uint3_ { unsigned x, y, z; };
extern thread_local uint3_ threadIdx;
extern thread_local uint3_ blockIdx;
extern uint3_ blockDim;
extern uint3_ gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __align__(x)
#define __launch_bounds__(a, b)
extern unsigned char mp_smem[];

struct WarpX { std::barrier<> *bar; long long slots[32]; };
extern WarpX g_warps[32];
extern std::barrier<> *g_block_bar;

inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warps[threadIdx.x / 32].bar->arrive_and_wait(); }
template <class T> inline T emu_exchange(T v, int src_fn_lane, bool use_src) {
    WarpX& w = g_warps[threadIdx.x / 32];
    int lane = threadIdx.x % 32;
    w.slots[lane] = (long long)v;
    w.bar->arrive_and_wait();
    T r = use_src ? (T)w.slots[src_fn_lane] : v;
    w.bar->arrive_and_wait();
    return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) {
    return emu_exchange(v, (threadIdx.x % 32) ^ m, true);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) {
    int lane = threadIdx.x % 32;
    return emu_exchange(v, lane - d, lane - d >= 0);
}
template <class T> inline T __shfl_sync(unsigned, T v, int s) { return emu_exchange(v, s, true); }
inline unsigned __ballot_sync(unsigned, bool p) {
    WarpX& w = g_warps[threadIdx.x / 32];
    int lane = threadIdx.x % 32;
    w.slots[lane] = p ? 1 : 0;
    w.bar->arrive_and_wait();
    unsigned m = 0;
    for (int i = 0; i < 32; ++i) if (w.slots[i]) m |= 1u << i;
    w.bar->arrive_and_wait();
    return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
