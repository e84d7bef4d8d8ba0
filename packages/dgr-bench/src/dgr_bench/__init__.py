"""Benches and the simulated network: route speed against llama.cpp and its RPC backend, bytes per
seam, routes through delayed links, and the netsim proxy they (and the chaos tests) put in front of
workers. Never imported by the runtime chain."""
