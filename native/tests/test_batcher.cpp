// The batcher over a real engine (DGR_TEST_MODEL): which forwards join a llama_decode, in what
// order, and that a batched decode step equals the same step computed alone, bit for bit, on a
// context past 300 tokens.
#include "batcher.h"
#include "support.h"

#include <cstring>
#include <future>
#include <thread>

using namespace dgr::worker;

namespace {

std::unique_ptr<dgr::ShardEngine> open_engine(int32_t threads) {
    dgr::EngineOptions o;
    o.model_path = dgr::test::model_path();
    o.n_threads = threads;
    o.n_ctx = 1024;
    o.n_batch = 512;
    o.max_sessions = 4;
    return dgr::ShardEngine::open(o);
}

// a prompt of more than 300 tokens, different per session
std::vector<int32_t> prompt(const dgr::ShardEngine & engine, int which) {
    std::string text = "Session " + std::to_string(which) + ". ";
    for (int i = 0; text.size() < 1700; ++i) {
        text += "The ledger for day " + std::to_string(i * (which + 2)) + " lists " + std::to_string(i * 7 + which) +
                " crates of " + (i % 3 == 0 ? "pears" : i % 3 == 1 ? "salt" : "rope") + " shipped north. ";
    }
    auto t = engine.tokenize(text, true);
    REQUIRE(t.size() > 340);
    t.resize(340);  // within one forward's n_batch
    return t;
}

struct Session {
    uint64_t id;
    std::vector<int32_t> tokens;
    int32_t next = 0;  // the greedy token after them
};

int32_t argmax(const dgr::ForwardResult & r) {
    const float * row = (const float *) r.data.data() + (size_t) (r.n_rows - 1) * (size_t) r.row_width;
    return (int32_t) (std::max_element(row, row + r.row_width) - row);
}

dgr::ForwardRequest step_of(const Session & s, const int32_t * token, int32_t n_past) {
    dgr::ForwardRequest r;
    r.session = s.id;
    r.epoch = 1;
    r.n_past = n_past;
    r.n_tokens = 1;
    r.tokens = token;
    return r;
}

// prefill each session on `engine`; returns the sessions with their first greedy token
std::vector<Session> prefill(dgr::ShardEngine & engine, int n) {
    std::vector<Session> sessions;
    for (int i = 0; i < n; ++i) {
        Session s{(uint64_t) (100 + i), prompt(engine, i)};
        dgr::ForwardRequest r;
        r.session = s.id;
        r.epoch = 1;
        r.n_tokens = (int32_t) s.tokens.size();
        r.tokens = s.tokens.data();
        s.next = argmax(engine.forward(r));
        sessions.push_back(std::move(s));
    }
    return sessions;
}

}  // namespace

TEST_CASE("a cohort's decode steps compute in one llama_decode and equal their solo steps bitwise") {
    for (int32_t threads : {1, 2}) {
        CAPTURE(threads);
        auto solo = open_engine(threads), batched = open_engine(threads);
        auto a = prefill(*solo, 3), b = prefill(*batched, 3);
        ComputeSlots slots("", 0);
        std::vector<size_t> widths;
        Batcher batcher(*batched, 4, slots, std::chrono::milliseconds(2000), [&](size_t w) { widths.push_back(w); });
        for (int step = 0; step < 4; ++step) {
            std::vector<dgr::BatchItem> items(3);
            std::vector<std::future<Batcher::Timing>> runs;
            for (size_t i = 0; i < 3; ++i) {
                items[i].request = step_of(b[i], &b[i].next, (int32_t) b[i].tokens.size());
                runs.push_back(std::async(std::launch::async, [&, i] {
                    return batcher.run(items[i], Cohort{77 + (uint64_t) step, 3}, /*next_key=*/5);
                }));
            }
            for (size_t i = 0; i < 3; ++i) {
                const Batcher::Timing t = runs[i].get();
                REQUIRE_FALSE(items[i].error);
                CHECK(t.cohort.size == 3);  // they leave together, for the same next stage
                CHECK(t.gathered_all);
                const dgr::ForwardResult alone = solo->forward(step_of(a[i], &a[i].next, (int32_t) a[i].tokens.size()));
                REQUIRE(alone.data.size() == items[i].result.data.size());
                CHECK(std::memcmp(alone.data.data(), items[i].result.data.data(), alone.data.size()) == 0);
                a[i].tokens.push_back(a[i].next);
                b[i].tokens.push_back(b[i].next);
                a[i].next = argmax(alone);
                b[i].next = argmax(items[i].result);
                CHECK(a[i].next == b[i].next);
            }
        }
        CHECK(widths == std::vector<size_t>(4, 3));
        CHECK(batcher.widest() == 3);
    }
}

TEST_CASE("a prefill chunk computes alone, and decode steps waiting behind it join one another") {
    auto engine = open_engine(1);
    auto sessions = prefill(*engine, 2);
    ComputeSlots slots("", 0);
    std::vector<size_t> widths;
    std::mutex widths_mutex;
    Batcher batcher(*engine, 4, slots, std::chrono::microseconds(0), [&](size_t w) {
        std::lock_guard<std::mutex> lock(widths_mutex);
        widths.push_back(w);
    });
    // a third session's prefill, and while it computes two decode steps arrive
    const auto text = prompt(*engine, 9);
    dgr::BatchItem fill;
    fill.request.session = 300;
    fill.request.epoch = 1;
    fill.request.n_tokens = (int32_t) text.size();
    fill.request.tokens = text.data();
    auto first = std::async(std::launch::async, [&] { return batcher.run(fill); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the prefill holds the engine
    std::vector<dgr::BatchItem> steps(2);
    std::vector<std::future<Batcher::Timing>> runs;
    for (size_t i = 0; i < 2; ++i) {
        steps[i].request = step_of(sessions[i], &sessions[i].next, (int32_t) sessions[i].tokens.size());
        runs.push_back(std::async(std::launch::async, [&, i] { return batcher.run(steps[i]); }));
    }
    first.get();
    for (auto & r : runs) r.get();
    REQUIRE_FALSE(fill.error);
    for (auto & s : steps) REQUIRE_FALSE(s.error);
    CHECK(fill.result.n_past == (int32_t) text.size());
    REQUIRE(widths.size() == 2);
    CHECK(widths[0] == 1);  // the prefill, alone
    CHECK(widths[1] == 2);  // the two steps, together
}

TEST_CASE("a refused forward in a batch gets its error, the others compute and its session is untouched") {
    auto engine = open_engine(1);
    auto sessions = prefill(*engine, 2);
    ComputeSlots slots("", 0);
    Batcher batcher(*engine, 4, slots, std::chrono::milliseconds(2000));
    std::vector<dgr::BatchItem> items(2);
    items[0].request = step_of(sessions[0], &sessions[0].next, (int32_t) sessions[0].tokens.size());
    items[1].request = step_of(sessions[1], &sessions[1].next, (int32_t) sessions[1].tokens.size() + 5);  // wrong n_past
    std::vector<std::future<Batcher::Timing>> runs;
    for (size_t i = 0; i < 2; ++i) {
        runs.push_back(std::async(std::launch::async, [&, i] { return batcher.run(items[i], Cohort{9, 2}); }));
    }
    for (auto & r : runs) r.get();
    CHECK_FALSE(items[0].error);
    REQUIRE(items[1].error);
    try {
        std::rethrow_exception(items[1].error);
    } catch (const dgr::ShardError & e) {
        CHECK(e.status() == dgr::Status::cache_mismatch);
    }
    // the refused session still takes its step at the right n_past
    const auto ok = engine->forward(step_of(sessions[1], &sessions[1].next, (int32_t) sessions[1].tokens.size()));
    CHECK(ok.n_past == (int32_t) sessions[1].tokens.size() + 1);
    CHECK(batcher.widest() == 2);
}

TEST_CASE("a cohort member that will not come is forgone: the others stop waiting for it") {
    auto engine = open_engine(1);
    auto sessions = prefill(*engine, 1);
    ComputeSlots slots("", 0);
    Batcher batcher(*engine, 4, slots, std::chrono::seconds(30));
    dgr::BatchItem item;
    item.request = step_of(sessions[0], &sessions[0].next, (int32_t) sessions[0].tokens.size());
    const auto t0 = std::chrono::steady_clock::now();
    auto run = std::async(std::launch::async, [&] { return batcher.run(item, Cohort{5, 2}); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    batcher.forgo(Cohort{5, 2});
    REQUIRE(run.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
    const auto t = run.get();
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
    CHECK_FALSE(item.error);
    CHECK(t.gathered_all);  // the rest of its cohort is accounted for
}
