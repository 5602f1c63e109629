// Host threads that enqueue work side by side: run_on_lanes(n, job) calls job(0) on the calling
// thread and job(1) .. job(n - 1) on threads kept for the process, and returns when all have
// returned. A grouped GEMM uses it to issue its groups' cuBLASLt calls on its stream lanes at
// once: enqueueing one small GEMM costs the host about as long as the GPU takes to run it, so a
// single thread issuing the groups one by one leaves the GPU waiting.
#pragma once

#include <functional>

namespace octet {

/// The most lanes run_on_lanes takes.
inline constexpr int kMaxLanes = 8;

/// Runs job(lane) for every lane in [0, lanes), all at once, and returns when every call has
/// returned. If any threw, rethrows the exception of the lowest such lane (after all finished,
/// so nothing the jobs use is released while one still runs). Where the threads are busy (a call
/// from a job, or from another thread at the same time), the lanes run one after another on the
/// calling thread instead, so the jobs must not wait for each other. A process forked from one
/// that made the threads makes its own.
void run_on_lanes(int lanes, const std::function<void(int lane)>& job);

/// How many run_on_lanes calls (with more than one lane) ran their lanes on the calling thread
/// alone since the process started.
long long lanes_run_inline();

}  // namespace octet
