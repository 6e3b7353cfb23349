/* docs.h — every docstring of ragvit._C, grouped like the bind_<family>.c
 * files: the module, attention, the pack family, the row ops, topk_index, the
 * runtime functions, then ragvit.Buffer. Each op's text is a one-line signature, a summary,
 * then Args (shapes, dtypes), Returns and Raises.
 * Included by module.c only: PyDoc_STRVAR defines a static array, and a second
 * includer would hold a copy it never uses (an unused-variable warning). */
#ifndef RAGVIT_DOCS_H
#define RAGVIT_DOCS_H

#include <Python.h>

PyDoc_STRVAR(module_doc,
             "ragvit's C extension: ragged attention and token packing on packed tokens.");

/* ---- attention ---- */

PyDoc_STRVAR(
    attention_doc,
    "attention(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, out=None, cls_attn=None,\n"
    "          bias=None, stream=None) -> out\n"
    "\n"
    "Per-sequence bidirectional softmax attention over packed tokens.\n"
    "\n"
    "Args:\n"
    "    q, k, v: (T, H, D) float16, bfloat16 or float32 arrays of one dtype, head dim\n"
    "        contiguous, any token/head strides (views of a (T, 3, H, D) qkv buffer\n"
    "        are read in place). D in {32, 64, 80, 96, 128}.\n"
    "    cu_seqlens: (S+1,) int32 on the same device: exclusive prefix sums of the\n"
    "        lengths, at most 2**31 entries; cu_seqlens[S] <= T. Rows of out outside\n"
    "        [cu_seqlens[0], cu_seqlens[S]) are left untouched: a given out keeps\n"
    "        them, an allocated one holds whatever its memory held (torch.empty).\n"
    "    max_seqlen: upper bound on every length, an int or any object with\n"
    "        __index__ (a NumPy integer); sizes the grid and is never read back from\n"
    "        the device. Default: read from cu_seqlens on the CPU, T on CUDA (pass it\n"
    "        on CUDA: a tight bound launches far fewer blocks).\n"
    "    scale: softmax scale, default 1/sqrt(D); finite and > 0 as the float32 the\n"
    "        kernels use (about 1.2e-38 to 2.4e38 once rounded).\n"
    "    out: (T, H, D) output of q's dtype. When omitted it is allocated in the\n"
    "        caller's array type, the type of the first array argument (q here;\n"
    "        every op's allocated outputs follow this rule): through its library's\n"
    "        DLPack exchange-API allocator (torch); as a NumPy array for NumPy\n"
    "        arguments; else ragvit allocates a ragvit.Buffer on q's device (CUDA:\n"
    "        stream-ordered, on the call's stream) and returns a cupy.ndarray over\n"
    "        it for CuPy arguments (made ready on CuPy's current stream),\n"
    "        type(q).__array_namespace__().from_dlpack(buffer) for others (JAX,\n"
    "        array_api_strict), or the Buffer itself (Numba and other DLPack or CUDA\n"
    "        Array Interface producers: wrap it with theirs). The output outlives\n"
    "        the inputs. A\n"
    "        torch out (and cls_attn, and every output an op is given) has its\n"
    "        autograd version counter bumped, so backward() through a tensor saved\n"
    "        before the call raises instead of using the overwritten values.\n"
    "    cls_attn: optional (T,) float32; receives, for each sequence, the head-mean\n"
    "        softmax probabilities of its first query token over its keys (bias\n"
    "        included: it is the same softmax).\n"
    "    bias: optional (T,) float32, any stride, on the same device, not sharing\n"
    "        memory with out or cls_attn: added to every logit of key j of j's\n"
    "        sequence, for all heads and queries: logits[i, j] = scale q_i.k_j +\n"
    "        bias[j] (ToMe proportional attention: log(size_j)). Must be finite on\n"
    "        the tokens of every sequence; checked on the CPU (ValueError), not on\n"
    "        CUDA (that would sync), where a NaN or inf propagates into the rows\n"
    "        and cls_attn entries of its sequence.\n"
    "    stream: int cudaStream_t handle or object with __cuda_stream__; default: the\n"
    "        producer's current stream (torch.cuda.current_stream()).\n"
    "\n"
    "Returns:\n"
    "    out.\n"
    "\n"
    "Raises:\n"
    "    TypeError (dtype, non-array argument), ValueError (shape, value, device,\n"
    "    read-only or aliased output; debug-mode device checks), BufferError\n"
    "    (unimportable array: no data behind its elements, e.g. freed storage;\n"
    "    in debug mode, torch's negative bit set: call .resolve_neg() first, as\n"
    "    the bit is lost otherwise), MemoryError, RuntimeError\n"
    "    (CUDA failure; a torch array that requires grad in grad mode: ragvit's\n"
    "    ops have no backward). An exception raised by an argument's own protocol\n"
    "    (__dlpack__, __cuda_array_interface__, __index__, ...) propagates unchanged.");

/* ---- the pack family ---- */

PyDoc_STRVAR(pack_doc,
             "pack(x, keep, *, stream=None) -> (packed, cu_seqlens, indices)\n"
             "\n"
             "Gather the kept tokens of a padded batch into packed rows, in order.\n"
             "\n"
             "Args:\n"
             "    x: (B, N, C) float16, bfloat16 or float32, channels contiguous.\n"
             "    keep: (B, N) bool or uint8 on x's device; nonzero keeps the token.\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    packed (T, C) of x's dtype, cu_seqlens (B+1,) int32 and indices (T,) int32\n"
             "    (each packed token's position n within its image), in x's array type\n"
             "    (the rule of attention's out).\n"
             "    On CUDA this synchronizes the stream once to learn T; pack_into does not.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, MemoryError, RuntimeError as attention.");

PyDoc_STRVAR(pack_into_doc,
             "pack_into(x, keep, out, cu_seqlens, *, indices=None, stream=None) -> None\n"
             "\n"
             "pack() into caller-sized capacity buffers, with no host sync and no\n"
             "allocation (CUDA-graph capturable); the total is cu_seqlens[B] on the device.\n"
             "On CUDA the count and the gather are one kernel launch.\n"
             "\n"
             "Args:\n"
             "    x: (B, N, C) float16, bfloat16 or float32, channels contiguous.\n"
             "    keep: (B, N) bool or uint8.\n"
             "    out: (capacity, C) of x's dtype; rows past the kept total are untouched.\n"
             "        Kept tokens beyond capacity: on the CPU a ValueError before anything\n"
             "        (cu_seqlens included) is written; on CUDA flagged by the launch\n"
             "        (ValueError in debug mode, after it), when rows and indices [0,\n"
             "        capacity) hold the first kept tokens and cu_seqlens the full sums.\n"
             "    cu_seqlens: (B+1,) int32, receives the prefix sums of the kept counts.\n"
             "    indices: optional (capacity,) int32, receives each token's position n.\n"
             "    stream: as for attention.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, RuntimeError as attention.");

PyDoc_STRVAR(
    unpack_doc,
    "unpack(packed, cu_seqlens, N, *, indices=None, fill=0.0, out=None, stream=None) -> out\n"
    "\n"
    "Scatter packed tokens back to a padded (B, N, C) batch.\n"
    "\n"
    "Args:\n"
    "    packed: (T, C) float16, bfloat16 or float32, channels contiguous.\n"
    "    cu_seqlens: (B+1,) int32; every length must be <= N.\n"
    "    N: tokens per padded image.\n"
    "    indices: optional (T,) int32 target position of each packed token (e.g.\n"
    "        the indices pack returned); default: the first len rows of each image.\n"
    "    fill: value of every row not written from packed; a finite fill must stay\n"
    "        finite in packed's dtype.\n"
    "    out: optional (B, N, C) output of packed's dtype; allocated in packed's\n"
    "        array type when omitted (the rule of attention's out).\n"
    "    stream: as for attention.\n"
    "\n"
    "Returns:\n"
    "    out.\n"
    "\n"
    "Raises:\n"
    "    TypeError, ValueError, BufferError, MemoryError, RuntimeError as attention.");

PyDoc_STRVAR(gather_prefix_doc,
             "gather_prefix(packed, cu_seqlens, k, *, out=None, stream=None) -> out\n"
             "\n"
             "The first k tokens of every sequence (CLS / distillation tokens) as (B, k, C).\n"
             "\n"
             "Args:\n"
             "    packed: (T, C) float16, bfloat16 or float32, channels contiguous.\n"
             "    cu_seqlens: (B+1,) int32 on packed's device; every length must be >= k.\n"
             "    k: tokens per sequence to gather, an int in [0, 2**31).\n"
             "    out: optional (B, k, C) output of packed's dtype, channels contiguous;\n"
             "        allocated in packed's array type when omitted (attention's rule).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out, out[b, j] = packed[cu_seqlens[b] + j].\n"
             "\n"
             "Raises:\n"
             "    ValueError: a sequence shorter than k on the CPU (nothing is written). On\n"
             "        CUDA lengths cannot be read without a sync: a short sequence's missing\n"
             "        rows are zeros and the device flag is set (raised in debug mode).\n"
             "    TypeError, BufferError, MemoryError, RuntimeError as attention.");

PyDoc_STRVAR(segment_mean_doc,
             "segment_mean(packed, cu_seqlens, *, skip=0, out=None, stream=None) -> out\n"
             "\n"
             "Mean of each sequence's tokens after its first `skip` (global average pooling).\n"
             "\n"
             "Args:\n"
             "    packed: (T, C) float16, bfloat16 or float32, channels contiguous.\n"
             "    cu_seqlens: (B+1,) int32 on packed's device.\n"
             "    skip: leading tokens of each sequence to leave out (e.g. 1 for a CLS\n"
             "        token), an int in [0, 2**31).\n"
             "    out: optional (B, C) output of packed's dtype, channels contiguous;\n"
             "        allocated in packed's array type when omitted (attention's rule).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out, out[b] = mean(packed[cu_seqlens[b] + skip : cu_seqlens[b+1]]), summed in\n"
             "    float32 and rounded once to packed's dtype. A sequence with no token past\n"
             "    `skip` gives a row of zeros (not NaN), so the op needs no host-side lengths.\n"
             "\n"
             "Raises:\n"
             "    ValueError: bad cu_seqlens contents on the CPU (on CUDA: zeros, flagged).\n"
             "    TypeError, BufferError, MemoryError, RuntimeError as attention.");

PyDoc_STRVAR(repack_doc,
             "repack(packed, cu_seqlens, keep, *, fuse_weights=None, stream=None)\n"
             "    -> (packed2, cu_seqlens2, src)\n"
             "\n"
             "Drop tokens of already packed sequences (second and later pruning stages).\n"
             "\n"
             "Args:\n"
             "    packed: (T, C) float16, bfloat16 or float32, channels contiguous.\n"
             "    cu_seqlens: (B+1,) int32 on packed's device.\n"
             "    keep: (T,) bool or uint8 over the rows of packed; nonzero keeps the row.\n"
             "        Rows outside every sequence are ignored.\n"
             "    fuse_weights: optional (T,) float32 (EViT inattentive-token fusion): each\n"
             "        sequence gets one extra row after its kept rows, sum(w x) / sum(w) over\n"
             "        its dropped rows, accumulated in float32. It is always appended (zeros\n"
             "        when sum(w) == 0, e.g. nothing dropped), so every count grows by\n"
             "        exactly 1 and a capacity of T + B always suffices; its src is -1.\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    packed2 (T2, C) of packed's dtype (kept rows, in order), cu_seqlens2 (B+1,)\n"
             "    int32 and src (T2,) int32 (each kept row's index into packed), in packed's\n"
             "    array type (attention's rule). On CUDA this synchronizes the stream once\n"
             "    to learn T2;\n"
             "    repack_into does not.\n"
             "\n"
             "Raises:\n"
             "    ValueError: bad cu_seqlens contents on the CPU.\n"
             "    TypeError, BufferError, MemoryError, RuntimeError as attention.");

PyDoc_STRVAR(repack_into_doc,
             "repack_into(packed, cu_seqlens, keep, out, cu_seqlens_out, *, src=None,\n"
             "            fuse_weights=None, stream=None) -> None\n"
             "\n"
             "repack() into caller-sized capacity buffers, with no host sync and no\n"
             "allocation (CUDA-graph capturable); the total is cu_seqlens_out[B] on the device.\n"
             "On CUDA the count, the gather and any fusion are one kernel launch.\n"
             "\n"
             "Args:\n"
             "    packed, cu_seqlens, keep: as for repack.\n"
             "    out: (capacity, C) of packed's dtype; rows past the kept total are\n"
             "        untouched. Kept rows beyond capacity are dropped and never written\n"
             "        (CPU: ValueError before anything, cu_seqlens_out included, is\n"
             "        written; CUDA: flagged, raised in debug mode).\n"
             "    cu_seqlens_out: (B+1,) int32, receives the prefix sums of the kept counts.\n"
             "    src: optional (capacity,) int32, receives each kept row's index into packed.\n"
             "    fuse_weights: optional (T,) float32, as for repack (fused in the same launch).\n"
             "    stream: as for attention.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, RuntimeError as attention.");

/* ---- the row ops ---- */

PyDoc_STRVAR(linear_doc,
             "linear(x, weight, bias=None, *, residual=None, out=None, stream=None) -> out\n"
             "\n"
             "nn.Linear on packed rows, with an optional residual added in the GEMM epilogue:\n"
             "out = x @ weight.T + bias + residual, accumulated in float32 and rounded once.\n"
             "\n"
             "Args:\n"
             "    x: (M, K) float16, bfloat16 or float32, unit column stride, any row stride\n"
             "        (a view of a wider buffer is read in place).\n"
             "    weight: (N, K) of x's dtype, as nn.Linear stores it; unit column stride.\n"
             "    bias: optional (N,) of x's dtype, contiguous.\n"
             "    residual: optional (M, N) of x's dtype, unit column stride; may be out\n"
             "        itself (in place, same strides): a transformer block's x + proj(h).\n"
             "    out: optional (M, N) output of x's dtype, unit column stride, not sharing\n"
             "        memory with x, weight or bias; allocated in x's array type when\n"
             "        omitted (the rule of attention's out).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out.\n"
             "\n"
             "CUDA: cuBLASLt, loaded on the first call (libcublasLt.so from the soname or\n"
             "the path the build found), bias in the GEMM epilogue, residual as beta = 1;\n"
             "float32 inputs run in full float32 (no TF32). The first call on a device and\n"
             "stream allocates a 32 MiB workspace (a stream first seen while capturing a\n"
             "CUDA graph gets a workspace-free algorithm instead); each new shape costs one\n"
             "cuBLASLt heuristic query on the host, cached. No host sync (the one-time\n"
             "workspace cudaMalloc aside).\n"
             "CPU: plain C, double accumulation (slow; for tests and small models).\n"
             "\n"
             "Raises:\n"
             "    ValueError (shapes, strides, aliasing, devices), TypeError (dtype),\n"
             "    BufferError, MemoryError, RuntimeError (CUDA or cuBLASLt failure,\n"
             "    cuBLASLt not loadable).");

PyDoc_STRVAR(layer_norm_doc,
             "layer_norm(x, weight=None, bias=None, *, eps=1e-5, out=None, stream=None) -> out\n"
             "\n"
             "LayerNorm over the last dim of packed rows (nn.LayerNorm on (M, C)).\n"
             "\n"
             "Args:\n"
             "    x: (M, C) float16, bfloat16 or float32, unit column stride, any row stride.\n"
             "    weight, bias: optional (C,) of x's dtype (absent: 1 and 0).\n"
             "    eps: added to the variance, in (0, 1] and at least 1.2e-38 once rounded\n"
             "        to float32.\n"
             "    out: optional (M, C) of x's dtype, unit column stride; may be x itself\n"
             "        (in place, same strides), else must not share memory with x, weight\n"
             "        or bias; allocated in x's array type when omitted (attention's rule).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out: (x - mean) / sqrt(var + eps) * weight + bias per row, biased variance,\n"
             "    statistics in float32 on CUDA (double on the CPU), rounded once.\n"
             "\n"
             "Raises:\n"
             "    ValueError (shapes, strides, aliasing, devices, eps), TypeError (dtype),\n"
             "    BufferError, MemoryError, RuntimeError (CUDA failure).");

PyDoc_STRVAR(gelu_doc,
             "gelu(x, *, out=None, stream=None) -> out\n"
             "\n"
             "Exact (erf) GELU of packed rows, x * Phi(x), as nn.GELU() computes it.\n"
             "\n"
             "Args:\n"
             "    x: (M, C) float16, bfloat16 or float32, unit column stride, any row stride.\n"
             "    out: optional (M, C) of x's dtype, unit column stride; may be x itself (in\n"
             "        place, same strides), else must not share memory with x; allocated\n"
             "        in x's array type when omitted (attention's rule).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out, computed in float32 (double on the CPU) and rounded once. On CUDA,\n"
             "    float16/bfloat16 data get Phi from a rational erfc (within 4e-7 of the\n"
             "    float64 GELU, far under their rounding; fewer instructions than erff),\n"
             "    float32 data from erff.\n"
             "\n"
             "Raises:\n"
             "    ValueError (shapes, strides, aliasing), TypeError (dtype), BufferError,\n"
             "    MemoryError, RuntimeError (CUDA failure).");

/* ---- topk_index ---- */

PyDoc_STRVAR(topk_index_doc,
             "topk_index(scores, k, *, prefix=0, out=None, stream=None) -> out\n"
             "\n"
             "Per row of a score matrix: the `prefix` leading columns and the k\n"
             "highest-scoring columns after them, in ascending column order (the kept\n"
             "token indices of a top-k pruning policy), in one launch with no host sync\n"
             "(CUDA-graph capturable).\n"
             "\n"
             "Args:\n"
             "    scores: (B, L) float16, bfloat16 or float32, unit column stride, any row\n"
             "        stride (a view of a wider matrix is read in place); L <= 8192.\n"
             "    k: columns to choose among [prefix, L), an int in [0, L - prefix].\n"
             "    prefix: leading columns always kept (CLS / distillation tokens), an int\n"
             "        in [0, L]; their scores are never read.\n"
             "    out: optional (B, prefix + k) int32 or int64, unit column stride, rows not\n"
             "        overlapping, not sharing memory with scores; allocated as int64 in\n"
             "        scores' array type when omitted (attention's rule).\n"
             "    stream: as for attention.\n"
             "\n"
             "Returns:\n"
             "    out: row b is the ascending union of 0..prefix-1 and the k columns c >=\n"
             "    prefix ranked highest by scores[b, c]. Ranking: score descending; ties\n"
             "    keep the lower column; NaN ranks above every number (as torch.topk);\n"
             "    -0.0 equals +0.0. The same on the CPU and on CUDA, bit for bit. B = 0 or\n"
             "    prefix + k = 0 launches nothing.\n"
             "\n"
             "Raises:\n"
             "    ValueError (shapes, L > 8192, k or prefix out of range, k + prefix > L,\n"
             "    strides, aliasing, devices), TypeError (dtype, k or prefix not an int),\n"
             "    BufferError, MemoryError, RuntimeError (CUDA failure).");

/* ---- graph_replay ---- */

PyDoc_STRVAR(
    graph_replay_doc,
    "graph_replay(graph_exec, x, static_x, outputs, *, stream=None) -> out\n"
    "\n"
    "One replay of a captured CUDA graph, as ragvit.cuda_graph calls it for a shape it has\n"
    "seen: x is copied into static_x (the graph's input), the graph is launched, and each\n"
    "of the graph's outputs is copied into a fresh tensor, all on one stream with nothing\n"
    "synchronized. Equivalent to static_x.copy_(x); graph.replay(); [o.clone() for o in\n"
    "outputs] for a graph that draws no random numbers (torch's replay then does nothing\n"
    "more than launch it on the current stream).\n"
    "\n"
    "Args:\n"
    "    graph_exec: the graph's cudaGraphExec_t as an int\n"
    "        (torch.cuda.CUDAGraph.raw_cuda_graph_exec()), instantiated on x's device; it\n"
    "        must read static_x and write outputs, which the caller keeps alive.\n"
    "    x: the input, a contiguous CUDA tensor of static_x's shape and dtype, of a\n"
    "        library whose DLPack exchange API allocates (torch).\n"
    "    static_x: the graph's input buffer, contiguous and writable.\n"
    "    outputs: the graph's output tensor, or a tuple of at most 6, each contiguous, of\n"
    "        any dtype ragvit imports (float16/32/64, bfloat16, int32/64, uint8, bool).\n"
    "    stream: int cudaStream_t handle or object with __cuda_stream__; default: x's\n"
    "        library's current stream on x's device (torch.cuda.current_stream()).\n"
    "\n"
    "Returns:\n"
    "    A new tensor of x's library per output, on x's device, allocated on the call's\n"
    "    stream: one tensor for a tensor, a tuple for a tuple.\n"
    "\n"
    "Raises:\n"
    "    ValueError: shapes differ, a tensor is not contiguous, a device differs or is the\n"
    "        host, x partly overlaps static_x, more than 6 outputs, graph_exec is 0.\n"
    "    TypeError: dtypes differ, graph_exec is not an int, outputs is a list, x's library\n"
    "        has no exchange-API allocator.\n"
    "    RuntimeError: a CPU-only build (refused before anything else), or a CUDA failure.\n"
    "    Nothing is queued when the arguments are refused.");

/* ---- runtime ---- */

PyDoc_STRVAR(build_info_doc,
             "build_info() -> dict\n"
             "\n"
             "What this build of the extension contains: commit (the tree's short git commit\n"
             "at build time, or RAGVIT_GIT_SHA; \"unknown\" outside a checkout), cuda (built\n"
             "with nvcc), cuda_archs (the RAGVIT_CUDA_ARCHS it was built for, e.g. [\"80\",\n"
             "\"90\"]; empty without CUDA) and cublaslt (CUDA linear compiled in; False:\n"
             "ragvit.linear runs on the CPU only). ragvit.build_info() adds the version and\n"
             "what the process sees.");

PyDoc_STRVAR(cuda_is_compiled_doc,
             "cuda_is_compiled() -> bool\n\nTrue when the extension was built with nvcc.");

PyDoc_STRVAR(
    cuda_device_count_doc,
    "cuda_device_count() -> int\n\nCUDA devices visible (0 for a CPU-only build or no driver).");

PyDoc_STRVAR(
    set_debug_doc,
    "set_debug(enabled) -> None\n\nWhen on, every CUDA op synchronizes and raises ValueError\n"
    "if a kernel flagged bad device contents (cu_seqlens, capacity, indices).");

PyDoc_STRVAR(is_debug_doc, "is_debug() -> bool\n\nWhether debug checks are on.");

/* ---- ragvit.Buffer ---- */

PyDoc_STRVAR(buffer_doc,
             "An output ragvit allocated itself, for arguments whose array library offers no\n"
             "allocator: a compact array on a CPU or CUDA device, owned by ragvit, freed when the\n"
             "last reference to it (or to an array made from it) goes. The ops return it wrapped\n"
             "in the caller's array type: a cupy.ndarray over it for CuPy arguments, through\n"
             "__array_namespace__().from_dlpack (or the package's from_dlpack) for others that\n"
             "have one, else as it is.\n"
             "\n"
             "Exported without a copy through __dlpack__ / __dlpack_device__ (numpy.from_dlpack,\n"
             "torch.from_dlpack, cupy.from_dlpack, jax.numpy.from_dlpack), the CUDA Array\n"
             "Interface v3 (CUDA buffers; Numba's cuda.as_cuda_array) and the NumPy array\n"
             "interface (host buffers). bfloat16 buffers export through DLPack only.\n"
             "\n"
             "CUDA memory comes from a per-device stream-ordered pool: allocated on the call's\n"
             "stream and freed, once unreferenced, on ragvit's own stream after the buffer's last\n"
             "known use (the launch that wrote it, then every ragvit call that read it), so\n"
             "dropping it while a kernel still uses it is safe, and callers' streams may be\n"
             "destroyed first. The pool keeps freed memory for later calls. Passed back to a\n"
             "ragvit op, a Buffer is read directly (the call's stream waits on its last use).\n"
             "\n"
             "Attributes: shape (tuple), ndim, dtype (name, e.g. 'float32').");

PyDoc_STRVAR(buffer_dlpack_doc,
             "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> capsule\n"
             "\n"
             "Export as a DLPack capsule (array API standard).\n"
             "\n"
             "Args:\n"
             "    stream: the consumer's stream. CUDA: None or 1 the legacy default stream, 2\n"
             "        the per-thread default stream, a larger int a cudaStream_t handle, -1 no\n"
             "        synchronization; the consumer's stream waits (an event) for the work\n"
             "        queued on the buffer's stream, and the buffer's free is then ordered on\n"
             "        it. Host buffers: None or -1.\n"
             "    max_version: (major, minor) the consumer reads; major >= 1 gets a\n"
             "        \"dltensor_versioned\" capsule (DLPack 1.x), None or major 0 a legacy\n"
             "        \"dltensor\" one.\n"
             "    dl_device: None or the buffer's own device.\n"
             "    copy: None or False (the export never copies).\n"
             "\n"
             "Raises:\n"
             "    ValueError (stream 0 or below -1, or not None/-1 for a host buffer),\n"
             "    TypeError (stream or max_version of the wrong type, positional or unknown\n"
             "    arguments), BufferError (another dl_device, copy=True), RuntimeError (CUDA\n"
             "    failure while making the consumer's stream wait).");

PyDoc_STRVAR(buffer_dlpack_device_doc,
             "__dlpack_device__() -> (device_type, device_id)\n\n(1, 0) on the host, (2, id) "
             "on CUDA device id.");

PyDoc_STRVAR(buffer_cai_doc,
             "CUDA Array Interface v3 of a CUDA buffer (shape, typestr, data, strides None,\n"
             "stream: the buffer's stream, 1 for the legacy default one). Absent on host\n"
             "and bfloat16 buffers (AttributeError).");

PyDoc_STRVAR(buffer_array_interface_doc,
             "NumPy array interface v3 of a host buffer. Absent on CUDA and bfloat16 buffers\n"
             "(AttributeError).");

PyDoc_STRVAR(launch_empty_doc,
             "_launch_empty(device=0, stream=0, *args, **kwargs) -> None\n\nLaunch an empty kernel "
             "(benchmark floor); further arguments are ignored.");

PyDoc_STRVAR(memory_stats_doc,
             "_memory_stats(device=0) -> dict\n\nCounters of the device's memory, for the tests: "
             "'events' (CUDA events the pool created), 'marks' (marks recorded, one per CUDA "
             "call that touched a ragvit.Buffer) and 'reused' (allocations served by a kept "
             "block, with no CUDA call).");

PyDoc_STRVAR(cupy_ndarray_doc,
             "_cupy_ndarray(buffer, like) -> cupy.ndarray or None\n\nThe cupy.ndarray over buffer "
             "that an op whose first array argument is like returns (None where like is no "
             "cupy.ndarray or the dtype has no NumPy counterpart), for the tests; no stream is "
             "touched.");

PyDoc_STRVAR(cupy_current_stream_doc,
             "_cupy_current_stream(device) -> int or None\n\nCuPy's current stream on device as "
             "ragvit reads it to order a CuPy output (None before any output went to a "
             "cupy.ndarray), for the tests.");

#endif /* RAGVIT_DOCS_H */
