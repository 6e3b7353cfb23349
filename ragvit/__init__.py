"""ragvit: token-pruned Vision Transformers, fast in wall-clock time.

Packed ragged attention and token packing launched from C on tensors imported
through DLPack (incl. the DLPack C exchange API), the CUDA Array Interface or
NumPy, with a CPU backend computing the same ops.
"""

from .ops import (
    attention,
    cuda_available,
    cuda_device_count,
    cuda_is_compiled,
    gather_prefix,
    is_debug,
    pack,
    pack_into,
    repack,
    repack_into,
    segment_mean,
    set_debug,
    unpack,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "attention",
    "cuda_available",
    "cuda_device_count",
    "cuda_is_compiled",
    "gather_prefix",
    "is_debug",
    "pack",
    "pack_into",
    "repack",
    "repack_into",
    "segment_mean",
    "set_debug",
    "unpack",
]
