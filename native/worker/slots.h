// Compute slots shared by the workers of one host. ggml's barriers spin: when several workers on
// one machine compute at once with more threads in total than it has cores, a preempted thread
// stalls its whole graph for a scheduler slice (measured on 2 cores: 3 workers x 2 threads
// serving 4 sessions at once fell from ~100 to 3-7 tokens/s). Workers therefore take one of
// cores / threads slots for each llama_decode: flock'd files in a directory they share, which
// the kernel releases if a worker dies holding one. A worker alone on its host always finds a
// slot free (two syscalls per forward).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace dgr::worker {

class ComputeSlots {
public:
    // `dir` empty: no slots (every compute proceeds at once); otherwise n >= 1 slot files in dir
    ComputeSlots(const std::string & dir, int n);
    ~ComputeSlots();
    ComputeSlots(const ComputeSlots &) = delete;
    ComputeSlots & operator=(const ComputeSlots &) = delete;

    class Hold {
    public:
        Hold() = default;
        explicit Hold(int fd, bool alone = true) : fd_(fd), alone_(alone) {}
        Hold(Hold && other) noexcept : fd_(other.fd_), alone_(other.alone_) { other.fd_ = -1; }
        Hold & operator=(Hold &&) = delete;
        Hold(const Hold &) = delete;
        ~Hold();
        // the graph computes without another's beside it, as far as the slots know: a slot was
        // taken, or the host has no slots (its workers' placement is the operator's)
        bool alone() const { return alone_; }

    private:
        int fd_ = -1;
        bool alone_ = true;
    };

    // waits until any slot is free, or kMaxWait with every slot held (then computes without one,
    // and at normal priority: Hold::alone is false)
    Hold acquire();
    static constexpr std::chrono::milliseconds kMaxWait{2000};
    int count() const { return (int) fds_.size(); }

private:
    std::vector<int> fds_;
    int next_ = 0;
};

// cores / threads, at least 1
int default_slot_count(int threads);

}  // namespace dgr::worker
