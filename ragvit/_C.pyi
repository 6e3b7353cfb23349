"""Type stubs for ragvit._C, the C extension. Shapes: S sequences, T packed
tokens, H heads, D head_dim, B images, N tokens per padded image, C channels.

Tensor arguments may be any object that offers the DLPack C exchange API
(torch >= 2.10), ``__dlpack__`` (versioned or legacy capsules),
``__cuda_array_interface__`` (v2/v3) or a NumPy array. Stream rule: an
explicit ``stream`` (int handle or object with ``__cuda_stream__``) wins; else
the current stream of the first tensor whose type has the exchange API; else
the CAI ``stream`` key (waited on, then used); else the legacy default stream.

Errors follow ``<op>: <arg> must be <rule>, got <actual>``: shape or value ->
ValueError, dtype -> TypeError, unimportable object or device -> BufferError
(TypeError for objects that offer no array protocol at all), out of memory ->
MemoryError, CUDA failure -> RuntimeError. A rejected call writes nothing.

Outputs left out are allocated in the caller's array type, the first array
argument's: its library's DLPack exchange-API allocator (torch), NumPy for NumPy
arguments, else a ``Buffer`` returned as a ``cupy.ndarray`` over it for CuPy
arguments (made ready on CuPy's current stream), as
``type(first).__array_namespace__().from_dlpack(buffer)`` (JAX,
array_api_strict), or as the ``Buffer`` itself when the type has no namespace.
"""

from typing import Any

Array = Any

#: Most columns (L) topk_index takes: a row's keys fit one block's shared memory.
TOPK_INDEX_MAX_COLS: int
#: Most dimensions an imported array may have.
MAX_DIMS: int
#: Most outputs graph_replay copies out of a graph.
GRAPH_MAX_OUTPUTS: int
#: The DLPack version this module speaks.
dlpack_version: str

def attention(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens: Array,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    out: Array | None = None,
    cls_attn: Array | None = None,
    bias: Array | None = None,
    stream: Any = None,
) -> Array:
    """Per-sequence bidirectional softmax attention over packed tokens.

    Args:
        q, k, v: (T, H, D) float16, bfloat16 or float32, one dtype, head dim
            contiguous, any token/head strides (views of a (T, 3, H, D) qkv
            buffer need no copy). D in {32, 64, 80, 96, 128}.
        cu_seqlens: (S+1,) int32 on the same device, exclusive prefix sums of
            the lengths; cu_seqlens[S] <= T (rows past it are left untouched).
        max_seqlen: upper bound on every length; sizes the grid and is never
            read from the device. Default: computed on the CPU, T on CUDA.
        scale: softmax scale, default 1/sqrt(D); must be finite and > 0 as the float32
            the kernels use (about 1.2e-38 to 2.4e38 once rounded).
        out: (T, H, D) output of q's dtype; allocated in q's array type when
            omitted (the module docs' rule).
        cls_attn: optional (T,) float32; for each sequence receives the
            head-mean softmax probabilities of its first query over its keys
            (bias included).
        bias: optional (T,) float32, any stride, same device, not overlapping
            out or cls_attn: added to the logit of key j for every head and
            query of j's sequence, logits[i, j] = scale * q_i . k_j + bias[j]
            (ToMe proportional attention: log(size_j)). Must be finite on the
            tokens of every sequence: checked on the CPU (ValueError); on CUDA
            it is not checked (that would sync) and a NaN/inf propagates.
        stream: CUDA stream to launch on (see the module docs).

    Returns:
        out.

    Raises:
        TypeError: a non-array argument, or a wrong dtype (bias: not float32).
        ValueError: a shape, value, device or aliasing problem (bias: not (T,),
            another device, overlapping out/cls_attn, non-finite on the CPU).
        BufferError, MemoryError, RuntimeError: as the module docs say.
    """

def pack(x: Array, keep: Array, *, stream: Any = None) -> tuple[Array, Array, Array]:
    """Gather kept tokens of a padded batch into packed rows.

    Args:
        x: (B, N, C) float16, bfloat16 or float32, channels contiguous.
        keep: (B, N) bool or uint8 (nonzero keeps the token), same device.

    Returns:
        (packed (T, C) of x's dtype, cu_seqlens (B+1,) int32, indices (T,)
        int32 source position of each packed token within its image). On
        CUDA this syncs once to learn T; use pack_into to stay sync-free.
    """

def pack_into(
    x: Array,
    keep: Array,
    out: Array,
    cu_seqlens: Array,
    *,
    indices: Array | None = None,
    stream: Any = None,
) -> None:
    """pack() into caller-sized capacity buffers with no host sync (one launch on CUDA).

    Args:
        x, keep: as for pack.
        out: (capacity, C) of x's dtype; tokens past capacity are dropped and
            flagged in debug mode.
        cu_seqlens: (B+1,) int32, receives the prefix sums (total at [B]).
        indices: optional (capacity,) int32, receives source positions.
    """

def unpack(
    packed: Array,
    cu_seqlens: Array,
    N: int,
    *,
    indices: Array | None = None,
    fill: float = 0.0,
    out: Array | None = None,
    stream: Any = None,
) -> Array:
    """Scatter packed tokens back to a padded (B, N, C) batch.

    Args:
        packed: (T, C) float16, bfloat16 or float32, channels contiguous.
        cu_seqlens: (B+1,) int32.
        N: tokens per padded image; every length must be <= N.
        indices: optional (T,) int32 target position of each packed token
            (e.g. the indices returned by pack); default: the first len rows.
        fill: value of every row not written from packed.
        out: optional (B, N, C) output of packed's dtype.

    Returns:
        out.
    """

def repack(
    packed: Array,
    cu_seqlens: Array,
    keep: Array,
    *,
    fuse_weights: Array | None = None,
    stream: Any = None,
) -> tuple[Array, Array, Array]:
    """Drop tokens of already packed sequences (later pruning stages).

    Args:
        packed: (T, C) float16, bfloat16 or float32, channels contiguous.
        cu_seqlens: (B+1,) int32, same device.
        keep: (T,) bool or uint8 over packed's rows (nonzero keeps the row);
            rows outside every sequence are ignored.
        fuse_weights: optional (T,) float32 (EViT inattentive-token fusion):
            every sequence gets one extra row after its kept rows,
            sum(w x) / sum(w) over its dropped rows in float32, src -1. It is
            always appended (zeros when sum(w) == 0, e.g. nothing dropped), so
            each count grows by exactly 1 and T + B rows always suffice.

    Returns:
        (packed2 (T2, C) of packed's dtype, kept rows in order; cu_seqlens2
        (B+1,) int32; src (T2,) int32 index of each kept row into packed).
        On CUDA this syncs once to learn T2; use repack_into to stay sync-free.
    """

def repack_into(
    packed: Array,
    cu_seqlens: Array,
    keep: Array,
    out: Array,
    cu_seqlens_out: Array,
    *,
    src: Array | None = None,
    fuse_weights: Array | None = None,
    stream: Any = None,
) -> None:
    """repack() into caller-sized capacity buffers with no host sync (one launch on CUDA).

    Args:
        packed, cu_seqlens, keep: as for repack.
        out: (capacity, C) of packed's dtype; rows past the total untouched;
            kept rows past capacity are never written (CPU: ValueError before
            any write; CUDA: flagged, raised in debug mode).
        cu_seqlens_out: (B+1,) int32, receives the prefix sums (total at [B]).
        src: optional (capacity,) int32, receives each row's index into packed.
        fuse_weights: as for repack, fused in the same launch.
    """

def gather_prefix(
    packed: Array, cu_seqlens: Array, k: int, *, out: Array | None = None, stream: Any = None
) -> Array:
    """The first k tokens of every sequence (CLS / distillation tokens).

    Args:
        packed: (T, C) float16, bfloat16 or float32, channels contiguous.
        cu_seqlens: (B+1,) int32; every length must be >= k.
        k: tokens per sequence, an int in [0, 2**31).
        out: optional (B, k, C) of packed's dtype.

    Returns:
        out (B, k, C), out[b, j] = packed[cu_seqlens[b] + j]. A sequence shorter
        than k raises ValueError on the CPU (nothing written); on CUDA its
        missing rows are zeros and the debug flag is set.
    """

def segment_mean(
    packed: Array,
    cu_seqlens: Array,
    *,
    skip: int = 0,
    out: Array | None = None,
    stream: Any = None,
) -> Array:
    """Mean over each sequence's tokens after its first `skip` (GAP heads).

    Args:
        packed: (T, C) float16, bfloat16 or float32, channels contiguous.
        cu_seqlens: (B+1,) int32.
        skip: leading tokens to leave out of each sequence (1 for a CLS token).
        out: optional (B, C) of packed's dtype.

    Returns:
        out (B, C): float32 sums rounded once to packed's dtype; a sequence
        with no token past `skip` gives zeros.
    """

def linear(
    x: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    residual: Array | None = None,
    out: Array | None = None,
    stream: Any = None,
) -> Array:
    """nn.Linear on packed rows, with an optional residual added in the GEMM epilogue.

    Args:
        x: (M, K) float16, bfloat16 or float32, unit column stride, any row stride.
        weight: (N, K) of x's dtype (nn.Linear.weight).
        bias: optional (N,) of x's dtype, contiguous.
        residual: optional (M, N) of x's dtype; may be out itself (in place).
        out: optional (M, N) of x's dtype, not overlapping x, weight or bias.

    Returns:
        out = x @ weight.T + bias + residual, float32 accumulation rounded once
        (CUDA: cuBLASLt, no TF32 for float32; CPU: C loops in double).
    """

def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    eps: float = 1e-5,
    out: Array | None = None,
    stream: Any = None,
) -> Array:
    """LayerNorm over the last dim of (M, C) rows; out may be x (in place).

    Returns:
        out = (x - mean) / sqrt(var + eps) * weight + bias, float32 statistics
        (double on the CPU), rounded once. eps must be in (0, 1] and at least 1.2e-38
        once rounded to float32.
    """

def gelu(x: Array, *, out: Array | None = None, stream: Any = None) -> Array:
    """Exact (erf) GELU of (M, C) rows, float32 math rounded once; out may be x."""

def topk_index(
    scores: Array,
    k: int,
    *,
    prefix: int = 0,
    out: Array | None = None,
    stream: Any = None,
) -> Array:
    """Per row: the `prefix` leading columns and the k top-scoring columns after them.

    One launch, no host sync (CUDA-graph capturable); replaces topk + sort +
    arange + cat in the top-k pruning policies.

    Args:
        scores: (B, L) float16, bfloat16 or float32, unit column stride, any row
            stride; L <= 8192.
        k: columns to choose among [prefix, L), an int in [0, L - prefix].
        prefix: leading columns always kept (CLS / distillation tokens), an int
            in [0, L]; their scores are never read.
        out: optional (B, prefix + k) int32 or int64, unit column stride, not
            overlapping scores; allocated as int64 like scores when omitted.

    Returns:
        out: row b is the ascending union of 0..prefix-1 and the k columns
        c >= prefix ranked highest by scores[b, c]. Ranking: score descending;
        ties keep the lower column; NaN ranks above every number (as
        torch.topk); -0.0 equals +0.0. CPU and CUDA agree bit for bit.

    Raises:
        ValueError: shapes, L > 8192, k or prefix out of range, k + prefix > L,
            strides, aliasing, devices.
        TypeError: scores' or out's dtype; k or prefix not an int (bool too).
    """

def graph_replay(
    graph_exec: int,
    x: Array,
    static_x: Array,
    outputs: Array | tuple[Array, ...],
    *,
    stream: Any = None,
) -> Array | tuple[Array, ...]:
    """One replay of a captured CUDA graph: x copied into static_x, the graph launched,
    each of its outputs copied into a fresh tensor, on one stream (ragvit.cuda_graph's
    call for a shape it has seen).

    Args:
        graph_exec: the cudaGraphExec_t as an int
            (torch.cuda.CUDAGraph.raw_cuda_graph_exec()), on x's device; it reads
            static_x and writes outputs.
        x: contiguous CUDA tensor of static_x's shape and dtype, of a library whose
            DLPack exchange API allocates (torch).
        static_x: the graph's input buffer, contiguous and writable.
        outputs: the graph's output tensor or a tuple of at most 6, each contiguous.
        stream: default: x's library's current stream on x's device.

    Returns:
        Fresh tensors of x's library on x's device: one for a tensor, a tuple for a tuple.

    Raises:
        ValueError: shapes, contiguity, devices (or the host), x partly overlapping
            static_x, more than 6 outputs, graph_exec 0.
        TypeError: dtypes, graph_exec not an int, outputs a list, x's library without an
            exchange-API allocator.
        RuntimeError: a CPU-only build, or a CUDA failure. A refused call queues nothing.
    """

class Buffer:
    """An output ragvit allocated itself (no allocator in the caller's library): a
    compact array on a CPU or CUDA device, exported without a copy through DLPack,
    the CUDA Array Interface v3 (CUDA) and the NumPy array interface (host). CUDA
    memory is stream-ordered: freed, once unreferenced, on ragvit's own stream after
    the buffer's last known use. Made by the ops only."""

    shape: tuple[int, ...]
    ndim: int
    #: The element type's name: float16, bfloat16, float32, float64, int32, int64, uint8, bool.
    dtype: str
    __cuda_array_interface__: dict
    __array_interface__: dict

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule (versioned when max_version[0] >= 1); the consumer's
        stream (None/1 legacy default, 2 per-thread, a handle; -1 no sync) waits
        on the buffer's."""

    def __dlpack_device__(self) -> tuple[int, int]:
        """(1, 0) on the host, (2, device id) on CUDA."""

def build_info() -> dict:
    """What this build contains: commit, cuda, cuda_archs, cublaslt."""

def cuda_is_compiled() -> bool:
    """True when the extension was built with nvcc."""

def cuda_device_count() -> int:
    """CUDA devices visible (0 for a CPU-only build or no driver)."""

def set_debug(enabled: bool) -> None:
    """Turn the device-side error flag check on or off (RAGVIT_DEBUG=1 at import)."""

def is_debug() -> bool:
    """Whether the debug check is on."""
