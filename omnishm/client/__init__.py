"""Runner-side client of omnishm: the seed's manager, adapter, group view and runner mixin.

Imports without vllm installed (the import invariant).
"""

from omnishm.client.group_view import PrefixCacheConfigError
from omnishm.client.manager import OmniPrefixCacheManager
from omnishm.interface import (
                               HIDDEN_KEY,
                               ModelCachePolicy,
                               OmniPrefixCacheCommitterError,
                               OmniPrefixCacheStagingTimeoutError,
                               OmniPrefixCacheUnmatchError,
                               PrefixCacheConfig,
                               StageCacheOutputs,
                               WriteSchedule,
)

__all__ = ["OmniPrefixCacheManager", "HIDDEN_KEY", "ModelCachePolicy", "OmniPrefixCacheCommitterError",
           "OmniPrefixCacheStagingTimeoutError", "OmniPrefixCacheUnmatchError", "PrefixCacheConfig",
           "PrefixCacheConfigError", "StageCacheOutputs", "WriteSchedule"]
