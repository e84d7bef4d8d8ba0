// Compute slots shared by the workers of one host. ggml's barriers spin: when several workers on
// one machine compute at once with more threads in total than it has cores, a preempted thread
// stalls its whole graph for a scheduler slice (measured on 2 cores: 3 workers x 2 threads
// serving 4 sessions at once fell from ~100 to 3-7 tokens/s). Workers therefore take one of
// cores / threads slots for each llama_decode: flock'd files in a directory they share, which
// the kernel releases if a worker dies holding one. A worker alone on its host always finds a
// slot free (two syscalls per forward).
// Slot i is also cores i*threads .. (i+1)*threads - 1 of those the worker may run on: with
// pinning on, a forward's compute threads go one on each (ShardEngine::use_cpus), so the threads
// of one graph never share a core, nor do the graphs of two slots.
#pragma once

#include "dgr/shard_engine.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace dgr::worker {

class ComputeSlots {
public:
    // `dir` empty: no slots (every compute proceeds at once); otherwise n >= 1 slot files in dir.
    // `pin_threads` > 1: a held slot names that many cores for its forward's threads (cpus());
    // > 0: the worker's threads settle on slot 0's cores while it serves one session (settle)
    ComputeSlots(const std::string & dir, int n, int pin_threads = 0);
    ~ComputeSlots();
    ComputeSlots(const ComputeSlots &) = delete;
    ComputeSlots & operator=(const ComputeSlots &) = delete;

    class Hold {
    public:
        Hold() = default;
        explicit Hold(int fd, bool alone = true, std::vector<int32_t> cpus = {})
            : fd_(fd), alone_(alone), cpus_(std::move(cpus)) {}
        Hold(Hold && other) noexcept : fd_(other.fd_), alone_(other.alone_), cpus_(std::move(other.cpus_)) {
            other.fd_ = -1;
        }
        Hold & operator=(Hold &&) = delete;
        Hold(const Hold &) = delete;
        ~Hold();
        // the graph computes without another's beside it, as far as the slots know: a slot was
        // taken, or the host has no slots (its workers' placement is the operator's)
        bool alone() const { return alone_; }
        // the cores of the slot, one per compute thread (empty: no slot, pinning off, or a slot
        // past the cores this worker may run on)
        const std::vector<int32_t> & cpus() const { return cpus_; }
        // the engine's next forwards as this hold allows: at its priority where the graph
        // computes alone, on the slot's cores
        void place(dgr::ShardEngine & engine) const {
            engine.use_priority(alone_);
            engine.use_cpus(cpus_);
        }

    private:
        int fd_ = -1;
        bool alone_ = true;
        std::vector<int32_t> cpus_;
    };

    // waits until any slot is free, or kMaxWait with every slot held (then computes without one,
    // and at normal priority: Hold::alone is false); a forward that did not get slot 0 leaves
    // slot 0's cores before it computes (settle(false))
    Hold acquire();
    // Where the worker's threads wait between forwards: on slot 0's cores while it serves one
    // session (`lone`), on every core it may use while it serves more. A lone session's stages
    // compute in turn, each on slot 0 (acquire takes the lowest free slot; a 1-thread forward
    // computes where its settled thread is), so the stage that sends a boundary and the one
    // woken to take it share a core that stays busy. Woken on an idle core
    // instead, the next stage pays, on a VM, a halted vCPU's wake and computes slower after it
    // (3 one-thread stages on 2 cores: 13-15 ms per token where one process takes 11-12). With
    // several sessions the stages overlap: a thread held to a computing core would wait behind
    // that compute (2 sessions' FIFO turns fell from 93 to 59 tokens/s). The same holds for
    // other workers of the host: after a forward of any of them found slot 0 taken (acquire,
    // stamped in the slot directory's `contended` file), none counts as lone for kContendedFor.
    // Two 1-session routes through six 1-thread workers on 2 cores, 64 tokens each, decoded 113
    // tok/s together with each worker going by its own forwards only, 126 with the shared stamp,
    // 137 with placement left to the kernel: each generation's first forwards still compute
    // settled until a contention is seen. The forward that finds slot 0 taken leaves slot 0's
    // cores itself (acquire): 128.5 -> 133.5 and 121.2 -> 127.5 tok/s in two interleaved A/Bs.
    // Moves every thread of the process, and only when that changes; a no-op without pinning or
    // where slot 0 spans every core.
    void settle(bool lone);
    static constexpr std::chrono::milliseconds kContendedFor{250};
    static constexpr std::chrono::milliseconds kMaxWait{2000};
    int count() const { return (int) fds_.size(); }

private:
    std::vector<int> fds_;
    int pin_threads_ = 0;
    std::atomic<int> settled_{-1};  // settle: 1 lone, 0 not, -1 not yet
    std::atomic<int64_t> contended_ns_{0};  // steady clock: a forward here found slot 0 taken
    int contended_fd_ = -1;                  // the same stamp for the host's workers
    void mark_contended();
    int64_t last_contended() const;
    std::vector<int32_t> allowed_;  // the cores this process may run on, in order
    std::vector<int32_t> home_;     // slot 0's cores (empty: no slots, pinning off, or too few cores)
};

// cores / threads, at least 1
int default_slot_count(int threads);

}  // namespace dgr::worker
