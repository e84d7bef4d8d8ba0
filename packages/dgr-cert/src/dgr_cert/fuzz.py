"""`nox -s fuzz`: libFuzzer over the decoders that face untrusted bytes, built with ASan and UBSan.

- `request`: a worker's request path (ShardService::compute: ForwardRequest parse, validation,
  boundary decode into the engine, the tail's sampler), on a head, a middle stage and a tail.
- `gguf`: the range-ownership load (ShardEngine::open over the patched loader) on mutated and
  truncated GGUF files.
- `stage-stream`: the data plane as a stage after the head reads it (the HELLO check, the FORWARD
  frame reader, then the request path and the relay of errors), on a middle stage and the tail.
- `datalink`: the connecting side of a data stream (DataLink's reader of what the stage sends
  back: relayed errors, END).

Both run over a small random-weight qwen3 model. The harnesses and the `fuzz` lane's llama.cpp
are built with clang (Debian's clang-14 and libclang-rt-14-dev): DGR's code with ASan and UBSan,
llama.cpp with ASan and coverage (its known, benign undefined behaviour is out of this lane's
scope; see dgr_llamacpp.build.FUZZ_FLAGS). Seeds are written fresh from
the wire schema and the model; the committed corpus under native/fuzz/corpus (the seeds, GGUF
ones cut short, from `--write-seeds`, and every input that once crashed) runs every time, as
regression inputs.
Crashers found land in native/fuzz/crashers/ and make the run fail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import numpy as np
from dgr_artifacts.downloads import cache_dir
from dgr_native.twins import ArchTwin, generate
from dgr_prd.paths import find_root
from dgr_records import report

# small enough that a decode takes microseconds: fuzzing is executions per second
FUZZ_TWIN = ArchTwin(
    "fuzz-twin", "qwen3", n_layer=8, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=256
)
SPLIT = "0:3,3:6,6:8"
HARNESSES = ("request", "gguf", "stage-stream", "datalink")
SEED_MAX_BYTES = 4097  # seeds committed to the corpus; the whole model is written fresh each run


def fuzz_model() -> Path:
    target = cache_dir() / "models" / "twins" / f"{FUZZ_TWIN.name}-{FUZZ_TWIN.digest()}.gguf"
    if not target.is_file():
        generate(FUZZ_TWIN, target)
    return target


def build_fuzzers(log: TextIO = sys.stderr, instrument_llama: bool = True) -> Path:
    """The harnesses, over the `fuzz` lane's instrumented llama.cpp (a long first build), or for
    a quick smoke (`instrument_llama=False`) over the `cpu` lane's, where only DGR's own code is
    instrumented; returns their directory."""
    from dgr_llamacpp.build import FUZZ_DGR_FLAGS, run_step
    from dgr_native.build import configure_engine

    for tool in ("clang-14", "clang++-14"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: install clang-14 and libclang-rt-14-dev")
    out = configure_engine(
        "fuzz",
        "fuzz" if instrument_llama else "fuzz-smoke",
        "fuzz" if instrument_llama else "cpu",
        [
            "-DCMAKE_C_COMPILER=clang-14",
            "-DCMAKE_CXX_COMPILER=clang++-14",
            f"-DCMAKE_C_FLAGS={FUZZ_DGR_FLAGS}",
            f"-DCMAKE_CXX_FLAGS={FUZZ_DGR_FLAGS}",
            "-DDGR_BUILD_PYTHON=OFF",
            "-DDGR_BUILD_FUZZ=ON",
        ],
    )
    run_step(["cmake", "--build", str(out), "--target", *(f"dgr-fuzz-{h}" for h in HARNESSES)], log)
    return out


def request_seeds() -> list[bytes]:
    """Valid requests for each stage kind and the variants the wire allows: the fuzzer mutates
    from inside the accepted language instead of from noise."""
    from dgr.v1 import shard_pb2 as pb
    from dgr_wire.codec import FNV_OFFSET, encode, prefix_hash

    n_embd = FUZZ_TWIN.n_embd
    rng = np.random.default_rng(20261201)
    seeds: list[bytes] = []
    for session, n in ((2, 1), (4, 3), (6, 8)):
        tokens = [int(t) for t in rng.integers(0, FUZZ_TWIN.n_vocab, n)]
        for sampling in (
            pb.Sampling(),
            pb.Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=7),
            pb.Sampling(temperature=1.0, want_logits=True),
        ):
            seeds.append(
                pb.ForwardRequest(
                    session_id=session,
                    expect=pb.CacheExpectation(epoch=1, n_past=0, prefix_hash=FNV_OFFSET),
                    token_ids=tokens,
                    sampling=sampling,
                ).SerializeToString()
            )
        for dtype in ("f32", "f16", "bf16"):
            # odd session ids: the harness makes the checksum right after mutation
            boundary = encode(rng.standard_normal((n, n_embd)).astype(np.float32), dtype)
            seeds.append(
                pb.ForwardRequest(
                    session_id=session + 1,
                    expect=pb.CacheExpectation(epoch=1, n_past=0),
                    boundary=boundary,
                    token_ids=tokens,
                    boundary_dtype=pb.DTYPE_BF16 if dtype == "f32" else pb.DTYPE_F32,
                    sampling=pb.Sampling(temperature=0.5, top_k=5),
                ).SerializeToString()
            )
        seeds.append(
            pb.ForwardRequest(
                session_id=session,
                expect=pb.CacheExpectation(epoch=2, n_past=0, prefix_hash=prefix_hash(tokens)),
                token_ids=tokens,
                route=pb.RouteSpec(
                    stages=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], stage_index=1
                ),
                last_chunk=True,
                max_tokens=4,
                stop_ids=[1, 2],
                token_interval_ms=25,
            ).SerializeToString()
        )
    # a drafted step at the tail of a 3-stage route: whole, and its two parts (verify.h)
    tokens = [int(t) for t in rng.integers(0, FUZZ_TWIN.n_vocab, 5)]
    route = pb.RouteSpec(stages=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], stage_index=2)
    for first, n, n_draft, index, last in (
        (0, 5, 4, 0, True),
        (0, 3, 2, 0, False),
        (3, 2, 2, 1, True),
    ):
        boundary = encode(rng.standard_normal((n, n_embd)).astype(np.float32), "f32")
        seeds.append(
            pb.ForwardRequest(
                session_id=9,
                expect=pb.CacheExpectation(epoch=1, n_past=first, truncate=index == 0),
                boundary=boundary,
                token_ids=tokens[first : first + n],
                n_draft=n_draft,
                chunk_index=index,
                last_chunk=last,
                route=route,
            ).SerializeToString()
        )
    return seeds


def stage_stream_seeds() -> list[bytes]:
    """Forward-mode requests for the stages after the head, and a few whole data streams (each
    input is also fed as it is: HELLO and frames)."""
    from dgr.v1 import shard_pb2 as pb

    requests = [s for s in request_seeds() if pb.ForwardRequest.FromString(s).HasField("boundary")]
    route = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    out = []
    for i, raw in enumerate(requests):
        req = pb.ForwardRequest.FromString(raw)
        req.route.CopyFrom(pb.RouteSpec(stages=route, stage_index=1 + i % 2))
        req.last_chunk = True
        if i % 3 == 0:
            req.cohort.CopyFrom(pb.Cohort(id=5, size=2))
        out.append(req.SerializeToString())
    # whole streams as serve_data reads them (the listener took the magic): HELLO, REQUEST
    hello = pb.DataHello(stream=pb.DATA_STREAM_FORWARD, version=1, capabilities=["cohorts"])
    opening = frame(pb.DATA_FRAME_HELLO, hello.SerializeToString())
    out += [opening + frame(pb.DATA_FRAME_REQUEST, r) for r in out[:4]]
    return out


def datalink_seeds() -> list[bytes]:
    """What a stage sends back: replies relaying an error from further down, and ENDs."""
    from dgr.v1 import shard_pb2 as pb

    errors = [
        pb.ForwardReply(
            session_id=7,
            epoch=1,
            error=pb.StageError(stage=2, address="127.0.0.1:3", code=code, message="why"),
        ).SerializeToString()
        for code in (8, 14, 0)
    ]
    ends = [pb.DataEnd(code=c, message="bye").SerializeToString() for c in (0, 1, 13)]
    streams = [frame(pb.DATA_FRAME_REPLY, e) + frame(pb.DATA_FRAME_END, ends[2]) for e in errors]
    return errors + ends + streams


def frame(kind: int, payload: bytes) -> bytes:
    """A data-plane frame: uint32 little-endian payload length, kind byte, payload."""
    return len(payload).to_bytes(4, "little") + bytes([kind]) + payload


SEEDS = {
    "request": request_seeds,
    "gguf": lambda: gguf_seeds(),
    "stage-stream": stage_stream_seeds,
    "datalink": datalink_seeds,
}


def gguf_seeds() -> list[bytes]:
    """The model whole and cut short, each under every range selector the harness knows."""
    data = fuzz_model().read_bytes()
    cuts = [len(data), len(data) // 2, 4096, 64, 8]
    return [bytes([selector]) + data[:cut] for cut in cuts for selector in range(7)]


def run(
    harness: str,
    runs: int,
    seconds: int,
    root: Path,
    binaries: Path,
    jobs: int = 1,
) -> dict[str, object]:
    """One harness: the committed corpus (regressions) plus fresh seeds, `runs` executions or
    `seconds`, whichever ends first. Returns the run's figures; crashers go to
    native/fuzz/crashers/<harness>/."""
    corpus = root / "native" / "fuzz" / "corpus" / harness
    crashers = root / "native" / "fuzz" / "crashers" / harness
    crashers.mkdir(parents=True, exist_ok=True)
    seeds = SEEDS[harness]()
    with tempfile.TemporaryDirectory(prefix=f"dgr-fuzz-{harness}-") as tmp:
        work = Path(tmp) / "corpus"
        fresh = Path(tmp) / "seeds"
        work.mkdir()
        fresh.mkdir()
        for i, seed in enumerate(seeds):
            (fresh / f"seed-{i:03d}").write_bytes(seed)
        dirs = [str(work), str(fresh)] + ([str(corpus)] if corpus.is_dir() else [])
        env = {
            **os.environ,
            "DGR_FUZZ_MODEL": str(fuzz_model()),
            "DGR_FUZZ_SPLIT": SPLIT,
            "TMPDIR": tmp,
            "ASAN_OPTIONS": "allocator_may_return_null=1:detect_leaks=0",
            "UBSAN_OPTIONS": "print_stacktrace=1",
        }
        cmd = [
            str(binaries / f"dgr-fuzz-{harness}"),
            f"-runs={runs}",
            f"-max_total_time={seconds}",
            f"-artifact_prefix={crashers}/",
            "-rss_limit_mb=4096",
            "-malloc_limit_mb=2048",
            "-max_len=" + (str(max(len(s) for s in seeds)) if harness == "gguf" else "4096"),
            "-print_final_stats=1",
            *([f"-jobs={jobs}", f"-workers={jobs}"] if jobs > 1 else []),
            *dirs,
        ]
        t0 = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
    log = done.stdout + done.stderr
    execs = sum(int(m) for m in re.findall(r"stat::number_of_executed_units:\s*(\d+)", log))
    found = sorted(p.name for p in crashers.iterdir() if p.is_file())
    result: dict[str, object] = {
        "harness": harness,
        "executions": execs,
        "seconds": round(wall, 1),
        "exec_per_s": round(execs / wall, 1) if wall else 0.0,
        "crashes": len(found),
        "crasher_files": found,
        "exit_code": done.returncode,
        "regression_inputs": len(list(corpus.iterdir())) if corpus.is_dir() else 0,
    }
    if done.returncode != 0 or found:
        result["log_tail"] = log[-4000:]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_cert.fuzz")
    parser.add_argument("--harness", choices=HARNESSES, nargs="+", default=list(HARNESSES))
    parser.add_argument("--runs", type=int, default=1_000_000, help="executions per harness")
    parser.add_argument("--seconds", type=int, default=3000, help="time limit per harness")
    parser.add_argument("--gguf-runs", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--llama",
        choices=["fuzz", "cpu"],
        default="fuzz",
        help="the llama.cpp the harnesses link: the fuzz lane's, instrumented (a 30-minute first "
        "build), or the cpu lane's, where only DGR's own code is instrumented",
    )
    parser.add_argument("--out", default="evidence/fuzz/fuzz.json")
    parser.add_argument(
        "--write-seeds",
        action="store_true",
        help="write the seeds into native/fuzz/corpus (small ones only: GGUF prefixes) and stop",
    )
    args = parser.parse_args(argv)
    root = find_root().root
    if args.write_seeds:
        for harness in HARNESSES:
            seeds = SEEDS[harness]()
            corpus = root / "native" / "fuzz" / "corpus" / harness
            corpus.mkdir(parents=True, exist_ok=True)
            for i, seed in enumerate(s for s in seeds if len(s) <= SEED_MAX_BYTES):
                (corpus / f"seed-{i:03d}").write_bytes(seed)
        return 0
    binaries = build_fuzzers(instrument_llama=args.llama == "fuzz")
    results = []
    for harness in args.harness:
        runs = args.gguf_runs if harness == "gguf" else args.runs
        r = run(harness, runs, args.seconds, root, binaries, args.jobs)
        r["llama_instrumented"] = args.llama == "fuzz"
        print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
        if "log_tail" in r:
            print(r["log_tail"], file=sys.stderr)
        results.append(r)
    out = root / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    # the harnesses not run this time keep their last recorded run
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for r in results:
        r["measured_utc"] = now
    kept = json.loads(out.read_text()).get("runs", []) if out.is_file() else []
    ran = {r["harness"] for r in results}
    merged = [r for r in kept if r.get("harness") not in ran] + results
    out.write_text(json.dumps({"measured_utc": now, "runs": merged}, indent=2) + "\n")
    by = {str(r["harness"]): r for r in results}
    report(
        "fuzz",
        {f"{h}_{k}": by[h][k] for h in by for k in ("executions", "crashes", "exec_per_s")},
    )
    return 0 if all(r["crashes"] == 0 and r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
