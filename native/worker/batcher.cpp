#include "batcher.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <vector>

namespace dgr::worker {

namespace {

bool decode_step(const dgr::BatchItem & item) { return item.request.n_tokens == 1; }

uint64_t random_base() {
    std::random_device rd;
    std::mt19937_64 gen(((uint64_t) rd() << 32) | rd());
    return gen();
}

constexpr size_t kRecentCohorts = 64;

}  // namespace

Batcher::Batcher(dgr::ShardEngine & engine, int32_t max_batch, ComputeSlots & slots, std::chrono::microseconds gather,
                 std::function<void(size_t)> on_turn)
    : engine_(engine),
      max_batch_(max_batch),
      slots_(slots),
      gather_(gather),
      on_turn_(std::move(on_turn)),
      id_base_(random_base()) {}

Batcher::Timing Batcher::run(dgr::BatchItem & item, Cohort cohort, uint64_t next_key, uint32_t peers) {
    Waiting me;
    me.item = &item;
    me.cohort = cohort;
    me.next_key = next_key;
    me.peers = peers;
    me.arrived = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    queue_.push_back(&me);
    if (gathering_) arrival_cv_.notify_one();
    while (!me.done) {
        if (busy_) {
            done_cv_.wait(lock);
            continue;
        }
        take_turn(lock);  // the oldest group: this caller's own, or one that waited longer
    }
    const auto finished = std::chrono::steady_clock::now();
    using seconds = std::chrono::duration<double>;
    return {seconds(me.started - me.arrived).count(), seconds(finished - me.started).count(), me.alone, me.out,
            me.gathered_all};
}

bool Batcher::gather(std::unique_lock<std::mutex> & lock) {
    const Waiting * first = queue_.front();
    const Cohort c = first->cohort;
    const bool in_cohort = c.size > 1;
    if (gather_.count() <= 0 || max_batch_ < 2 || !decode_step(*first->item) || (!in_cohort && first->peers == 0)) {
        return true;
    }
    // members already computed (a straggler of a cohort whose window ran out, or one wider than
    // max_batch) are not waited for again
    auto needed = [&]() -> uint32_t {
        if (!in_cohort) return 1;
        return std::min<uint32_t>(c.size - std::min(served(c.id), c.size), (uint32_t) max_batch_);
    };
    auto members = [&] {
        uint32_t n = 0;
        for (const Waiting * w : queue_) n += w->cohort.id == c.id ? 1 : 0;
        return n;
    };
    auto steps = [&] {
        uint32_t n = 0;
        for (const Waiting * w : queue_) n += decode_step(*w->item) ? 1 : 0;
        return n;
    };
    // the peers are sessions whose steps left the head after this one's, its own cohort's
    // members among them: whichever of the two is larger
    auto total = [&] {
        return std::min<uint32_t>(std::max<uint32_t>(needed(), 1 + first->peers), (uint32_t) max_batch_);
    };
    auto cohort_here = [&] { return !in_cohort || members() >= needed(); };
    gathering_ = true;
    arrival_cv_.wait_until(lock, first->arrived + gather_, [&] { return cohort_here() && steps() >= total(); });
    gathering_ = false;
    return cohort_here();  // the cohort complete (peers that did not come are no cohort of its)
}

void Batcher::take_turn(std::unique_lock<std::mutex> & lock) {
    busy_ = true;  // nobody else takes a turn while this one gathers
    const bool complete = gather(lock);
    // the oldest request, and the decode steps waiting behind it when it is one too
    std::vector<Waiting *> group{queue_.front()};
    queue_.pop_front();
    if (decode_step(*group[0]->item)) {
        for (auto it = queue_.begin(); it != queue_.end() && (int32_t) group.size() < max_batch_;) {
            if (decode_step(*(*it)->item)) {
                group.push_back(*it);
                it = queue_.erase(it);
            } else {
                ++it;
            }
        }
    }
    const auto started = std::chrono::steady_clock::now();
    // the cohorts leaving: this decode's steps counted by where they go next
    const uint64_t id = id_base_ + ++turns_;
    std::map<uint64_t, uint32_t> bound;
    if (group.size() > 1) {
        for (Waiting * w : group) ++bound[w->next_key];
    }
    for (Waiting * w : group) {
        if (w->cohort.size > 1) serve(w->cohort.id);
        w->started = started;
        w->gathered_all = complete || w->cohort.size < 2 || w->cohort.id != group[0]->cohort.id;
        if (group.size() > 1 && bound[w->next_key] > 1) w->out = Cohort{id, bound[w->next_key]};
    }
    lock.unlock();
    std::vector<dgr::BatchItem> batch(group.size());
    for (size_t i = 0; i < group.size(); ++i) {
        batch[i].request = group[i]->item->request;
        batch[i].out_dtype = group[i]->item->out_dtype;
    }
    bool alone = true;
    try {
        slots_.settle(engine_.session_count() <= 1);
        const ComputeSlots::Hold slot = slots_.acquire();
        alone = slot.alone();
        slot.place(engine_);
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
    if (on_turn_) on_turn_(group.size());
    busy_ = false;
    // the callers served, and those still queued: one of them takes the next turn
    done_cv_.notify_all();
}

void Batcher::serve(uint64_t id) {
    auto it = std::find_if(served_.begin(), served_.end(), [&](const auto & s) { return s.first == id; });
    if (it != served_.end()) {
        ++it->second;
        return;
    }
    served_.emplace_back(id, 1);
    if (served_.size() > kRecentCohorts) served_.pop_front();
}

uint32_t Batcher::served(uint64_t id) const {
    for (const auto & [cohort, n] : served_) {
        if (cohort == id) return n;
    }
    return 0;
}

void Batcher::forgo(Cohort cohort) {
    if (cohort.size < 2) return;
    std::lock_guard<std::mutex> lock(mutex_);
    serve(cohort.id);
    if (gathering_) arrival_cv_.notify_one();
}

size_t Batcher::widest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return widest_;
}

}  // namespace dgr::worker
