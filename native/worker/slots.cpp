#include "slots.h"
#include "clock.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace dgr::worker {

namespace {

cpu_set_t to_set(const std::vector<int32_t> & cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int32_t c : cpus) CPU_SET(c, &set);
    return set;
}

}  // namespace

ComputeSlots::ComputeSlots(const std::string & dir, int n, int pin_threads) : pin_threads_(pin_threads) {
    if (dir.empty()) return;
    cpu_set_t set;
    if (pin_threads_ > 0 && sched_getaffinity(0, sizeof(set), &set) == 0) {
        for (int32_t c = 0; c < CPU_SETSIZE; ++c) {
            if (CPU_ISSET(c, &set)) allowed_.push_back(c);
        }
    }
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
        throw std::invalid_argument("--compute-slots: cannot create " + dir + ": " + std::strerror(errno));
    }
    for (int i = 0; i < n; ++i) {
        const std::string path = dir + "/slot-" + std::to_string(i) + "-of-" + std::to_string(n);
        const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd < 0) {
            for (int f : fds_) close(f);
            throw std::invalid_argument("--compute-slots: cannot open " + path + ": " + std::strerror(errno));
        }
        fds_.push_back(fd);
    }
    if (pin_threads_ > 0 && (size_t) pin_threads_ <= allowed_.size()) {
        home_.assign(allowed_.begin(), allowed_.begin() + pin_threads_);
    }
    // when a forward last found slot 0 taken, for every worker of the host (settle); a worker
    // that cannot open it only goes by its own forwards
    contended_fd_ = open((dir + "/contended").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
}

ComputeSlots::~ComputeSlots() {
    for (int fd : fds_) close(fd);
    if (contended_fd_ >= 0) close(contended_fd_);
}

void ComputeSlots::mark_contended() {
    const int64_t now = steady_ns();
    contended_ns_.store(now);
    if (contended_fd_ >= 0) (void) !pwrite(contended_fd_, &now, sizeof(now), 0);
}

int64_t ComputeSlots::last_contended() const {
    int64_t last = contended_ns_.load(), shared = 0;
    if (contended_fd_ >= 0 && pread(contended_fd_, &shared, sizeof(shared), 0) == (ssize_t) sizeof(shared)) {
        last = std::max(last, shared);
    }
    return last;
}

ComputeSlots::Hold::~Hold() {
    if (fd_ >= 0) flock(fd_, LOCK_UN);
}

ComputeSlots::Hold ComputeSlots::acquire() {
    if (fds_.empty()) return Hold();
    // the lowest slot that is free, polled with a short growing pause: blocking on one slot would
    // tie this worker to its holder, and a holder that hangs (SIGSTOP, a debugger, a stall) would
    // then stop every worker queued behind it while other slots sit free. Slots only keep
    // spinning graphs apart: past kMaxWait with all of them held, compute anyway.
    // Lowest first: the stages of a lone session compute one after another, so each finds slot 0
    // free and computes on its cores, where the workers' other threads wait (settle); only
    // forwards that overlap spread to the other slots' cores.
    // A forward that finds slot 0 taken also leaves slot 0's cores itself, before it computes:
    // settled there, it would compute beside the holder on a core already busy while another
    // idles (until the next forward's settle).
    const auto give_up = std::chrono::steady_clock::now() + kMaxWait;
    auto pause = std::chrono::microseconds(20);
    while (true) {
        for (size_t slot = 0; slot < fds_.size(); ++slot) {
            const int fd = fds_[slot];
            if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
                if (slot > 0) settle(false);
                const size_t first = slot * (size_t) pin_threads_;
                if (pin_threads_ < 2 || first + (size_t) pin_threads_ > allowed_.size()) return Hold(fd);
                return Hold(fd, true, std::vector<int32_t>(allowed_.begin() + (long) first,
                                                           allowed_.begin() + (long) (first + (size_t) pin_threads_)));
            }
            if (errno != EWOULDBLOCK && errno != EINTR) return Hold(-1, false);  // cannot lock: compute anyway
            if (slot == 0) mark_contended();  // another compute on slot 0's cores (settle)
        }
        if (std::chrono::steady_clock::now() > give_up) {
            settle(false);
            return Hold(-1, false);
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
}

void ComputeSlots::settle(bool lone) {
    if (home_.empty() || home_.size() == allowed_.size()) return;  // nothing to choose between
    const int64_t calm_since = lone ? last_contended() + std::chrono::nanoseconds(kContendedFor).count() : 0;
    const int want = lone && steady_ns() >= calm_since ? 1 : 0;
    if (settled_.exchange(want) == want) return;
    const cpu_set_t set = to_set(want == 1 ? home_ : allowed_);
    // every thread of the process, this one included; a thread started meanwhile by one not yet
    // moved keeps its creator's cores until the next change
    if (DIR * tasks = opendir("/proc/self/task")) {
        while (const dirent * e = readdir(tasks)) {
            const int tid = std::atoi(e->d_name);
            if (tid > 0) sched_setaffinity(tid, sizeof(set), &set);
        }
        closedir(tasks);
    }
}

int default_slot_count(int threads) {
    const int cores = (int) std::max(1u, std::thread::hardware_concurrency());
    return std::max(1, cores / std::max(1, threads));
}

}  // namespace dgr::worker
