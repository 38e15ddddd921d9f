// weir's CPU thread pool: parallel loops that do not wait for threads that never showed up.
//
// An OpenMP parallel loop ends at a barrier every thread of the team must reach, so when the
// OS deschedules one of them (another process needs the core: on a 2-core box the HTTP server
// and the client, issue 18) the others wait out its time slice, at every op of a step. Here the
// loop's tasks are claimed one at a time from a shared counter by whichever threads are
// running, the caller included, and the call returns as soon as every task has been run: a
// thread that wakes late finds nothing left and costs nothing. Idle workers spin for a few tens
// of microseconds (the gap between two ops of a step), then sleep.

#pragma once

#include <cstdint>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace weir {

// Runs fn(ctx, task) for every task in [0, tasks), on at most `threads` threads (the caller is
// one of them), and returns when all have run. One loop at a time: a call made while another
// thread's loop is running runs its tasks on the caller alone.
void parallel_for(int64_t tasks, int64_t threads, void (*fn)(void*, int64_t), void* ctx);

template <typename F>
void parallel_for(int64_t tasks, int64_t threads, F&& f) {
    using Fn = std::remove_reference_t<F>;
    parallel_for(tasks, threads, [](void* c, int64_t t) { (*static_cast<Fn*>(c))(t); },
                 static_cast<void*>(&f));
}

// A spin-wait's pause.
inline void relax_cpu() {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

// The calling thread's index in the pool: 0 for the caller of a loop, 1.. for workers (for
// per-thread scratch space).
int thread_index();

// How many distinct thread indexes a loop on `threads` threads may use.
inline int64_t max_thread_index(int64_t threads) { return threads < 1 ? 1 : threads; }

}  // namespace weir
