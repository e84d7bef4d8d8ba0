// The worker's command line: every option declared once, here (CLI11), with its help, default and
// range. `dgr worker` forwards everything it does not resolve itself (the model's name, a
// recipe's node) to this table, so the two cannot disagree; `--check-args` parses a command line,
// prints the options as resolved and exits 0 without loading anything, which is how the tests
// check every command line the documentation shows.
#pragma once

#include "service.h"

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace dgr::worker {

struct WorkerOptions {
    std::string model, listen = "127.0.0.1:0";
    int32_t first = 0, last = -1, threads = 2, n_ctx = 2048, n_batch = 512, max_sessions = 4;
    int drain_seconds = 10;
    int poll = 50;     // ggml threadpool spin level while a forward is in flight: the pool wakes as
                       // the forward starts and polls for its graph (0: it sleeps until the graph
                       // wakes it); between forwards it sleeps whatever this says
    int prio = 0;      // compute threads' priority, as llama.cpp's --prio (0 normal .. 3 realtime);
                       // -1 (auto, opt-in): 1 where allowed and the host's workers take turns
    int rollback = 16; // rejected drafts one forward may drop where state is not positional (V4)
    int gpu_layers = 0;  // owned layers on the lane's device (the default: all off the CPU lane)
    bool mtp = false;  // the tail serves the MTP (nextn) block and drafts with it
    int cache_sessions = -1;      // prefix reuse: finished sessions kept (-1: max_sessions)
    uint64_t cache_bytes = 0;     // and the most KV they hold (0: no bound but the count)
    bool batch_invariant = true;  // --kernels invariant (default) or stock
    bool warmup = true;
    int keepalive_ms = 10000;  // every link, both sides
    bool data_links = true;  // forward mode's links to plaintext peers: data streams (else gRPC calls)
    int max_data_streams = 0;  // data streams served at once (0: 4 per session slot + 16)
    std::string compute_slots = "auto";  // a directory, "auto" or "none"
    bool pin = true;  // each forward's compute threads on the cores of its compute slot (slots.h)
    std::vector<int32_t> cpus;  // --cpus: the cores this worker may run on, all its threads (empty:
                                // what it was started with); the gate pins each stage to its own
    std::string metrics_listen;          // HOST:PORT for /metrics and /metrics.json (empty: off)
    // files named on the command line, and what they hold once read (read_files)
    std::string token_file, tls_cert_file, tls_key_file, tls_client_ca_file, peer_ca_file;
    std::string tls_cert, tls_key, tls_client_ca, peer_ca;  // PEM contents
    bool check_args = false;  // print the options as resolved and exit
    bool version = false;
    ServiceOptions service;
};

// Declares every option on `app`, bound to `o` (defaults as `o` holds them).
void declare_options(CLI::App & app, WorkerOptions & o);

// Parses argv into `o`. Returns -1 to go on; otherwise the exit code (0 after --help, --version
// or --check-args, having printed what they print; 2 after a usage error, printed to stderr naming
// the option). `read` reads the files the options name (--auth-token-file, TLS), as a start does
// and --check-args does not.
int parse_options(int argc, const char * const * argv, WorkerOptions & o, bool read = true);

// The files the options name, read into `o`; throws std::invalid_argument naming the option.
void read_files(WorkerOptions & o);

}  // namespace dgr::worker
