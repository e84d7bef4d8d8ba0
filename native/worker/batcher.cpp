#include "batcher.h"

#include <chrono>
#include <vector>

namespace dgr::worker {

Batcher::Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots)
    : engine_(engine), max_batch_(max_batch), slots_(slots) {}

Batcher::Timing Batcher::run(dgr::BatchItem & item) {
    const auto arrived = std::chrono::steady_clock::now();
    Waiting me{&item};
    std::unique_lock<std::mutex> lock(mutex_);
    queue_.push_back(&me);
    while (!me.done) {
        if (busy_) {
            done_cv_.wait(lock);
            continue;
        }
        take_turn(lock);  // the oldest group: this caller's own, or one that waited longer
    }
    const auto finished = std::chrono::steady_clock::now();
    using seconds = std::chrono::duration<double>;
    return {seconds(me.started - arrived).count(), seconds(finished - me.started).count(), me.alone};
}

void Batcher::take_turn(std::unique_lock<std::mutex> & lock) {
    // the oldest request, and the decode steps waiting behind it when it is one too
    std::vector<Waiting *> group{queue_.front()};
    queue_.pop_front();
    if (group[0]->item->request.n_tokens == 1) {
        for (auto it = queue_.begin(); it != queue_.end() && (int32_t) group.size() < max_batch_;) {
            if ((*it)->item->request.n_tokens == 1) {
                group.push_back(*it);
                it = queue_.erase(it);
            } else {
                ++it;
            }
        }
    }
    busy_ = true;
    const auto started = std::chrono::steady_clock::now();
    for (Waiting * w : group) w->started = started;
    lock.unlock();
    std::vector<dgr::BatchItem> batch(group.size());
    for (size_t i = 0; i < group.size(); ++i) {
        batch[i].request = group[i]->item->request;
        batch[i].out_dtype = group[i]->item->out_dtype;
    }
    bool alone = true;
    try {
        const ComputeSlots::Hold slot = slots_.acquire();
        alone = slot.alone();
        engine_.use_priority(alone);
        engine_.forward_batch(batch);
    } catch (...) {
        for (auto & b : batch) {
            if (!b.error) b.error = std::current_exception();
        }
    }
    lock.lock();
    for (size_t i = 0; i < group.size(); ++i) {
        group[i]->item->result = std::move(batch[i].result);
        group[i]->item->error = batch[i].error;
        group[i]->alone = alone;
        group[i]->done = true;
    }
    widest_ = std::max(widest_, group.size());
    busy_ = false;
    // the callers served, and those still queued: one of them takes the next turn
    done_cv_.notify_all();
}

size_t Batcher::widest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return widest_;
}

}  // namespace dgr::worker
