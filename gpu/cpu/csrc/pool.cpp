// weir's CPU thread pool (declared in weir.h).
//
// One loop at a time. `state` holds the loop's generation (high 32 bits) and the next unclaimed
// task (low 32 bits); a thread claims a task by compare-and-swap on the whole word, so a claim
// can only succeed on the loop it read the job for. Before the caller writes the next job it
// marks the finished loop's counter exhausted, so a straggler still holding the old word fails
// its swap instead of running a task of the new job. `done` counts finished tasks; the caller
// returns when it reaches the task count, which includes every task any thread claimed.
//
// The caller waits for the last claimed tasks by spinning, then asleep: a worker the OS took
// off its core in the middle of a task (the HTTP process wanted it) holds that task until it
// runs again, and a caller spinning on the other core keeps the scheduler from moving the
// worker there. Served at 64 streams on 2 cores, a few long waits were most of the caller's
// waiting; asleep, its core goes to the HTTP process or the stalled worker instead of to the
// spin (figures: docs/benchmarks.md).

#include "weir.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace weir {
namespace {

constexpr uint64_t kExhausted = 0xffffffffu;
constexpr auto kSpin = std::chrono::microseconds(50);  // then sleep until the next loop
// The caller's wait for the last claimed tasks, spun before sleeping: most end within a task's
// length; sleeping sooner was slower served (a sleeping caller gave its core away for the time a
// wake-up takes, hundreds of times a second)
constexpr auto kWaitSpin = std::chrono::microseconds(300);

thread_local int tl_index = 0;

struct Pool {
    std::atomic<uint64_t> state{kExhausted};  // generation 0, nothing to claim
    std::atomic<int64_t> done{0};
    // the job of the current generation, written before the generation is published (atomics
    // only because a straggler may read them while the next job is written: its claim fails)
    std::atomic<void (*)(void*, int64_t)> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> tasks{0};
    std::atomic<int64_t> threads{0};
    std::mutex busy;  // held by the caller of a loop
    std::mutex sleep_mu;
    std::condition_variable wake;
    std::atomic<int> sleepers{0};
    std::mutex done_mu;  // the caller asleep until `done` reaches the task count
    std::condition_variable done_cv;
    std::atomic<int> caller_asleep{0};
    int workers = 0;  // started so far, indexes 1..workers
    pid_t pid = getpid();

    static uint32_t gen(uint64_t s) { return uint32_t(s >> 32); }

    // Claim and run tasks of generation g until none is left.
    void run(uint32_t g) {
        for (;;) {
            uint64_t s = state.load(std::memory_order_acquire);
            if (gen(s) != g) return;
            const uint64_t next = s & 0xffffffffu;
            const auto f = fn.load(std::memory_order_relaxed);
            void* const c = ctx.load(std::memory_order_relaxed);
            const int64_t n = tasks.load(std::memory_order_relaxed);
            if (next >= uint64_t(n) || (tl_index && tl_index >= threads.load())) return;
            if (!state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
            f(c, int64_t(next));
            // seq_cst with the caller's caller_asleep store and done load (wait_done): either it
            // sees this task done, or this thread sees it asleep and wakes it
            if (done.fetch_add(1, std::memory_order_seq_cst) + 1 == n &&
                caller_asleep.load(std::memory_order_seq_cst)) {
                std::lock_guard<std::mutex> lock(done_mu);
                done_cv.notify_one();
            }
        }
    }

    // The caller: until every task of the loop (n of them) has run.
    void wait_done(int64_t n) {
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; done.load(std::memory_order_acquire) < n; ++i) {
            relax_cpu();
            if ((i & 63) == 63 && std::chrono::steady_clock::now() - start > kWaitSpin) {
                std::unique_lock<std::mutex> lock(done_mu);
                caller_asleep.store(1, std::memory_order_seq_cst);
                done_cv.wait(lock, [&] { return done.load(std::memory_order_seq_cst) >= n; });
                caller_asleep.store(0, std::memory_order_relaxed);
                return;
            }
        }
    }

    void worker(int index) {
        tl_index = index;
        uint32_t seen = gen(state.load(std::memory_order_acquire));
        for (;;) {
            const auto start = std::chrono::steady_clock::now();
            uint32_t g = seen;
            for (int i = 0;; ++i) {
                g = gen(state.load(std::memory_order_acquire));
                if (g != seen) break;
                relax_cpu();
                if ((i & 63) == 63 && std::chrono::steady_clock::now() - start > kSpin) {
                    std::unique_lock<std::mutex> lock(sleep_mu);
                    sleepers.fetch_add(1);
                    wake.wait(lock, [&] { return gen(state.load()) != seen; });
                    sleepers.fetch_sub(1);
                    g = gen(state.load(std::memory_order_acquire));
                    break;
                }
            }
            seen = g;
            run(g);
        }
    }

    void grow(int64_t threads_wanted) {
        for (; workers + 1 < threads_wanted; ++workers) {
            const int index = workers + 1;
            std::thread([this, index] { worker(index); }).detach();
        }
    }

    void loop(int64_t n, int64_t nthreads, void (*f)(void*, int64_t), void* c) {
        grow(nthreads);
        const uint32_t g = gen(state.load()) + 1;
        state.store((uint64_t(g - 1) << 32) | kExhausted, std::memory_order_seq_cst);
        fn.store(f, std::memory_order_relaxed);
        ctx.store(c, std::memory_order_relaxed);
        tasks.store(n, std::memory_order_relaxed);
        threads.store(nthreads, std::memory_order_relaxed);
        done.store(0, std::memory_order_relaxed);
        // seq_cst with the sleepers check below: either a worker going to sleep sees this
        // generation, or this thread sees it counted and wakes it
        state.store(uint64_t(g) << 32, std::memory_order_seq_cst);
        if (sleepers.load() > 0) {
            std::lock_guard<std::mutex> lock(sleep_mu);
            wake.notify_all();
        }
        run(g);
        wait_done(n);
    }
};

Pool* pool() {
    static Pool* p = new Pool();  // never destroyed: its workers outlive static destructors
    if (p->pid != getpid()) p = new Pool();  // a forked child has none of the parent's threads
    return p;
}

}  // namespace

void parallel_for(int64_t tasks, int64_t threads, void (*fn)(void*, int64_t), void* ctx) {
    if (tasks <= 0) return;
    Pool* p = pool();
    std::unique_lock<std::mutex> busy(p->busy, std::try_to_lock);
    if (threads <= 1 || tasks == 1 || !busy.owns_lock() || tl_index != 0) {
        for (int64_t t = 0; t < tasks; ++t) fn(ctx, t);  // alone: no one to hand tasks to
        return;
    }
    p->loop(tasks, threads, fn, ctx);
}

int thread_index() { return tl_index; }

}  // namespace weir

namespace weir {

void pool_selftest(int64_t tasks, int64_t threads, bool hold, int64_t worker_us, int32_t* runs,
                   int32_t* by) {
    std::atomic<int> worker_started{0};
    std::atomic<int> caller_waited{0};
    parallel_for(tasks, threads, [&](int64_t t) {
        const int index = thread_index();
        if (index == 0) {
            if (hold && !caller_waited.exchange(1)) {
                while (!worker_started.load(std::memory_order_acquire)) relax_cpu();
            }
        } else {
            worker_started.store(1, std::memory_order_release);
            if (hold) std::this_thread::sleep_for(std::chrono::microseconds(worker_us));
        }
        __atomic_fetch_add(&runs[t], 1, __ATOMIC_RELAXED);
        by[t] = 1 + index;
    });
}

}  // namespace weir
