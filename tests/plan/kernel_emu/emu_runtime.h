// The definitions behind emu.h and the launcher of an emulated kernel: the blocks of a grid run
// one after the other; each CUDA thread is a std::thread, or a fiber with -DEMU_FIBERS. Include
// it once per library.
#pragma once
#include "emu.h"
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#ifdef EMU_FIBERS
#include <csetjmp>
#include <ucontext.h>
#endif
EMU_TLS uint3_ threadIdx;
EMU_TLS uint3_ blockIdx;
uint3_ blockDim;
uint3_ gridDim;
alignas(16) unsigned char mp_smem[1 << 20];
WarpX g_warps[32];
EmuBarrier *g_block_bar;

#ifdef EMU_FIBERS
// A fiber starts through its ucontext; after that every switch is a _setjmp/_longjmp pair
// (no signal-mask system call: 10x cheaper than swapcontext).
struct EmuFiber {
    ucontext_t ctx;
    jmp_buf jb;
    std::unique_ptr<char[]> stack;  // not zeroed: a fiber touches only what it uses
    bool started = false, done = false;
    const EmuBarrier *on = nullptr;  // the barrier it waits at (the scheduler skips it meanwhile)
    unsigned gen = 0;
};
static constexpr size_t EMU_STACK = 1 << 16;  // bytes per fiber
static jmp_buf g_sched_jb;
static EmuFiber *g_fib;
static int g_cur;
static long long g_events;
static std::function<void()> *g_body;
void emu_progress() { ++g_events; }
void emu_block_on(const EmuBarrier *b, unsigned gen) {
    EmuFiber &me = g_fib[g_cur];
    me.on = b;
    me.gen = gen;
    if (!_setjmp(me.jb)) _longjmp(g_sched_jb, 1);  // resumed once b->gen != gen
    me.on = nullptr;
}
static void emu_fiber_main() {
    (*g_body)();
    g_fib[g_cur].done = true;
    ++g_events;
    _longjmp(g_sched_jb, 1);  // never returns: its stack is dropped with the fiber
}
static void emu_resume(EmuFiber &fb) {
    if (_setjmp(g_sched_jb)) return;  // the fiber yielded or finished
    if (fb.started) _longjmp(fb.jb, 1);
    fb.started = true;
    setcontext(&fb.ctx);
}

// One block: round-robin over its runnable fibers until all return; a round without a
// barrier arrival or a return is a deadlock (a barrier some threads never reach).
static void run_block(int block, unsigned b, std::function<void()> &body) {
    std::vector<EmuFiber> fibs(block);
    g_body = &body;
    g_fib = fibs.data();
    for (auto &fb : fibs) {
        fb.stack.reset(new char[EMU_STACK]);
        getcontext(&fb.ctx);
        fb.ctx.uc_stack.ss_sp = fb.stack.get();
        fb.ctx.uc_stack.ss_size = EMU_STACK;
        fb.ctx.uc_link = nullptr;
        makecontext(&fb.ctx, emu_fiber_main, 0);
    }
    for (int alive = block; alive > 0;) {
        const long long before = g_events;
        for (int i = 0; i < block; ++i) {
            if (fibs[i].done || (fibs[i].on && fibs[i].on->gen == fibs[i].gen)) continue;
            g_cur = i;
            threadIdx = {(unsigned)i, 0, 0};
            blockIdx = {b, 0, 0};
            emu_resume(fibs[i]);
            alive -= fibs[i].done ? 1 : 0;
        }
        if (alive > 0 && g_events == before) {
            std::fprintf(stderr, "emulated block %u deadlocked at a barrier\n", b);
            std::abort();
        }
    }
}
#else
static void run_block(int block, unsigned b, std::function<void()> &body) {
    std::vector<std::thread> ts;
    for (int t = 0; t < block; ++t)
        ts.emplace_back([=, &body] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {b, 0, 0}; body(); });
    for (auto &t : ts) t.join();
}
#endif

// Runs f as `grid` blocks of `block` threads. Shared memory starts as 0xCD bytes in every
// block (garbage, like real shared memory); returns the first byte at or past `smem` that a
// block wrote (a write past the kernel's layout), -1 if none.
template <class F> static long long launch(int grid, int block, F f, long long smem = 0) {
    blockDim = {(unsigned)block, 1, 1};
    gridDim = {(unsigned)grid, 1, 1};
    std::function<void()> body = f;
    long long bad = -1;
    for (int b = 0; b < grid; ++b) {
        EmuBarrier bb(block);
        g_block_bar = &bb;
        for (int w = 0; w < block / 32; ++w) g_warps[w].bar = new EmuBarrier(32);
        std::memset(mp_smem, 0xCD, sizeof(mp_smem));
        run_block(block, (unsigned)b, body);
        for (int w = 0; w < block / 32; ++w) delete g_warps[w].bar;
        for (size_t i = smem; i < sizeof(mp_smem) && bad < 0; ++i)
            if (mp_smem[i] != 0xCD) bad = (long long)i;
    }
    return bad;
}
