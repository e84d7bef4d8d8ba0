#include "drafting.h"

#include <algorithm>
#include <cmath>

namespace dgr::worker {

namespace {
constexpr double kDecay = 0.2;       // weight of the newest step in the moving averages
constexpr double kKeep = 0.9;        // decay of the acceptance counts per drafting step
constexpr int32_t kWarmup = 2;       // plain steps timed before the first draft
constexpr int32_t kProbeEvery = 16;  // with drafting off, a one-draft probe this often at first,
constexpr int32_t kProbeMax = 256;   // twice as long after each probe rejected, up to this
constexpr int32_t kPlainEvery = 32;  // with drafting on, a plain step this often keeps t0 fresh
// drafting only where it is expected to gain at least this much: what the cost model leaves out
// (each switch between a one-row and a k-row graph rebuilds the graph on every stage: 0.3-0.9 ms
// per forward of the whole model at 1 thread) and its estimates' noise. On loopback at 1 thread
// the model expected ~1.1x where drafting ran 0.96-0.99x of plain decode
constexpr double kMargin = 0.10;

void blend(double & avg, double x, int32_t seen) { avg = seen == 0 ? x : avg + kDecay * (x - avg); }
}  // namespace

PromptLookup::PromptLookup(int32_t ngram_min, int32_t ngram_max)
    : ngram_min_(ngram_min), ngram_max_(ngram_max), last_end_((size_t) ngram_max + 1) {}

uint64_t PromptLookup::key(size_t end, int32_t n) const {
    uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the n ids before `end`
    for (size_t i = end - (size_t) n; i < end; ++i) {
        h = (h ^ (uint32_t) history_[i]) * 0x100000001B3ull;
    }
    return h;
}

void PromptLookup::add(int32_t token) {
    // the n-grams that ended just before this token now have a successor: index them
    const size_t end = history_.size();
    for (int32_t n = ngram_min_; n <= ngram_max_; ++n) {
        if ((size_t) n <= end) last_end_[(size_t) n][key(end, n)] = end;
    }
    history_.push_back(token);
}

std::vector<int32_t> PromptLookup::propose(int32_t max_draft) const {
    const size_t end = history_.size();
    for (int32_t n = ngram_max_; n >= ngram_min_ && max_draft > 0; --n) {
        if ((size_t) n > end) continue;
        const auto & seen = last_end_[(size_t) n];
        const auto it = seen.find(key(end, n));
        if (it == seen.end()) continue;
        const size_t from = it->second;  // the token that followed the earlier occurrence
        const size_t to = std::min(end, from + (size_t) max_draft);
        // a hash collision proposes tokens that fail verification, never wrong output
        return std::vector<int32_t>(history_.begin() + (long) from, history_.begin() + (long) to);
    }
    return {};
}

DraftController::DraftController(int32_t max_draft, double units_per_draft, bool shadowed, StepCosts costs)
    : max_draft_(max_draft),
      units_(units_per_draft),
      shadowed_(shadowed),
      trials_(shadowed ? 3.0 : 2.0),
      probe_every_(kProbeEvery) {
    // a route timed before: no warm-up, and its beta instead of the prior; both keep adapting
    if (costs.probe_every > 0) {
        probe_every_ = costs.probe_every;
        since_draft_ = costs.since_draft;
    }
    if (!shadowed_ && costs.trials > 0.0) {  // a shadowed source relearns p from each text
        hits_ = costs.hits;
        trials_ = costs.trials;
    }
    if (costs.t0 > 0.0) {
        t0_ = costs.t0;
        plain_seen_ = kWarmup;
        if (costs.drafted) {
            beta_ = costs.beta;
            draft_seen_ = 1;
        }
    }
}

double DraftController::acceptance() const { return hits_ / trials_; }

StepCosts DraftController::costs() const {
    return {t0_, beta_, draft_seen_ > 0, 0.0, probe_every_, since_draft_, hits_, trials_};
}

StepCosts DraftCosts::get(uint64_t route) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto & [key, costs] : routes_) {
        if (key == route) return costs;
    }
    return {};
}

void DraftCosts::put(uint64_t route, const StepCosts & costs) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = routes_.begin(); it != routes_.end(); ++it) {
        if (it->first == route) {
            routes_.erase(it);
            break;
        }
    }
    routes_.emplace_back(route, costs);
    if (routes_.size() > kRoutes) routes_.pop_front();
}

int32_t DraftController::best(int32_t limit, int32_t since) const {
    const double p = std::min(acceptance(), 0.999);
    // the prior, until drafting steps are timed: a unit of drafting costs a quarter of a plain step
    const double beta = (draft_seen_ == 0 ? 0.25 * t0_ : beta_) * units_;
    int32_t k_best = 0;
    double best_rate = (1.0 + kMargin) / t0_, expected = 1.0, pk = 1.0;
    for (int32_t k = 1; k <= std::min(max_draft_, limit); ++k) {
        pk *= p;
        expected += pk;  // 1 + p + ... + p^k
        const double rate = expected / (t0_ + beta * k);
        if (rate > best_rate) {
            k_best = k;
            best_rate = rate;
        }
    }
    if (k_best == 0 && !shadowed_ && since >= probe_every_) k_best = 1;  // is drafting paying yet?
    return k_best;
}

DraftChoice DraftController::next(int32_t proposal_limit) {
    if (proposal_limit < 1 || plain_seen_ < kWarmup || (shadowed_ && trials_seen_ == 0)) return {};
    ++since_draft_;
    if (draft_seen_ > 0 && ++steps_ % kPlainEvery == 0) return {};
    if (draft_seen_ == 0) beta_ = 0.25 * t0_;  // (per unit)
    const int32_t k = best(proposal_limit, since_draft_);
    const bool probe = k > 0 && since_draft_ >= probe_every_ && best(proposal_limit, 0) == 0;
    if (k > 0) since_draft_ = 0;
    return {k, probe};
}

void DraftController::observe(int32_t drafted, int32_t accepted, double seconds, int32_t cost_units, bool probe) {
    if (seconds <= 0.0) return;
    if (cost_units <= 0) {
        blend(t0_, seconds, plain_seen_++);
        return;
    }
    // one noisy step moves the estimate by kDecay, not to itself: the prior counts as a step
    if (plain_seen_ > 0) blend(beta_, std::max(0.0, seconds - t0_) / cost_units, ++draft_seen_);
    if (drafted == 0) return;
    if (probe) {  // a probe that failed waits twice as long for the next; one that held resets
        probe_every_ = accepted == 0 ? std::min(2 * probe_every_, kProbeMax) : kProbeEvery;
    }
    count(drafted, accepted);
}

void DraftController::shadow(bool accepted) { count(1, accepted ? 1 : 0); }

void DraftController::count(int32_t drafted, int32_t accepted) {
    // each draft up to the first rejection was a trial; the rejection (if any) one more
    ++trials_seen_;
    hits_ = kKeep * hits_ + accepted;
    trials_ = kKeep * trials_ + accepted + (accepted < drafted ? 1 : 0);
}

}  // namespace dgr::worker
