// Turns on the engine, batched: forwards that wait at the same time are computed together, as
// llama-server batches its slots. Requests are taken in arrival order; when the oldest waiting one
// is a single-token decode step, every other decode step waiting behind it (of other sessions)
// joins its llama_decode, up to max_batch of them (1: plain FIFO turns). Prefill chunks compute
// alone, in the batch shape their session would have had on its own.
//
// Cohorts (forward mode): the decode steps a stage computed together reach the next stage one by
// one, each on its own session's stream. A step that arrives as a member of a cohort of n waits,
// before its turn, for the other n - 1 (at most the gather window after it arrived), so a convoy
// of sessions stays one llama_decode at every stage instead of splitting into the first arrival
// and the rest. Each computed decode step leaves with its own cohort: the id of the llama_decode
// it shared and how many of that decode's steps go to the same next stage. The head forms the
// convoy: its decode step also waits for `peers`, sessions whose tokens follow close behind.
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
#include <functional>
#include <mutex>
#include <utility>

namespace dgr::worker {

// a llama_decode's decode steps bound for one next stage (size < 2: none)
struct Cohort {
    uint64_t id = 0;
    uint32_t size = 0;
};

class Batcher {
public:
    // each llama_decode holds one of the host's compute slots (slots.h); a step arriving in a
    // cohort waits at most `gather` for the rest of it (0: never waits); `on_turn` hears each
    // llama_decode's width
    Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots, std::chrono::microseconds gather,
            std::function<void(size_t)> on_turn = {});
    Batcher(const Batcher &) = delete;
    Batcher & operator=(const Batcher &) = delete;

    struct Timing {
        double queue_seconds;    // waiting for its turn
        double compute_seconds;  // its turn (the llama_decode it shared)
        bool alone;              // it held a compute slot (else: computed at normal priority)
        Cohort cohort;           // the steps computed with it that go where it goes (next_key)
        bool gathered_all;       // false: it led the turn's cohort, whose window ran out before
                                 // every member arrived
    };
    // computes `item`, with whatever waits beside it; on return item.result or item.error is set.
    // `cohort`: the one it arrived in; `next_key`: where its output goes (equal keys, same stage)
    // `peers`: decode steps of other sessions expected within the gather window (the head
    // knows which sessions' tokens follow close behind this one's), waited for like a cohort
    Timing run(dgr::BatchItem & item, Cohort cohort = {}, uint64_t next_key = 0, uint32_t peers = 0);

    // a member of `cohort` that will not come (its session generated its last token): the others
    // stop waiting for it
    void forgo(Cohort cohort);

    // largest number of forwards computed in one llama_decode so far
    size_t widest() const;

private:
    struct Waiting {
        dgr::BatchItem * item = nullptr;
        Cohort cohort;       // arrived in
        uint64_t next_key = 0;
        uint32_t peers = 0;
        std::chrono::steady_clock::time_point arrived{};
        bool done = false;
        bool alone = true;
        bool gathered_all = true;
        Cohort out;
        std::chrono::steady_clock::time_point started{};  // when its turn began
    };
    // with the lock held and the engine free: compute the oldest group (unlocked meanwhile)
    void take_turn(std::unique_lock<std::mutex> & lock);
    // with the lock held: wait (at most the window) for the rest of the oldest step's cohort
    bool gather(std::unique_lock<std::mutex> & lock);
    // with the lock held: count one more member of `id` as served (computed, or not coming)
    void serve(uint64_t id);
    uint32_t served(uint64_t id) const;

    dgr::ShardEngine & engine_;
    const int32_t max_batch_;
    ComputeSlots & slots_;
    mutable std::mutex mutex_;
    const std::chrono::microseconds gather_;
    const std::function<void(size_t)> on_turn_;
    const uint64_t id_base_;  // random: cohort ids of different stages do not meet
    uint64_t turns_ = 0;
    std::condition_variable done_cv_;
    std::condition_variable arrival_cv_;  // a step arrived while a turn gathers its cohort
    std::deque<Waiting *> queue_;
    std::deque<std::pair<uint64_t, uint32_t>> served_;  // recent cohorts: members computed so far
    bool busy_ = false;       // a turn is gathering or computing
    bool gathering_ = false;
    size_t widest_ = 0;
};

}  // namespace dgr::worker
