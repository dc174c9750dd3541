"""Integrations of omnishm with serving engines.

``omnishm.integrations.vllm`` runs the omni prefix cache inside a vLLM v1 engine
through vLLM's public ``worker_extension_cls`` hook; ``omnishm.integrations.vllm_omni``
puts vllm-omni's own model runners on an omnishm cache. Nothing here imports vllm
at module scope (the import invariant).
"""

from __future__ import annotations


def vllm_omni_plugin() -> None:
    """vLLM ``general_plugins`` entry point, run in every vLLM process: with the ``vllm_omni`` knob on
    (``OMNISHM_VLLM_OMNI=1`` or the config file), vllm-omni's runners build omnishm's drop-in cache.

    Reads that knob alone (a bad value of another knob is not this plugin's to refuse in every vLLM
    process); raises ``omnishm.config.ConfigError`` for a bad value of it.
    """
    from omnishm.config import resolve

    if resolve("client", {}, names=("vllm_omni",)).values["vllm_omni"]:
        from omnishm.integrations.vllm_omni import install

        install()
