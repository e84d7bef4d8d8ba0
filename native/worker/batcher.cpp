#include "batcher.h"

#include <vector>

namespace dgr::worker {

Batcher::Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots)
    : engine_(engine), max_batch_(max_batch), slots_(slots), thread_([this] { compute_loop(); }) {}

Batcher::~Batcher() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    work_cv_.notify_all();
    thread_.join();
}

void Batcher::run(dgr::BatchItem & item) {
    Waiting me{&item};
    std::unique_lock<std::mutex> lock(mutex_);
    queue_.push_back(&me);
    work_cv_.notify_one();
    done_cv_.wait(lock, [&] { return me.done; });
}

void Batcher::compute_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
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
        lock.unlock();
        std::vector<dgr::BatchItem> batch(group.size());
        for (size_t i = 0; i < group.size(); ++i) {
            batch[i].request = group[i]->item->request;
            batch[i].out_dtype = group[i]->item->out_dtype;
        }
        try {
            const ComputeSlots::Hold slot = slots_.acquire();
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
            group[i]->done = true;
        }
        widest_ = std::max(widest_, group.size());
        done_cv_.notify_all();
    }
}

size_t Batcher::widest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return widest_;
}

}  // namespace dgr::worker
