// The worker's option table (options.h): defaults, every kind of value, refusals naming the
// option, and --check-args, which parses without reading the files the options name.
#include "options.h"
#include "support.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

using dgr::worker::WorkerOptions;

namespace {

// parse_options over a command line; returns its code, stdout and stderr
int parse(std::vector<std::string> args, WorkerOptions & o, std::string * out = nullptr, std::string * err = nullptr,
          bool read = true) {
    args.insert(args.begin(), "dgr-shard-worker");
    std::vector<const char *> argv;
    for (const auto & a : args) argv.push_back(a.c_str());
    std::ostringstream o_buf, e_buf;
    auto * old_out = std::cout.rdbuf(o_buf.rdbuf());
    auto * old_err = std::cerr.rdbuf(e_buf.rdbuf());
    const int code = dgr::worker::parse_options((int) argv.size(), argv.data(), o, read);
    std::cout.rdbuf(old_out);
    std::cerr.rdbuf(old_err);
    if (out) *out = o_buf.str();
    if (err) *err = e_buf.str();
    return code;
}

std::string refusal(std::vector<std::string> args) {
    WorkerOptions o;
    std::string err;
    CHECK(parse(std::move(args), o, nullptr, &err) == 2);
    return err;
}

}  // namespace

TEST_CASE("options: defaults, and each kind of value") {
    WorkerOptions o;
    REQUIRE(parse({"--model", "m.gguf"}, o) == -1);
    CHECK(o.model == "m.gguf");
    CHECK(o.first == 0);
    CHECK(o.last == -1);
    CHECK(o.threads == 2);
    CHECK(o.service.max_queue == 16);
    CHECK(o.batch_invariant);
    CHECK(o.data_links);
    CHECK(o.prio == 0);
    CHECK(o.service.convoy_auto);
    WorkerOptions p;
    REQUIRE(parse({"--model", "m", "--layers", "10:20", "--threads", "1", "--prio", "auto", "--kernels", "stock",
                   "--links", "grpc", "--pin", "off", "--prefix-cache-bytes", "2G", "--gpu-layers", "-1", "--mtp",
                   "--no-warmup", "--draft-part-rows", "0", "--max-message-bytes", "2048", "--convoy", "always"},
                  p) == -1);
    CHECK(p.first == 10);
    CHECK(p.last == 20);
    CHECK(p.prio == -1);
    CHECK_FALSE(p.batch_invariant);
    CHECK_FALSE(p.data_links);
    CHECK_FALSE(p.pin);
    CHECK(p.cache_bytes == (2ull << 30));
    CHECK(p.gpu_layers == -1);
    CHECK(p.mtp);
    CHECK_FALSE(p.warmup);
    CHECK(p.service.draft_part_rows == 0);
    CHECK(p.service.max_message_bytes == 2048);
    CHECK_FALSE(p.service.convoy_auto);
}

TEST_CASE("options: a bad value or an unknown option is refused, naming it") {
    CHECK(refusal({}).find("--model is required") != std::string::npos);
    CHECK(refusal({"--model", "m", "--threads", "0"}).find("--threads: 0 is not an integer in [1, 512]") != std::string::npos);
    CHECK(refusal({"--model", "m", "--threads", "2x"}).find("--threads: 2x") != std::string::npos);
    CHECK(refusal({"--model", "m", "--layers", "10"}).find("--layers: takes FIRST:LAST") != std::string::npos);
    CHECK(refusal({"--model", "m", "--prio", "4"}).find("--prio: 4 is not an integer in [0, 3]") != std::string::npos);
    CHECK(refusal({"--model", "m", "--kernels", "fast"}).find("--kernels: invariant or stock, not fast") != std::string::npos);
    CHECK(refusal({"--model", "m", "--convoy", "never"}).find("--convoy: auto or always, not never") != std::string::npos);
    CHECK(refusal({"--model", "m", "--draft-part-rows", "1"}).find("0 (whole steps) or 2..64") != std::string::npos);
    CHECK(refusal({"--model", "m", "--prefix-cache-bytes", "2T"}).find("is not a byte count") != std::string::npos);
    CHECK(refusal({"--model", "m", "--recipe-id", "a b"}).find("--recipe-id: a b is not 1-128 characters") != std::string::npos);
    CHECK(refusal({"--model", "m", "--tls-cert", "c.pem"}).find("--tls-cert and --tls-key go together") != std::string::npos);
    CHECK(refusal({"--model", "m", "--tls-client-ca", "ca.pem"}).find("needs --tls-cert") != std::string::npos);
    CHECK(refusal({"--model", "m", "--frobnicate"}).find("--frobnicate") != std::string::npos);
    CHECK(refusal({"--model", "m", "--threads"}).find("--threads") != std::string::npos);
}

TEST_CASE("options: a model fingerprint is 64 lowercase hex digits, as dgr worker gives it") {
    WorkerOptions o;
    REQUIRE(parse({"--model", "m", "--model-fingerprint", std::string(64, 'a')}, o) == -1);
    CHECK(o.service.fingerprint == std::string(64, 'a'));
    for (const std::string bad : {std::string("zz zz"), std::string(63, 'a'), std::string(64, 'A'),
                                  std::string(62, 'a') + "\xff\xfe"}) {
        CHECK(refusal({"--model", "m", "--model-fingerprint", bad}).find("is not 64 lowercase hex digits") !=
              std::string::npos);
    }
}

TEST_CASE("options: the model's name is its file name less .gguf, printable ASCII, at most 128") {
    WorkerOptions o;
    REQUIRE(parse({"--model", "/models/smollm2-135m-q4_1.gguf"}, o) == -1);
    CHECK(o.service.model_name == "smollm2-135m-q4_1");
    WorkerOptions p;
    REQUIRE(parse({"--model", "rel/caf\xc3\xa9 model.bin"}, p) == -1);
    CHECK(p.service.model_name == "caf__ model.bin");
    WorkerOptions q;
    REQUIRE(parse({"--model", std::string(200, 'm') + ".gguf"}, q) == -1);
    CHECK(q.service.model_name == std::string(128, 'm'));
}

TEST_CASE("options: a listen address names a port in 0..65535, a CPU range runs upward") {
    // getaddrinfo takes a port past 65535 modulo 2**16: 127.0.0.1:99999 listened on 34463
    CHECK(refusal({"--model", "m", "--listen", "127.0.0.1:99999"})
              .find("--listen: 127.0.0.1:99999 is not HOST:PORT with a port in 0..65535, or unix:PATH") !=
          std::string::npos);
    CHECK(refusal({"--model", "m", "--listen", "localhost"}).find("--listen: localhost is not HOST:PORT") !=
          std::string::npos);
    CHECK(refusal({"--model", "m", "--listen", "h:5x"}).find("--listen: h:5x") != std::string::npos);
    CHECK(refusal({"--model", "m", "--metrics-listen", "nope"}).find("--metrics-listen: nope is not HOST:PORT") !=
          std::string::npos);
    CHECK(refusal({"--model", "m", "--metrics-listen", "unix:/tmp/m"}).find("--metrics-listen: unix:/tmp/m") !=
          std::string::npos);
    CHECK(refusal({"--model", "m", "--cpus", "1-0"}).find("--cpus: 1-0 is not a range of cores") != std::string::npos);
    WorkerOptions o;
    REQUIRE(parse({"--model", "m", "--listen", "[::1]:0", "--metrics-listen", "0.0.0.0:65535", "--cpus", "0-1"}, o) ==
            -1);
    CHECK(o.listen == "[::1]:0");
    CHECK(o.metrics_listen == "0.0.0.0:65535");
    WorkerOptions u;
    REQUIRE(parse({"--model", "m", "--listen", "unix:/tmp/w.sock"}, u) == -1);
    CHECK(u.listen == "unix:/tmp/w.sock");
}

TEST_CASE("options: --check-args prints the options as resolved without reading their files") {
    WorkerOptions o;
    std::string out;
    REQUIRE(parse({"--check-args", "--model", "m", "--layers", "0:15", "--auth-token-file", "/no/such/file",
                   "--max-sessions", "3"},
                  o, &out) == 0);
    CHECK(out.find("layers = 0:15\n") != std::string::npos);
    CHECK(out.find("auth_token_file = /no/such/file\n") != std::string::npos);
    CHECK(out.find("prefix_cache_sessions = 3\n") != std::string::npos);  // default: max_sessions
    CHECK(out.find("max_data_streams = 28\n") != std::string::npos);      // 4 per session + 16
    WorkerOptions started;
    std::string err;
    CHECK(parse({"--model", "m", "--auth-token-file", "/no/such/file"}, started, nullptr, &err) == 2);
    CHECK(err.find("--auth-token-file: cannot read /no/such/file") != std::string::npos);
}

TEST_CASE("options: the token file's token, its line end stripped, and an empty one refused") {
    const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/dgr-options-token";
    {
        std::ofstream(path) << "s3cret\r\n";
    }
    WorkerOptions o;
    REQUIRE(parse({"--model", "m", "--auth-token-file", path}, o) == -1);
    CHECK(o.service.token == "s3cret");
    {
        std::ofstream(path) << "\n";
    }
    WorkerOptions e;
    std::string err;
    CHECK(parse({"--model", "m", "--auth-token-file", path}, e, nullptr, &err) == 2);
    CHECK(err.find("the file holds no token") != std::string::npos);
    std::remove(path.c_str());
}

TEST_CASE("options: a certificate, key or CA file that is not PEM is refused naming the option") {
    const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/dgr-options-pem";
    {
        std::ofstream(path) << "not a certificate\n";
    }
    for (const char * option : {"--tls-cert", "--peer-ca"}) {
        WorkerOptions o;
        std::string err;
        std::vector<std::string> args = {"--model", "m", option, path};
        if (std::string(option) == "--tls-cert") args.insert(args.end(), {"--tls-key", path});
        CHECK(parse(args, o, nullptr, &err) == 2);
        CHECK(err.find(std::string(option) + ": " + path + " is not PEM") != std::string::npos);
    }
    {
        std::ofstream(path) << "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    }
    WorkerOptions o;
    REQUIRE(parse({"--model", "m", "--peer-ca", path}, o) == -1);
    CHECK(o.peer_ca.find("-----BEGIN CERTIFICATE-----") == 0);
    std::remove(path.c_str());
}

TEST_CASE("options: --help and --version exit 0") {
    WorkerOptions o;
    std::string out;
    CHECK(parse({"--help"}, o, &out) == 0);
    CHECK(out.find("--prefix-cache-sessions") != std::string::npos);
    CHECK(parse({"--version"}, o, &out) == 0);
    CHECK(out.find("dgr-shard-worker llama.cpp ") != std::string::npos);
}
