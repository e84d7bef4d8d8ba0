#include "slots.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace dgr::worker {

ComputeSlots::ComputeSlots(const std::string & dir, int n) {
    if (dir.empty()) return;
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
}

ComputeSlots::~ComputeSlots() {
    for (int fd : fds_) close(fd);
}

ComputeSlots::Hold::~Hold() {
    if (fd_ >= 0) flock(fd_, LOCK_UN);
}

ComputeSlots::Hold ComputeSlots::acquire() {
    if (fds_.empty()) return Hold();
    // a free slot if there is one; else wait on the next in turn (the engine has one caller at a
    // time, so next_ needs no lock)
    for (int fd : fds_) {
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) return Hold(fd);
    }
    const int fd = fds_[(size_t) (next_++ % (int) fds_.size())];
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) return Hold();  // cannot lock: compute anyway rather than stall
    }
    return Hold(fd);
}

int default_slot_count(int threads) {
    const int cores = (int) std::max(1u, std::thread::hardware_concurrency());
    return std::max(1, cores / std::max(1, threads));
}

}  // namespace dgr::worker
