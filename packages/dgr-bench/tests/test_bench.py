"""The gate's ratios from interleaved rounds: each round's reference is that round's faster
llama-bench build, and the gate reads medians over rounds."""

from __future__ import annotations

import pytest
from dgr_bench.bench import (
    ENGINE,
    ONE,
    RPC2,
    SINGLE_LANE,
    SINGLE_PRIO,
    SINGLE_STOCK,
    THREE,
    THREE_GRPC,
    THREE_RT,
    paired_ratios,
)


def rnd(
    stock: float, lane: float, three: float, one: float = 50.0, prio: float = 10.0
) -> dict[str, dict[str, float]]:
    return {
        SINGLE_STOCK: {"prefill": 100.0, "decode": stock},
        SINGLE_LANE: {"prefill": 90.0, "decode": lane},
        SINGLE_PRIO: {"prefill": 80.0, "decode": prio},
        THREE_RT: {"prefill": 95.0, "decode": three + 3},
        THREE_GRPC: {"prefill": 95.0, "decode": three / 1.2},
        ENGINE: {"prefill": 100.0, "decode": 50.0},
        ONE: {"prefill": 100.0, "decode": one},
        THREE: {"prefill": 95.0, "decode": three},
        RPC2: {"prefill": 80.0, "decode": 25.0},
    }


def test_each_round_is_held_to_its_faster_build() -> None:
    # round 1: stock is faster (60), round 2: lane is (80), round 3: a slow moment for all
    p = paired_ratios([rnd(60, 40, 54), rnd(50, 80, 72), rnd(30, 20, 24)])
    r = p["per_round"]["decode_ratio_3stage_vs_single"]
    assert r == pytest.approx([0.9, 0.9, 0.8])
    assert p["ratios"]["decode_ratio_3stage_vs_single"] == pytest.approx(0.9)
    # the table's medians would compare 54 against max(50, 40): drift the rounds do not carry
    assert p["rows"][THREE]["decode"] == 54
    assert p["ratios"]["prefill_ratio_3stage_vs_single"] == pytest.approx(0.95)
    assert p["ratios"]["decode_ratio_3stage_vs_rpc"] == pytest.approx(54 / 25)
    # the realtime route is reported against the same reference, beside the gated default
    assert p["per_round"]["decode_ratio_3stage_realtime_vs_single"] == pytest.approx(
        [57 / 60, 75 / 80, 27 / 30]
    )
    # and the data plane's gain over gRPC links, within each round
    assert p["ratios"]["decode_ratio_3stage_data_vs_grpc_links"] == pytest.approx(1.2)


def test_llama_bench_at_prio_1_is_a_reference_too() -> None:
    p = paired_ratios([rnd(60, 40, 54, prio=90)])
    assert p["per_round"]["decode_ratio_3stage_vs_single"] == pytest.approx([54 / 90])


def test_one_stage_cost_is_per_token_milliseconds() -> None:
    p = paired_ratios([rnd(60, 40, 54, one=40.0), rnd(60, 40, 54, one=50.0)] * 2)
    # 1000/40 - 1000/50 = 5 ms in half the rounds, 0 in the rest: the median is their middle
    assert p["ratios"]["ms_per_token_1stage_over_engine"] == pytest.approx(2.5)
    assert p["ratios"]["decode_ratio_1stage_vs_engine"] == pytest.approx(0.9)
