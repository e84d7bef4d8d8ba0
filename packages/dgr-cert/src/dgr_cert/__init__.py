"""Certification harnesses that run real workers under stress: seeded fault injection
(`dgr_cert.chaos`), soak (`dgr_cert.soak`) and libFuzzer over the worker's decoders
(`dgr_cert.fuzz`). Nothing in the runtime chain imports this package."""
