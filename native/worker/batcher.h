// Turns on the engine, batched: forwards that wait at the same time are computed together, as
// llama-server batches its slots. Requests are taken in arrival order; when the oldest waiting one
// is a single-token decode step, every other decode step waiting behind it (of other sessions)
// joins its llama_decode, up to max_batch of them (1: plain FIFO turns). Prefill chunks compute alone, in the batch shape their
// session would have had on its own. No extra thread: a waiting caller computes for the group
// (leader/follower), so the engine is only ever driven by one thread at a time.
#pragma once

#include "dgr/shard_engine.h"
#include "slots.h"

#include <condition_variable>
#include <deque>
#include <mutex>

namespace dgr::worker {

class Batcher {
public:
    // each llama_decode holds one of the host's compute slots (slots.h)
    Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots)
        : engine_(engine), max_batch_(max_batch), slots_(slots) {}

    // computes `item`, with whatever waits beside it; on return item.result or item.error is set
    void run(dgr::BatchItem & item);

    // largest number of forwards computed in one llama_decode so far
    size_t widest() const;

private:
    struct Waiting {
        dgr::BatchItem * item;
        bool done = false;
    };

    dgr::ShardEngine & engine_;
    const int32_t max_batch_;
    ComputeSlots & slots_;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<Waiting *> queue_;
    bool busy_ = false;
    size_t widest_ = 0;
};

}  // namespace dgr::worker
