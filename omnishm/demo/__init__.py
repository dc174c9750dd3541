"""``omnishm demo``: a simulated vLLM-like engine with TP ranks sharing one committer."""
