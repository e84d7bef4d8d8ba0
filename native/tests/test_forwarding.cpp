// The connecting side of a data stream (forwarding.h): what DataLink reads back from the stage it
// streams to, and the errors it relays upstream, checked as bytes off the wire.
#include "forwarding.h"
#include "support.h"

using dgr::test::frame;
using dgr::test::socket_pair;
using dgr::test::write_all;
using namespace dgr::worker;
using grpc::StatusCode;

namespace {

std::string end_frame(int32_t code, const std::string & message) {
    dgr::v1::DataEnd end;
    end.set_code(code);
    end.set_message(message);
    return frame(dgr::v1::DATA_FRAME_END, end.SerializeAsString());
}

std::string relayed(uint32_t stage, int32_t code, const std::string & message) {
    dgr::v1::ForwardReply r;
    r.mutable_error()->set_stage(stage);
    r.mutable_error()->set_address("m:2");
    r.mutable_error()->set_code(code);
    r.mutable_error()->set_message(message);
    return frame(dgr::v1::DATA_FRAME_REPLY, r.SerializeAsString());
}

// the status read_stage_stream ends with over `bytes`, and the errors it relayed
grpc::Status read(const std::string & bytes, std::vector<dgr::v1::StageError> * errors = nullptr) {
    auto [a, b] = socket_pair();
    write_all(a, bytes);
    ::close(a);
    FrameConn conn(b, 10000, 1 << 20);
    std::vector<dgr::v1::StageError> got;
    const grpc::Status st = read_stage_stream(conn, [&](const dgr::v1::StageError & e) { got.push_back(e); });
    if (errors) *errors = got;
    return st;
}

}  // namespace

TEST_CASE("DataLink's reader: errors relayed from further down, then the END's status") {
    std::vector<dgr::v1::StageError> errors;
    const auto st = read(relayed(2, (int) StatusCode::RESOURCE_EXHAUSTED, "no slot") +
                             frame(dgr::v1::DATA_FRAME_REPLY, "") +  // a reply without error: nothing to relay
                             end_frame((int) StatusCode::CANCELLED, "done"),
                         &errors);
    CHECK(st.error_code() == StatusCode::CANCELLED);
    CHECK(st.error_message() == "done");
    REQUIRE(errors.size() == 1);
    CHECK(errors[0].stage() == 2);
    CHECK(errors[0].code() == (int) StatusCode::RESOURCE_EXHAUSTED);
}

TEST_CASE("DataLink's reader: a stream ended without END, an END that does not parse or carries no error code") {
    CHECK(read("").error_message().find("closed the data stream without ending it") != std::string::npos);
    CHECK(read(frame(dgr::v1::DATA_FRAME_END, "\xff\xff")).error_code() == StatusCode::INTERNAL);
    const auto ok_end = read(end_frame(0, ""));
    CHECK(ok_end.error_code() == StatusCode::UNAVAILABLE);
    CHECK(ok_end.error_message() == "the stage ended the stream");
    const auto odd = read(end_frame(99, "x"));
    CHECK(odd.error_code() == StatusCode::UNAVAILABLE);
    CHECK(odd.error_message().find("status 99, not a gRPC status code") != std::string::npos);
    CHECK(read(end_frame(-3, "x")).error_code() == StatusCode::UNAVAILABLE);
    CHECK(read(frame(9, "")).error_code() == StatusCode::INVALID_ARGUMENT);  // an unknown frame kind
}

TEST_CASE("a relayed StageError goes on with a gRPC error code and bounded text") {
    std::vector<dgr::v1::StageError> errors;
    read(relayed(1, 0, "fine?") + relayed(1, 77, std::string(10000, 'm')) + end_frame(1, ""), &errors);
    REQUIRE(errors.size() == 2);
    CHECK(errors[0].code() == (int) StatusCode::UNKNOWN);
    CHECK(errors[0].message().find("(the stage sent status code 0, not a gRPC error) fine?") == 0);
    CHECK(errors[1].code() == (int) StatusCode::UNKNOWN);
    CHECK(errors[1].message().size() == 4096);
    dgr::v1::StageError fine;
    fine.set_code((int) StatusCode::NOT_FOUND);
    fine.set_message("gone");
    CHECK(relayed_error(fine).code() == (int) StatusCode::NOT_FOUND);
    CHECK(relayed_error(fine).message() == "gone");
}

TEST_CASE("stage_error names the stage, its address and the status") {
    const auto e = stage_error(3, "t:9", grpc::Status(StatusCode::DEADLINE_EXCEEDED, "slow"));
    CHECK(e.stage() == 3);
    CHECK(e.address() == "t:9");
    CHECK(e.code() == (int) StatusCode::DEADLINE_EXCEEDED);
    CHECK(e.message() == "slow");
    CHECK(loopback_address("127.0.0.1:5"));
    CHECK(loopback_address("[::1]:5"));
    CHECK_FALSE(loopback_address("192.0.2.1:5"));
}
