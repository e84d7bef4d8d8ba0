"""DGR-050: the exact compatibility descriptor, read from live workers. Two workers are compatible
if and only if every exact field agrees; a mismatch names the field."""

from __future__ import annotations

import pytest
from dgr_cli.workers import WorkerProcess
from dgr_meshnet.collect import descriptor
from dgr_meshnet.inputs import (
    EXACT_FIELDS,
    CompatibilityDescriptor,
    IncompatibleError,
    mismatched_fields,
    require_compatible,
)
from dgr_prd.native_pin import llama_pin, patch_stack_hash
from dgr_prd.paths import find_root
from pydantic import ValidationError

OTHER = {
    "model_fingerprint": "0" * 64,
    "llama_cpp_commit": "1" * 40,
    "patch_stack_sha256": "2" * 64,
    "schema_version": 2,
    "lane": "cuda",
    "arch": "qwen3",
    "n_layer": 31,
    "recipe": "smollm2-q8_0-2x",
}


def test_live_workers_of_one_build_and_model_are_compatible(
    metered_workers: list[WorkerProcess],
) -> None:
    head, tail = (descriptor(w.address) for w in metered_workers)
    require_compatible(head, tail)
    repo = find_root()
    pin = llama_pin(repo.llama_manifest)
    assert pin is not None
    assert head.llama_cpp_commit == pin["commit"]
    assert head.patch_stack_sha256 == patch_stack_hash(repo.patches)
    assert (head.lane, head.arch, head.n_layer, head.schema_version) == ("cpu", "llama", 30, 1)
    assert head.recipe is None


def test_every_field_is_exact(metered_workers: list[WorkerProcess]) -> None:
    real = descriptor(metered_workers[0].address)
    assert set(OTHER) == set(EXACT_FIELDS)  # every field of the descriptor is exercised
    for field, value in OTHER.items():
        other = real.model_copy(update={field: value})
        assert mismatched_fields(real, other) == [field]
        with pytest.raises(IncompatibleError) as info:
            require_compatible(real, other)
        assert info.value.fields == [field] and field in str(info.value)
    everything = real.model_copy(update=OTHER)
    assert mismatched_fields(real, everything) == list(EXACT_FIELDS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_fingerprint", "not-hex"),
        ("llama_cpp_commit", "0c1e5709"),  # a short commit is not the exact one
        ("patch_stack_sha256", "Z" * 64),
        ("schema_version", 0),
        ("lane", "tpu"),
        ("arch", ""),
        ("n_layer", 0),
        ("input_version", "2.0"),
    ],
)
def test_a_malformed_descriptor_is_refused_by_field(
    metered_workers: list[WorkerProcess], field: str, value: object
) -> None:
    good = descriptor(metered_workers[0].address).model_dump()
    with pytest.raises(ValidationError) as info:
        CompatibilityDescriptor.model_validate({**good, field: value})
    assert field in str(info.value)
    with pytest.raises(ValidationError, match="extra"):
        CompatibilityDescriptor.model_validate({**good, "region": "eu"})
