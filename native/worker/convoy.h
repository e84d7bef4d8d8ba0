// Whether the head's sessions travel as one convoy or apart.
//
// A convoy (batcher.h's cohorts, and the head's peers) keeps concurrent sessions one llama_decode
// at every stage: a stage computes their steps at once, then idles while they cross the link to
// the next. That pays where the stages' compute is most of a round: stages that share cores do
// not contend, and a batched step costs less than its steps one by one. Apart, each session's
// step leaves the head as soon as its token is back, and a stage computes one session's step
// while another's crosses a link: that pays where the links are most of the round (2 cores, 3
// stages behind 10 ms links, 4 sessions at 1 thread: 2.27x one session's aggregate as a convoy,
// 3.20x apart; on loopback at 2 threads, 8 sessions: 115 tok/s as a convoy, 80 apart).
//
// The head learns which from its decode steps: each token comes back with the time the stages
// held its step and computed it (StepTime, summed around the ring). The round (the step leaving
// to its token back) less what the stages held is the links' part, whatever the sessions do;
// the ring's compute is what a convoy would batch. Sessions go apart where the links' part (the
// least over the recent steps: a late token is no shorter link) exceeds kLinkShare of the
// ring's compute (their median), and travel as a convoy until kMinSteps steps were seen.
//
// The rule cannot see how many stages share one host's cores. Where that decides (8 sessions at
// 2 threads on 2 cores behind 10 ms links; 1 thread on loopback) the ways measured within the
// VM's drift of each other; a rule that timed both ways chose on that noise and lost 15% on
// loopback (log/architecture-history.md, "Convoy or apart").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

namespace dgr::worker {

class ConvoyRule {
public:
    static constexpr double kLinkShare = 0.25;
    static constexpr size_t kWindow = 32;   // the recent steps the rule reads
    static constexpr size_t kMinSteps = 8;  // seen before it may part a convoy

    struct Estimate {
        double link_s = 0.0;     // the links' part of a round (0: not known yet)
        double compute_s = 0.0;  // the ring's compute of a step
        size_t steps = 0;        // steps in the window
        bool apart = false;
    };

    // may_part false (worker --convoy always): it measures, and keeps the convoy whatever it finds
    explicit ConvoyRule(bool may_part = true) : may_part_(may_part) {}

    // one decode step: its round trip at the head and the stages' time for it, seconds
    void observe(double round_s, double held_s, double compute_s);
    bool apart() const;
    Estimate estimate() const;

private:
    struct Step {
        double link_s, compute_s;
    };
    Estimate decide() const;  // with the lock held

    const bool may_part_;
    mutable std::mutex mutex_;
    std::deque<Step> steps_;
    Estimate now_;
};

// A head's rules, one per route it drives (a route's stages and links are its own), the most
// recently used kRoutes kept.
class ConvoyRules {
public:
    static constexpr size_t kRoutes = 64;
    explicit ConvoyRules(bool may_part = true) : may_part_(may_part) {}  // as ConvoyRule's
    // the rule of the route keyed `route` (head_session.h's route_costs_key with source 0), made if new
    std::shared_ptr<ConvoyRule> of(uint64_t route);
    // of the route whose rule was asked for last (what the metrics show)
    ConvoyRule::Estimate latest() const;

private:
    const bool may_part_;
    mutable std::mutex mutex_;
    std::deque<std::pair<uint64_t, std::shared_ptr<ConvoyRule>>> rules_;  // most recent last
};

}  // namespace dgr::worker
