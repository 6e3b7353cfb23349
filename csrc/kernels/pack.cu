/* pack.cu — the pack family, bytes only (exact): count keep (B, N) into cu_seqlens (B+1,); gather
 * x (B, N, C) into out (capacity, C) + indices (repack: image b is packed rows [cu_in[b],
 * cu_in[b+1]) of packed (T, C)); unpack packed (T, C) into out (B, N, C) by position or indices
 * (gather_prefix: unpack with N = k). count: grid = (1), a warp per image; gather and the _into
 * form: grid = (B * chunks, slices), block (b, k) moves image b's kept tokens among positions
 * [k * step, (k + 1) * step); unpack: grid = (B, slices). Decision: an _into block finds its
 * first output row by counting the keep bytes before it itself (one launch, no scratch, no host
 * sync; docs/kernels/pack.md). Covered by tests/test_pack.py (checked with torch.equal). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "cuda_util.cuh"
#include "elem.cuh"

static constexpr int kCountThreads = 1024;
static constexpr int kMoveThreads = 256;       /* gather and unpack */
static constexpr int kMoveRows = kMoveThreads; /* rows per step of unpack */
static constexpr int kCopyLoads = 4;           /* vector loads in flight per thread (gather) */
static constexpr int kCountLoads = 8;          /* 16-byte mask loads in flight per thread */
/* Vectors per channel slice: keeps kMoveRows * columns inside int32 in the kernels. */
static constexpr int64_t kMaxSliceVecs = (int64_t)1 << 22;
static constexpr unsigned kFullMask = 0xffffffffu;

// ---- device helpers ----

static __device__ __forceinline__ void pack_flag(unsigned int *flag, unsigned int bit) {
    if (flag != nullptr) atomicOr(flag, bit);
}

/* Rows [*start, *start + *len) of image b (see ragvit_pack_args); false for a
 * repack range that is negative, decreasing or past T (read as empty). */
static __device__ __forceinline__ bool pack_range(const ragvit_pack_args &a, int64_t b,
                                                  int64_t *start, int64_t *len) {
    *start = 0;
    *len = a.seqlen;
    if (a.cu_seqlens_in == nullptr) return true;
    const int64_t s = a.cu_seqlens_in[b * a.cu_seqlens_in_stride];
    const int64_t e = a.cu_seqlens_in[(b + 1) * a.cu_seqlens_in_stride];
    if (s < 0 || e < s || e > a.seqlen) {
        *len = 0;
        return false;
    }
    *start = s;
    *len = e - s;
    return true;
}

/* Exclusive prefix sum of x over the block (blockDim.x a multiple of 32); *total
 * gets the block's sum. Callers __syncthreads() between two calls (warp_s reuse). */
static __device__ __forceinline__ int pack_block_scan(int x, int *warp_s, int *total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    int inclusive = x;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += y;
    }
    if (lane == 31) warp_s[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? warp_s[lane] : 0;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int y = __shfl_up_sync(kFullMask, w, offset);
            if (lane >= offset) w += y;
        }
        if (lane < num_warps) warp_s[lane] = w;
    }
    __syncthreads();
    *total = warp_s[num_warps - 1];
    return (warp > 0 ? warp_s[warp - 1] : 0) + inclusive - x;
}

/* A vector of copies of one element: bits holds the element twice for 2-byte types. */
static __device__ __forceinline__ void pack_make_fill(uint4 *v, unsigned int bits) {
    *v = make_uint4(bits, bits, bits, bits);
}
static __device__ __forceinline__ void pack_make_fill(uint2 *v, unsigned int bits) {
    *v = make_uint2(bits, bits);
}
static __device__ __forceinline__ void pack_make_fill(unsigned int *v, unsigned int bits) {
    *v = bits;
}
static __device__ __forceinline__ void pack_make_fill(unsigned short *v, unsigned int bits) {
    *v = (unsigned short)bits;
}

/* The fused token of image b's rows [start, start + len) into out row `row`,
 * element columns [e0, e1): sum(w x) / sum(w) over the dropped rows, float32,
 * rows in ascending order (deterministic); zeros when sum(w) == 0. Every
 * thread sums the weights itself (broadcast loads), so no barrier is needed. */
template <typename T>
static __device__ __forceinline__ void pack_fuse_row(const ragvit_pack_args &a, int64_t b,
                                                     int64_t start, int64_t len, int64_t row,
                                                     int64_t e0, int64_t e1) {
    const uint8_t *keep = a.keep + b * a.keep_stride_b;
    float weight_sum = 0.0f;
    for (int64_t n = start; n < start + len; n++) {
        if (keep[n * a.keep_stride_n] == 0) weight_sum += a.fuse_weights[n * a.fuse_weights_stride];
    }
    const T *x = static_cast<const T *>(a.x) + b * a.x_stride_b;
    T *out = static_cast<T *>(a.out) + row * a.out_stride_token;
    for (int64_t c = e0 + threadIdx.x; c < e1; c += kMoveThreads) {
        float acc = 0.0f;
        for (int64_t n = start; n < start + len; n++) {
            if (keep[n * a.keep_stride_n] == 0)
                acc +=
                    a.fuse_weights[n * a.fuse_weights_stride] * elem_load(x + n * a.x_stride_n + c);
        }
        elem_store(out + c, weight_sum != 0.0f ? acc / weight_sum : 0.0f);
    }
}

/* Nonzero bytes among the four of w, without branches: bit 7 of each byte of
 * (w & 0x7f..) + 0x7f.. is set iff its low 7 bits are nonzero (each byte's sum stays below 256,
 * so bytes never mix), OR w puts back the bytes whose own bit 7 was set. */
static __device__ __forceinline__ int pack_nonzero_bytes(unsigned int w) {
    return __popc((((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u);
}

/* This thread's share of the nonzero bytes among p[e * stride], e in [0, n).
 * Unit stride reads 16 bytes per load, kCountLoads independent loads per thread
 * before any is used, so a block covers 32 KB of mask per memory round trip. */
static __device__ __forceinline__ int pack_count_local(const uint8_t *p, int64_t stride,
                                                       int64_t n) {
    const int tid = threadIdx.x;
    int local = 0;
    if (n <= 0) return 0;
    if (stride != 1) {
        for (int64_t e = tid; e < n; e += kMoveThreads) local += p[e * stride] != 0;
        return local;
    }
    const int64_t head = min(n, (int64_t)((16 - ((uintptr_t)p & 15)) & 15));
    if (tid < head) local += p[tid] != 0;
    const uint4 *v = reinterpret_cast<const uint4 *>(p + head); /* 16-byte aligned */
    const int64_t num_vecs = (n - head) >> 4;
    for (int64_t i0 = 0; i0 < num_vecs; i0 += kCountLoads * kMoveThreads) {
        uint4 w[kCountLoads];
#pragma unroll
        for (int j = 0; j < kCountLoads; j++) {
            const int64_t i = i0 + j * kMoveThreads + tid;
            w[j] = i < num_vecs ? __ldg(v + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < kCountLoads; j++)
            local += pack_nonzero_bytes(w[j].x) + pack_nonzero_bytes(w[j].y) +
                     pack_nonzero_bytes(w[j].z) + pack_nonzero_bytes(w[j].w);
    }
    const int64_t done = head + (num_vecs << 4);
    if (tid < n - done) /* fewer than 16 left */
        local += p[done + tid] != 0;
    return local;
}

/* Sum of x over the block, to every thread (all must call). */
static __device__ __forceinline__ int64_t pack_block_sum(int x, int *warp_s) {
    int total = 0;
    pack_block_scan(x, warp_s, &total);
    __syncthreads(); /* warp_s is reused by the caller's next scan */
    return total;
}

/* Kept tokens before image b's position `pos` in packing order, summed over the
 * block (all threads get it; all must call). pack: keep elements [0, b*N + pos)
 * of the (B, N) mask; repack: rows [cu_in[0], cu_in[b] + pos) clamped to [0, T],
 * which for valid cu_seqlens_in are exactly the rows before it (for garbage: any
 * in-bounds count, the bad image is flagged). keep is B*N bytes and L2-resident
 * after the first blocks touch it, so this is one or two round trips per block. */
static __device__ int64_t pack_count_before(const ragvit_pack_args &a, int64_t b, int64_t pos,
                                            int *warp_s) {
    int local = 0;
    if (a.cu_seqlens_in != nullptr) {
        const int64_t lo = max((int64_t)0, (int64_t)a.cu_seqlens_in[0]);
        int64_t hi = min(a.seqlen, (int64_t)a.cu_seqlens_in[b * a.cu_seqlens_in_stride] + pos);
        hi = max(hi, lo);
        local = pack_count_local(a.keep + lo * a.keep_stride_n, a.keep_stride_n, hi - lo);
    } else if (a.keep_stride_b == a.seqlen * a.keep_stride_n) { /* flat: e at keep[e * s_n] */
        local = pack_count_local(a.keep, a.keep_stride_n, b * a.seqlen + pos);
    } else {
        const int64_t hi = b * a.seqlen + pos;
        for (int64_t e = threadIdx.x; e < hi; e += kMoveThreads) {
            const int64_t i = e / a.seqlen;
            local += a.keep[i * a.keep_stride_b + (e - i * a.seqlen) * a.keep_stride_n] != 0;
        }
    }
    return pack_block_sum(local, warp_s);
}

// ---- kernels ----

/* One block: a warp counts each image's kept tokens (plus its fused token), then a block scan turns
 * kCountThreads counts at a time into cu_seqlens entries; rows_before is the sum of earlier
 * rounds. A bad repack range counts as empty and is flagged. */
static __global__ void __launch_bounds__(kCountThreads)
    pack_count_kernel(const ragvit_pack_args a) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    __shared__ int count_s[kCountThreads];
    __shared__ int warp_s[32];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    constexpr int kWarps = kCountThreads / 32;

    if (tid == 0) a.cu_seqlens[0] = 0;
    int64_t rows_before = 0;
    for (int64_t base = 0; base < a.batch; base += kCountThreads) {
        for (int r = warp; r < kCountThreads; r += kWarps) {
            const int64_t b = base + r;
            int count = 0;
            if (b < a.batch) { /* warp-uniform, so the shuffles below see all lanes */
                int64_t start = 0, len = 0;
                if (!pack_range(a, b, &start, &len) && lane == 0)
                    pack_flag(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
                const uint8_t *row = a.keep + b * a.keep_stride_b;
                for (int64_t n = start + lane; n < start + len; n += 32)
                    count += row[n * a.keep_stride_n] != 0;
                if (lane == 0 && a.is_fusing) count += 1; /* the fused token */
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1)
                    count += __shfl_xor_sync(kFullMask, count, offset);
            }
            if (lane == 0) count_s[r] = count;
        }
        __syncthreads();
        int total = 0;
        const int mine = count_s[tid];
        const int before = pack_block_scan(mine, warp_s, &total);
        if (base + tid < a.batch)
            a.cu_seqlens[(base + tid + 1) * a.cu_seqlens_stride] =
                (int32_t)(rows_before + before + mine);
        rows_before += total;
        __syncthreads(); /* count_s and warp_s are rewritten by the next chunk */
    }
}

/* Block (k, y) of image b = blockIdx.x / chunks copies the kept tokens among positions
 * [k * step, (k + 1) * step) of the image (step = ceil(len / chunks)) to consecutive rows, vector
 * columns [y * cols_per_slice, ...) only; slice 0 also writes indices_out and, in the _into form,
 * cu_seqlens. Its first output row: kIsInto: the kept tokens before it in packing order, counted
 * by the block itself (pack_count_before: no scratch, no cross-block waiting, so any launch order
 * and graph replay are safe); otherwise cu_seqlens[b], written by the count kernel, plus the kept
 * tokens of the image before the chunk. The last chunk also writes the EViT fused token
 * (kIsFusing: float32 math, __launch_bounds__(256, 2) so nothing spills) and, in the _into form,
 * cu_seqlens[b + 1] (block 0 also cu_seqlens[0]). Rows past capacity are skipped and flagged.
 * Every row moves as kCopyLoads independent vector loads per thread, then the stores; rows and
 * columns advance by constant steps, so the copy loop divides nothing. The stepping loop is
 * written out twice (small-chunk preload, tile loop): as one helper it measured 1-3% slower
 * (docs/experiments.md). */
template <typename V, bool kIsFusing, bool kIsInto>
static __global__ void __launch_bounds__(kMoveThreads, kIsFusing ? 2 : 4)
    pack_chunk_kernel(const ragvit_pack_args a, int chunks, int vecs_per_row, int cols_per_slice) {
    cuda_pdl_wait();                      /* first: see cuda_util.cuh */
    __shared__ int token_s[kMoveThreads]; /* source position of each kept token of the tile */
    __shared__ int warp_s[32];
    const int tid = threadIdx.x;
    const int64_t b = blockIdx.x / (unsigned)chunks;
    const int k = (int)(blockIdx.x - b * chunks);
    const bool is_first_slice = blockIdx.y == 0;
    const bool is_last_chunk = k == chunks - 1;
    const bool should_write = is_first_slice && tid == 0;
    int64_t start = 0, len = 0; /* a bad repack range reads as empty */
    const bool is_valid = pack_range(a, b, &start, &len);
    if (kIsInto && !is_valid && k == 0 && should_write)
        pack_flag(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
    const int64_t step = (len + chunks - 1) / chunks;
    const int64_t c_begin = min(len, k * step), c_end = min(len, c_begin + step);
    const uint8_t *keep = a.keep + b * a.keep_stride_b; /* repack: keep_stride_b == 0 */

    const int64_t es = a.elem_size;
    const int c0 = (int)blockIdx.y * cols_per_slice;
    const int num_cols = max(0, min(vecs_per_row - c0, cols_per_slice));
    /* Thread tid starts at (row tid / num_cols, column tid % num_cols) of the tile;
     * each step of kMoveThreads vectors adds (dr, dc), wrapping c into the next row. */
    const int dr = num_cols > 0 ? kMoveThreads / num_cols : 0;
    const int dc = kMoveThreads - dr * num_cols;
    const int r_init = num_cols > 0 ? tid / num_cols : 0;
    const int c_init = tid - r_init * num_cols;
    const char *x_image = static_cast<const char *>(a.x) + b * a.x_stride_b * es;
    const int64_t x_row_bytes = a.x_stride_n * es, out_row_bytes = a.out_stride_token * es;

    /* The first tile's flags load while the block counts what comes before it. */
    int is_kept = c_begin + tid < c_end && keep[(start + c_begin + tid) * a.keep_stride_n] != 0;
    /* A small chunk (small B) also loads all its rows, kept or not, right away:
     * its copy then waits on one memory round trip instead of two. */
    const int64_t span = c_end - c_begin;
    const bool is_small = span <= kMoveThreads && span * num_cols <= kCopyLoads * kMoveThreads;
    const int small_work = is_small ? (int)span * num_cols : 0;
    V v[kCopyLoads];
    int rr[kCopyLoads], cc[kCopyLoads];
    {
        int r = r_init, c = c_init;
#pragma unroll
        for (int u = 0; u < kCopyLoads; u++) {
            rr[u] = r;
            cc[u] = c0 + c;
            r += dr;
            c += dc;
            if (c >= num_cols) {
                c -= num_cols;
                r += 1;
            }
        }
#pragma unroll
        for (int u = 0; u < kCopyLoads; u++) {
            if (tid + u * kMoveThreads < small_work)
                v[u] = __ldg(
                    reinterpret_cast<const V *>(x_image + (start + c_begin + rr[u]) * x_row_bytes) +
                    cc[u]);
        }
    }
    int64_t first = 0;
    if constexpr (kIsInto) {
        first = pack_count_before(a, b, is_valid ? c_begin : 0, warp_s) + (a.is_fusing ? b : 0);
    } else {
        first = a.cu_seqlens[b * a.cu_seqlens_stride]; /* uniform over the block */
        if (first < 0 || first > a.capacity) {
            if (should_write && k == 0)
                pack_flag(a.error_flag,
                          first < 0 ? RAGVIT_ERROR_BAD_CU_SEQLENS : RAGVIT_ERROR_CAPACITY);
            return;
        }
        first += pack_block_sum(
            pack_count_local(keep + start * a.keep_stride_n, a.keep_stride_n, c_begin), warp_s);
    }

    bool is_over = false;
    int64_t rows_done = 0;
    if (is_small) { /* block-uniform */
        int chunk_total = 0;
        const int rank = pack_block_scan(is_kept, warp_s, &chunk_total);
        token_s[tid] = is_kept ? rank : -1; /* output rank of position tid, or dropped */
        __syncthreads();
        const int rows = (int)max((int64_t)0, min((int64_t)chunk_total, a.capacity - first));
        if (is_first_slice) {
            is_over = tid == 0 && rows < chunk_total;
            if (is_kept && rank < rows && a.indices_out != nullptr)
                a.indices_out[(first + rank) * a.indices_stride] = (int)(start + c_begin + tid);
        }
        char *out_chunk = static_cast<char *>(a.out) + first * out_row_bytes;
#pragma unroll
        for (int u = 0; u < kCopyLoads; u++) {
            if (tid + u * kMoveThreads < small_work) {
                const int q = token_s[rr[u]];
                if (q >= 0 && q < rows)
                    reinterpret_cast<V *>(out_chunk + q * out_row_bytes)[cc[u]] = v[u];
            }
        }
        rows_done = chunk_total;
    }
    for (int64_t p0 = c_begin; !is_small && p0 < c_end; p0 += kMoveThreads) {
        if (p0 != c_begin)
            is_kept = p0 + tid < c_end && keep[(start + p0 + tid) * a.keep_stride_n] != 0;
        int tile_total = 0;
        const int rank = pack_block_scan(is_kept, warp_s, &tile_total);
        if (is_kept) /* < 2^31: B*N (pack) or T (repack) is checked */
            token_s[rank] = (int)(start + p0 + tid);
        __syncthreads();

        const int64_t row0 = first + rows_done;
        const int rows = (int)max((int64_t)0, min((int64_t)tile_total, a.capacity - row0));
        if (is_first_slice) {
            is_over |= tid == 0 && rows < tile_total;
            if (tid < rows && a.indices_out != nullptr)
                a.indices_out[(row0 + tid) * a.indices_stride] = token_s[tid];
        }
        char *out_tile = static_cast<char *>(a.out) + row0 * out_row_bytes;
        const int work = rows * num_cols;
        int r = r_init, c = c_init;
        for (int i = tid; i < work; i += kCopyLoads * kMoveThreads) {
#pragma unroll
            for (int u = 0; u < kCopyLoads; u++) {
                rr[u] = r;
                cc[u] = c0 + c;
                r += dr;
                c += dc;
                if (c >= num_cols) {
                    c -= num_cols;
                    r += 1;
                }
            }
#pragma unroll
            for (int u = 0; u < kCopyLoads; u++) {
                if (i + u * kMoveThreads < work)
                    v[u] = __ldg(reinterpret_cast<const V *>(x_image + (int64_t)token_s[rr[u]] *
                                                                           x_row_bytes) +
                                 cc[u]);
            }
#pragma unroll
            for (int u = 0; u < kCopyLoads; u++) {
                if (i + u * kMoveThreads < work)
                    reinterpret_cast<V *>(out_tile + rr[u] * out_row_bytes)[cc[u]] = v[u];
            }
        }
        rows_done += tile_total;
        __syncthreads(); /* token_s and warp_s are rewritten by the next tile */
    }
    if constexpr (kIsFusing) { /* a.is_fusing */
        if (is_last_chunk) {
            const int64_t row = first + rows_done;
            if (row < a.capacity) {
                const int64_t per_vec = (int64_t)sizeof(V) / es; /* vec_bytes >= elem_size */
                const int64_t e0 = c0 * per_vec, e1 = (c0 + num_cols) * per_vec;
                if (a.dtype == RAGVIT_DTYPE_F16)
                    pack_fuse_row<__half>(a, b, start, len, row, e0, e1);
                else if (a.dtype == RAGVIT_DTYPE_BF16)
                    pack_fuse_row<__nv_bfloat16>(a, b, start, len, row, e0, e1);
                else
                    pack_fuse_row<float>(a, b, start, len, row, e0, e1);
                if (should_write && a.indices_out != nullptr)
                    a.indices_out[row * a.indices_stride] = -1;
            } else if (should_write) {
                is_over = true;
            }
        }
        rows_done += 1;
    }
    if (is_over) pack_flag(a.error_flag, RAGVIT_ERROR_CAPACITY);
    if (kIsInto && should_write) {
        if (b == 0 && k == 0) a.cu_seqlens[0] = 0;
        if (is_last_chunk)
            a.cu_seqlens[(b + 1) * a.cu_seqlens_stride] = (int32_t)(first + rows_done);
    }
}

/* Block (b, y) owns vector columns [y * cols_per_slice, ...) of every row of image
 * b: it writes each of them once (copy or fill), then, with indices, scatters the
 * image's packed tokens over its own fills after a __syncthreads. */
template <typename V>
static __global__ void __launch_bounds__(kMoveThreads, 4)
    pack_unpack_kernel(const ragvit_unpack_args a, int es, int vecs_per_row, int cols_per_slice,
                       unsigned int fill_bits) {
    cuda_pdl_wait(); /* first: see cuda_util.cuh */
    const int64_t b = blockIdx.x;
    const int tid = threadIdx.x;
    const bool is_first_slice = blockIdx.y == 0;
    const bool should_flag = is_first_slice && tid == 0;
    const int64_t N = a.seqlen;
    const int64_t start = a.cu_seqlens[b * a.cu_seqlens_stride];
    const int64_t end = a.cu_seqlens[(b + 1) * a.cu_seqlens_stride];
    int64_t len = 0; /* bad entries: the image is all fill */
    if (start < 0 || end < start || end > a.total_tokens) {
        if (should_flag) pack_flag(a.error_flag, RAGVIT_ERROR_BAD_CU_SEQLENS);
    } else {
        len = end - start;
        if (a.is_prefix && len < N) { /* copy what there is; the rest is fill (0) */
            if (should_flag) pack_flag(a.error_flag, RAGVIT_ERROR_SHORT_SEQ);
        } else if (len > N) {
            if (should_flag && !a.is_prefix) pack_flag(a.error_flag, RAGVIT_ERROR_SEQLEN_OVER_MAX);
            len = N;
        }
    }
    const bool has_indices = a.indices != nullptr;
    const int64_t copied = has_indices ? 0 : len; /* rows [0, copied) come from packed */

    const int c0 = (int)blockIdx.y * cols_per_slice;
    const int num_cols = max(0, min(vecs_per_row - c0, cols_per_slice));
    V fill;
    pack_make_fill(&fill, fill_bits);
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
                dst[c] = reinterpret_cast<const V *>(packed +
                                                     (start + j) * a.packed_stride_token * es)[c];
            else
                dst[c] = fill;
        }
    }
    if (!has_indices) return; /* uniform: a kernel argument */

    __syncthreads(); /* this block's fills land before its scatter overwrites them */
    for (int64_t t0 = 0; t0 < len; t0 += kMoveRows) {
        const int work = (int)min((int64_t)kMoveRows, len - t0) * num_cols;
        for (int i = tid; i < work; i += kMoveThreads) {
            const int r = i / num_cols;
            const int c = c0 + (i - r * num_cols);
            const int64_t t = start + t0 + r;
            const int64_t n = a.indices[t * a.indices_stride];
            if (n < 0 || n >= N) {
                if (is_first_slice && c == c0) pack_flag(a.error_flag, RAGVIT_ERROR_BAD_INDEX);
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
static int pack_vec_bytes(int64_t row_bytes, int64_t elem_size, const void *p0, const void *p1,
                          int64_t s0, int64_t s1, int64_t s2) {
    for (int64_t v = 16; v > elem_size; v >>= 1) {
        if (row_bytes % v == 0 && (uintptr_t)p0 % v == 0 && (uintptr_t)p1 % v == 0 &&
            (s0 * elem_size) % v == 0 && (s1 * elem_size) % v == 0 && (s2 * elem_size) % v == 0)
            return (int)v;
    }
    return (int)elem_size;
}

/* Splits each row's vectors into grid.y slices: enough blocks to fill the device
 * when B is small, slices of >= 16 vectors, each slice small enough for int math. */
static void pack_slices(int64_t vecs, int64_t batch, const ragvit_device_info *dev, int *num_slices,
                        int *cols_per_slice) {
    const int64_t sm_count = dev->sm_count > 0 ? dev->sm_count : 1;
    int64_t slices = (2 * sm_count + batch - 1) / batch;
    const int64_t most = vecs / 16 > 1 ? vecs / 16 : 1;
    if (slices > most) slices = most;
    const int64_t least = (vecs + kMaxSliceVecs - 1) / kMaxSliceVecs;
    if (slices < least) slices = least;
    if (slices < 1) slices = 1;
    int64_t cols = (vecs + slices - 1) / slices;
    if (cols > 0)
        slices = (vecs + cols - 1) / cols; /* no empty trailing slice */
    else
        slices = 1;
    *num_slices = (int)slices;
    *cols_per_slice = (int)cols;
}

/* B*N (pack) or T (repack) fits the int32 cu_seqlens (the CPU backend's rule),
 * so n and ranks are ints; B fits grid.x. */
static ragvit_status pack_check_batch(const ragvit_pack_args *a) {
    const int64_t batch = a->batch, seqlen = a->seqlen;
    if (a->cu_seqlens_in != nullptr) {
        if (batch < 0 || batch > INT32_MAX || seqlen < 0 || seqlen > INT32_MAX)
            return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                               "repack: packed must have at most 2^31-1 rows and sequences, "
                               "got T=%lld, B=%lld",
                               (long long)seqlen, (long long)batch);
        return RAGVIT_STATUS_OK;
    }
    if (batch < 0 || seqlen < 0 || (seqlen > 0 && batch > INT32_MAX / seqlen))
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "pack: x must hold at most 2^31-1 tokens (B*N) for int32 cu_seqlens, "
                           "got B=%lld, N=%lld",
                           (long long)batch, (long long)seqlen);
    return RAGVIT_STATUS_OK;
}

/* Rows of at most 2^32 bytes keep every vector column an int in the kernels. */
static ragvit_status pack_check_row(const char *op, const char *name, int64_t channels,
                                    int64_t elem_size) {
    if (channels < 0 || channels > (int64_t)INT32_MAX * 2 / elem_size)
        return ragvit_fail(RAGVIT_STATUS_INVALID_SHAPE,
                           "%s: %s must have 0 <= C <= %lld channels, got %lld", op, name,
                           (long long)((int64_t)INT32_MAX * 2 / elem_size), (long long)channels);
    return RAGVIT_STATUS_OK;
}

extern "C" ragvit_status ragvit_cuda_pack_count(const ragvit_pack_args *a,
                                                const ragvit_device_info *dev, void *stream) {
    RAGVIT_TRY(pack_check_batch(a));
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_count_kernel, 1, kCountThreads, 0,
                         (cudaStream_t)stream, *a));
    return RAGVIT_STATUS_OK;
}

/* Chunks per image of the gather: enough blocks for about two per SM (B = 1
 * gets dozens of small blocks instead of one serial walk over its rows; B >= 2
 * blocks per SM keeps one block per image, so each block's count of the mask
 * before it is paid ~B times, not more), each chunk at least 4 positions and
 * enough to give every thread a vector; B * chunks fits grid.x. avg_len: N
 * (pack) or T / B (repack; lengths vary, every image gets the same chunks). */
static int pack_chunks(int64_t batch, int64_t avg_len, int64_t vecs,
                       const ragvit_device_info *dev) {
    const int64_t sm_count = dev->sm_count > 0 ? dev->sm_count : 1;
    int64_t chunks = (2 * sm_count + batch - 1) / batch;
    int64_t min_len = vecs > 0 ? (kMoveThreads + vecs - 1) / vecs : kMoveThreads;
    if (min_len < 4) min_len = 4;
    const int64_t most = avg_len / min_len;
    if (chunks > most) chunks = most;
    if (chunks > INT32_MAX / batch) chunks = INT32_MAX / batch;
    return chunks < 1 ? 1 : (int)chunks;
}

/* Splits rows into grid.y column slices only where a slice would overflow the
 * kernel's int math (rows above 2^22 vectors). */
static void pack_gather_slices(int64_t vecs, int *num_slices, int *cols_per_slice) {
    int64_t slices = (vecs + kMaxSliceVecs - 1) / kMaxSliceVecs;
    if (slices < 1) slices = 1;
    int64_t cols = (vecs + slices - 1) / slices;
    *num_slices = cols > 0 ? (int)((vecs + cols - 1) / cols) : 1;
    *cols_per_slice = (int)cols;
}

template <typename V>
static ragvit_status pack_gather_launch(const ragvit_pack_args *a, int vec_bytes, bool is_into,
                                        const ragvit_device_info *dev, cudaStream_t stream) {
    const int64_t vecs = a->channels * a->elem_size / vec_bytes;
    int slices = 1, cols = 0;
    pack_gather_slices(vecs, &slices, &cols);
    const int64_t avg_len = a->cu_seqlens_in != nullptr ? a->seqlen / a->batch : a->seqlen;
    const int chunks = pack_chunks(a->batch, avg_len, vecs, dev);
    const dim3 grid((unsigned)(a->batch * chunks), (unsigned)slices);
    const int v = (int)vecs;
    /* The fusing variants (repack with fuse_weights) get more registers each. */
    const bool is_fusing = a->is_fusing;
    if (is_into && is_fusing)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_chunk_kernel<V, true, true>, grid,
                             kMoveThreads, 0, stream, *a, chunks, v, cols));
    else if (is_into)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_chunk_kernel<V, false, true>, grid,
                             kMoveThreads, 0, stream, *a, chunks, v, cols));
    else if (is_fusing)
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_chunk_kernel<V, true, false>, grid,
                             kMoveThreads, 0, stream, *a, chunks, v, cols));
    else
        CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_chunk_kernel<V, false, false>, grid,
                             kMoveThreads, 0, stream, *a, chunks, v, cols));
    return RAGVIT_STATUS_OK;
}

/* Checks sizes, then launches the gather (is_into: the one-launch count +
 * gather) with the widest vector the rows allow. B >= 1 and N >= 1 here. */
static ragvit_status pack_move(const ragvit_pack_args *a, bool is_into,
                               const ragvit_device_info *dev, void *stream) {
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const int64_t es = a->elem_size;
    const cudaStream_t s = (cudaStream_t)stream;
    const int v = pack_vec_bytes(a->channels * es, es, a->x, a->out, a->x_stride_b, a->x_stride_n,
                                 a->out_stride_token);
    switch (v) {
    case 16: return pack_gather_launch<uint4>(a, v, is_into, dev, s);
    case 8: return pack_gather_launch<uint2>(a, v, is_into, dev, s);
    case 4: return pack_gather_launch<unsigned int>(a, v, is_into, dev, s);
    default: return pack_gather_launch<unsigned short>(a, v, is_into, dev, s);
    }
}

static ragvit_status pack_check_move(const ragvit_pack_args *a) {
    const int64_t es = a->elem_size;
    if (es != 2 && es != 4)
        return ragvit_fail(RAGVIT_STATUS_INVALID_DTYPE,
                           "pack: x must have 2- or 4-byte elements, got %d bytes",
                           (int)a->elem_size);
    RAGVIT_TRY(pack_check_batch(a));
    return pack_check_row("pack", "x", a->channels, es);
}

/* Nothing to write but cu_seqlens: no image, or no token and no fused token. */
static bool pack_has_no_rows(const ragvit_pack_args *a) {
    return a->batch == 0 || (a->seqlen == 0 && !a->is_fusing);
}

extern "C" ragvit_status ragvit_cuda_pack_gather(const ragvit_pack_args *a,
                                                 const ragvit_device_info *dev, void *stream) {
    RAGVIT_TRY(pack_check_move(a));
    if (pack_has_no_rows(a)) return RAGVIT_STATUS_OK;
    return pack_move(a, false, dev, stream);
}

extern "C" ragvit_status ragvit_cuda_pack_into(const ragvit_pack_args *a,
                                               const ragvit_device_info *dev, void *stream) {
    RAGVIT_TRY(pack_check_move(a));
    if (pack_has_no_rows(a)) /* the count kernel writes the (zero) counts */
        return ragvit_cuda_pack_count(a, dev, stream);
    return pack_move(a, true, dev, stream);
}

template <typename V>
static ragvit_status pack_unpack_launch(const ragvit_unpack_args *a, int es, int vec_bytes,
                                        unsigned int fill_bits, const ragvit_device_info *dev,
                                        cudaStream_t stream) {
    const int64_t vecs = a->channels * es / vec_bytes;
    int slices = 1, cols = 0;
    pack_slices(vecs, a->batch, dev, &slices, &cols);
    const dim3 grid((unsigned)a->batch, (unsigned)slices);
    CUDA_TRY(cuda_launch(dev, RAGVIT_PDL_PACK, pack_unpack_kernel<V>, grid, kMoveThreads, 0, stream,
                         *a, es, (int)vecs, cols, fill_bits));
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
    RAGVIT_TRY(pack_check_row("unpack", "packed", a->channels, es));
    if (a->batch == 0 || a->seqlen == 0) return RAGVIT_STATUS_OK;
    cuda_device_guard guard;
    RAGVIT_TRY(guard.enter(dev->device_id));
    const cudaStream_t s = (cudaStream_t)stream;
    const int v = pack_vec_bytes(a->channels * es, es, a->out, a->packed, a->out_stride_b,
                                 a->out_stride_n, a->packed_stride_token);
    switch (v) {
    case 16: return pack_unpack_launch<uint4>(a, es, v, fill_bits, dev, s);
    case 8: return pack_unpack_launch<uint2>(a, es, v, fill_bits, dev, s);
    case 4: return pack_unpack_launch<unsigned int>(a, es, v, fill_bits, dev, s);
    default: return pack_unpack_launch<unsigned short>(a, es, v, fill_bits, dev, s);
    }
}
