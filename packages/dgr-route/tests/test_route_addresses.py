"""Route.open checks its stage addresses before it dials any (dgr_route.route.check_addresses):
gRPC itself takes port 99999 as 34463 and a bare name as port 443, and an empty list failed
with an IndexError."""

from __future__ import annotations

import pytest
from dgr_route.route import Route


@pytest.mark.parametrize(
    ("addresses", "message"),
    [
        ([], "a route needs at least one stage address"),
        (["127.0.0.1:99999"], "stage 0: address '127.0.0.1:99999' is not HOST:PORT"),
        (["127.0.0.1:7001", "worker-b"], "stage 1: address 'worker-b' is not HOST:PORT"),
        (["127.0.0.1:0"], "stage 0: address '127.0.0.1:0'"),
        ([":7001"], "stage 0: address ':7001'"),
        (["[]:7001"], "stage 0"),
        (["127.0.0.1:70x1"], "stage 0"),
        (["unix:"], "stage 0: address 'unix:'"),
    ],
)
def test_a_bad_address_is_named_before_anything_is_dialled(
    addresses: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        Route.open(addresses, timeout=1)
