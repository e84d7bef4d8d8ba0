"""bench-verify: resumable verification throughput against sha256sum on the same file, same run.

Both read a warm page cache; rounds alternate so that machine noise hits both alike. Prints the
ratio and writes JSON into evidence/bench/ (and into the story's metrics under the runner).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dgr_artifacts.manifest import DEFAULT_CHUNK, FileEntry, hash_file
from dgr_artifacts.models import model_path
from dgr_artifacts.verify import VerifyReport, verify_file
from dgr_records import report, write_bench

TARGET_BYTES = 512 * 2**20
ROUNDS = 5


def make_file(directory: Path) -> Path:
    block = model_path().read_bytes()
    path = directory / "bench.bin"
    with path.open("wb") as out:
        written = 0
        while written < TARGET_BYTES:
            out.write(block[: TARGET_BYTES - written])
            written += min(len(block), TARGET_BYTES - written)
    return path


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="dgr-bench-verify-") as tmp:
        path = make_file(Path(tmp))
        whole, chunks = hash_file(path, DEFAULT_CHUNK)  # also warms the page cache
        entry = FileEntry(
            name=path.name,
            size=path.stat().st_size,
            sha256=whole,
            chunk_size=DEFAULT_CHUNK,
            chunk_sha256=chunks,
        )
        ref_s, dgr_s = [], []
        for n in range(ROUNDS):
            t0 = time.perf_counter()
            out = subprocess.run(
                ["sha256sum", str(path)], capture_output=True, text=True, check=True
            ).stdout
            ref_s.append(time.perf_counter() - t0)
            assert out.split()[0] == whole
            state = Path(tmp) / f"state-{n}"
            state.mkdir()
            result = VerifyReport()
            t0 = time.perf_counter()
            verify_file(entry, path, state, "bench", result)
            dgr_s.append(time.perf_counter() - t0)
            assert not result.bad and not result.problems
    size_mib = TARGET_BYTES / 2**20
    ref, dgr = statistics.median(ref_s), statistics.median(dgr_s)
    ratio = ref / dgr
    results = {
        "file_mib": size_mib,
        "rounds": ROUNDS,
        "chunk_bytes": DEFAULT_CHUNK,
        "sha256sum_median_s": round(ref, 4),
        "dgr_verify_median_s": round(dgr, 4),
        "sha256sum_mib_s": round(size_mib / ref, 1),
        "dgr_verify_mib_s": round(size_mib / dgr, 1),
        "verify_ratio_vs_sha256sum": round(ratio, 3),
        "target": 0.8,
        "meets_target": ratio >= 0.8,
    }
    print(f"{'reader':<22}{'median s':>10}{'MiB/s':>10}")
    print(f"{'sha256sum':<22}{ref:>10.3f}{size_mib / ref:>10.1f}")
    print(f"{'dgr verify (resumable)':<22}{dgr:>10.3f}{size_mib / dgr:>10.1f}")
    print(f"ratio dgr/sha256sum throughput: {ratio:.3f} (target >= 0.8)")
    write_bench("bench-verify", results)
    report("bench", results)
    return 0 if ratio >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
