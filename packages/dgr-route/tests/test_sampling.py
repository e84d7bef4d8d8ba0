"""Sampling options are checked where the caller makes them, against the wire's ranges (float32
temperature, uint32 top_k, top_p in [0, 1], uint64 seed): a bad value is a ValueError that names
it, not protobuf's "Value out of range" from deep inside a generation (what `dgr serve` answered
as a bare 500 for top_k 10**12)."""

from __future__ import annotations

import math

import pytest
from dgr_route.route import Sampling


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.5),
        ("temperature", 1e39),  # finite, but no float32
        ("top_k", -1),
        ("top_k", 2**32),
        ("top_p", math.nan),
        ("top_p", 1.5),
        ("seed", -1),
        ("seed", 2**64),
        # of another type: a float seed or top_k went on to protobuf's TypeError, a string
        # temperature was Python's "'<=' not supported"
        ("seed", 1.5),
        ("top_k", 2.5),
        ("top_k", True),
        ("temperature", "hot"),
        ("top_p", None),
    ],
)
def test_an_out_of_range_sampling_option_is_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"sampling {field} must be"):
        Sampling(**{field: value})


def test_the_ranges_own_ends_go_on_the_wire() -> None:
    m = Sampling(temperature=2.0, top_k=2**32 - 1, top_p=1.0, seed=2**64 - 1).message()
    assert (m.top_k, m.seed, m.top_p, m.temperature) == (2**32 - 1, 2**64 - 1, 1.0, 2.0)
