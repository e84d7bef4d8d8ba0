"""Model artifacts: GGUF identity, hashed manifests, verification, provisioning, subsets."""
