"""`nox -s bench-seam-bytes`: what crosses a seam per token, measured on real routes.

For each model a 3-stage route over loopback workers prefills a seeded prompt and decodes; the
route counts the serialized boundary messages and token ids it relays into stages after the head.
The residual itself is hc x n_embd values per token; each message adds shape, dtype and checksum
(the decode figures count one message per token; prefill amortizes it over a chunk).
For the DeepSeek V4 twin the real model's figure is stated next to it: 4 x 4096 x 2 bytes = 32 KiB
per token per seam in bf16, plus the token-id sideband. Writes evidence/bench/bench-seam-bytes.json.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
from dgr_cli.workers import descriptor_args, start_worker
from dgr_records import report, write_bench
from dgr_route.route import Route, SeamTraffic
from dgr_wire.codec import REAL_V4, seam_bytes

PROMPT_TOKENS = 200
DECODE_TOKENS = 16


def decode_traffic(addresses: list[str], wire_dtype: str, n_vocab: int) -> tuple[SeamTraffic, ...]:
    """(prefill, decode) traffic of one generation over the route with this wire dtype."""
    route = Route.open(addresses, wire_dtype=wire_dtype, mode="relay")  # counts what it carries
    prompt = np.random.default_rng(0).integers(0, n_vocab, PROMPT_TOKENS)
    stream = route.generate([int(t) for t in prompt], DECODE_TOKENS + 1)
    next(stream)  # the prefill: one message per chunk, not what a decode step costs
    prefill, route.wire = route.wire, SeamTraffic()
    for _ in stream:
        pass
    route.close()
    return prefill, route.wire


def measure(name: str) -> dict[str, Any]:
    from dgr_artifacts.models import model_path
    from dgr_route.engine import locate
    from dgr_route.local import even_layout

    model = model_path(name)
    whole = locate().module().Engine(str(model), n_ctx=1024).describe()
    layout = even_layout(int(whole["n_layer"]), 3)
    descriptor = descriptor_args(model)
    workers = [start_worker(model, a, b, descriptor=descriptor, n_ctx=1024) for a, b in layout]
    try:
        addresses = [w.address for w in workers]
        traffic = {
            dt: decode_traffic(addresses, dt, int(whole["n_vocab"])) for dt in ("f32", "bf16")
        }
    finally:
        for w in workers:
            w.stop()
    residual = seam_bytes(int(whole["hc"]), int(whole["n_embd"]))
    out: dict[str, Any] = {
        "layout": layout,
        "hc": int(whole["hc"]),
        "n_embd": int(whole["n_embd"]),
        "residual_bytes_per_token_f32": residual["f32"],
        "residual_bytes_per_token_bf16": residual["bf16"],
    }
    for dt, (prefill, decode) in traffic.items():
        out[f"wire_{dt}_boundary_bytes_per_token_per_seam"] = round(
            decode.per_token()["boundary"], 1
        )
        out[f"wire_{dt}_prefill_boundary_bytes_per_token_per_seam"] = round(
            prefill.per_token()["boundary"], 1
        )
    out["wire_sideband_bytes_per_token_per_seam"] = round(
        traffic["f32"][1].per_token()["sideband"], 1
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dgr_bench.seam_bytes")
    parser.add_argument("--model", action="append")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        name: measure(name) for name in args.model or ["smollm2-135m-q4_1", "dsv4-twin"]
    }
    real = seam_bytes(REAL_V4["hc"], REAL_V4["n_embd"])
    results["real-deepseek-v4"] = {
        "hc": REAL_V4["hc"],
        "n_embd": REAL_V4["n_embd"],
        "residual_bytes_per_token_f32": real["f32"],
        "residual_bytes_per_token_bf16": real["bf16"],
        "sideband_bytes_per_token": real["token_id_sideband"],
    }
    print(
        f"{'model':<22}{'hc x n_embd':>12}{'f32 B':>8}{'bf16 B':>8}"
        f"{'wire f32':>10}{'wire bf16':>11}{'ids B':>7}"
    )
    for name, r in results.items():
        wire32 = r.get("wire_f32_boundary_bytes_per_token_per_seam", "-")
        wire16 = r.get("wire_bf16_boundary_bytes_per_token_per_seam", "-")
        ids = r.get("wire_sideband_bytes_per_token_per_seam", r.get("sideband_bytes_per_token"))
        shape = f"{r['hc']} x {r['n_embd']}"
        print(
            f"{name:<22}{shape:>12}{r['residual_bytes_per_token_f32']:>8}"
            f"{r['residual_bytes_per_token_bf16']:>8}{wire32!s:>10}{wire16!s:>11}{ids!s:>7}"
        )
    print(
        f"real DeepSeek V4: {real['bf16']} B = {real['bf16'] // 1024} KiB per token per seam in "
        f"bf16 ({real['f32'] // 1024} KiB in f32), plus {real['token_id_sideband']} B of token id"
    )
    write_bench("bench-seam-bytes", results)
    report("bench_seam_bytes", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
