// The head's convoy rule (convoy.h): batched where the stages' compute is most of a round,
// apart where the links are.
#include "convoy.h"
#include "support.h"

#include <cmath>
#include <limits>

using namespace dgr::worker;

TEST_CASE("convoy: sessions stay a convoy until enough steps were seen, and while the links are short") {
    ConvoyRule rule;
    CHECK_FALSE(rule.apart());
    // behind 10 ms links (3 hops): 45 ms rounds of which the stages held 15, computing 12
    for (size_t i = 0; i + 1 < ConvoyRule::kMinSteps; ++i) rule.observe(0.045, 0.015, 0.012);
    CHECK_FALSE(rule.apart());  // too few steps to part a convoy
    rule.observe(0.045, 0.015, 0.012);
    CHECK(rule.apart());
    const ConvoyRule::Estimate e = rule.estimate();
    CHECK(e.steps == ConvoyRule::kMinSteps);
    CHECK(std::abs(e.link_s - 0.030) < 1e-9);
    CHECK(std::abs(e.compute_s - 0.012) < 1e-9);

    // loopback: the round is the stages' time but for a fraction of a millisecond
    ConvoyRule loopback;
    for (int i = 0; i < 40; ++i) loopback.observe(0.0402, 0.040, 0.036);
    CHECK_FALSE(loopback.apart());
    CHECK(loopback.estimate().steps == ConvoyRule::kWindow);
}

TEST_CASE("convoy: the links' part is the least over the window, the compute the median") {
    ConvoyRule rule;
    // one round in the window with almost no link part keeps the sessions together: a late
    // token is no longer link, a quick one shows how short the links are
    for (int i = 0; i < 20; ++i) rule.observe(0.045, 0.015, 0.012);
    CHECK(rule.apart());
    rule.observe(0.0151, 0.015, 0.012);
    CHECK_FALSE(rule.apart());
    // out of the window again after kWindow steps
    for (size_t i = 0; i < ConvoyRule::kWindow; ++i) rule.observe(0.045, 0.015, 0.012);
    CHECK(rule.apart());
    // one step of a huge compute does not move the median
    rule.observe(1.0, 0.9, 0.9);
    CHECK(std::abs(rule.estimate().compute_s - 0.012) < 1e-9);
}

TEST_CASE("convoy: a round shorter than the stages held (their own clocks) is a link of 0; NaN and negatives are not learned") {
    ConvoyRule rule;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (int i = 0; i < 10; ++i) {
        rule.observe(nan, 0.01, 0.01);
        rule.observe(0.05, nan, 0.01);
        rule.observe(-1.0, 0.01, 0.01);
        rule.observe(0.05, 0.01, -0.5);
        rule.observe(std::numeric_limits<double>::infinity(), 0.01, 0.01);
    }
    CHECK(rule.estimate().steps == 0);
    for (int i = 0; i < 10; ++i) rule.observe(0.010, 0.012, 0.011);
    CHECK(rule.estimate().link_s == 0.0);
    CHECK_FALSE(rule.apart());
}

TEST_CASE("convoy: each route has a rule of its own, the most recently used kept") {
    ConvoyRules rules;
    CHECK(rules.latest().steps == 0);
    auto a = rules.of(1);
    auto b = rules.of(2);
    CHECK(a != b);
    CHECK(rules.of(1) == a);  // the same route, the same rule
    for (int i = 0; i < 10; ++i) a->observe(0.045, 0.015, 0.012);
    CHECK(a->apart());
    CHECK_FALSE(b->apart());  // another route's links are its own
    CHECK(rules.latest().apart);  // route 1 was asked for last
    rules.of(2);
    CHECK_FALSE(rules.latest().apart);
    for (uint64_t r = 100; r < 100 + ConvoyRules::kRoutes; ++r) rules.of(r);
    CHECK(rules.of(1) != a);  // dropped for room: learned afresh
    CHECK(a->apart());        // while a session that holds it still reads it
}

TEST_CASE("convoy: a rule that may not part (worker --convoy always) measures and keeps the convoy") {
    ConvoyRules rules(false);
    auto rule = rules.of(1);
    for (int i = 0; i < 20; ++i) rule->observe(0.045, 0.015, 0.012);
    CHECK_FALSE(rule->apart());
    const ConvoyRule::Estimate e = rules.latest();  // what the metrics show: the head's choice
    CHECK_FALSE(e.apart);
    CHECK(std::abs(e.link_s - 0.030) < 1e-9);
    CHECK(e.steps == 20);
}
