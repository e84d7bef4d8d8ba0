"""The DGR engine as installed from the dgr-engine wheel: this directory holds the `_dgr_engine`
module, the `dgr-shard-worker` executable and the patched llama.cpp libraries they link. The
runtime finds it through `dgr_route.engine.locate()`."""

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
WORKER = DIRECTORY / "dgr-shard-worker"
