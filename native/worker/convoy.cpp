#include "convoy.h"

#include <algorithm>
#include <cmath>

namespace dgr::worker {

void ConvoyRule::observe(double round_s, double held_s, double compute_s) {
    if (!std::isfinite(round_s) || !std::isfinite(held_s) || !std::isfinite(compute_s) || round_s < 0.0 ||
        compute_s < 0.0) {
        return;
    }
    // the stages' clocks are their own: a round shorter than what they held is a link of ~0
    const Step step{std::max(0.0, round_s - held_s), compute_s};
    std::lock_guard<std::mutex> lock(mutex_);
    steps_.push_back(step);
    if (steps_.size() > kWindow) steps_.pop_front();
    now_ = decide();
}

ConvoyRule::Estimate ConvoyRule::decide() const {
    Estimate e;
    e.steps = steps_.size();
    if (steps_.empty()) return e;
    std::array<double, kWindow> compute{};  // on every token's path: no allocation
    e.link_s = steps_.front().link_s;
    for (size_t i = 0; i < steps_.size(); ++i) {
        e.link_s = std::min(e.link_s, steps_[i].link_s);
        compute[i] = steps_[i].compute_s;
    }
    const auto end = compute.begin() + (long) e.steps, mid = compute.begin() + (long) (e.steps / 2);
    std::nth_element(compute.begin(), mid, end);
    e.compute_s = *mid;
    e.apart = may_part_ && e.steps >= kMinSteps && e.link_s > kLinkShare * e.compute_s;
    return e;
}

bool ConvoyRule::apart() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return now_.apart;
}

ConvoyRule::Estimate ConvoyRule::estimate() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return now_;
}

std::shared_ptr<ConvoyRule> ConvoyRules::of(uint64_t route) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find_if(rules_.begin(), rules_.end(), [&](const auto & r) { return r.first == route; });
    std::shared_ptr<ConvoyRule> rule = it != rules_.end() ? it->second : std::make_shared<ConvoyRule>(may_part_);
    if (it != rules_.end()) rules_.erase(it);
    rules_.emplace_back(route, rule);
    if (rules_.size() > kRoutes) rules_.pop_front();  // a session still holding it keeps it
    return rule;
}

ConvoyRule::Estimate ConvoyRules::latest() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return rules_.empty() ? ConvoyRule::Estimate{} : rules_.back().second->estimate();
}

}  // namespace dgr::worker
