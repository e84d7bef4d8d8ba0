// Turns on the engine, batched: forwards that wait at the same time are computed together, as
// llama-server batches its slots. Requests are taken in arrival order; when the oldest waiting one
// is a single-token decode step, every other decode step waiting behind it (of other sessions)
// joins its llama_decode, up to max_batch of them (1: plain FIFO turns). Prefill chunks compute
// alone, in the batch shape their session would have had on its own.
//
// No thread of its own: a caller that finds the engine idle computes on its own thread (leader),
// taking the oldest group; the others wait, and when a turn ends one of those still waiting takes
// the next. A forward on an idle stage thus costs no handoff to another thread: every thread
// woken on a route's per-token path is a wake-up latency on the critical path. (The lanes build
// ggml without OpenMP, whose teams are per calling thread: ggml's own threadpool serves any caller.)
#pragma once

#include "dgr/shard_engine.h"
#include "slots.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>

namespace dgr::worker {

class Batcher {
public:
    // each llama_decode holds one of the host's compute slots (slots.h)
    Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots);
    Batcher(const Batcher &) = delete;
    Batcher & operator=(const Batcher &) = delete;

    struct Timing {
        double queue_seconds;    // waiting for its turn
        double compute_seconds;  // its turn (the llama_decode it shared)
        bool alone;              // it held a compute slot (else: computed at normal priority)
    };
    // computes `item`, with whatever waits beside it; on return item.result or item.error is set
    Timing run(dgr::BatchItem & item);

    // largest number of forwards computed in one llama_decode so far
    size_t widest() const;

private:
    struct Waiting {
        dgr::BatchItem * item;
        bool done = false;
        bool alone = true;
        std::chrono::steady_clock::time_point started{};  // when its turn began
    };
    // with the lock held and the engine free: compute the oldest group (unlocked meanwhile)
    void take_turn(std::unique_lock<std::mutex> & lock);

    dgr::ShardEngine & engine_;
    const int32_t max_batch_;
    ComputeSlots & slots_;
    mutable std::mutex mutex_;
    std::condition_variable done_cv_;
    std::deque<Waiting *> queue_;
    bool busy_ = false;  // a turn is computing
    size_t widest_ = 0;
};

}  // namespace dgr::worker
