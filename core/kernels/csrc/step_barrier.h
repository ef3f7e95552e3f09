// Where the decode step's threads meet (decode_step.cpp): seven times a layer, 210 times a step of
// SmolLM2-135M. libgomp's `omp barrier` keeps the bookkeeping of OpenMP's tasks at every meeting;
// a step has no tasks, and this barrier keeps only a count and a phase, each on its own cache line
// (a sense-counting barrier, as in Mellor-Crummey and Scott, 1991, with the phase as its sense).
//
// Each arriving thread adds one to the count; the last resets it and advances the phase, and the
// others watch the phase. The count's read-modify-writes and the phase's release and acquire carry
// every thread's writes before the barrier to every thread after it.
//
// A waiting thread spins (with PAUSE) for SPIN_NS, then yields its CPU between looks: a partner
// preempted by another process (core/cpu_share.py drops to one thread only at its next look) must
// not find its CPU spun away for a whole time slice.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace sendlens {

class StepBarrier {
 public:
  static constexpr int64_t SPIN_NS = 50'000;  // a meeting within a step waits a few microseconds

  // Every thread of the team, before its first wait: the team's size (OpenMP may give a region
  // fewer threads than it asked for; each thread writes the same number).
  void join(int threads) { threads_.store(threads, std::memory_order_relaxed); }

  void wait() {
    const uint32_t phase = phase_.load(std::memory_order_relaxed);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_.load(std::memory_order_relaxed) - 1) {  // the last to arrive
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    bool spin = true;
    for (uint32_t looks = 1; phase_.load(std::memory_order_acquire) == phase; ++looks) {
      if (!spin) {
        std::this_thread::yield();
        continue;
      }
#if defined(__x86_64__) || defined(_M_X64)
      _mm_pause();
#endif
      if (looks % 256 == 0)
        spin = std::chrono::steady_clock::now() - start < std::chrono::nanoseconds(SPIN_NS);
    }
  }

 private:
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<uint32_t> phase_{0};
  std::atomic<int> threads_{1};
};

}  // namespace sendlens
