// Runs one kernel launch on the host: each block's threads are fibers switched only at
// barriers, blocks one after another on the calling OS thread.
#include <sys/mman.h>
#if !(defined(__x86_64__) && defined(__linux__))
#include <ucontext.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cudasim.cuh"
#include "registry.h"

namespace cudasim {
namespace {

enum State { READY, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

const size_t STACK_BYTES = 128 * 1024;

#if defined(__x86_64__) && defined(__linux__)
// A fiber switch saves only what the ABI asks a callee to keep (rbx, rbp, r12-r15, the
// SSE and x87 control words) and swaps stacks. ucontext's swapcontext also saves the signal
// mask with a system call on every switch, which made those calls most of a launch's time.
struct Context {
    void* sp;
};
extern "C" void cudasim_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl cudasim_switch
    .hidden cudasim_switch
    .type cudasim_switch, @function
cudasim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudasim_switch, .-cudasim_switch
)");

void switch_to(Context* from, Context* to) { cudasim_switch(&from->sp, to->sp); }

// Lays out a new stack as cudasim_switch leaves one: the control words, six zeroed
// registers, then `entry` as the return address, entered with the alignment of a call.
void make_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;  // the fake return address of `entry`, which never returns
    *--sp = reinterpret_cast<uint64_t>(entry);
    for (int i = 0; i < 6; i++) *--sp = 0;
    uint32_t words[2];
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(words[0]), "=m"(words[1]));
    words[1] &= 0xffff;
    --sp;
    std::memcpy(sp, words, 8);
    c->sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
void switch_to(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
void make_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

struct Fiber {
    Context ctx;
    ThreadCtx t;
    State state;
    uint64_t warp_value;
};

struct WarpSnapshot {
    uint64_t values[32];
    unsigned live;
};

struct Block {
    std::vector<Fiber> fibers;
    // Each warp's lane values at its last release: lanes read these after resuming, when
    // faster lanes may already have published their next values.
    std::vector<WarpSnapshot> warps;
    Context sched;
    const KernelInfo* kernel;
    void** args;
    bool faulted;
    std::string fault;
};

thread_local Block* g_block = nullptr;
thread_local Fiber* g_cur = nullptr;
thread_local std::vector<char*> g_stacks;

char* stack_for(size_t i) {
    while (g_stacks.size() <= i) {
        void* p = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        g_stacks.push_back(static_cast<char*>(p));
    }
    return g_stacks[i];
}

void yield_to_scheduler() { switch_to(&g_cur->ctx, &g_block->sched); }

// A fiber's first frame: it never returns; a finished fiber is never resumed.
void fiber_main() {
    Block* b = g_block;
    b->kernel->invoke(b->kernel->fn, b->args);
    g_cur->state = DONE;
    yield_to_scheduler();
    std::abort();
}

}  // namespace

ThreadCtx* current() { return &g_cur->t; }

void sync_block() {
    g_cur->state = AT_BLOCK_BARRIER;
    yield_to_scheduler();
}

void warp_exchange(uint64_t value, uint64_t out[32], unsigned* live_mask) {
    g_cur->warp_value = value;
    g_cur->state = AT_WARP_BARRIER;
    yield_to_scheduler();
    const WarpSnapshot& w = g_block->warps[g_cur->t.warp];
    for (unsigned l = 0; l < 32; l++) out[l] = w.values[l];
    *live_mask = w.live;
}

[[noreturn]] void fault(const char* what) {
    g_block->faulted = true;
    if (g_block->fault.empty()) g_block->fault = what;
    g_cur->state = DONE;
    yield_to_scheduler();
    std::abort();
}

}  // namespace cudasim

using namespace cudasim;

// Runs every block of a launch. Returns 0, or 1 with a message in `err`.
extern "C" int cudasim_run(const KernelInfo* k, const unsigned grid[3], const unsigned block[3],
                           void* dynamic_shared, void** args, char* err, size_t errlen) {
    size_t nthreads = (size_t)block[0] * block[1] * block[2];
    Block b;
    b.kernel = k;
    b.args = args;
    b.faulted = false;
    b.fibers.resize(nthreads);
    b.warps.resize((nthreads + 31) / 32);
    Block* saved_block = g_block;
    Fiber* saved_cur = g_cur;
    g_block = &b;
    int rc = 0;
    for (unsigned bz = 0; bz < grid[2] && !rc; bz++)
        for (unsigned by = 0; by < grid[1] && !rc; by++)
            for (unsigned bx = 0; bx < grid[0] && !rc; bx++) {
                for (size_t i = 0; i < nthreads; i++) {
                    Fiber& f = b.fibers[i];
                    f.state = READY;
                    f.warp_value = 0;
                    f.t.thread_idx = {(unsigned)(i % block[0]), (unsigned)(i / block[0] % block[1]),
                                      (unsigned)(i / ((size_t)block[0] * block[1]))};
                    f.t.block_idx = {bx, by, bz};
                    f.t.block_dim = {block[0], block[1], block[2]};
                    f.t.grid_dim = {grid[0], grid[1], grid[2]};
                    f.t.lane = (unsigned)(i % 32);
                    f.t.warp = (unsigned)(i / 32);
                    f.t.dynamic_shared = dynamic_shared;
                    char* stack = stack_for(i);
                    if (!stack) {
                        snprintf(err, errlen, "out of host memory for thread stacks");
                        rc = 1;
                        break;
                    }
                    make_context(&f.ctx, stack, STACK_BYTES, fiber_main);
                }
                if (rc) break;
                for (;;) {
                    for (size_t i = 0; i < nthreads && !b.faulted; i++) {
                        Fiber& f = b.fibers[i];
                        if (f.state != READY) continue;
                        g_cur = &f;
                        switch_to(&b.sched, &f.ctx);
                    }
                    if (b.faulted) break;
                    // Everyone is done or waiting. Release warps whose live lanes all wait at
                    // an exchange; else the block barrier when every live thread waits there.
                    bool any_live = false, released = false;
                    size_t nwarps = (nthreads + 31) / 32;
                    for (size_t w = 0; w < nwarps; w++) {
                        bool live = false, all_warp = true;
                        for (size_t i = w * 32; i < nthreads && i < w * 32 + 32; i++) {
                            State s = b.fibers[i].state;
                            if (s == DONE) continue;
                            live = true;
                            if (s != AT_WARP_BARRIER) all_warp = false;
                        }
                        any_live |= live;
                        if (live && all_warp) {
                            // Exited lanes and lanes past the block's size are not live.
                            WarpSnapshot& snap = b.warps[w];
                            snap.live = 0;
                            for (unsigned l = 0; l < 32; l++) {
                                size_t i = w * 32 + l;
                                snap.values[l] = 0;
                                if (i < nthreads && b.fibers[i].state == AT_WARP_BARRIER) {
                                    snap.values[l] = b.fibers[i].warp_value;
                                    snap.live |= 1u << l;
                                    b.fibers[i].state = READY;
                                }
                            }
                            released = true;
                        }
                    }
                    if (!any_live) break;
                    if (released) continue;
                    bool all_block = true;
                    for (auto& f : b.fibers)
                        if (f.state != DONE && f.state != AT_BLOCK_BARRIER) all_block = false;
                    if (!all_block) {
                        b.faulted = true;
                        b.fault =
                            "threads of one block wait at different barriers (a __syncthreads "
                            "or warp operation not reached by every live thread)";
                        break;
                    }
                    for (auto& f : b.fibers)
                        if (f.state == AT_BLOCK_BARRIER) f.state = READY;
                }
                if (b.faulted) {
                    snprintf(err, errlen, "block (%u, %u, %u): %s", bx, by, bz, b.fault.c_str());
                    rc = 1;
                }
            }
    g_block = saved_block;
    g_cur = saved_cur;
    return rc;
}
