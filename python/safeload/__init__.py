"""safeload: a drop-in for safetensors 0.8 that reads checkpoints in parallel, straight into
memory each tensor owns, with the GIL released.

    from safeload import safe_open          # instead of: from safetensors import safe_open
    import safeload.torch                   # instead of: import safetensors.torch
"""

from ._open import _safe_open_handle, safe_open  # noqa: F401
from ._prefetch import PrefetchLoader, PrefetchPlan, TensorMeta  # noqa: F401
from ._safeload import (  # noqa: F401
    SafetensorError,
    TensorSpec,
    __version__,
    deserialize,
    memory_info,
    pooled_bytes,
    release_memory,
    serialize,
    serialize_file,
)
from .patch import patch, patched, unpatch  # noqa: F401,E402  (rebinds safeload.patch to the function)

__all__ = [
    "PrefetchLoader",
    "PrefetchPlan",
    "SafetensorError",
    "TensorMeta",
    "TensorSpec",
    "__version__",
    "deserialize",
    "memory_info",
    "patch",
    "patched",
    "pooled_bytes",
    "release_memory",
    "safe_open",
    "_safe_open_handle",
    "serialize",
    "serialize_file",
    "unpatch",
]
