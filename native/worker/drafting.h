// Speculative decoding at the head of a forward-mode route: where drafts come from and how many to
// send. The head drafts by prompt lookup, or takes the drafts the tail's MTP block made with the
// last token (ShardEngine::draft_mtp); one forward of the last accepted token and its drafts
// crosses the route, and the tail verifies every position (sampling.h), so the output equals
// plain decode.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dgr::worker {

// Prompt lookup, as llama.cpp's lookup decoding: the tokens that followed the latest earlier
// occurrence of the text's last n-gram (the longest of ngram_max..ngram_min that occurred before).
class PromptLookup {
public:
    PromptLookup(int32_t ngram_min, int32_t ngram_max);
    void add(int32_t token);                                // the session's next token
    std::vector<int32_t> propose(int32_t max_draft) const;  // empty: no n-gram recurs
    const std::vector<int32_t> & history() const { return history_; }

private:
    uint64_t key(size_t end, int32_t n) const;  // the n-gram ending before history_[end]
    int32_t ngram_min_, ngram_max_;
    std::vector<int32_t> history_;
    // per n: n-gram -> where the latest occurrence ended (the index of the token after it)
    std::vector<std::unordered_map<uint64_t, size_t>> last_end_;
};

// The draft length, from what the steps measured. A step of k drafts yields 1 + (accepted) tokens,
// E(k) = (1 - p^(k+1)) / (1 - p) on average when each draft is accepted with probability p, and
// costs t0 + beta * u * k: t0 a plain step (the trip around the route and one token's compute),
// beta a unit of drafting work, u units per draft: 1 where the head drafts (verifying the draft),
// 2 where the tail drafts a step ahead (making the draft with the MTP block, then verifying it;
// a step is timed with the units it carried, so the making is counted where it happened, often
// in a step that verified nothing). The controller picks the k in [0, max_draft] with the most tokens
// per second, a k > 0 only where that beats plain decode by a margin (10%: what the model leaves
// out, such as graph rebuilds between step shapes); where drafts are rarely accepted, or a draft
// costs nearly a plain step (loopback at 1 thread), that is k = 0, plain decode.
// How it notices when drafts start to be accepted depends on the source:
// - shadowed (prompt lookup): proposals cost nothing to make, so in a plain step the head still
//   proposes the next token and checks it against the token that comes back (`shadow`), one free
//   trial of p per step; such a controller never sends a probe, and it drafts only after its
//   first trial (prior 1/3: a first proposal that held makes p 1/2, one that failed keeps
//   drafting off);
// - otherwise (MTP: making a draft costs the tail a pass of its block): a one-draft probe, after
//   16 steps, then after twice as many as before each time a probe is rejected (at most 256), back
//   to 16 when one is accepted.
// What the steps of a route cost, as a controller measured them (t0 and beta below): a property
// of the route's stages and links, not of one generation's text, so a head keeps it per route
// (DraftCosts) and the next generation over the same route starts from it instead of from the
// prior. Without it every generation paid for relearning: on loopback at 1 thread a draft's row
// costs about a plain step, but the prior (a quarter of one) kept drafting on for the first ~8
// drafting steps of each 64-token generation (lookup drafting 0.98x of plain decode there).
struct StepCosts {
    double t0 = 0.0, beta = 0.0;  // seconds: a plain step (0: not timed), a unit of drafting work
    bool drafted = false;         // beta measured (otherwise the prior)
    double head = 0.0;            // seconds: the head's own compute of a plain step (0: not timed;
                                  // the head's, not the controller's: whether steps go in parts)
    // probing (unshadowed sources, MTP): steps between probes and steps since the last draft, so
    // that a route whose probes keep failing (an MTP block that drafts nothing useful) backs off
    // across generations too, instead of probing afresh at the 16th step of each (0: none yet)
    int32_t probe_every = 0, since_draft = 0;
    // acceptance, read back by unshadowed sources (MTP) only: the decayed counts behind p, so
    // that the next generation starts from what the route's drafts achieved instead of the prior
    // of 1/2, which kept an MTP block that drafts nothing useful drafting for the first steps of
    // every generation (0 trials: none yet; a shadowed source learns p free in each text)
    double hits = 0.0, trials = 0.0;
};

struct DraftChoice {
    int32_t k = 0;       // drafts (0: a plain step)
    bool probe = false;  // a probe: drafting does not pay by the estimates, but is it paying yet?
};

class DraftController {
public:
    // `costs`: what an earlier generation over the same route measured (DraftCosts), if any
    DraftController(int32_t max_draft, double units_per_draft, bool shadowed, StepCosts costs = {});
    DraftChoice next(int32_t proposal_limit);  // drafts for the next step to draft for
    // a step that verified `drafted` drafts (`probe`: as a probe) and did `cost_units` units of
    // drafting work in all
    void observe(int32_t drafted, int32_t accepted, double seconds, int32_t cost_units, bool probe);
    // a one-token proposal checked against the token plain decode produced instead of being
    // sent (shadowed controllers)
    void shadow(bool accepted);
    double acceptance() const;             // p, the estimate
    StepCosts costs() const;               // what the steps measured so far (for DraftCosts)

private:
    int32_t best(int32_t limit, int32_t since) const;  // the k with the most tokens per second
    void count(int32_t drafted, int32_t accepted);      // drafts verified (or shadowed): p's counts
    int32_t max_draft_;
    double units_;                           // drafting work per draft
    double t0_ = 0.0, beta_ = 0.0;           // seconds, moving averages
    bool shadowed_;
    double hits_ = 1.0, trials_;             // decayed counts behind p (prior 1/2, shadowed 1/3)
    int32_t plain_seen_ = 0, draft_seen_ = 0, since_draft_ = 0, steps_ = 0, trials_seen_ = 0;
    int32_t probe_every_;      // steps of plain decode before a probe
};

// StepCosts per route (a key of its stages and draft source), for the generations a head drives;
// the latest kRoutes routes are kept.
class DraftCosts {
public:
    StepCosts get(uint64_t route) const;
    void put(uint64_t route, const StepCosts & costs);
    static constexpr size_t kRoutes = 64;

private:
    mutable std::mutex mutex_;
    std::deque<std::pair<uint64_t, StepCosts>> routes_;  // oldest first
};

}  // namespace dgr::worker
