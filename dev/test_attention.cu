/* test_attention.cu — GPU self-test of the attention kernels against a float64 CPU reference:
 * ragged fp16/bf16 batches (lengths 1-1024 with gaps, empty and invalid sequences, 70000
 * sequences; D 32-128; contiguous and (T, 3, H, D) q/k/v views, padded out; cls_attn on and off)
 * through the dispatcher's plan and forced mma.sync and wgmma plans. Outputs start as NaN and
 * must stay NaN outside the valid rows, the error flag must match, and a second launch must be
 * bitwise equal. It links the module's own csrc/kernels/attention*.cu, so it tests the code that
 * ships. Options, and the build for sm_80 GPUs: dev/README.md. Build and run (cc 9.0 GPUs):
 *   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DRAGVIT_WITH_CUDA -DRAGVIT_HAS_SM90A \
 *     -Icsrc/include -Icsrc/kernels -gencode=arch=compute_90a,code=sm_90a dev/test_attention.cu \
 *     csrc/kernels/attention.cu csrc/kernels/attention_fma.cu csrc/kernels/attention_mma.cu \
 *     csrc/kernels/attention_wgmma.cu -o dev/test_attention.bin && dev/test_attention.bin */
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention.cuh"
#include "workbench.h"

// ---- link stand-ins (status.c and device.cu are not part of this program) ----

extern "C" ragvit_status ragvit_cuda_fail(int error, const char *expr, const char *file, int line) {
    fprintf(stderr, "CUDA error %s: %s (%s @ %s:%d)\n", cudaGetErrorName((cudaError_t)error),
            cudaGetErrorString((cudaError_t)error), expr, file, line);
    return RAGVIT_STATUS_CUDA_ERROR;
}

extern "C" ragvit_status ragvit_fail(ragvit_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "ragvit_fail: ");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    return status;
}

// ---- host helpers ----

/* The wgmma path is linked only with sm_90a code (RAGVIT_HAS_SM90A); without it its predicate
 * is false, so its plans are never forced. */
static bool wgmma_supports(const ragvit_attention_args *a, const ragvit_device_info *dev) {
#ifdef RAGVIT_HAS_SM90A
    return attention_wgmma_supports(a, dev);
#else
    (void)a;
    (void)dev;
    return false;
#endif
}

/* attention_wgmma_launch_plan on the default stream (keys, num_stages 0 and tma -1: its own
 * choice); only called where wgmma_supports holds. */
static ragvit_status wgmma_launch_plan(const ragvit_attention_args *a,
                                       const ragvit_device_info *dev, int keys, int num_stages,
                                       int tma) {
#ifdef RAGVIT_HAS_SM90A
    return attention_wgmma_launch_plan(a, dev, keys, num_stages, tma, 0);
#else
    (void)a;
    (void)dev;
    (void)keys;
    (void)num_stages;
    (void)tma;
    return RAGVIT_STATUS_INVALID_VALUE;
#endif
}

static const uint16_t kPoison16 = 0xFFFFu;     /* NaN in fp16 and in bf16 */
static const uint32_t kPoison32 = 0xFFFFFFFFu; /* NaN in fp32 */

static bool g_is_quick = false; /* small cases only (for compute-sanitizer) */
static bool g_is_sweep = true;  /* bench: forced plans besides the launcher's (--no-sweep) */

struct test_case {
    std::string name;
    int dtype;
    int head_dim;
    int num_heads;
    bool is_qkv_view;     /* q, k, v are views of one (T, 3, H, D) buffer; out is padded */
    std::vector<int> cu;  /* cu_seqlens as given to the kernel (may be invalid) */
    int64_t total_tokens; /* T */
    int max_seqlen;       /* as passed in the args */
    float scale;
    float q_gain;           /* q ~ q_gain * N(0, 1): larger -> peakier softmax */
    float k_ramp;           /* k of a sequence's token i ~ (1 + k_ramp i / len) N(0, 1) */
    unsigned expected_flag; /* RAGVIT_ERROR_* bits the kernel must raise */
    uint32_t seed;
};

/* Element offsets of (t, h, d) in each host/device buffer. */
struct layout {
    int64_t q_off, k_off, v_off;             /* offset of q/k/v inside the input buffer */
    int64_t in_stride_token, in_stride_head; /* same for q, k and v */
    int64_t in_elems;                        /* q buffer (or the shared qkv buffer) */
    int64_t out_stride_token, out_stride_head, out_elems;
    int64_t cls_stride;
};

static layout make_layout(const test_case &c) {
    layout l;
    const int64_t T = c.total_tokens, H = c.num_heads, D = c.head_dim;
    if (c.is_qkv_view) {
        l.q_off = 0;
        l.k_off = H * D;
        l.v_off = 2 * H * D;
        l.in_stride_token = 3 * H * D;
        l.in_stride_head = D;
        l.in_elems = T * 3 * H * D;
        l.out_stride_head = D + 8;
        l.out_stride_token = H * (D + 8) + 16;
        l.out_elems = T * l.out_stride_token;
        l.cls_stride = 3;
    } else {
        l.q_off = l.k_off = l.v_off = 0;
        l.in_stride_token = H * D;
        l.in_stride_head = D;
        l.in_elems = T * H * D;
        l.out_stride_head = D;
        l.out_stride_token = H * D;
        l.out_elems = T * H * D;
        l.cls_stride = 1;
    }
    return l;
}

/* Sequences the kernel must process: the same rules as launch.h. */
static std::vector<int> valid_seqs(const test_case &c) {
    std::vector<int> v;
    for (size_t s = 0; s + 1 < c.cu.size(); ++s) {
        const int start = c.cu[s], end = c.cu[s + 1];
        if (start < 0 || end < start || end > c.total_tokens || end - start > c.max_seqlen)
            continue;
        v.push_back((int)s);
    }
    return v;
}

struct inputs {
    std::vector<uint16_t> q, k, v; /* q holds all three when is_qkv_view */
};

struct reference {
    std::vector<double> out; /* dense (T, H, D) */
    std::vector<double> cls; /* (T,) */
};

static reference compute_reference(const test_case &c, const layout &l, const inputs &in) {
    const int H = c.num_heads, D = c.head_dim;
    const int64_t T = c.total_tokens;
    reference r;
    r.out.assign((size_t)(T * H * D), 0.0);
    r.cls.assign((size_t)T, 0.0);
    std::vector<double> p0((size_t)(T * H), 0.0); /* first query's probabilities per head */
    const std::vector<uint16_t> &qb = in.q;
    const std::vector<uint16_t> &kb = c.is_qkv_view ? in.q : in.k;
    const std::vector<uint16_t> &vb = c.is_qkv_view ? in.q : in.v;
    const std::vector<int> seqs = valid_seqs(c);
    std::vector<std::pair<int, int>> tasks;
    for (int s : seqs)
        for (int h = 0; h < H; ++h) tasks.push_back({s, h});
    std::atomic<size_t> next(0);
    auto worker = [&]() {
        std::vector<double> Q, K, V, logits;
        for (;;) {
            const size_t i = next++;
            if (i >= tasks.size()) return;
            const int s = tasks[i].first, h = tasks[i].second;
            const int start = c.cu[s], len = c.cu[s + 1] - c.cu[s];
            Q.resize((size_t)len * D);
            K.resize((size_t)len * D);
            V.resize((size_t)len * D);
            logits.resize((size_t)len);
            for (int j = 0; j < len; ++j)
                for (int d = 0; d < D; ++d) {
                    const int64_t e = (int64_t)(start + j) * l.in_stride_token +
                                      (int64_t)h * l.in_stride_head + d;
                    Q[(size_t)j * D + d] = from_bits(qb[(size_t)(l.q_off + e)], c.dtype);
                    K[(size_t)j * D + d] = from_bits(kb[(size_t)(l.k_off + e)], c.dtype);
                    V[(size_t)j * D + d] = from_bits(vb[(size_t)(l.v_off + e)], c.dtype);
                }
            for (int qi = 0; qi < len; ++qi) {
                double mx = -INFINITY;
                for (int j = 0; j < len; ++j) {
                    double acc = 0.0;
                    for (int d = 0; d < D; ++d) acc += Q[(size_t)qi * D + d] * K[(size_t)j * D + d];
                    logits[(size_t)j] = acc * (double)c.scale;
                    mx = logits[(size_t)j] > mx ? logits[(size_t)j] : mx;
                }
                double sum = 0.0;
                for (int j = 0; j < len; ++j) {
                    logits[(size_t)j] = exp(logits[(size_t)j] - mx);
                    sum += logits[(size_t)j];
                }
                double *o = &r.out[(size_t)(((int64_t)(start + qi) * H + h) * D)];
                for (int j = 0; j < len; ++j) {
                    const double p = logits[(size_t)j] / sum;
                    for (int d = 0; d < D; ++d) o[d] += p * V[(size_t)j * D + d];
                    if (qi == 0) p0[(size_t)((int64_t)(start + j) * H + h)] = p;
                }
            }
        }
    };
    unsigned n = std::thread::hardware_concurrency();
    n = n == 0 ? 4 : (n > 32 ? 32 : n);
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < n; ++i) pool.emplace_back(worker);
    for (auto &t : pool) t.join();
    for (int s : seqs)
        for (int t = c.cu[s]; t < c.cu[s + 1]; ++t) {
            double acc = 0.0;
            for (int h = 0; h < H; ++h) acc += p0[(size_t)((int64_t)t * H + h)];
            r.cls[(size_t)t] = acc / H;
        }
    return r;
}

struct run_result {
    std::vector<uint16_t> out;
    std::vector<uint32_t> cls;
    unsigned flag;
    bool is_launched;
};

struct device_buffers {
    void *in_q = nullptr, *in_k = nullptr, *in_v = nullptr;
    int32_t *cu = nullptr;
    unsigned *flag = nullptr;
};

/* Launch shapes every case runs with: {sm_count, num_warps, num_stages}; 0 = the
 * launcher's own choice (sm_count steers it: more SMs -> fewer warps, more stages);
 * num_warps = -1 / -2: the sm_90a wgmma path with 64- / 128-key tiles and num_stages K/V
 * slots where it applies (else the launcher's own choice), loaded by cp.async; -3: 64-key
 * tiles with every whole tile by TMA where the layout allows it, at any length. */
struct launch_shape {
    int sm_count, num_warps, num_stages;
};

static run_result run_kernel(const test_case &c, const layout &l, const device_buffers &b,
                             bool with_cls, launch_shape shape) {
    run_result r;
    r.is_launched = false;
    const int64_t T = c.total_tokens;
    void *out = nullptr;
    float *cls = nullptr;
    CHECK_CUDA(cudaMalloc(&out, (size_t)l.out_elems * 2));
    CHECK_CUDA(cudaMemset(out, 0xFF, (size_t)l.out_elems * 2));
    if (with_cls) {
        CHECK_CUDA(cudaMalloc(&cls, (size_t)(T * l.cls_stride) * 4));
        CHECK_CUDA(cudaMemset(cls, 0xFF, (size_t)(T * l.cls_stride) * 4));
    }
    CHECK_CUDA(cudaMemset(b.flag, 0, sizeof(unsigned)));

    const uint16_t *q = static_cast<const uint16_t *>(b.in_q);
    const uint16_t *k = static_cast<const uint16_t *>(c.is_qkv_view ? b.in_q : b.in_k);
    const uint16_t *v = static_cast<const uint16_t *>(c.is_qkv_view ? b.in_q : b.in_v);
    ragvit_attention_args a;
    memset(&a, 0, sizeof a);
    a.out = out;
    a.q = q + l.q_off;
    a.k = k + l.k_off;
    a.v = v + l.v_off;
    a.cu_seqlens = b.cu;
    a.cls_attn = cls;
    a.error_flag = b.flag;
    a.out_stride_token = l.out_stride_token;
    a.out_stride_head = l.out_stride_head;
    a.q_stride_token = a.k_stride_token = a.v_stride_token = l.in_stride_token;
    a.q_stride_head = a.k_stride_head = a.v_stride_head = l.in_stride_head;
    a.cls_attn_stride = with_cls ? l.cls_stride : 0;
    a.total_tokens = T;
    a.num_seqs = (int32_t)c.cu.size() - 1;
    a.num_heads = c.num_heads;
    a.head_dim = c.head_dim;
    a.max_seqlen = c.max_seqlen;
    a.scale = c.scale;
    a.dtype = c.dtype;

    int device = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    ragvit_device_info dev;
    memset(&dev, 0, sizeof dev);
    dev.is_initialized = 1;
    dev.device_id = device;
    dev.sm_count = shape.sm_count;
    dev.cc_major = prop.major;
    dev.cc_minor = prop.minor;
    dev.smem_per_block_optin = (int64_t)prop.sharedMemPerBlockOptin;
    dev.error_flag = b.flag;

    if (attention_mma_supports(&a, &dev)) {
        const attention_mma_plan plan =
            attention_mma_make_plan(&a, &dev, shape.num_warps, shape.num_stages);
        const bool is_auto = (shape.num_warps == 0 && shape.num_stages == 0) ||
                             (shape.num_warps < 0 && !wgmma_supports(&a, &dev));
        const ragvit_status st =
            is_auto ? ragvit_cuda_attention(&a, &dev, nullptr)
            : shape.num_warps < 0
                ? wgmma_launch_plan(&a, &dev, shape.num_warps == -2 ? 128 : 64, shape.num_stages,
                                    shape.num_warps == -3 ? 1 : 0)
                : attention_mma_launch_plan(&a, &plan, &dev, 0);
        if (st != RAGVIT_STATUS_OK) {
            fprintf(stderr, "launch returned status %d\n", (int)st);
            exit(2);
        }
        CHECK_CUDA(cudaDeviceSynchronize());
        r.is_launched = true;
    }
    r.out.resize((size_t)l.out_elems);
    CHECK_CUDA(cudaMemcpy(r.out.data(), out, (size_t)l.out_elems * 2, cudaMemcpyDeviceToHost));
    if (with_cls) {
        r.cls.resize((size_t)(T * l.cls_stride));
        CHECK_CUDA(cudaMemcpy(r.cls.data(), cls, r.cls.size() * 4, cudaMemcpyDeviceToHost));
    }
    CHECK_CUDA(cudaMemcpy(&r.flag, b.flag, sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(out));
    if (cls != nullptr) CHECK_CUDA(cudaFree(cls));
    return r;
}

struct check_stats {
    double max_err = 0.0;     /* max |got - ref| over the valid output */
    double max_cls_err = 0.0; /* max |got - ref| over cls_attn */
    int64_t bad_values = 0;   /* outside tolerance, or not finite */
    int64_t bad_poison = 0;   /* written outside the valid region */
    int64_t bad_cls = 0;
    int64_t nondeterministic = 0;
    bool bad_flag = false;
    bool not_launched = false;
};

static void check_run(const test_case &c, const layout &l, const reference &ref,
                      const run_result &r, const run_result &again, bool with_cls,
                      check_stats *st) {
    const int H = c.num_heads, D = c.head_dim;
    const int64_t T = c.total_tokens;
    const double atol = c.dtype == RAGVIT_DTYPE_F16 ? 2e-3 : 1.6e-2;
    const double rtol = c.dtype == RAGVIT_DTYPE_F16 ? 5e-3 : 2e-2;
    if (!r.is_launched) {
        st->not_launched = true;
        return;
    }
    std::vector<char> is_valid_elem((size_t)l.out_elems, 0);
    std::vector<char> is_valid_token((size_t)T, 0);
    for (int s : valid_seqs(c))
        for (int t = c.cu[s]; t < c.cu[s + 1]; ++t) {
            is_valid_token[(size_t)t] = 1;
            for (int h = 0; h < H; ++h)
                for (int d = 0; d < D; ++d) {
                    const int64_t e =
                        (int64_t)t * l.out_stride_token + (int64_t)h * l.out_stride_head + d;
                    is_valid_elem[(size_t)e] = 1;
                    const double got = from_bits(r.out[(size_t)e], c.dtype);
                    const double want = ref.out[(size_t)(((int64_t)t * H + h) * D + d)];
                    const double err = fabs(got - want);
                    if (!std::isfinite(got) || !(err <= atol + rtol * fabs(want))) ++st->bad_values;
                    if (std::isfinite(err) && err > st->max_err) st->max_err = err;
                }
        }
    for (int64_t e = 0; e < l.out_elems; ++e) {
        if (!is_valid_elem[(size_t)e] && r.out[(size_t)e] != kPoison16) ++st->bad_poison;
        if (r.out[(size_t)e] != again.out[(size_t)e]) ++st->nondeterministic;
    }
    if (with_cls) {
        for (int64_t i = 0; i < T * l.cls_stride; ++i) {
            const bool is_slot =
                i % l.cls_stride == 0 && is_valid_token[(size_t)(i / l.cls_stride)];
            if (r.cls[(size_t)i] != again.cls[(size_t)i]) ++st->nondeterministic;
            if (!is_slot) {
                if (r.cls[(size_t)i] != kPoison32) ++st->bad_poison;
                continue;
            }
            float got;
            memcpy(&got, &r.cls[(size_t)i], 4);
            const double want = ref.cls[(size_t)(i / l.cls_stride)];
            const double err = fabs((double)got - want);
            if (!std::isfinite(got) || !(err <= 1e-6 + 1e-4 * fabs(want))) ++st->bad_cls;
            if (std::isfinite(err) && err > st->max_cls_err) st->max_cls_err = err;
        }
    }
    if (r.flag != c.expected_flag || again.flag != c.expected_flag) st->bad_flag = true;
}

static void fill_inputs(const test_case &c, const layout &l, inputs *in) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t T = c.total_tokens, H = c.num_heads, D = c.head_dim;
    in->q.assign((size_t)l.in_elems, kPoison16);
    if (!c.is_qkv_view) {
        in->k.assign((size_t)l.in_elems, kPoison16);
        in->v.assign((size_t)l.in_elems, kPoison16);
    }
    /* Tokens of valid sequences get random values; every other token stays NaN, so a read
     * of it (instead of a zero fill) would show up in the output. */
    std::vector<char> is_used((size_t)T, 0);
    std::vector<float> k_gain((size_t)T, 1.0f); /* row maxima that grow along the keys */
    for (int s : valid_seqs(c))
        for (int t = c.cu[s]; t < c.cu[s + 1]; ++t) {
            is_used[(size_t)t] = 1;
            const float pos = (float)(t - c.cu[s]) / (float)(c.cu[s + 1] - c.cu[s]);
            k_gain[(size_t)t] = 1.0f + c.k_ramp * pos;
        }
    std::vector<uint16_t> &kb = c.is_qkv_view ? in->q : in->k;
    std::vector<uint16_t> &vb = c.is_qkv_view ? in->q : in->v;
    for (int64_t t = 0; t < T; ++t) {
        if (!is_used[(size_t)t]) continue;
        for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) {
                const int64_t e = t * l.in_stride_token + h * l.in_stride_head + d;
                in->q[(size_t)(l.q_off + e)] = to_bits(c.q_gain * normal(rng), c.dtype);
                kb[(size_t)(l.k_off + e)] = to_bits(k_gain[(size_t)t] * normal(rng), c.dtype);
                vb[(size_t)(l.v_off + e)] = to_bits(normal(rng), c.dtype);
            }
    }
}

static int run_case(const test_case &c) {
    const layout l = make_layout(c);
    inputs in;
    fill_inputs(c, l, &in);
    const reference ref = compute_reference(c, l, in);

    device_buffers b;
    const size_t in_bytes = (size_t)l.in_elems * 2;
    CHECK_CUDA(cudaMalloc(&b.in_q, in_bytes));
    CHECK_CUDA(cudaMemcpy(b.in_q, in.q.data(), in_bytes, cudaMemcpyHostToDevice));
    if (!c.is_qkv_view) {
        CHECK_CUDA(cudaMalloc(&b.in_k, in_bytes));
        CHECK_CUDA(cudaMalloc(&b.in_v, in_bytes));
        CHECK_CUDA(cudaMemcpy(b.in_k, in.k.data(), in_bytes, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(b.in_v, in.v.data(), in_bytes, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&b.cu, c.cu.size() * sizeof(int32_t)));
    CHECK_CUDA(
        cudaMemcpy(b.cu, c.cu.data(), c.cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&b.flag, sizeof(unsigned)));

    const std::vector<launch_shape> shapes =
        g_is_quick
            ? std::vector<launch_shape>{{132, 0, 0},  {132, 1, 3},  {132, 4, 2},
                                        {132, -1, 3}, {132, -2, 3}, {132, -3, 3}}
            : std::vector<launch_shape>{{132, 0, 0},  {1000000, 0, 0}, {132, 4, 2},  {132, 4, 3},
                                        {132, 3, 4},  {132, 2, 3},     {132, 1, 2},  {132, 1, 4},
                                        {132, -1, 2}, {132, -1, 3},    {132, -1, 5}, {132, -2, 2},
                                        {132, -2, 5}, {132, -3, 2},    {132, -3, 5}};
    int failures = 0;
    for (int with_cls = 0; with_cls < 2; ++with_cls) {
        check_stats st;
        for (const launch_shape &sh : shapes) {
            const run_result r = run_kernel(c, l, b, with_cls != 0, sh);
            const run_result again = run_kernel(c, l, b, with_cls != 0, sh);
            check_stats one;
            check_run(c, l, ref, r, again, with_cls != 0, &one);
            st.max_err = one.max_err > st.max_err ? one.max_err : st.max_err;
            st.max_cls_err = one.max_cls_err > st.max_cls_err ? one.max_cls_err : st.max_cls_err;
            st.bad_values += one.bad_values;
            st.bad_poison += one.bad_poison;
            st.bad_cls += one.bad_cls;
            st.nondeterministic += one.nondeterministic;
            st.bad_flag = st.bad_flag || one.bad_flag;
            st.not_launched = st.not_launched || one.not_launched;
            if (one.bad_values || one.bad_poison || one.bad_cls || one.nondeterministic ||
                one.bad_flag || one.not_launched)
                printf("    ^ sm_count=%d warps=%d stages=%d: bad_values=%lld bad_poison=%lld "
                       "bad_cls=%lld nondet=%lld flag=%u/%u (want %u)%s\n",
                       sh.sm_count, sh.num_warps, sh.num_stages, (long long)one.bad_values,
                       (long long)one.bad_poison, (long long)one.bad_cls,
                       (long long)one.nondeterministic, r.flag, again.flag, c.expected_flag,
                       one.not_launched ? " NOT LAUNCHED" : "");
        }
        const bool is_ok = !(st.bad_values || st.bad_poison || st.bad_cls || st.nondeterministic ||
                             st.bad_flag || st.not_launched);
        printf("%-4s %-34s %s D=%3d H=%2d %s cls=%d  max_err=%.3e  max_cls_err=%.3e  seed=%u\n",
               is_ok ? "ok" : "FAIL", c.name.c_str(), c.dtype == RAGVIT_DTYPE_F16 ? "f16 " : "bf16",
               c.head_dim, c.num_heads, c.is_qkv_view ? "qkv-view" : "contig  ", with_cls,
               st.max_err, st.max_cls_err, c.seed);
        fflush(stdout);
        failures += is_ok ? 0 : 1;
    }
    CHECK_CUDA(cudaFree(b.in_q));
    if (b.in_k != nullptr) CHECK_CUDA(cudaFree(b.in_k));
    if (b.in_v != nullptr) CHECK_CUDA(cudaFree(b.in_v));
    CHECK_CUDA(cudaFree(b.cu));
    CHECK_CUDA(cudaFree(b.flag));
    return failures;
}

static test_case make_case(const std::string &name, int dtype, int D, int H, bool is_qkv_view,
                           const std::vector<int> &lens, int lead, int tail, uint32_t seed) {
    test_case c;
    c.name = name;
    c.dtype = dtype;
    c.head_dim = D;
    c.num_heads = H;
    c.is_qkv_view = is_qkv_view;
    c.cu.push_back(lead);
    int longest = 1;
    for (int len : lens) {
        c.cu.push_back(c.cu.back() + len);
        longest = len > longest ? len : longest;
    }
    c.total_tokens = c.cu.back() + tail;
    c.max_seqlen = longest;
    c.scale = 1.0f / sqrtf((float)D);
    c.q_gain = 1.0f;
    c.k_ramp = 0.0f;
    c.expected_flag = 0;
    c.seed = seed;
    return c;
}

/* attention_mma_supports must refuse what the kernel cannot read with 16-byte loads. */
static int check_supports(void) {
    static char buffer[4096] __attribute__((aligned(256)));
    ragvit_attention_args a;
    memset(&a, 0, sizeof a);
    a.out = buffer;
    a.q = buffer;
    a.k = buffer + 256;
    a.v = buffer + 512;
    a.q_stride_token = a.k_stride_token = a.v_stride_token = 3 * 6 * 64;
    a.q_stride_head = a.k_stride_head = a.v_stride_head = 64;
    a.out_stride_token = 6 * 64;
    a.out_stride_head = 64;
    a.num_seqs = 1;
    a.num_heads = 6;
    a.head_dim = 64;
    a.max_seqlen = 197;
    a.scale = 0.125f;
    a.dtype = RAGVIT_DTYPE_F16;
    ragvit_device_info dev;
    memset(&dev, 0, sizeof dev);
    dev.cc_major = 9;
    dev.sm_count = 132;
    int failures = 0;
    /* one check of a supports predicate (name: how it prints) */
    auto expect_of =
        [&](const char *name,
            bool (*supports)(const ragvit_attention_args *, const ragvit_device_info *),
            const char *what, const ragvit_attention_args &x, const ragvit_device_info &d,
            bool want) {
            const bool got = supports(&x, &d);
            if (got != want) {
                printf("FAIL %s(%s) = %d, want %d\n", name, what, (int)got, (int)want);
                ++failures;
            }
        };
    auto expect = [&](const char *what, const ragvit_attention_args &x, const ragvit_device_info &d,
                      bool want) {
        expect_of("supports", attention_mma_supports, what, x, d, want);
    };
    expect("aligned f16 D=64", a, dev, true);
    ragvit_attention_args x = a;
    x.dtype = RAGVIT_DTYPE_BF16;
    expect("bf16", x, dev, true);
    x = a;
    x.dtype = RAGVIT_DTYPE_F32;
    expect("f32", x, dev, false);
    x = a;
    x.head_dim = 48;
    expect("head_dim 48", x, dev, false);
    x = a;
    x.q = buffer + 8;
    expect("q + 8 bytes", x, dev, false);
    x = a;
    x.out = buffer + 2;
    expect("out + 2 bytes", x, dev, false);
    x = a;
    x.k_stride_token = 3 * 6 * 64 + 4;
    expect("k token stride % 8 != 0", x, dev, false);
    x = a;
    x.v_stride_head = 68;
    expect("v head stride % 8 != 0", x, dev, false);
    x = a;
    x.num_heads = ATTENTION_MMA_MAX_HEADS + 1;
    expect("too many heads", x, dev, false);
    ragvit_device_info old_dev = dev;
    old_dev.cc_major = 7;
    expect("sm_75 device", a, old_dev, false);
    x = a;
    x.head_dim = 128;
    expect("D=128 with 48 KB of shared memory", x, dev, false);
    ragvit_device_info big_dev = dev;
    big_dev.smem_per_block_optin = 227 * 1024;
    expect("D=128 with 227 KB of shared memory", x, big_dev, true);
    /* the sm_90a path: D = 64 fp16/bf16 without cls_attn or bias, on 9.0 only */
    auto expect_wgmma = [&](const char *what, const ragvit_attention_args &x,
                            const ragvit_device_info &d, bool want) {
#ifndef RAGVIT_HAS_SM90A
        want = false; /* a build without sm_90a code never takes it */
#endif
        expect_of("wgmma_supports", wgmma_supports, what, x, d, want);
    };
    expect_wgmma("D=64 on 9.0", a, big_dev, true);
    expect_wgmma("D=64 on 9.0 with 48 KB of shared memory", a, dev, false);
    ragvit_device_info ampere = big_dev;
    ampere.cc_major = 8;
    expect_wgmma("D=64 on 8.0", a, ampere, false);
    x = a;
    x.head_dim = 128;
    expect_wgmma("D=128", x, big_dev, false);
    x = a;
    x.cls_attn = reinterpret_cast<float *>(buffer + 1024);
    expect_wgmma("cls_attn", x, big_dev, false);
    x = a;
    x.bias = reinterpret_cast<const float *>(buffer + 1024);
    expect_wgmma("bias", x, big_dev, false);
    x = a;
    x.dtype = RAGVIT_DTYPE_F32;
    expect_wgmma("fp32", x, big_dev, false);
    printf("%-4s attention_mma_supports checks\n", failures ? "FAIL" : "ok");
    return failures;
}

/* GPU time per launch (CUDA events around 200 back-to-back launches after warm-up) on
 * DeiT-like ragged batches: lengths uniform in +-20% around the mean (or all equal),
 * q/k/v views of one (T, 3, H, D) buffer. Correctness is covered by the cases above, not
 * re-checked here. */
static void bench(const char *only, bool is_wgmma_only) {
    struct shape {
        const char *name;
        int batch, mean_len, num_heads;
        bool is_fixed = false; /* every length mean_len (else +-20%) */
    };
    const shape shapes[] = {{"deit-s B=1 len 197", 1, 197, 6},
                            {"deit-s B=32 keep .5", 32, 99, 6},
                            {"deit-s B=256 keep .5", 256, 99, 6},
                            {"deit-s B=256 len 197", 256, 197, 6},
                            {"deit-b B=64 keep .5", 64, 99, 12},
                            {"deit-b B=256 len 197", 256, 197, 12},
                            {"deit-s B=1 keep .5", 1, 99, 6},
                            {"deit-b B=1 len 577", 1, 577, 12},
                            {"deit-b B=32 len 577", 32, 577, 12},
                            {"deit-b B=256 all 192", 256, 192, 12, true},
                            {"deit-b B=256 all 197", 256, 197, 12, true},
                            {"deit-b B=32 all 577", 32, 577, 12, true},
                            {"deit-b B=32 all 576", 32, 576, 12, true},
                            {"deit-s B=32 all 577", 32, 577, 6, true},
                            {"deit-s B=256 all 197", 256, 197, 6, true},
                            {"deit-b B=4 all 197", 4, 197, 12, true}};
    const int D = 64;
    int device = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    printf("bench (fp16, D=64, GPU us per launch, median of 5 x 200 launches; wNsM = forced "
           "warps/stages, kKsS = wgmma keys/stages):\n");
    for (const shape &sh : shapes) {
        if (only != nullptr && strstr(sh.name, only) == nullptr) continue;
        std::mt19937 rng(99);
        const int spread = sh.batch == 1 || sh.is_fixed ? 0 : sh.mean_len / 5; /* +-20% */
        std::uniform_int_distribution<int> len_dist(sh.mean_len - spread, sh.mean_len + spread);
        std::vector<int> cu(1, 0);
        int longest = 1;
        double flops = 0.0;
        for (int b = 0; b < sh.batch; ++b) {
            const int len = len_dist(rng);
            cu.push_back(cu.back() + len);
            longest = len > longest ? len : longest;
            flops += 4.0 * len * len * D * sh.num_heads;
        }
        const int64_t T = cu.back(), H = sh.num_heads;
        void *qkv = nullptr, *out = nullptr;
        float *cls = nullptr;
        int32_t *cu_d = nullptr;
        unsigned *flag = nullptr;
        CHECK_CUDA(cudaMalloc(&qkv, (size_t)(T * 3 * H * D) * 2));
        CHECK_CUDA(cudaMalloc(&out, (size_t)(T * H * D) * 2));
        CHECK_CUDA(cudaMalloc(&cls, (size_t)T * 4));
        CHECK_CUDA(cudaMalloc(&cu_d, cu.size() * 4));
        CHECK_CUDA(cudaMalloc(&flag, 4));
        CHECK_CUDA(cudaMemset(flag, 0, 4));
        std::vector<uint16_t> host((size_t)(T * 3 * H * D));
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (auto &x : host) x = to_bits(normal(rng), RAGVIT_DTYPE_F16);
        CHECK_CUDA(cudaMemcpy(qkv, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(cu_d, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
        ragvit_attention_args a;
        memset(&a, 0, sizeof a);
        a.out = out;
        a.q = qkv;
        a.k = static_cast<uint16_t *>(qkv) + H * D;
        a.v = static_cast<uint16_t *>(qkv) + 2 * H * D;
        a.cu_seqlens = cu_d;
        a.error_flag = flag;
        a.out_stride_token = H * D;
        a.out_stride_head = D;
        a.q_stride_token = a.k_stride_token = a.v_stride_token = 3 * H * D;
        a.q_stride_head = a.k_stride_head = a.v_stride_head = D;
        a.cls_attn_stride = 1;
        a.total_tokens = T;
        a.num_seqs = sh.batch;
        a.num_heads = sh.num_heads;
        a.head_dim = D;
        a.max_seqlen = longest;
        a.scale = 0.125f;
        a.dtype = RAGVIT_DTYPE_F16;
        ragvit_device_info dev;
        memset(&dev, 0, sizeof dev);
        dev.is_initialized = 1;
        dev.device_id = device;
        dev.sm_count = prop.multiProcessorCount;
        dev.cc_major = prop.major;
        dev.cc_minor = prop.minor;
        dev.smem_per_block_optin = (int64_t)prop.sharedMemPerBlockOptin;
        dev.error_flag = flag;
        cudaEvent_t e0, e1;
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
        /* median of 5 x 200 launches, in us per launch */
        auto time_launch = [&](auto launch) {
            for (int i = 0; i < 50; ++i)
                if (launch() != RAGVIT_STATUS_OK) exit(2);
            std::vector<float> reps;
            for (int r = 0; r < 5; ++r) {
                CHECK_CUDA(cudaEventRecord(e0));
                for (int i = 0; i < 200; ++i) (void)launch();
                CHECK_CUDA(cudaEventRecord(e1));
                CHECK_CUDA(cudaEventSynchronize(e1));
                float ms = 0.0f;
                CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
                reps.push_back(ms * 1000.0f / 200.0f);
            }
            CHECK_CUDA(cudaGetLastError());
            std::sort(reps.begin(), reps.end());
            return (double)reps[2];
        };
        auto time_plan = [&](const attention_mma_plan &plan) {
            return time_launch([&] { return attention_mma_launch_plan(&a, &plan, &dev, 0); });
        };
        a.cls_attn = nullptr;
        const attention_mma_plan best = attention_mma_make_plan(&a, &dev, 0, 0);
        const double us = g_is_sweep ? time_plan(best) : 0.0;
        a.cls_attn = cls;
        const double us_cls =
            is_wgmma_only ? 0.0 : time_plan(attention_mma_make_plan(&a, &dev, 0, 0));
        a.cls_attn = nullptr;
        printf("  %-22s T=%6lld  auto (w%d s%d grid %ux%ux%u) %7.2f us %6.1f TFLOP/s | "
               "cls %7.2f us |",
               sh.name, (long long)T, best.num_warps, best.num_stages, best.grid.x, best.grid.y,
               best.grid.z, us, flops / (us * 1e6), us_cls);
        const int forced[][2] = {{1, 2}, {1, 4}, {2, 2}, {2, 4}, {4, 2}, {4, 4}};
        for (const auto &f : forced)
            if (!is_wgmma_only)
                printf(" w%ds%d %.2f", f[0], f[1],
                       time_plan(attention_mma_make_plan(&a, &dev, f[0], f[1])));
        if (wgmma_supports(&a, &dev)) { /* the sm_90a path, what auto runs */
            printf(" | wgmma %.2f",
                   time_launch([&] { return wgmma_launch_plan(&a, &dev, 0, 0, -1); }));
            for (int keys = 64; keys <= 128 && g_is_sweep; keys *= 2)
                for (int stages = 2; stages <= ATTENTION_WGMMA_MAX_STAGES; ++stages)
                    printf(" k%ds%d %.2f", keys, stages, time_launch([&] {
                               return wgmma_launch_plan(&a, &dev, keys, stages, -1);
                           }));
        }
        printf("\n");
        fflush(stdout);
        CHECK_CUDA(cudaEventDestroy(e0));
        CHECK_CUDA(cudaEventDestroy(e1));
        CHECK_CUDA(cudaFree(qkv));
        CHECK_CUDA(cudaFree(out));
        CHECK_CUDA(cudaFree(cls));
        CHECK_CUDA(cudaFree(cu_d));
        CHECK_CUDA(cudaFree(flag));
    }
}

int main(int argc, char **argv) {
    bool is_bench = false, is_bench_only = false;
    const char *only = nullptr;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--quick") == 0)
            g_is_quick = true;
        else if (strcmp(argv[i], "--bench") == 0)
            is_bench = true;
        else if (strcmp(argv[i], "--bench-only") == 0)
            is_bench = is_bench_only = true;
        else if (strcmp(argv[i], "--shape") == 0 && i + 1 < argc)
            only = argv[++i];
        else if (strcmp(argv[i], "--no-sweep") == 0)
            g_is_sweep = false;
        else {
            fprintf(stderr,
                    "usage: %s [--quick] [--bench | --bench-only] [--no-sweep] [--shape NAME]\n",
                    argv[0]);
            return 2;
        }
    }
    int device = 0;
    CHECK_CUDA(cudaGetDevice(&device));
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    printf("device %d: %s (sm_%d%d, %d SMs)\n", device, prop.name, prop.major, prop.minor,
           prop.multiProcessorCount);
    ragvit_device_info init_dev;
    memset(&init_dev, 0, sizeof init_dev);
    init_dev.device_id = device;
    init_dev.cc_major = prop.major;
    init_dev.cc_minor = prop.minor;
    init_dev.sm_count = prop.multiProcessorCount;
    init_dev.smem_per_block_optin = (int64_t)prop.sharedMemPerBlockOptin;
    if (attention_init(&init_dev) != RAGVIT_STATUS_OK) {
        printf("FAIL: attention_init\n");
        return 1;
    }

    if (is_bench_only) {
        bench(only, true);
        return 0;
    }
    int failures = check_supports();
    const int dtypes[] = {RAGVIT_DTYPE_F16, RAGVIT_DTYPE_BF16};
    const std::vector<int> dims =
        g_is_quick ? std::vector<int>{64, 80} : std::vector<int>{32, 64, 80, 96, 128};
    const std::vector<int> sweep =
        g_is_quick ? std::vector<int>{1, 17, 64, 72, 130}
                   : std::vector<int>{1, 16, 17, 63, 64, 65, 72, 136, 137, 197, 577, 1024};
    uint32_t seed = 1234;

    /* Every dtype, head_dim and layout over the awkward lengths. */
    for (int dtype : dtypes)
        for (int D : dims)
            for (int view = 0; view < 2; ++view) {
                test_case c = make_case("lengths 1..1024, gaps", dtype, D, 6, view != 0, sweep,
                                        view ? 5 : 0, view ? 7 : 3, seed++);
                if (D == 80 || (D == 64 && view != 0))
                    c.q_gain = 3.0f; /* peaky softmax: large row maxima, many underflows */
                failures += run_case(c);
            }

    /* Row maxima that grow along the keys, from one key tile to the next by a little (ramp
     * 4) and by far (ramp 16): O's rescale factors range from near 1 to near 0. */
    for (int dtype : dtypes)
        for (float ramp : {4.0f, 16.0f}) {
            test_case c = make_case("growing row maxima", dtype, 64, 6, ramp > 8.0f,
                                    g_is_quick ? std::vector<int>{130, 200}
                                               : std::vector<int>{577, 197, 300, 1024, 130, 64},
                                    0, 0, seed++);
            c.k_ramp = ramp;
            failures += run_case(c);
        }

    /* Thin last query tiles (the wgmma path's, D = 64: max_seqlen % 64 in 1..8 puts every
     * sequence that reaches the last query tile on the mma.sync thin path): 1, 2, 4 and 8-row
     * bounds, with the folded key tail (577, 197) and without, every sequence thin (max 8), a
     * loose max_seqlen that no sequence reaches, and one that caps the grid (no thin blocks). */
    struct thin_set {
        std::vector<int> lens;
        int max_seqlen; /* 0: the longest */
    };
    const std::vector<thin_set> thin_sets =
        g_is_quick ? std::vector<thin_set>{{{72, 65, 70, 1, 64, 30}, 0}, {{5, 1, 8, 3}, 0}}
                   : std::vector<thin_set>{{{577, 577, 570, 576, 513, 1, 200}, 0},
                                           {{197, 193, 200, 196, 129, 64, 5}, 0},
                                           {{5, 1, 8, 3, 7, 2}, 0},
                                           {{136, 130, 129, 72, 65, 8}, 0},
                                           {{300, 250, 100}, 577},
                                           {{577, 10, 200}, 64 * 2000 + 1}};
    for (int dtype : dtypes)
        for (const thin_set &set : thin_sets)
            for (int view = 0; view < 2; ++view) {
                test_case c = make_case("thin last query tiles", dtype, 64, 6, view != 0, set.lens,
                                        view ? 5 : 0, view ? 7 : 3, seed++);
                if (set.max_seqlen > 0) c.max_seqlen = set.max_seqlen;
                c.q_gain = view ? 3.0f : 1.0f;
                failures += run_case(c);
            }

    /* DeiT shapes: batch 1 (few blocks), a pruned batch of H = 12 with a loose max_seqlen. */
    for (int dtype : dtypes) {
        if (g_is_quick) break;
        failures +=
            run_case(make_case("deit-s batch 1 len 197", dtype, 64, 6, true, {197}, 0, 0, seed++));
        std::mt19937 rng(seed);
        std::uniform_int_distribution<int> len_dist(40, 200);
        std::vector<int> lens(32);
        for (int &x : lens) x = len_dist(rng);
        test_case c =
            make_case("deit-b pruned batch 32, loose max", dtype, 64, 12, true, lens, 0, 0, seed++);
        c.max_seqlen = 1000;
        c.scale = 0.3f;
        failures += run_case(c);
    }

    /* Invalid cu_seqlens: skipped, flagged, never written; the valid neighbours still run. */
    for (int dtype : dtypes) {
        test_case c = make_case("invalid sequences", dtype, 64, 6, false, {}, 0, 0, seed++);
        c.cu = {0, 10, 5, 30, 40, 40, 52, 70, 90};
        /* [0,10) ok; [10,5) decreasing; [5,30) len 25 > max 20; [30,40) ok; [40,40) empty;
         * [40,52) ok; [52,70) ok (18); [70,90) past T = 80 */
        c.total_tokens = 80;
        c.max_seqlen = 20;
        c.expected_flag = RAGVIT_ERROR_BAD_CU_SEQLENS | RAGVIT_ERROR_SEQLEN_OVER_MAX;
        failures += run_case(c);
        test_case n = make_case("negative start", dtype, 32, 2, true, {}, 0, 0, seed++);
        n.cu = {-3, 8, 20};
        n.total_tokens = 24;
        n.max_seqlen = 16;
        n.expected_flag = RAGVIT_ERROR_BAD_CU_SEQLENS;
        failures += run_case(n);
    }

    /* More sequences than gridDim.z allows, empty ones, and a loose max_seqlen = T that
     * makes the launcher cap the grid so blocks loop over query tiles. */
    if (!g_is_quick) {
        std::mt19937 rng(seed);
        std::uniform_int_distribution<int> len_dist(0, 3);
        std::vector<int> lens(70000);
        for (int &x : lens) x = len_dist(rng);
        lens[12345] = 300;
        lens[69999] = 129;
        test_case c =
            make_case("70000 seqs, loose max", RAGVIT_DTYPE_F16, 32, 2, true, lens, 0, 2, seed++);
        c.max_seqlen = (int)c.total_tokens;
        failures += run_case(c);
    }

    if (is_bench) bench(only, false);
    if (failures == 0) {
        printf("ALL PASS\n");
        return 0;
    }
    printf("FAIL: %d case(s)\n", failures);
    return 1;
}
