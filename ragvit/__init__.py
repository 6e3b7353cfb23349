"""ragvit: token-pruned Vision Transformers, fast in wall-clock time.

Packed ragged attention and token packing launched from C on tensors imported
through DLPack (incl. the DLPack C exchange API), the CUDA Array Interface or
NumPy, with a CPU backend computing the same ops. ``ragvit.patch(model, policy)``
runs a timm ViT/DeiT on packed pruned tokens (torch and timm are imported only
when it is first used; policies live in ``ragvit.pruning``), and
``ragvit.cuda_graph(model)`` replays it as CUDA graphs, one per input shape.

Every op follows the same rules for its arrays (docs/interop.md): outputs must not overlap
themselves or an input; an array with elements must have data behind it; torch outputs the
caller passes get their autograd version counter bumped in grad mode; the CPU backend runs
large calls without the GIL; outputs left out come back in the caller's array type (torch,
NumPy, CuPy, JAX, any array API library; else a ``ragvit.Buffer``).
"""

from .ops import (
    Buffer,
    attention,
    build_info,
    cuda_available,
    cuda_device_count,
    cuda_is_compiled,
    gather_prefix,
    gelu,
    is_debug,
    layer_norm,
    linear,
    pack,
    pack_into,
    repack,
    repack_into,
    segment_mean,
    set_debug,
    topk_index,
    unpack,
)

__version__ = "0.1.0"

# The timm shim needs torch: import it on first use so `import ragvit` works without.
_TIMM_PATCH_NAMES = ("patch", "unpatch", "is_patched", "UnsupportedModelError",
                     "forward_with_decisions", "kept_mask")
_GRAPH_NAMES = ("cuda_graph", "CudaGraphFallbackWarning", "GraphedModel")


def __getattr__(name):
    if name in _TIMM_PATCH_NAMES:
        from . import timm_patch

        return getattr(timm_patch, name)
    if name in _GRAPH_NAMES:
        from . import graph

        return getattr(graph, name)
    raise AttributeError(f"module 'ragvit' has no attribute {name!r}")


__all__ = [
    "Buffer",
    "CudaGraphFallbackWarning",
    "GraphedModel",
    "UnsupportedModelError",
    "__version__",
    "attention",
    "build_info",
    "cuda_available",
    "cuda_graph",
    "cuda_device_count",
    "cuda_is_compiled",
    "forward_with_decisions",
    "gather_prefix",
    "gelu",
    "is_debug",
    "is_patched",
    "kept_mask",
    "layer_norm",
    "linear",
    "pack",
    "pack_into",
    "patch",
    "repack",
    "repack_into",
    "segment_mean",
    "set_debug",
    "topk_index",
    "unpack",
    "unpatch",
]
