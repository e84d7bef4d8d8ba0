"""The libFuzzer harnesses (native/fuzz) build with ASan and UBSan and run clean for a short
while over their seeds and the committed regression corpus: the C++ decoders a worker runs on
untrusted bytes, not a Python model of them. `nox -s fuzz` runs 1M request executions over an
instrumented llama.cpp as well, and 1M each through the data plane's two readers."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from dgr_cert import fuzz
from dgr_prd.paths import find_root

pytestmark = pytest.mark.skipif(
    shutil.which("clang++-14") is None, reason="Debian clang-14 (scripts/apt-packages.txt)"
)


@pytest.fixture(scope="module")
def binaries() -> Path:
    return fuzz.build_fuzzers(sys.stderr, instrument_llama=False)


@pytest.mark.parametrize(
    "harness,runs", [("request", 3000), ("gguf", 150), ("stage-stream", 3000), ("datalink", 5000)]
)
def test_harness_runs_clean(binaries: Path, harness: str, runs: int) -> None:
    result = fuzz.run(harness, runs, 120, find_root().root, binaries)
    assert result["crashes"] == 0 and result["exit_code"] == 0, result.get("log_tail")
    assert int(str(result["executions"])) >= min(runs, 100)


def test_the_request_seeds_reach_every_stage_kind() -> None:
    """Seeds for a head (token ids), later stages (a boundary in each dtype) and forward mode."""
    from dgr.v1 import shard_pb2 as pb

    seeds = [pb.ForwardRequest.FromString(s) for s in fuzz.request_seeds()]
    assert any(s.token_ids and not s.HasField("boundary") for s in seeds)
    assert {s.boundary.dtype for s in seeds if s.HasField("boundary")} == {
        pb.DTYPE_F32,
        pb.DTYPE_F16,
        pb.DTYPE_BF16,
    }
    assert any(s.HasField("route") for s in seeds)
    # a drafted step in parts: its later part holds drafts only
    assert any(s.chunk_index > 0 and s.n_draft == len(s.token_ids) for s in seeds)


def test_the_data_plane_seeds_reach_past_the_opening() -> None:
    """Stage-stream seeds are forward-mode requests for the middle stage and the tail (and whole
    streams: magic, HELLO, REQUEST); datalink seeds relay errors and end streams."""
    from dgr.v1 import shard_pb2 as pb

    seeds = fuzz.stage_stream_seeds()
    hello = bytes([pb.DATA_FRAME_HELLO])
    streams = [s for s in seeds if s[4:5] == hello]
    requests = [pb.ForwardRequest.FromString(s) for s in seeds if s not in streams]
    assert {r.route.stage_index for r in requests} == {1, 2}
    assert all(r.HasField("boundary") for r in requests)
    assert streams and all(pb.DataHello.FromString(s[5 : 5 + s[0]]).version == 1 for s in streams)
    links = fuzz.datalink_seeds()
    assert any(pb.ForwardReply.FromString(s).HasField("error") for s in links[:3])
