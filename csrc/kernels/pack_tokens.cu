/* pack_tokens.cu — padded <-> packed token movement (bytes only, exact): count
 * keep (B, N) into cu_seqlens (B+1,); gather x (B, N, C) into out (capacity, C)
 * (+ indices); unpack packed (T, C) into out (B, N, C) by position or by indices.
 * count: grid = (1), 1024 threads, a warp per image row, block scan in chunks of 1024.
 * gather / unpack: grid = (B, channel slices), 256 threads; one block owns all rows
 * of its image's slice, which is what orders unpack's fill before its scatter.
 * Rows move as 16/8/4/2-byte vectors, the widest that sizes, pointers and strides allow.
 * Covered by tests/test_ops.py (pack / pack_into / unpack cases, checked with torch.equal). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "cuda_check.cuh"

static constexpr int kCountThreads = 1024;
static constexpr int kMoveThreads = 256;       /* gather and unpack */
static constexpr int kMoveRows = kMoveThreads; /* rows per step of gather / unpack */
/* Vectors per channel slice: keeps kMoveRows * columns inside int32 in the kernels. */
static constexpr int64_t kMaxSliceVecs = (int64_t)1 << 22;
static constexpr unsigned kFullMask = 0xffffffffu;

// ---- device helpers ----

static __device__ __forceinline__ void pack_tokens_flag(unsigned int *flag, unsigned int bit) {
    if (flag != nullptr)
        atomicOr(flag, bit);
}

/* Exclusive prefix sum of x over the block (blockDim.x a multiple of 32); *total
 * gets the block's sum. Callers __syncthreads() between two calls (warp_s reuse). */
static __device__ __forceinline__ int pack_tokens_block_scan(int x, int *warp_s, int *total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    int inclusive = x;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset)
            inclusive += y;
    }
    if (lane == 31)
        warp_s[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? warp_s[lane] : 0;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int y = __shfl_up_sync(kFullMask, w, offset);
            if (lane >= offset)
                w += y;
        }
        if (lane < num_warps)
            warp_s[lane] = w;
    }
    __syncthreads();
    *total = warp_s[num_warps - 1];
    return (warp > 0 ? warp_s[warp - 1] : 0) + inclusive - x;
}

/* A vector of copies of one element: bits holds the element twice for 2-byte types. */
static __device__ __forceinline__ void pack_tokens_make_fill(uint4 *v, unsigned int bits) {
    *v = make_uint4(bits, bits, bits, bits);
}
static __device__ __forceinline__ void pack_tokens_make_fill(uint2 *v, unsigned int bits) {
    *v = make_uint2(bits, bits);
}
static __device__ __forceinline__ void pack_tokens_make_fill(unsigned int *v, unsigned int bits) {
    *v = bits;
}
static __device__ __forceinline__ void pack_tokens_make_fill(unsigned short *v,
                                                             unsigned int bits) {
    *v = (unsigned short)bits;
}

// ---- kernels ----

static __global__ void __launch_bounds__(kCountThreads)
    pack_tokens_count_kernel(const ragvit_pack_args a) {
    __shared__ int count_s[kCountThreads];
    __shared__ int warp_s[32];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    constexpr int kWarps = kCountThreads / 32;

    if (tid == 0)
        a.cu_seqlens[0] = 0;
    int64_t carry = 0;
    for (int64_t base = 0; base < a.batch; base += kCountThreads) {
        for (int r = warp; r < kCountThreads; r += kWarps) {
            const int64_t b = base + r;
            int count = 0;
            if (b < a.batch) { /* warp-uniform, so the shuffles below see all lanes */
                const uint8_t *row = a.keep + b * a.keep_stride_b;
                for (int64_t n = lane; n < a.seqlen; n += 32)
                    count += row[n * a.keep_stride_n] != 0;
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1)
                    count += __shfl_xor_sync(kFullMask, count, offset);
            }
            if (lane == 0)
                count_s[r] = count;
        }
        __syncthreads();
        int total = 0;
        const int mine = count_s[tid];
        const int before = pack_tokens_block_scan(mine, warp_s, &total);
        if (base + tid < a.batch)
            a.cu_seqlens[(base + tid + 1) * a.cu_seqlens_stride] =
                (int32_t)(carry + before + mine);
        carry += total;
        __syncthreads(); /* count_s and warp_s are rewritten by the next chunk */
    }
}

/* Block (b, y) copies vector columns [y * cols_per_slice, ...) of image b's kept
 * tokens; slice 0 also writes indices_out. Rows past capacity are skipped. */
template <typename V>
static __global__ void __launch_bounds__(kMoveThreads, 4)
    pack_tokens_gather_kernel(const ragvit_pack_args a, int vecs_per_row, int cols_per_slice) {
    __shared__ int token_s[kMoveRows]; /* source n of each kept token of the chunk */
    __shared__ int warp_s[32];
    const int64_t b = blockIdx.x;
    const int tid = threadIdx.x;
    const bool is_first_slice = blockIdx.y == 0;
    const int64_t first = a.cu_seqlens[b * a.cu_seqlens_stride];
    /* Uniform over the block: every thread read the same entry. */
    if (first < 0) {
        if (is_first_slice && tid == 0)
            pack_tokens_flag(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
        return;
    }
    if (first > a.capacity) {
        if (is_first_slice && tid == 0)
            pack_tokens_flag(a.error_flag, RAGVIT_ERROR_CAPACITY);
        return;
    }

    const int c0 = (int)blockIdx.y * cols_per_slice;
    const int num_cols = max(0, min(vecs_per_row - c0, cols_per_slice));
    const int64_t es = a.elem_size;
    const char *x_image = static_cast<const char *>(a.x) + b * a.x_stride_b * es;
    char *out = static_cast<char *>(a.out);
    bool is_over = false;
    int64_t carry = 0;
    for (int64_t n0 = 0; n0 < a.seqlen; n0 += kMoveRows) {
        const int64_t n = n0 + tid;
        const int is_kept = n < a.seqlen && a.keep[b * a.keep_stride_b + n * a.keep_stride_n] != 0;
        int chunk_total = 0;
        const int rank = pack_tokens_block_scan(is_kept, warp_s, &chunk_total);
        if (is_kept)
            token_s[rank] = (int)n;
        __syncthreads();

        const int64_t row0 = first + carry;
        if (is_first_slice && tid < chunk_total) {
            const int64_t row = row0 + tid;
            if (row < a.capacity) {
                if (a.indices_out != nullptr)
                    a.indices_out[row * a.indices_stride] = token_s[tid];
            } else {
                is_over = true;
            }
        }
        const int work = chunk_total * num_cols;
        for (int i = tid; i < work; i += kMoveThreads) {
            const int r = i / num_cols;
            const int c = c0 + (i - r * num_cols);
            const int64_t row = row0 + r;
            if (row < a.capacity) {
                const V *src = reinterpret_cast<const V *>(
                    x_image + (int64_t)token_s[r] * a.x_stride_n * es);
                V *dst = reinterpret_cast<V *>(out + row * a.out_stride_token * es);
                dst[c] = src[c];
            }
        }
        carry += chunk_total;
        __syncthreads(); /* token_s and warp_s are rewritten by the next chunk */
    }
    if (is_over)
        pack_tokens_flag(a.error_flag, RAGVIT_ERROR_CAPACITY);
}

/* Block (b, y) owns vector columns [y * cols_per_slice, ...) of every row of image
 * b: it writes each of them once (copy or fill), then, with indices, scatters the
 * image's packed tokens over its own fills after a __syncthreads. */
template <typename V>
static __global__ void __launch_bounds__(kMoveThreads, 4)
    pack_tokens_unpack_kernel(const ragvit_unpack_args a, int es, int vecs_per_row,
                              int cols_per_slice, unsigned int fill_bits) {
    const int64_t b = blockIdx.x;
    const int tid = threadIdx.x;
    const bool is_first_slice = blockIdx.y == 0;
    const bool should_flag = is_first_slice && tid == 0;
    const int64_t N = a.seqlen;
    const int64_t start = a.cu_seqlens[b * a.cu_seqlens_stride];
    const int64_t end = a.cu_seqlens[(b + 1) * a.cu_seqlens_stride];
    int64_t len = 0; /* bad entries: the image is all fill */
    if (start < 0 || end < start || end > a.total_tokens) {
        if (should_flag)
            pack_tokens_flag(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
    } else {
        len = end - start;
        if (len > N) {
            if (should_flag)
                pack_tokens_flag(a.error_flag, RAGVIT_ERROR_SEQLEN_OVER_MAX);
            len = N;
        }
    }
    const bool has_indices = a.indices != nullptr;
    const int64_t copied = has_indices ? 0 : len; /* rows [0, copied) come from packed */

    const int c0 = (int)blockIdx.y * cols_per_slice;
    const int num_cols = max(0, min(vecs_per_row - c0, cols_per_slice));
    V fill;
    pack_tokens_make_fill(&fill, fill_bits);
    char *out_image = static_cast<char *>(a.out) + b * a.out_stride_b * es;
    const char *packed = static_cast<const char *>(a.packed);

    for (int64_t j0 = 0; j0 < N; j0 += kMoveRows) {
        const int work = (int)min((int64_t)kMoveRows, N - j0) * num_cols;
        for (int i = tid; i < work; i += kMoveThreads) {
            const int r = i / num_cols;
            const int c = c0 + (i - r * num_cols);
            const int64_t j = j0 + r;
            V *dst = reinterpret_cast<V *>(out_image + j * a.out_stride_n * es);
            if (j < copied)
                dst[c] = reinterpret_cast<const V *>(
                    packed + (start + j) * a.packed_stride_token * es)[c];
            else
                dst[c] = fill;
        }
    }
    if (!has_indices)
        return; /* uniform: a kernel argument */

    __syncthreads(); /* this block's fills land before its scatter overwrites them */
    for (int64_t t0 = 0; t0 < len; t0 += kMoveRows) {
        const int work = (int)min((int64_t)kMoveRows, len - t0) * num_cols;
        for (int i = tid; i < work; i += kMoveThreads) {
            const int r = i / num_cols;
            const int c = c0 + (i - r * num_cols);
            const int64_t t = start + t0 + r;
            const int64_t n = a.indices[t * a.indices_stride];
            if (n < 0 || n >= N) {
                if (is_first_slice && c == c0)
                    pack_tokens_flag(a.error_flag, RAGVIT_ERROR_BAD_INDEX);
                continue;
            }
            V *dst = reinterpret_cast<V *>(out_image + n * a.out_stride_n * es);
            dst[c] = reinterpret_cast<const V *>(packed + t * a.packed_stride_token * es)[c];
        }
    }
}

// ---- launcher ----

/* Widest vector (16, 8, 4 or 2 bytes, never below elem_size) that divides the
 * row size, both base pointers and every byte stride. */
static int pack_tokens_vec_bytes(int64_t row_bytes, int64_t elem_size, const void *p0,
                                 const void *p1, int64_t s0, int64_t s1, int64_t s2) {
    for (int64_t v = 16; v > elem_size; v >>= 1) {
        if (row_bytes % v == 0 && (uintptr_t)p0 % v == 0 && (uintptr_t)p1 % v == 0 &&
            (s0 * elem_size) % v == 0 && (s1 * elem_size) % v == 0 && (s2 * elem_size) % v == 0)
            return (int)v;
    }
    return (int)elem_size;
}

/* Splits each row's vectors into grid.y slices: enough blocks to fill the device
 * when B is small, slices of >= 16 vectors, each slice small enough for int math. */
static void pack_tokens_slices(int64_t vecs, int64_t batch, const ragvit_device_info *dev,
                               int *num_slices, int *cols_per_slice) {
    const int64_t sm_count = dev->sm_count > 0 ? dev->sm_count : 1;
    int64_t slices = (2 * sm_count + batch - 1) / batch;
    const int64_t most = vecs / 16 > 1 ? vecs / 16 : 1;
    if (slices > most)
        slices = most;
    const int64_t least = (vecs + kMaxSliceVecs - 1) / kMaxSliceVecs;
    if (slices < least)
        slices = least;
    if (slices < 1)
        slices = 1;
    int64_t cols = (vecs + slices - 1) / slices;
    if (cols > 0)
        slices = (vecs + cols - 1) / cols; /* no empty trailing slice */
    else
        slices = 1;
    *num_slices = (int)slices;
    *cols_per_slice = (int)cols;
}

/* B*N fits the int32 cu_seqlens (the CPU backend's rule), so n and ranks are ints. */
static ragvit_status pack_tokens_check_batch(int64_t batch, int64_t seqlen) {
    if (batch < 0 || seqlen < 0 || (seqlen > 0 && batch > INT32_MAX / seqlen))
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "pack: x must hold at most 2^31-1 tokens (B*N) for int32 cu_seqlens, "
                           "got B=%lld, N=%lld",
                           (long long)batch, (long long)seqlen);
    return RAGVIT_STATUS_OK;
}

/* Rows of at most 2^32 bytes keep every vector column an int in the kernels. */
static ragvit_status pack_tokens_check_row(const char *op, const char *name, int64_t channels,
                                           int64_t elem_size) {
    if (channels < 0 || channels > (int64_t)INT32_MAX * 2 / elem_size)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must have 0 <= C <= %lld channels, got %lld", op, name,
                           (long long)((int64_t)INT32_MAX * 2 / elem_size), (long long)channels);
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_pack_count(const ragvit_pack_args *a,
                                                const ragvit_device_info *dev, void *stream) {
    RAGVIT_TRY(pack_tokens_check_batch(a->batch, a->seqlen));
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    pack_tokens_count_kernel<<<1, kCountThreads, 0, (cudaStream_t)stream>>>(*a);
    CUDA_TRY(cudaGetLastError());
    return RAGVIT_STATUS_OK;
}

template <typename V>
static ragvit_status pack_tokens_gather_launch(const ragvit_pack_args *a, int vec_bytes,
                                               const ragvit_device_info *dev,
                                               cudaStream_t stream) {
    const int64_t vecs = a->channels * a->elem_size / vec_bytes;
    int slices = 1, cols = 0;
    pack_tokens_slices(vecs, a->batch, dev, &slices, &cols);
    const dim3 grid((unsigned)a->batch, (unsigned)slices);
    pack_tokens_gather_kernel<V><<<grid, kMoveThreads, 0, stream>>>(*a, (int)vecs, cols);
    CUDA_TRY(cudaGetLastError());
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_pack_gather(const ragvit_pack_args *a,
                                                 const ragvit_device_info *dev, void *stream) {
    const int64_t es = a->elem_size;
    if (es != 2 && es != 4)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "pack: x must have 2- or 4-byte elements, got %d bytes",
                           (int)a->elem_size);
    RAGVIT_TRY(pack_tokens_check_batch(a->batch, a->seqlen));
    RAGVIT_TRY(pack_tokens_check_row("pack", "x", a->channels, es));
    if (a->batch == 0 || a->seqlen == 0)
        return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    const int v = pack_tokens_vec_bytes(a->channels * es, es, a->x, a->out, a->x_stride_b,
                                        a->x_stride_n, a->out_stride_token);
    switch (v) {
    case 16:
        return pack_tokens_gather_launch<uint4>(a, v, dev, s);
    case 8:
        return pack_tokens_gather_launch<uint2>(a, v, dev, s);
    case 4:
        return pack_tokens_gather_launch<unsigned int>(a, v, dev, s);
    default:
        return pack_tokens_gather_launch<unsigned short>(a, v, dev, s);
    }
}

template <typename V>
static ragvit_status pack_tokens_unpack_launch(const ragvit_unpack_args *a, int es,
                                               int vec_bytes, unsigned int fill_bits,
                                               const ragvit_device_info *dev,
                                               cudaStream_t stream) {
    const int64_t vecs = a->channels * es / vec_bytes;
    int slices = 1, cols = 0;
    pack_tokens_slices(vecs, a->batch, dev, &slices, &cols);
    const dim3 grid((unsigned)a->batch, (unsigned)slices);
    pack_tokens_unpack_kernel<V>
        <<<grid, kMoveThreads, 0, stream>>>(*a, es, (int)vecs, cols, fill_bits);
    CUDA_TRY(cudaGetLastError());
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_unpack(const ragvit_unpack_args *a,
                                            const ragvit_device_info *dev, void *stream) {
    /* fill rounds once from double, as the CPU backend does. */
    unsigned int fill_bits = 0;
    int es = 0;
    switch (a->dtype) {
    case RAGVIT_DTYPE_F16: {
        const __half h = __double2half(a->fill);
        unsigned short u;
        memcpy(&u, &h, sizeof u);
        fill_bits = (unsigned int)u | ((unsigned int)u << 16);
        es = 2;
        break;
    }
    case RAGVIT_DTYPE_BF16: {
        const __nv_bfloat16 h = __double2bfloat16(a->fill);
        unsigned short u;
        memcpy(&u, &h, sizeof u);
        fill_bits = (unsigned int)u | ((unsigned int)u << 16);
        es = 2;
        break;
    }
    case RAGVIT_DTYPE_F32: {
        const float f = (float)a->fill;
        memcpy(&fill_bits, &f, sizeof fill_bits);
        es = 4;
        break;
    }
    default:
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "unpack: packed must be float16, bfloat16 or float32, got dtype code %d",
                           (int)a->dtype);
    }
    if (a->seqlen < 0 || a->batch < 0 || a->batch > INT32_MAX)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "unpack: out must have 0 <= B < 2^31 and N >= 0, got B=%lld, N=%lld",
                           (long long)a->batch, (long long)a->seqlen);
    RAGVIT_TRY(pack_tokens_check_row("unpack", "packed", a->channels, es));
    if (a->batch == 0 || a->seqlen == 0)
        return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    const int v = pack_tokens_vec_bytes(a->channels * es, es, a->out, a->packed, a->out_stride_b,
                                        a->out_stride_n, a->packed_stride_token);
    switch (v) {
    case 16:
        return pack_tokens_unpack_launch<uint4>(a, es, v, fill_bits, dev, s);
    case 8:
        return pack_tokens_unpack_launch<uint2>(a, es, v, fill_bits, dev, s);
    case 4:
        return pack_tokens_unpack_launch<unsigned int>(a, es, v, fill_bits, dev, s);
    default:
        return pack_tokens_unpack_launch<unsigned short>(a, es, v, fill_bits, dev, s);
    }
}
