"""Integrations of omnishm with serving engines.

``omnishm.integrations.vllm`` runs the omni prefix cache inside a vLLM v1 engine
through vLLM's public ``worker_extension_cls`` hook. Nothing here imports vllm
at module scope (the import invariant).
"""
