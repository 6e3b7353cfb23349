/* module.c — ragvit._C: the op wrappers, their docstrings, the method table
 * and the module's lifecycle (PyModuleDef, Py_mod_exec, module state).
 * Layout of the glue: errors.c raises, args.c parses, interop.c imports and
 * allocates, glue.h declares what they share.
 * Decision: everything a call needs lives in the module state, not in C
 * globals, so each (sub)interpreter's module owns its own cache and context. */
#include "glue.h"

/* -1 with ValueError unless packed is (T, C) and cu_seqlens (B+1,) (for
 * sizing an output before the core checks everything else). */
static int check_packed_dims(call_state *cs, const ragvit_tensor *packed, const ragvit_tensor *cu) {
    if (packed->ndim == 2 && cu->ndim == 1) return 0;
    ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                "%s: packed must be (T, C) and cu_seqlens (B+1,), got %d and %d dimensions", cs->op,
                packed->ndim, cu->ndim);
    return raise_status(RAGVIT_STATUS_INVALID_SHAPE);
}

/* The output of a per-sequence op: (B, rows, C), or (B, C) when rows < 0.
 * Returns a new reference to `given` (its rows per sequence checked) or a new
 * array allocated like packed; NULL with an exception. */
static PyObject *sequence_output(call_state *cs, PyObject *given, const ragvit_tensor *packed,
                                 const ragvit_tensor *cu, long long rows, const char *rows_name,
                                 ragvit_tensor *out) {
    if (given != NULL) {
        if (rows >= 0 && out->ndim == 3 && out->shape[1] != rows) {
            ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                        "%s: out must have %s=%lld rows per sequence, got %lld", cs->op, rows_name,
                        rows, (long long)out->shape[1]);
            raise_status(RAGVIT_STATUS_INVALID_SHAPE);
            return NULL;
        }
        Py_INCREF(given);
        return given;
    }
    if (check_packed_dims(cs, packed, cu)) return NULL;
    const int64_t batch = cu->shape[0] > 0 ? cu->shape[0] - 1 : 0;
    const int64_t shape[3] = {batch, rows >= 0 ? rows : packed->shape[1], packed->shape[1]};
    return alloc_like(cs, 0, packed, "out", packed->dtype, rows >= 0 ? 3 : 2, shape, out);
}

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
    "        lengths; cu_seqlens[S] <= T, rows past it are left untouched.\n"
    "    max_seqlen: upper bound on every length; sizes the grid and is never read\n"
    "        back from the device. Default: read from cu_seqlens on the CPU, T on CUDA\n"
    "        (pass it on CUDA: a tight bound launches far fewer blocks).\n"
    "    scale: softmax scale, default 1/sqrt(D); finite and > 0.\n"
    "    out: (T, H, D) output of q's dtype. When omitted it is allocated by q's\n"
    "        library (DLPack exchange API, e.g. torch) or NumPy for host arrays.\n"
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
    "    (unimportable array), MemoryError, RuntimeError (CUDA failure).");

static PyObject *py_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"q",     "k",   "v",        "cu_seqlens", "max_seqlen",
                                        "scale", "out", "cls_attn", "bias",       "stream"};
    PyObject *values[10];
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor q, k, v, cu, out, cls, bias;
    int64_t max_seqlen;
    double scale;
    call_state cs;
    call_init(&cs, module, "attention");
    if (parse_args(cs.op, args, nargs, kwnames, names, 10, 5, 4, values)) return NULL;
    if (parse_max_seqlen(&cs, values[4], &max_seqlen)) return NULL;
    if (parse_float(&cs, values[5], "scale", 0.0, &scale)) return NULL;
    if (parse_stream(&cs, values[9])) return NULL;
    if (import_arg(&cs, values[0], "q", &q) || import_arg(&cs, values[1], "k", &k) ||
        import_arg(&cs, values[2], "v", &v) || import_arg(&cs, values[3], "cu_seqlens", &cu) ||
        import_arg(&cs, values[6], "out", &out) || import_arg(&cs, values[7], "cls_attn", &cls) ||
        import_arg(&cs, values[8], "bias", &bias)) {
        goto done;
    }
    if (!out.is_present) {
        if (q.ndim != 3)
            RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                                 "attention: q must have 3 dimensions, got %d", q.ndim));
        out_obj = alloc_like(&cs, 0, &q, "out", q.dtype, 3, q.shape, &out);
        if (out_obj == NULL) goto done;
    } else {
        out_obj = values[6];
        Py_INCREF(out_obj);
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_attention(&cs.st->ctx, &out, &cls, &q, &k, &v, &cu, &bias, max_seqlen,
                              values[5] ? &scale : NULL, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

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
             "    (each packed token's position n within its image), in x's library.\n"
             "    On CUDA this synchronizes the stream once to learn T; pack_into does not.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, MemoryError, RuntimeError as attention.");

static PyObject *py_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    static const char *const names[] = {"x", "keep", "stream"};
    PyObject *values[3];
    PyObject *cu_obj = NULL, *out_obj = NULL, *idx_obj = NULL, *result = NULL;
    ragvit_tensor x, keep, cu, out, idx;
    call_state cs;
    call_init(&cs, module, "pack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 3, 2, 2, values)) return NULL;
    if (parse_stream(&cs, values[2])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "keep", &keep)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    if (x.ndim != 3) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "pack: x must have 3 dimensions (B, N, C), got %d", x.ndim));
    }
    const int64_t cu_shape[1] = {x.shape[0] + 1};
    cu_obj = alloc_like(&cs, 0, &x, "cu_seqlens", RAGVIT_DTYPE_I32, 1, cu_shape, &cu);
    if (cu_obj == NULL) goto done;
    RAISE_IF(ragvit_pack_count(&cs.st->ctx, &cu, &keep, cs.stream));
    int32_t total = 0;
    RAISE_IF(ragvit_read_int32(&total, &cu, x.shape[0], cs.stream));
    const int64_t out_shape[2] = {total, x.shape[2]};
    const int64_t idx_shape[1] = {total};
    out_obj = alloc_like(&cs, 0, &x, "packed", x.dtype, 2, out_shape, &out);
    if (out_obj == NULL) goto done;
    idx_obj = alloc_like(&cs, 0, &x, "indices", RAGVIT_DTYPE_I32, 1, idx_shape, &idx);
    if (idx_obj == NULL) goto done;
    RAISE_IF(ragvit_pack_gather(&cs.st->ctx, &out, &idx, &x, &keep, &cu, cs.stream));
    result = PyTuple_Pack(3, out_obj, cu_obj, idx_obj);
done:
    release_slots(&cs);
    Py_XDECREF(cu_obj);
    Py_XDECREF(out_obj);
    Py_XDECREF(idx_obj);
    return result;
}

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
             "        Kept tokens beyond capacity are dropped (CPU: ValueError; CUDA: flagged,\n"
             "        raised in debug mode).\n"
             "    cu_seqlens: (B+1,) int32, receives the prefix sums of the kept counts.\n"
             "    indices: optional (capacity,) int32, receives each token's position n.\n"
             "    stream: as for attention.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, RuntimeError as attention.");

static PyObject *py_pack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"x", "keep", "out", "cu_seqlens", "indices", "stream"};
    PyObject *values[6];
    PyObject *result = NULL;
    ragvit_tensor x, keep, out, cu, idx;
    call_state cs;
    call_init(&cs, module, "pack_into");
    if (parse_args(cs.op, args, nargs, kwnames, names, 6, 4, 4, values)) return NULL;
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "keep", &keep) ||
        import_arg(&cs, values[2], "out", &out) || import_arg(&cs, values[3], "cu_seqlens", &cu) ||
        import_arg(&cs, values[4], "indices", &idx)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_pack_into(&cs.st->ctx, &out, &idx, &cu, &x, &keep, cs.stream));
    result = Py_None;
    Py_INCREF(result);
done:
    release_slots(&cs);
    return result;
}

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
    "    fill: value of every row not written from packed.\n"
    "    out: optional (B, N, C) output of packed's dtype.\n"
    "    stream: as for attention.\n"
    "\n"
    "Returns:\n"
    "    out.\n"
    "\n"
    "Raises:\n"
    "    TypeError, ValueError, BufferError, MemoryError, RuntimeError as attention.");

static PyObject *py_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"packed", "cu_seqlens", "N",     "indices",
                                        "fill",   "out",        "stream"};
    PyObject *values[7];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, idx, out;
    double fill;
    call_state cs;
    call_init(&cs, module, "unpack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 7, 3, 3, values)) return NULL;
    long long n = 0;
    if (parse_count(&cs, values[2], "N", &n)) return NULL;
    if (parse_float(&cs, values[4], "fill", 0.0, &fill)) return NULL;
    if (parse_stream(&cs, values[6])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[3], "indices", &idx) || import_arg(&cs, values[5], "out", &out)) {
        goto done;
    }
    out_obj = sequence_output(&cs, values[5], &packed, &cu, n, "N", &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_unpack(&cs.st->ctx, &out, &packed, &cu, &idx, fill, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

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
             "        allocated like packed when omitted.\n"
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

/* gather_prefix (is_prefix: required k) and segment_mean (optional skip):
 * (packed, cu_seqlens, <count>, *, out=None, stream=None) -> out. */
static PyObject *sequence_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, const char *op, const char *count_name,
                             int is_prefix) {
    const char *const names[] = {"packed", "cu_seqlens", count_name, "out", "stream"};
    const int positional = is_prefix ? 3 : 2;
    PyObject *values[5];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, out;
    long long count = 0;
    call_state cs;
    call_init(&cs, module, op);
    if (parse_args(op, args, nargs, kwnames, names, 5, positional, positional, values)) {
        return NULL;
    }
    if (values[2] != NULL && parse_count(&cs, values[2], count_name, &count)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) || import_arg(&cs, values[3], "out", &out)) {
        goto done;
    }
    out_obj =
        sequence_output(&cs, values[3], &packed, &cu, is_prefix ? count : -1, count_name, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(is_prefix ? ragvit_gather_prefix(&cs.st->ctx, &out, &packed, &cu, cs.stream)
                       : ragvit_segment_mean(&cs.st->ctx, &out, &packed, &cu, count, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

static PyObject *py_gather_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    return sequence_op(module, args, nargs, kwnames, "gather_prefix", "k", 1);
}

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
             "        allocated like packed when omitted.\n"
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

static PyObject *py_segment_mean(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    return sequence_op(module, args, nargs, kwnames, "segment_mean", "skip", 0);
}

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
             "        overlapping, not sharing memory with scores; allocated as int64 like\n"
             "        scores when omitted.\n"
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

static PyObject *py_topk_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"scores", "k", "prefix", "out", "stream"};
    PyObject *values[5];
    PyObject *out_obj = NULL, *result = NULL;
    ragvit_tensor scores, out;
    long long k = 0, prefix = 0;
    call_state cs;
    call_init(&cs, module, "topk_index");
    if (parse_args(cs.op, args, nargs, kwnames, names, 5, 2, 2, values)) return NULL;
    if (parse_count(&cs, values[1], "k", &k)) return NULL;
    if (values[2] != NULL && parse_count(&cs, values[2], "prefix", &prefix)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "scores", &scores) || import_arg(&cs, values[3], "out", &out)) {
        goto done;
    }
    if (values[3] != NULL) {
        out_obj = values[3];
        Py_INCREF(out_obj);
    } else if (scores.ndim == 2 && scores.shape[1] <= RAGVIT_TOPK_MAX_COLS &&
               prefix + k <= scores.shape[1]) {
        /* Any other scores, k or prefix fails in the core before out is read. */
        const int64_t shape[2] = {scores.shape[0], prefix + k};
        out_obj = alloc_like(&cs, 0, &scores, "out", RAGVIT_DTYPE_I64, 2, shape, &out);
        if (out_obj == NULL) goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_topk_index(&cs.st->ctx, &out, &scores, k, prefix, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

/* New reference to the given out, or a new (rows, cols) array allocated like
 * the argument in slot 0 (x); NULL with an exception. */
static PyObject *rows_output(call_state *cs, PyObject *given, const ragvit_tensor *x, int64_t cols,
                             ragvit_tensor *out) {
    if (given != NULL) {
        Py_INCREF(given);
        return given;
    }
    if (x->ndim != 2) {
        ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE, "%s: x must have 2 dimensions (M, K), got %d",
                    cs->op, x->ndim);
        raise_status(RAGVIT_STATUS_INVALID_SHAPE);
        return NULL;
    }
    const int64_t shape[2] = {x->shape[0], cols};
    return alloc_like(cs, 0, x, "out", x->dtype, 2, shape, out);
}

PyDoc_STRVAR(linear_doc,
             "linear(x, weight, bias=None, *, residual=None, out=None, stream=None) -> out\n"
             "\n"
             "nn.Linear on packed rows with an optional fused residual add:\n"
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
             "        memory with x, weight or bias; allocated like x when omitted.\n"
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

static PyObject *py_linear(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"x", "weight", "bias", "residual", "out", "stream"};
    PyObject *values[6];
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor x, w, bias, res, out;
    call_state cs;
    call_init(&cs, module, "linear");
    if (parse_args(cs.op, args, nargs, kwnames, names, 6, 3, 2, values)) return NULL;
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "weight", &w) ||
        import_arg(&cs, values[2], "bias", &bias) || import_arg(&cs, values[3], "residual", &res) ||
        import_arg(&cs, values[4], "out", &out)) {
        goto done;
    }
    if (values[4] == NULL && w.ndim != 2) {
        RAISE_IF(ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                             "linear: weight must have 2 dimensions (N, K), got %d", w.ndim));
    }
    out_obj = rows_output(&cs, values[4], &x, values[4] == NULL ? w.shape[0] : 0, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_linear(&cs.st->ctx, &out, &x, &w, &bias, &res, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

PyDoc_STRVAR(layer_norm_doc,
             "layer_norm(x, weight=None, bias=None, *, eps=1e-5, out=None, stream=None) -> out\n"
             "\n"
             "LayerNorm over the last dim of packed rows (nn.LayerNorm on (M, C)).\n"
             "\n"
             "Args:\n"
             "    x: (M, C) float16, bfloat16 or float32, unit column stride, any row stride.\n"
             "    weight, bias: optional (C,) of x's dtype (absent: 1 and 0).\n"
             "    eps: added to the variance, finite and in (0, 1].\n"
             "    out: optional (M, C) of x's dtype, unit column stride; may be x itself\n"
             "        (in place, same strides), else must not share memory with x, weight\n"
             "        or bias; allocated like x when omitted.\n"
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
             "        like x when omitted.\n"
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

/* layer_norm (has_affine) and gelu: (x, [weight, bias,] *, [eps,] out, stream). */
static PyObject *rowwise_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames, int has_affine) {
    static const char *const ln_names[] = {"x", "weight", "bias", "eps", "out", "stream"};
    static const char *const gelu_names[] = {"x", "out", "stream"};
    PyObject *values[6] = {NULL};
    PyObject *result = NULL, *out_obj = NULL;
    ragvit_tensor x, w, bias, out;
    double eps = 1e-5;
    call_state cs;
    call_init(&cs, module, has_affine ? "layer_norm" : "gelu");
    if (has_affine) {
        if (parse_args(cs.op, args, nargs, kwnames, ln_names, 6, 3, 1, values)) return NULL;
        if (parse_float(&cs, values[3], "eps", 1e-5, &eps)) return NULL;
    } else {
        /* gelu's (x, out, stream) land in the slots layer_norm uses for them */
        PyObject *g[3];
        if (parse_args(cs.op, args, nargs, kwnames, gelu_names, 3, 1, 1, g)) return NULL;
        values[0] = g[0];
        values[4] = g[1];
        values[5] = g[2];
    }
    if (parse_stream(&cs, values[5])) return NULL;
    if (import_arg(&cs, values[0], "x", &x) || import_arg(&cs, values[1], "weight", &w) ||
        import_arg(&cs, values[2], "bias", &bias) || import_arg(&cs, values[4], "out", &out)) {
        goto done;
    }
    out_obj = rows_output(&cs, values[4], &x, x.ndim == 2 ? x.shape[1] : 0, &out);
    if (out_obj == NULL) goto done;
    if (finish_streams(&cs)) goto done;
    RAISE_IF(has_affine ? ragvit_layer_norm(&cs.st->ctx, &out, &x, &w, &bias, eps, cs.stream)
                        : ragvit_gelu(&cs.st->ctx, &out, &x, cs.stream));
    result = out_obj;
    out_obj = NULL;
done:
    release_slots(&cs);
    Py_XDECREF(out_obj);
    return result;
}

static PyObject *py_layer_norm(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    return rowwise_op(module, args, nargs, kwnames, 1);
}

static PyObject *py_gelu(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames) {
    return rowwise_op(module, args, nargs, kwnames, 0);
}

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
             "    library. On CUDA this synchronizes the stream once to learn T2;\n"
             "    repack_into does not.\n"
             "\n"
             "Raises:\n"
             "    ValueError: bad cu_seqlens contents on the CPU.\n"
             "    TypeError, BufferError, MemoryError, RuntimeError as attention.");

static PyObject *py_repack(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"packed", "cu_seqlens", "keep", "fuse_weights", "stream"};
    PyObject *values[5];
    PyObject *cu2_obj = NULL, *out_obj = NULL, *src_obj = NULL, *result = NULL;
    ragvit_tensor packed, cu, keep, weights, cu2, out, src;
    call_state cs;
    call_init(&cs, module, "repack");
    if (parse_args(cs.op, args, nargs, kwnames, names, 5, 3, 3, values)) return NULL;
    if (parse_stream(&cs, values[4])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[2], "keep", &keep) ||
        import_arg(&cs, values[3], "fuse_weights", &weights)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    if (check_packed_dims(&cs, &packed, &cu)) goto done;
    cu2_obj = alloc_like(&cs, 0, &packed, "cu_seqlens", RAGVIT_DTYPE_I32, 1, cu.shape, &cu2);
    if (cu2_obj == NULL) goto done;
    RAISE_IF(ragvit_repack_count(&cs.st->ctx, &cu2, &packed, &cu, &keep, &weights, cs.stream));
    int32_t total = 0;
    RAISE_IF(ragvit_read_int32(&total, &cu2, cu.shape[0] - 1, cs.stream));
    const int64_t out_shape[2] = {total, packed.shape[1]};
    const int64_t src_shape[1] = {total};
    out_obj = alloc_like(&cs, 0, &packed, "packed", packed.dtype, 2, out_shape, &out);
    if (out_obj == NULL) goto done;
    src_obj = alloc_like(&cs, 0, &packed, "src", RAGVIT_DTYPE_I32, 1, src_shape, &src);
    if (src_obj == NULL) goto done;
    RAISE_IF(ragvit_repack_gather(&cs.st->ctx, &out, &src, &packed, &cu, &keep, &weights, &cu2,
                                  cs.stream));
    result = PyTuple_Pack(3, out_obj, cu2_obj, src_obj);
done:
    release_slots(&cs);
    Py_XDECREF(cu2_obj);
    Py_XDECREF(out_obj);
    Py_XDECREF(src_obj);
    return result;
}

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
             "        (CPU: ValueError before any row is written; CUDA: flagged, raised in\n"
             "        debug mode).\n"
             "    cu_seqlens_out: (B+1,) int32, receives the prefix sums of the kept counts.\n"
             "    src: optional (capacity,) int32, receives each kept row's index into packed.\n"
             "    fuse_weights: optional (T,) float32, as for repack (fused in the same launch).\n"
             "    stream: as for attention.\n"
             "\n"
             "Raises:\n"
             "    TypeError, ValueError, BufferError, RuntimeError as attention.");

static PyObject *py_repack_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    static const char *const names[] = {"packed",         "cu_seqlens", "keep",         "out",
                                        "cu_seqlens_out", "src",        "fuse_weights", "stream"};
    PyObject *values[8];
    PyObject *result = NULL;
    ragvit_tensor packed, cu, keep, out, cu2, src, weights;
    call_state cs;
    call_init(&cs, module, "repack_into");
    if (parse_args(cs.op, args, nargs, kwnames, names, 8, 5, 5, values)) return NULL;
    if (parse_stream(&cs, values[7])) return NULL;
    if (import_arg(&cs, values[0], "packed", &packed) ||
        import_arg(&cs, values[1], "cu_seqlens", &cu) ||
        import_arg(&cs, values[2], "keep", &keep) || import_arg(&cs, values[3], "out", &out) ||
        import_arg(&cs, values[4], "cu_seqlens_out", &cu2) ||
        import_arg(&cs, values[5], "src", &src) ||
        import_arg(&cs, values[6], "fuse_weights", &weights)) {
        goto done;
    }
    if (finish_streams(&cs)) goto done;
    RAISE_IF(ragvit_repack_into(&cs.st->ctx, &out, &src, &cu2, &packed, &cu, &keep, &weights,
                                cs.stream));
    result = Py_None;
    Py_INCREF(result);
done:
    release_slots(&cs);
    return result;
}

static PyObject *py_cuda_is_compiled(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyBool_FromLong(ragvit_cuda_is_compiled());
}

static PyObject *py_cuda_device_count(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    int32_t count = 0;
    if (raise_status(ragvit_device_count(&count))) return NULL;
    return PyLong_FromLong(count);
}

static PyObject *py_set_debug(PyObject *module, PyObject *flag) {
    int value = PyObject_IsTrue(flag);
    if (value < 0) return NULL;
    ((module_state *)PyModule_GetState(module))->ctx.is_debug = value;
    Py_RETURN_NONE;
}

static PyObject *py_is_debug(PyObject *module, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(((module_state *)PyModule_GetState(module))->ctx.is_debug);
}

/* _launch_empty(device=0, stream=0, *args, **kwargs): the benchmarks' floor.
 * Arguments past device and stream, positional or keyword, are accepted and
 * ignored, so the floor can be called with exactly the call shape of the op it
 * is compared with (same argument count, same keyword names). */
static PyObject *py_launch_empty(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    PyObject *device_obj = nargs > 0 ? args[0] : NULL; /* borrowed */
    PyObject *stream_obj = nargs > 1 ? args[1] : NULL; /* borrowed */
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j); /* borrowed */
        int index = keyword_is(key, "device") ? 0 : keyword_is(key, "stream") ? 1 : -1;
        if (index < 0) continue;
        if (index < nargs) {
            PyErr_Format(PyExc_TypeError, "launch_empty() got multiple values for argument '%U'",
                         key);
            return NULL;
        }
        *(index == 0 ? &device_obj : &stream_obj) = args[nargs + j];
    }
    call_state cs;
    call_init(&cs, module, "launch_empty");
    long device = (device_obj && device_obj != Py_None) ? PyLong_AsLong(device_obj) : 0;
    if (device == -1 && PyErr_Occurred()) return NULL;
    if (parse_stream(&cs, stream_obj == Py_None ? NULL : stream_obj)) return NULL;
    if (raise_status(ragvit_launch_empty(&cs.st->ctx, (int32_t)device, cs.stream))) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL | METH_KEYWORDS,
     attention_doc},
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_FASTCALL | METH_KEYWORDS, pack_doc},
    {"pack_into", (PyCFunction)(void (*)(void))py_pack_into, METH_FASTCALL | METH_KEYWORDS,
     pack_into_doc},
    {"unpack", (PyCFunction)(void (*)(void))py_unpack, METH_FASTCALL | METH_KEYWORDS, unpack_doc},
    {"repack", (PyCFunction)(void (*)(void))py_repack, METH_FASTCALL | METH_KEYWORDS, repack_doc},
    {"repack_into", (PyCFunction)(void (*)(void))py_repack_into, METH_FASTCALL | METH_KEYWORDS,
     repack_into_doc},
    {"gather_prefix", (PyCFunction)(void (*)(void))py_gather_prefix, METH_FASTCALL | METH_KEYWORDS,
     gather_prefix_doc},
    {"segment_mean", (PyCFunction)(void (*)(void))py_segment_mean, METH_FASTCALL | METH_KEYWORDS,
     segment_mean_doc},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL | METH_KEYWORDS, linear_doc},
    {"layer_norm", (PyCFunction)(void (*)(void))py_layer_norm, METH_FASTCALL | METH_KEYWORDS,
     layer_norm_doc},
    {"gelu", (PyCFunction)(void (*)(void))py_gelu, METH_FASTCALL | METH_KEYWORDS, gelu_doc},
    {"topk_index", (PyCFunction)(void (*)(void))py_topk_index, METH_FASTCALL | METH_KEYWORDS,
     topk_index_doc},
    {"cuda_is_compiled", py_cuda_is_compiled, METH_NOARGS,
     "cuda_is_compiled() -> bool\n\nTrue when the extension was built with nvcc."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int\n\nCUDA devices visible (0 for a CPU-only build or no driver)."},
    {"set_debug", py_set_debug, METH_O,
     "set_debug(enabled) -> None\n\nWhen on, every CUDA op synchronizes and raises ValueError\n"
     "if a kernel flagged bad device contents (cu_seqlens, capacity, indices)."},
    {"is_debug", py_is_debug, METH_NOARGS, "is_debug() -> bool\n\nWhether debug checks are on."},
    {"_launch_empty", (PyCFunction)(void (*)(void))py_launch_empty, METH_FASTCALL | METH_KEYWORDS,
     "_launch_empty(device=0, stream=0, *args, **kwargs) -> None\n\nLaunch an empty kernel "
     "(benchmark floor); further arguments are ignored."},
    {NULL, NULL, 0, NULL},
};

/* ---- module lifecycle ---- */

static int module_exec(PyObject *module) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (import_numpy_api() < 0) return -1;
    ragvit_context_init(&st->ctx);
    const char *debug = getenv("RAGVIT_DEBUG");
    st->ctx.is_debug = debug && debug[0] && strcmp(debug, "0") != 0;
    st->str_dlpack = PyUnicode_InternFromString("__dlpack__");
    st->str_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    st->str_cai = PyUnicode_InternFromString("__cuda_array_interface__");
    st->str_cuda_stream = PyUnicode_InternFromString("__cuda_stream__");
    st->str_exchange_api = PyUnicode_InternFromString("__dlpack_c_exchange_api__");
    st->str_stream = PyUnicode_InternFromString("stream");
    st->str_max_version = PyUnicode_InternFromString("max_version");
    st->max_version = Py_BuildValue("(ii)", 1, 0);
    if (!st->str_dlpack || !st->str_dlpack_device || !st->str_cai || !st->str_cuda_stream ||
        !st->str_exchange_api || !st->str_stream || !st->str_max_version || !st->max_version) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "TOPK_INDEX_MAX_COLS", RAGVIT_TOPK_MAX_COLS) < 0) {
        return -1;
    }
    return PyModule_AddStringConstant(module, "dlpack_version", "1.3");
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_count; i++) Py_VISIT(st->api_cache[i].type);
    return 0;
}

static int module_clear(PyObject *module) {
    module_state *st = (module_state *)PyModule_GetState(module);
    if (st == NULL) return 0;
    for (int i = 0; i < st->api_cache_count; i++) Py_CLEAR(st->api_cache[i].type);
    st->api_cache_count = 0;
    Py_CLEAR(st->str_dlpack);
    Py_CLEAR(st->str_dlpack_device);
    Py_CLEAR(st->str_cai);
    Py_CLEAR(st->str_cuda_stream);
    Py_CLEAR(st->str_exchange_api);
    Py_CLEAR(st->str_stream);
    Py_CLEAR(st->str_max_version);
    Py_CLEAR(st->max_version);
    return 0;
}

static void module_free(void *module) {
    module_state *st = (module_state *)PyModule_GetState((PyObject *)module);
    module_clear((PyObject *)module);
    if (st) ragvit_context_release(&st->ctx);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ragvit._C",
    .m_doc = "ragvit's C extension: ragged attention and token packing on packed tokens.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
