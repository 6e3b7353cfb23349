"""Public ops of ragvit.

The array ops are the C entry points themselves (``ragvit._C``): a Python wrapper
would add a frame to a call whose whole budget is a few microseconds. Their
docstrings (``help(ragvit.attention)``) give shapes, dtypes and errors; the
import rules and the stream rule are in the ``ragvit._C`` module docs. ``Buffer`` is the
type of the outputs ragvit allocates itself when the caller's array library has no
allocator (docs/interop.md).
"""

from . import _C

Buffer = _C.Buffer
attention = _C.attention
pack = _C.pack
pack_into = _C.pack_into
unpack = _C.unpack
repack = _C.repack
repack_into = _C.repack_into
gather_prefix = _C.gather_prefix
segment_mean = _C.segment_mean
linear = _C.linear
layer_norm = _C.layer_norm
gelu = _C.gelu
topk_index = _C.topk_index
TOPK_INDEX_MAX_COLS = _C.TOPK_INDEX_MAX_COLS
cuda_is_compiled = _C.cuda_is_compiled
cuda_device_count = _C.cuda_device_count
set_debug = _C.set_debug
is_debug = _C.is_debug


def build_info() -> dict:
    """What the installed ragvit contains, and what this process sees of it.

    Returns:
        A dict: version; commit (the tree's short git commit at build time, "unknown" for a
        build outside a checkout); cuda (CUDA kernels compiled in); cuda_archs (the
        architectures they were built for, e.g. ["80", "90"]); cublaslt (CUDA linear compiled
        in; libcublasLt is loaded on first use: without either, ragvit.linear on CUDA arrays
        raises, and a patched model runs its linears through torch, with a RuntimeWarning);
        cpu_only (no CUDA kernels); cuda_devices (CUDA devices visible now, 0 without CUDA).
    """
    from . import __version__

    info = {"version": __version__, **_C.build_info()}
    info["cpu_only"] = not info["cuda"]
    info["cuda_devices"] = _C.cuda_device_count() if info["cuda"] else 0
    return info


def cuda_available() -> bool:
    """Whether CUDA ops can run here.

    Returns:
        True when the extension was built with nvcc and at least one CUDA device
        is visible; False on CPU-only builds or machines without a GPU.
    """
    return _C.cuda_is_compiled() and _C.cuda_device_count() > 0


__all__ = [
    "Buffer",
    "build_info",
    "attention",
    "pack",
    "pack_into",
    "unpack",
    "repack",
    "repack_into",
    "gather_prefix",
    "segment_mean",
    "linear",
    "layer_norm",
    "gelu",
    "topk_index",
    "cuda_available",
    "cuda_is_compiled",
    "cuda_device_count",
    "set_debug",
    "is_debug",
]
