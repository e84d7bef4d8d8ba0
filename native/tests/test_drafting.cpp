// Speculative decoding at the head (drafting.h) and the host's compute slots (slots.h).
#include "drafting.h"
#include "slots.h"
#include "support.h"

#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

using namespace dgr::worker;

namespace {

PromptLookup lookup_of(const std::vector<int32_t> & text, int32_t ngram_min = 1, int32_t ngram_max = 3) {
    PromptLookup lookup(ngram_min, ngram_max);
    for (int32_t t : text) lookup.add(t);
    return lookup;
}

std::string temp_dir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dgr-slots-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    return tmpl;
}

}  // namespace

TEST_CASE("prompt lookup proposes what followed the latest earlier occurrence of the last n-gram") {
    // ... 1 2 3 [4 5 6] ... 1 2 3 -> 4 5 6
    auto lookup = lookup_of({9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3});
    CHECK(lookup.propose(3) == std::vector<int32_t>{4, 5, 6});
    CHECK(lookup.propose(1) == std::vector<int32_t>{4});
    CHECK(lookup.propose(0).empty());
    CHECK(lookup.history().size() == 11);
}

TEST_CASE("prompt lookup prefers the longest n-gram and the latest occurrence") {
    // "2 3" occurred twice (followed by 8, then by 4); "1 2 3" only before 4
    auto longest = lookup_of({1, 2, 3, 4, 0, 2, 3, 8, 0, 1, 2, 3});
    CHECK(longest.propose(1) == std::vector<int32_t>{4});
    auto latest = lookup_of({5, 3, 4, 6, 3, 8, 9, 3}, 1, 1);  // "3" last followed by 8
    CHECK(latest.propose(2) == std::vector<int32_t>{8, 9});
    auto none = lookup_of({1, 2, 3, 4});
    CHECK(none.propose(4).empty());
    auto short_only = lookup_of({7, 7}, 2, 3);  // no bigram seen before the last
    CHECK(short_only.propose(2).empty());
}

TEST_CASE("prompt lookup stops its proposal at the end of the text") {
    auto lookup = lookup_of({1, 2, 1, 2}, 2, 2);  // "1 2" then "1 2": what followed the first: 1 2
    CHECK(lookup.propose(8) == std::vector<int32_t>{1, 2});
}

TEST_CASE("draft controller: plain decode until timed, and drafts where they are accepted and cheap") {
    DraftController c(4, 1.0, /*shadowed=*/true);
    CHECK(c.next(4).k == 0);  // not timed yet
    c.observe(0, 0, 0.010, 0, false);
    c.observe(0, 0, 0.010, 0, false);
    CHECK(c.next(4).k == 0);  // a shadowed source drafts only after its first trial
    for (int i = 0; i < 10; ++i) c.shadow(true);
    CHECK(c.acceptance() > 0.8);
    const DraftChoice d = c.next(4);
    CHECK(d.k >= 2);
    CHECK_FALSE(d.probe);
    CHECK(c.next(1).k <= 1);  // never more than the proposal holds
    CHECK(c.next(0).k == 0);
}

TEST_CASE("draft controller: drafts that are rejected turn drafting off") {
    DraftController c(4, 1.0, true);
    c.observe(0, 0, 0.010, 0, false);
    c.observe(0, 0, 0.010, 0, false);
    c.shadow(false);
    CHECK(c.next(4).k == 0);  // p stays low
    for (int i = 0; i < 20; ++i) {
        c.observe(3, 0, 0.020, 3, false);  // three drafts, none accepted, twice a plain step
    }
    CHECK(c.acceptance() < 0.2);
    CHECK(c.next(4).k == 0);
}

TEST_CASE("draft controller (MTP): a one-draft probe after 16 plain steps, backing off when it fails") {
    DraftController c(4, 2.0, /*shadowed=*/false);
    c.observe(0, 0, 0.010, 0, false);
    c.observe(0, 0, 0.010, 0, false);
    for (int i = 0; i < 40; ++i) c.observe(1, 0, 0.012, 2, true);  // drafts not accepted: p falls
    int steps = 0;
    DraftChoice d;
    do {
        d = c.next(4);
        ++steps;
    } while (d.k == 0 && steps < 1000);
    CHECK(d.k == 1);
    CHECK(d.probe);
    c.observe(1, 0, 0.012, 2, true);  // rejected: the next probe waits twice as long
    const StepCosts costs = c.costs();
    CHECK(costs.probe_every >= 32);
    CHECK(costs.drafted);
    CHECK(costs.t0 == doctest::Approx(0.010));
}

TEST_CASE("draft costs are kept per route, the latest kRoutes") {
    DraftCosts costs;
    CHECK(costs.get(1).t0 == 0.0);
    StepCosts s;
    s.t0 = 0.5;
    costs.put(1, s);
    CHECK(costs.get(1).t0 == 0.5);
    for (uint64_t r = 2; r <= DraftCosts::kRoutes + 1; ++r) costs.put(r, s);
    CHECK(costs.get(1).t0 == 0.0);  // the oldest went
    CHECK(costs.get(2).t0 == 0.5);
    // a controller started from them skips the warm-up
    DraftController c(4, 1.0, false, costs.get(2));
    CHECK(c.costs().t0 == doctest::Approx(0.5));
}

TEST_CASE("compute slots: no directory, no slots, and a held slot is taken by nobody else") {
    ComputeSlots none("", 4);
    CHECK(none.count() == 0);
    CHECK(none.acquire().alone());

    const std::string dir = temp_dir();
    ComputeSlots a(dir, 1), b(dir, 1);  // two workers of one host
    CHECK(a.count() == 1);
    auto held = std::make_unique<ComputeSlots::Hold>(a.acquire());
    CHECK(held->alone());
    auto waiter = std::async(std::launch::async, [&] {
        ComputeSlots::Hold h = b.acquire();
        return std::make_pair(h.alone(), std::chrono::steady_clock::now());
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(waiter.wait_for(std::chrono::milliseconds(0)) == std::future_status::timeout);  // waits its turn
    // released: the other worker takes it, then and not before (times from this thread: the
    // waiter's own start may lag under a sanitizer)
    const auto released = std::chrono::steady_clock::now();
    held.reset();
    const auto [alone, taken] = waiter.get();
    CHECK(alone);
    CHECK(taken >= released);
    CHECK(taken - released < ComputeSlots::kMaxWait);
    std::filesystem::remove_all(dir);
}

TEST_CASE("compute slots: with every slot held past kMaxWait a forward computes anyway, not alone") {
    const std::string dir = temp_dir();
    ComputeSlots a(dir, 2), b(dir, 2), c(dir, 2);  // three workers of one host
    ComputeSlots::Hold first = a.acquire(), second = b.acquire();  // both slots
    CHECK(first.alone());
    CHECK(second.alone());
    const auto t0 = std::chrono::steady_clock::now();
    ComputeSlots::Hold late = c.acquire();
    CHECK_FALSE(late.alone());
    CHECK(std::chrono::steady_clock::now() - t0 >= ComputeSlots::kMaxWait);
    std::filesystem::remove_all(dir);
}

TEST_CASE("compute slots: an unusable directory is refused, naming the flag") {
    CHECK_THROWS_WITH_AS(ComputeSlots("/proc/no-such-dir/slots", 1), doctest::Contains("--compute-slots: cannot create"),
                         std::invalid_argument);
    CHECK(default_slot_count(1) >= 1);
    CHECK(default_slot_count(1 << 20) == 1);
}
