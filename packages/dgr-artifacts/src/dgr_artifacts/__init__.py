"""Model artifacts: GGUF identity, hashed manifests, resumable verification, provisioning, subsets."""
