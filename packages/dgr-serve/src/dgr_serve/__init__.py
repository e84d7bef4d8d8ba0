"""The OpenAI-compatible server over a DGR route (`dgr serve`)."""
