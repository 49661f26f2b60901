// CPU emulation of the CUDA subset used by csrc/plan_kernel.cu and csrc/choice_kernel.cu: every
// CUDA thread of a block runs as its own std::thread, or, built with -DEMU_FIBERS, as a fiber
// (ucontext) of one OS thread that yields at every barrier (10x faster on a small machine).
// Lets the tests run the real planner kernels on a machine without a GPU
// (tests/plan/test_cuda_kernel_emulated.py, test_choice_kernel_emulated.py). Not a general
// CUDA emulator; emu_runtime.h holds the definitions and the launcher.
#pragma once
#include <barrier>
#include <thread>
#include <vector>
#include <cstring>
#include <cstdint>
#include <atomic>
struct uint3_ { unsigned x, y, z; };
#ifdef EMU_FIBERS
#define EMU_TLS  // one OS thread: the scheduler sets the running fiber's indices
struct EmuBarrier;
void emu_block_on(const EmuBarrier *b, unsigned gen);  // yield until b leaves generation gen
void emu_progress();  // a barrier arrival or completion (deadlock detection)
struct EmuBarrier {
    int expected, count = 0;
    unsigned gen = 0;
    explicit EmuBarrier(int n) : expected(n) {}
    void arrive_and_wait() {
        const unsigned g = gen;
        emu_progress();
        if (++count == expected) {
            count = 0;
            ++gen;
            return;
        }
        emu_block_on(this, g);
    }
};
#else
#define EMU_TLS thread_local
using EmuBarrier = std::barrier<>;
#endif
extern EMU_TLS uint3_ threadIdx;
extern EMU_TLS uint3_ blockIdx;
extern uint3_ blockDim;
extern uint3_ gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __align__(x)
#define __launch_bounds__(a, b)
extern unsigned char mp_smem[];

struct WarpX { EmuBarrier *bar; long long slots[32]; };
extern WarpX g_warps[32];
extern EmuBarrier *g_block_bar;

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
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline int atomicMin(int* p, int v) {  // returns the old value, as CUDA's
    int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST,
                                                   __ATOMIC_SEQ_CST)) {
    }
    return old;
}
// Doubles (csrc/choice_kernel.cu): bit casts for shuffles, and the rounded product and sum
// (compiled with -ffp-contract=off, so never fused into an FMA, as on the device).
inline long long __double_as_longlong(double x) { long long v; std::memcpy(&v, &x, 8); return v; }
inline double __longlong_as_double(long long v) { double x; std::memcpy(&x, &v, 8); return x; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
