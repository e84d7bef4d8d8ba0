#include "options.h"

#include "dgr/shard_engine.h"
#include "forwarding.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace dgr::worker {

namespace {

constexpr int kMax = 1 << 24;

std::string read_text(const std::string & path, const std::string & option) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::invalid_argument(option + ": cannot read " + path);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A certificate, key or CA file: gRPC would refuse one that is not PEM only when the server starts
// (then reported as "cannot listen") or at a peer link's first handshake.
std::string read_pem(const std::string & path, const std::string & option) {
    std::string text = read_text(path, option);
    if (text.find("-----BEGIN ") == std::string::npos) {
        throw std::invalid_argument(option + ": " + path + " is not PEM (no -----BEGIN line)");
    }
    return text;
}

int to_int(const std::string & option, const std::string & value, int lo, int hi) {
    size_t used = 0;
    long v = 0;
    try {
        v = std::stol(value, &used);
    } catch (const std::exception &) {
        used = 0;
    }
    if (used != value.size() || v < lo || v > hi) {
        throw CLI::ValidationError(option, value + " is not an integer in [" + std::to_string(lo) + ", " +
                                               std::to_string(hi) + "]");
    }
    return (int) v;
}

// a byte count: digits with an optional K, M or G suffix (binary units), at most 1 TiB
uint64_t parse_bytes(const std::string & option, const std::string & value) {
    static const std::string kSuffixes = "KMG";
    std::string digits = value;
    int shift = 0;
    if (!digits.empty() && kSuffixes.find(digits.back()) != std::string::npos) {
        shift = 10 * (int) (kSuffixes.find(digits.back()) + 1);
        digits.pop_back();
    }
    const bool ok = !digits.empty() && digits.size() <= 13 && std::all_of(digits.begin(), digits.end(), ::isdigit);
    const uint64_t v = ok ? std::stoull(digits) << shift : 0;
    if (!ok || v > (1ull << 40) || (shift > 0 && (v >> shift) != std::stoull(digits))) {
        throw CLI::ValidationError(option, value + " is not a byte count (digits, then K, M or G) up to 1T");
    }
    return v;
}

// NAME@HEX as dgr_artifacts.recipe.Recipe.id makes it: at most 128 characters of [A-Za-z0-9._@-]
std::string recipe_id(const std::string & value) {
    const bool ok = !value.empty() && value.size() <= 128 &&
                    std::all_of(value.begin(), value.end(), [](unsigned char c) {
                        return std::isalnum(c) || c == '.' || c == '_' || c == '@' || c == '-';
                    });
    if (!ok) throw CLI::ValidationError("--recipe-id", value + " is not 1-128 characters of [A-Za-z0-9._@-]");
    return value;
}

// the model's fingerprint as dgr_artifacts makes it (recipe.Hex64): 64 lowercase hex digits.
// Describe carries it as a proto3 string, which must be UTF-8: a byte like 0xff in it made every
// client's Describe fail to parse, and any other text matched no manifest.
std::string fingerprint(const std::string & value) {
    const bool ok = value.size() == 64 && std::all_of(value.begin(), value.end(), [](unsigned char c) {
                        return std::isdigit(c) || (c >= 'a' && c <= 'f');
                    });
    if (!ok) throw CLI::ValidationError("--model-fingerprint", value.substr(0, 80) + " is not 64 lowercase hex digits");
    return value;
}

// the model's name as a client sees it: the GGUF's file name less .gguf, at most 128 characters,
// a byte outside printable ASCII as '_' (a proto3 string must be UTF-8; a file name need not be)
std::string model_name(const std::string & path) {
    std::string name = path.substr(path.find_last_of('/') + 1);
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".gguf") == 0) name.resize(name.size() - 5);
    name.resize(std::min<size_t>(name.size(), 128));
    for (char & c : name) {
        if ((unsigned char) c < 0x20 || (unsigned char) c > 0x7e) c = '_';
    }
    return name;
}

// where to listen: HOST:PORT with a port in 0..65535 (0 picks one), or unix:PATH where allowed;
// getaddrinfo would take a port past 65535 modulo 2**16 and listen somewhere not named
std::string listen_address(const std::string & option, const std::string & value, bool unix_ok) {
    if (unix_ok && value.rfind("unix", 0) == 0 && value.find(':') != std::string::npos &&
        value.find(':') + 1 < value.size()) {
        return value;
    }
    std::string host, port;
    if (!split_address(value, &host, &port)) {
        throw CLI::ValidationError(option, value + " is not HOST:PORT with a port in 0..65535" +
                                               std::string(unix_ok ? ", or unix:PATH" : ""));
    }
    return value;
}

// a CPU list as taskset -c takes it: N, N-M, comma-separated; distinct and ascending on output
std::vector<int32_t> parse_cpus(const std::string & option, const std::string & value) {
    std::vector<int32_t> out;
    std::stringstream parts(value);
    std::string part;
    while (std::getline(parts, part, ',')) {
        const auto dash = part.find('-');
        const int lo = to_int(option, part.substr(0, dash), 0, 4095);
        const int hi = dash == std::string::npos ? lo : to_int(option, part.substr(dash + 1), 0, 4095);
        if (hi < lo) throw CLI::ValidationError(option, part + " is not a range of cores (N-M with N <= M)");
        for (int c = lo; c <= hi; ++c) out.push_back(c);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    if (out.empty()) throw CLI::ValidationError(option, "names no CPU: " + value);
    return out;
}

// an integer option in [lo, hi]
template <typename T> CLI::Option * integer(CLI::App & app, const std::string & name, T & into, int lo, int hi,
                                            const std::string & help) {
    return app
        .add_option_function<std::string>(
            name, [&into, name, lo, hi](const std::string & v) { into = (T) to_int(name, v, lo, hi); }, help)
        ->type_name("N")
        ->default_str(std::to_string(into));
}

// one of two words, into a bool (true: the first)
CLI::Option * choice(CLI::App & app, const std::string & name, bool & into, const std::string & yes,
                     const std::string & no, const std::string & help) {
    return app
        .add_option_function<std::string>(
            name,
            [&into, name, yes, no](const std::string & v) {
                if (v != yes && v != no) throw CLI::ValidationError(name, yes + " or " + no + ", not " + v);
                into = v == yes;
            },
            help)
        ->type_name(yes + "|" + no)
        ->default_str(into ? yes : no);
}

void declare_engine(CLI::App & app, WorkerOptions & o) {
    app.add_option("--model", o.model, "the GGUF this worker serves a range of")->required()->type_name("PATH");
    app.add_option_function<std::string>(
           "--layers",
           [&o](const std::string & v) {
               const auto colon = v.find(':');
               if (colon == std::string::npos) throw CLI::ValidationError("--layers", "takes FIRST:LAST, not " + v);
               o.first = to_int("--layers", v.substr(0, colon), 0, kMax);
               o.last = to_int("--layers", v.substr(colon + 1), -1, kMax);
           },
           "the main layers [FIRST, LAST) it owns (LAST -1: through the last)")
        ->type_name("FIRST:LAST")
        ->default_str("0:-1");
    integer(app, "--threads", o.threads, 1, 512, "compute threads per forward");
    integer(app, "--n-ctx", o.n_ctx, 1, kMax, "context per session");
    integer(app, "--n-batch", o.n_batch, 1, kMax, "most tokens one forward carries");
    integer(app, "--max-sessions", o.max_sessions, 1, 4096, "session slots (each with its KV)");
    integer(app, "--poll", o.poll, 0, 100, "ggml threadpool spin level while a forward is in flight");
    app.add_option_function<std::string>(
           "--prio", [&o](const std::string & v) { o.prio = v == "auto" ? -1 : to_int("--prio", v, 0, 3); },
           "compute threads' priority as llama.cpp's --prio (0 normal .. 3 realtime); auto: 1 where allowed "
           "and the host's workers take turns (opt-in)")
        ->type_name("auto|0-3")
        ->default_str("0");
    integer(app, "--rollback", o.rollback, 0, 64, "drafts one forward may drop where state is not positional (V4)");
    integer(app, "--gpu-layers", o.gpu_layers, -1, 4096, "owned layers on the lane's device (-1: all)");
    app.add_flag("--mtp", o.mtp, "the tail also serves the model's MTP (nextn) block and drafts with it");
    integer(app, "--prefix-cache-sessions", o.cache_sessions, 0, 4096,
            "prefix reuse: finished sessions whose KV is kept (default: --max-sessions; 0: none)")
        ->default_str("max-sessions");
    app.add_option_function<std::string>(
           "--prefix-cache-bytes", [&o](const std::string & v) { o.cache_bytes = parse_bytes("--prefix-cache-bytes", v); },
           "prefix reuse: the most KV the kept sessions hold (0: no bound but their number)")
        ->type_name("N[K|M|G]")
        ->default_str("0");
    choice(app, "--kernels", o.batch_invariant, "invariant", "stock",
           "invariant: a sequence's values do not depend on its batch (batched == solo, reuse == full prefill, "
           "bit for bit); stock: ggml's batch-shaped kernels");
    app.add_flag_callback("--no-warmup", [&o] { o.warmup = false; }, "serve without the warm-up forwards");
    app.add_option("--compute-slots", o.compute_slots, "slots shared by the host's workers: DIR, auto or none")
        ->type_name("DIR|auto|none")
        ->capture_default_str();
    choice(app, "--pin", o.pin, "on", "off", "each forward's threads on the cores of its compute slot");
    app.add_option_function<std::string>(
           "--cpus", [&o](const std::string & v) { o.cpus = parse_cpus("--cpus", v); },
           "the cores this worker runs on, every thread of it (as taskset -c: 0-3,6; default: what it was "
           "started with)")
        ->type_name("LIST");
}

void declare_service(CLI::App & app, WorkerOptions & o) {
    app.add_option_function<std::string>(
           "--listen", [&o](const std::string & v) { o.listen = listen_address("--listen", v, true); },
           "HOST:PORT (port 0 picks one), or unix:PATH")
        ->type_name("HOST:PORT")
        ->default_str(o.listen);
    integer(app, "--max-message-bytes", o.service.max_message_bytes, 1024, INT32_MAX / 2, "largest message taken");
    integer(app, "--max-queue", o.service.max_queue, 0, 1 << 20, "forwards that may wait behind the one computing");
    integer(app, "--max-batch", o.service.max_batch, 1, 4096, "decode steps computed in one llama_decode (1: FIFO)");
    integer(app, "--gather-us", o.service.gather_us, 0, 1000 * 1000,
            "how long a decode step that arrived in a cohort waits for the rest of it");
    choice(app, "--convoy", o.service.convoy_auto, "auto", "always",
           "the head: sessions travel apart where the links take much more than the stages' compute "
           "(auto), or always as a convoy within the gather window");
    app.add_option_function<std::string>(
           "--draft-part-rows",
           [&o](const std::string & v) {
               o.service.draft_part_rows = to_int("--draft-part-rows", v, 0, 64);
               if (o.service.draft_part_rows == 1) throw CLI::ValidationError("--draft-part-rows", "0 (whole steps) or 2..64");
           },
           "the head, behind slow links: a drafted step of more rows goes in parts of about N rows")
        ->type_name("0|2-64")
        ->default_str(std::to_string(o.service.draft_part_rows));
    integer(app, "--keepalive-ms", o.keepalive_ms, 200, 3600 * 1000, "every link's keepalive, both sides");
    app.add_option_function<std::string>(
           "--model-fingerprint", [&o](const std::string & v) { o.service.fingerprint = fingerprint(v); },
           "the GGUF's fingerprint (given by dgr worker)")
        ->type_name("HEX");
    app.add_option_function<std::string>(
           "--recipe-id", [&o](const std::string & v) { o.service.recipe = recipe_id(v); }, "the recipe served")
        ->type_name("ID");
    integer(app, "--drain-seconds", o.drain_seconds, 0, 3600, "on SIGTERM, how long streams in flight may finish");
    choice(app, "--links", o.data_links, "data", "grpc",
           "forward mode's links to plaintext peers: framed TCP streams (data) or gRPC calls");
    integer(app, "--max-data-streams", o.max_data_streams, 1, 65536,
            "data streams served at once (default: 4 per session slot + 16)")
        ->default_str("4 x max-sessions + 16");
    app.add_option_function<std::string>(
           "--metrics-listen",
           [&o](const std::string & v) { o.metrics_listen = listen_address("--metrics-listen", v, false); },
           "serve /metrics and /metrics.json at HOST:PORT")
        ->type_name("HOST:PORT");
    app.add_option("--auth-token-file", o.token_file, "require the bearer token this file holds on every call")
        ->type_name("FILE");
    app.add_option("--tls-cert", o.tls_cert_file, "PEM server certificate (serve TLS)")->type_name("FILE");
    app.add_option("--tls-key", o.tls_key_file, "PEM key of the server certificate")->type_name("FILE");
    app.add_option("--tls-client-ca", o.tls_client_ca_file, "PEM CA clients' certificates must chain to (mTLS)")
        ->type_name("FILE");
    app.add_option("--peer-ca", o.peer_ca_file,
                   "PEM CA of the other workers' certificates (default: --tls-client-ca, else the system's)")
        ->type_name("FILE");
}

std::string cpu_list(const std::vector<int32_t> & cpus) {
    std::string out;
    for (int32_t c : cpus) out += (out.empty() ? "" : ",") + std::to_string(c);
    return out;
}

// the options after parsing, one per line, as the worker will use them
std::string resolved(const WorkerOptions & o) {
    std::ostringstream s;
    s << "model = " << o.model << "\nlayers = " << o.first << ":" << o.last << "\nlisten = " << o.listen
      << "\nthreads = " << o.threads << "\nn_ctx = " << o.n_ctx << "\nn_batch = " << o.n_batch
      << "\nmax_sessions = " << o.max_sessions << "\npoll = " << o.poll << "\nprio = " << (o.prio < 0 ? "auto" : std::to_string(o.prio))
      << "\nrollback = " << o.rollback << "\ngpu_layers = " << o.gpu_layers << "\nmtp = " << o.mtp
      << "\nprefix_cache_sessions = " << (o.cache_sessions < 0 ? o.max_sessions : o.cache_sessions)
      << "\nprefix_cache_bytes = " << o.cache_bytes << "\nkernels = " << (o.batch_invariant ? "invariant" : "stock")
      << "\nwarmup = " << o.warmup << "\ncompute_slots = " << o.compute_slots << "\npin = " << (o.pin ? "on" : "off")
      << "\ncpus = " << cpu_list(o.cpus)
      << "\nmax_message_bytes = " << o.service.max_message_bytes << "\nmax_queue = " << o.service.max_queue
      << "\nmax_batch = " << o.service.max_batch << "\ngather_us = " << o.service.gather_us
      << "\nconvoy = " << (o.service.convoy_auto ? "auto" : "always")
      << "\ndraft_part_rows = " << o.service.draft_part_rows << "\nkeepalive_ms = " << o.keepalive_ms
      << "\ndrain_seconds = " << o.drain_seconds << "\nlinks = " << (o.data_links ? "data" : "grpc")
      << "\nmax_data_streams = " << (o.max_data_streams > 0 ? o.max_data_streams : o.max_sessions * 4 + 16)
      << "\nmetrics_listen = " << o.metrics_listen << "\nauth_token_file = " << o.token_file
      << "\ntls_cert = " << o.tls_cert_file << "\ntls_key = " << o.tls_key_file << "\ntls_client_ca = " << o.tls_client_ca_file
      << "\npeer_ca = " << o.peer_ca_file << "\nmodel_name = " << o.service.model_name
      << "\nmodel_fingerprint = " << o.service.fingerprint
      << "\nrecipe_id = " << o.service.recipe << "\n";
    return s.str();
}

}  // namespace

void declare_options(CLI::App & app, WorkerOptions & o) {
    app.description("dgr-shard-worker: one layer range of a GGUF model served over gRPC (dgr.v1.ShardService)");
    app.set_version_flag("--version", [] {
        const dgr::BuildInfo & b = dgr::build_info();
        return std::string("dgr-shard-worker llama.cpp ") + b.llama_commit + " patches " + b.patch_stack_sha256 +
               " lane " + b.lane + " schema " + std::to_string(b.schema_version);
    });
    app.add_flag("--check-args", o.check_args, "parse the options, print them as resolved and exit 0");
    declare_engine(app, o);
    declare_service(app, o);
}

void read_files(WorkerOptions & o) {
    if (!o.token_file.empty()) {
        std::string token = read_text(o.token_file, "--auth-token-file");
        while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) token.pop_back();
        if (token.empty()) throw std::invalid_argument("--auth-token-file: the file holds no token");
        o.service.token = token;
    }
    if (!o.tls_cert_file.empty()) o.tls_cert = read_pem(o.tls_cert_file, "--tls-cert");
    if (!o.tls_key_file.empty()) o.tls_key = read_pem(o.tls_key_file, "--tls-key");
    if (!o.tls_client_ca_file.empty()) o.tls_client_ca = read_pem(o.tls_client_ca_file, "--tls-client-ca");
    if (!o.peer_ca_file.empty()) o.peer_ca = read_pem(o.peer_ca_file, "--peer-ca");
}

int parse_options(int argc, const char * const * argv, WorkerOptions & o, bool read) {
    o.gpu_layers = std::string(dgr::build_info().lane) == "cpu" ? 0 : -1;
    o.keepalive_ms = kKeepaliveMs;
    CLI::App app;
    declare_options(app, o);
    try {
        app.parse(argc, argv);
        if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
            throw CLI::ValidationError("--tls-cert", "--tls-cert and --tls-key go together");
        }
        if (!o.tls_client_ca_file.empty() && o.tls_cert_file.empty()) {
            throw CLI::ValidationError("--tls-client-ca", "--tls-client-ca needs --tls-cert and --tls-key");
        }
    } catch (const CLI::CallForHelp & e) {
        return app.exit(e);
    } catch (const CLI::CallForVersion & e) {
        return app.exit(e);
    } catch (const CLI::ParseError & e) {
        std::cerr << "dgr-shard-worker: " << e.what() << "\n(dgr-shard-worker --help lists the options)\n";
        return 2;
    }
    o.service.model_name = model_name(o.model);
    if (o.check_args) {
        std::cout << resolved(o);
        return 0;
    }
    if (read) {
        try {
            read_files(o);
        } catch (const std::invalid_argument & e) {
            std::cerr << "dgr-shard-worker: " << e.what() << "\n";
            return 2;
        }
    }
    return -1;
}

}  // namespace dgr::worker
