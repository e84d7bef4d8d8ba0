// Turns on the engine, batched: forwards that wait at the same time are computed together, as
// llama-server batches its slots. Requests are taken in arrival order; when the oldest waiting one
// is a single-token decode step, every other decode step waiting behind it (of other sessions)
// joins its llama_decode, up to max_batch of them (1: plain FIFO turns). Prefill chunks compute
// alone, in the batch shape their session would have had on its own.
//
// One compute thread drives the engine, so ggml's threadpool always has the same caller whatever
// gRPC thread a request arrived on.
#pragma once

#include "dgr/shard_engine.h"
#include "slots.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace dgr::worker {

class Batcher {
public:
    // each llama_decode holds one of the host's compute slots (slots.h)
    Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots);
    ~Batcher();
    Batcher(const Batcher &) = delete;
    Batcher & operator=(const Batcher &) = delete;

    // computes `item`, with whatever waits beside it; on return item.result or item.error is set
    void run(dgr::BatchItem & item);

    // largest number of forwards computed in one llama_decode so far
    size_t widest() const;

private:
    struct Waiting {
        dgr::BatchItem * item;
        bool done = false;
    };
    void compute_loop();

    dgr::ShardEngine & engine_;
    const int32_t max_batch_;
    ComputeSlots & slots_;
    mutable std::mutex mutex_;
    std::condition_variable work_cv_, done_cv_;
    std::deque<Waiting *> queue_;
    bool stop_ = false;
    size_t widest_ = 0;
    std::thread thread_;  // last: started once everything above exists
};

}  // namespace dgr::worker
