"""The pinned llama.cpp: manifest, fetch, verification and the numbered patch stack."""
