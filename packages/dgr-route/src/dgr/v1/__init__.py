# Generated from proto/dgr/v1/shard.proto by `nox -s proto`; do not edit.
