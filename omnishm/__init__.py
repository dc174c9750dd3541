"""omnishm: a multiprocess shared-memory omni prefix cache for vLLM omni pipelines.

Importing the package is cheap on purpose: no torch, no zmq, no vllm. The
committer lives in ``omnishm.committer``, clients in ``omnishm.client``, the
command line in ``omnishm.cli`` (``omnishm`` console script).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
