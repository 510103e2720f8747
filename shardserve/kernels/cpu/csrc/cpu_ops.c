/* CPU kernels for x86 with AVX2 + FMA, compiled on first use by shardserve/layers/cpu_ops.py
 * (plain C, no torch headers; called through ctypes on tensors' data pointers).
 *
 * - linear_packed: fp32 activations times bf16 or fp32 weights packed in panels, fp32 accumulation.
 * - write_kv / paged_attention: the paged KV pool (fp32, bf16 or fp8 E4M3 with a per-tensor scale)
 *   written and read in place.
 * - rms_norm (with the residual add), silu_and_mul, rotary_neox: the small per-token layers, one
 *   call each instead of several torch ops.
 *
 * Batch invariance is a design rule here: every output element is computed by the same operations
 * in the same order whatever the batch around it, so a request's tokens do not depend on who else
 * is being served. Threads split work only across independent outputs, never inside a sum.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Fixed reduction order: lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the last two. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* e^x for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial
 * (Cephes' coefficients); about 1 ulp over the clamped range [-87.3, 88.7]. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {   /* the same function for one value, so tails match vectors */
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* ---- linear layers with packed weights -----------------------------------------------------------
 * Weights are packed once at load time (cpu_ops.pack_weight) into panels of 16 output features:
 * wp[N / 16][K][16], bf16 or fp32, so that for each k the 16 weights of a panel are one or two
 * 32-byte loads. Every output element y[m, n] is then one sequential chain acc = fma(x[m, k], w[k, n], acc)
 * over k = 0 .. K-1, plus the bias: the same operations in the same order whatever M is and
 * wherever row m sits, so a request's results are bit-identical alone or batched.
 */

/* MR (<= 6) rows of x times one panel [K][16], fp32 (WBF16 = 0) or bf16 widened in registers:
 * 12 accumulators, the outer-product form. The accumulators are named variables, not an array:
 * gcc spills arrays of vectors to the stack. */
#define ROW(i, a, b)                                                                      \
    if (MR > i) {                                                                         \
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                           \
        a = _mm256_fmadd_ps(xb, w0, a);                                                   \
        b = _mm256_fmadd_ps(xb, w1, b);                                                   \
    }
#define STORE(i, a, b)                                                                    \
    if (MR > i) {                                                                         \
        float out[16];                                                                    \
        _mm256_storeu_ps(out, a);                                                         \
        _mm256_storeu_ps(out + 8, b);                                                     \
        for (int j = 0; j < ncols; j++) y[i * ldy + j] = bias ? out[j] + bias[j] : out[j]; \
    }

static inline __attribute__((always_inline)) void
micro(const int MR, const int WBF16, const float *x, int64_t ldx, const void *panel, float *y, int64_t ldy,
      int64_t K, const float *bias, int ncols) {
    const float *pf = (const float *)panel;
    const uint16_t *ph = (const uint16_t *)panel;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
           b4 = a0, a5 = a0, b5 = a0;
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = WBF16 ? load_bf16x8(ph + k * 16) : _mm256_loadu_ps(pf + k * 16);
        const __m256 w1 = WBF16 ? load_bf16x8(ph + k * 16 + 8) : _mm256_loadu_ps(pf + k * 16 + 8);
        ROW(0, a0, b0) ROW(1, a1, b1) ROW(2, a2, b2) ROW(3, a3, b3) ROW(4, a4, b4) ROW(5, a5, b5)
    }
    STORE(0, a0, b0) STORE(1, a1, b1) STORE(2, a2, b2) STORE(3, a3, b3) STORE(4, a4, b4) STORE(5, a5, b5)
}
#undef ROW
#undef STORE

#define MICRO_ROWS(W)                                                          \
    switch (mr) {                                                              \
    case 6: micro(6, W, x, ldx, panel, y, ldy, K, bias, ncols); return;        \
    case 5: micro(5, W, x, ldx, panel, y, ldy, K, bias, ncols); return;        \
    case 4: micro(4, W, x, ldx, panel, y, ldy, K, bias, ncols); return;        \
    case 3: micro(3, W, x, ldx, panel, y, ldy, K, bias, ncols); return;        \
    case 2: micro(2, W, x, ldx, panel, y, ldy, K, bias, ncols); return;        \
    default: micro(1, W, x, ldx, panel, y, ldy, K, bias, ncols); return;       \
    }

/* Constant MR and WBF16 per call site, so each variant is compiled with its loops unrolled. */
static void micro_dispatch(int mr, int wbf16, const float *x, int64_t ldx, const void *panel, float *y, int64_t ldy,
                           int64_t K, const float *bias, int ncols) {
    if (wbf16) {
        MICRO_ROWS(1)
    }
    MICRO_ROWS(0)
}
#undef MICRO_ROWS

/* One row of x (single-stream decode) against PN (<= 6) panels at once, bf16 (widened in registers)
 * or fp32: the same chain per element as micro, with PN streams of weights in flight. */
#define PANEL(j, a, b)                                                                    \
    if (PN > j) {                                                                         \
        const int64_t at = (j * K + k) * 16;                                              \
        a = _mm256_fmadd_ps(xb, WBF16 ? load_bf16x8(ph + at) : _mm256_loadu_ps(pf + at), a); \
        b = _mm256_fmadd_ps(xb, WBF16 ? load_bf16x8(ph + at + 8) : _mm256_loadu_ps(pf + at + 8), b); \
    }
#define STORE(j, a, b)                                                                    \
    if (PN > j) {                                                                         \
        float out[16];                                                                    \
        _mm256_storeu_ps(out, a);                                                         \
        _mm256_storeu_ps(out + 8, b);                                                     \
        for (int c = 0; c < 16 && j * 16 + c < ncols; c++)                                \
            y[j * 16 + c] = bias ? out[c] + bias[j * 16 + c] : out[c];                    \
    }

static inline __attribute__((always_inline)) void
gemv_panels(const int PN, const int WBF16, const float *x, const void *wp, float *y, int64_t K, const float *bias,
            int64_t ncols) {
    const uint16_t *ph = (const uint16_t *)wp;
    const float *pf = (const float *)wp;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
           b4 = a0, a5 = a0, b5 = a0;
    for (int64_t k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        PANEL(0, a0, b0) PANEL(1, a1, b1) PANEL(2, a2, b2) PANEL(3, a3, b3) PANEL(4, a4, b4) PANEL(5, a5, b5)
    }
    STORE(0, a0, b0) STORE(1, a1, b1) STORE(2, a2, b2) STORE(3, a3, b3) STORE(4, a4, b4) STORE(5, a5, b5)
}
#undef PANEL
#undef STORE

#define GEMV_PANELS(W)                                                         \
    switch (pn) {                                                              \
    case 6: gemv_panels(6, W, x, w, y + n, K, b, N - n); break;                \
    case 5: gemv_panels(5, W, x, w, y + n, K, b, N - n); break;                \
    case 4: gemv_panels(4, W, x, w, y + n, K, b, N - n); break;                \
    case 3: gemv_panels(3, W, x, w, y + n, K, b, N - n); break;                \
    case 2: gemv_panels(2, W, x, w, y + n, K, b, N - n); break;                \
    default: gemv_panels(1, W, x, w, y + n, K, b, N - n); break;               \
    }

/* y[M, N] = x[M, K] @ W^T (+ bias) with W packed in panels of bf16 (wbf16) or fp32 values. */
void linear_packed(const float *x, int64_t ldx, const void *wp, int wbf16, const float *bias,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t panels = (N + 15) / 16, esize = wbf16 ? 2 : 4;
    const char *wbytes = (const char *)wp;
    if (M == 1) {
        const int64_t groups = (panels + 5) / 6;
#pragma omp parallel for schedule(static) if (N * K > 65536)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p = g * 6, pn = panels - p < 6 ? panels - p : 6, n = p * 16;
            const void *w = wbytes + p * K * 16 * esize;
            const float *b = bias ? bias + n : 0;
            if (wbf16) {
                GEMV_PANELS(1)
            } else {
                GEMV_PANELS(0)
            }
        }
        return;
    }
    if (M < 32 || !wbf16) {   /* panels read straight from memory (a few rows, or fp32 needing no widening) */
#pragma omp parallel for schedule(static) if (M * N * K > 65536)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n = p * 16;
            const int ncols = N - n < 16 ? (int)(N - n) : 16;
            for (int64_t m = 0; m < M; m += 6)
                micro_dispatch(M - m < 6 ? (int)(M - m) : 6, wbf16, x + m * ldx, ldx, wbytes + p * K * 16 * esize,
                               y + m * ldy + n, ldy, K, bias ? bias + n : 0, ncols);
        }
        return;
    }
    /* Tasks are (group of PG panels, chunk of MC rows): the group is widened to fp32 once into a
     * per-thread buffer that stays in L2 while the chunk's rows stream past it, 6 at a time. */
    const uint16_t *wh = (const uint16_t *)wp;
    const int64_t PG = 3, MC = 96;
    const int64_t groups = (panels + PG - 1) / PG, chunks = (M + MC - 1) / MC;
#pragma omp parallel if (M * N * K > 65536)
    {
        float *buf = (float *)malloc(sizeof(float) * PG * K * 16);
#pragma omp for collapse(2) schedule(static)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t p0 = g * PG, p1 = p0 + PG < panels ? p0 + PG : panels;
                const int64_t m0 = c * MC, m1 = m0 + MC < M ? m0 + MC : M;
                const uint16_t *src = wh + p0 * K * 16;
                for (int64_t i = 0; i < (p1 - p0) * K * 16; i += 8)
                    _mm256_storeu_ps(buf + i, load_bf16x8(src + i));
                for (int64_t p = p0; p < p1; p++) {
                    const int64_t n = p * 16;
                    const int ncols = N - n < 16 ? (int)(N - n) : 16;
                    for (int64_t m = m0; m < m1; m += 6) {
                        const int mr = m1 - m < 6 ? (int)(m1 - m) : 6;
                        micro_dispatch(mr, 0, x + m * ldx, ldx, buf + (p - p0) * K * 16, y + m * ldy + n, ldy, K,
                                       bias ? bias + n : 0, ncols);
                    }
                }
            }
        free(buf);
    }
}
#undef GEMV_PANELS

/* ---- paged KV cache ---------------------------------------------------------------------------
 * Cache layout (TorchAttentionBackend's): one [num_kv_heads, num_blocks, block_size, head_dim]
 * tensor for K and one for V, of kind KV_F32, KV_BF16 or KV_FP8. A token at slot s = block *
 * block_size + offset of head h lives at row h * num_blocks * block_size + s. head_dim must be a
 * multiple of 8.
 *
 * KV_FP8 (--kv-cache-dtype fp8): E4M3 bytes holding x / scale (one k_scale, one v_scale per layer),
 * rounded to nearest even and saturated at +-448, as kernels/attention/kv_fp8.py's torch reference
 * (torch's float8_e4m3fn cast). A read widens the byte to fp16 by moving its bits (s eeee mmm into
 * s 0eeee mmm0000000: the same value times 2^-8, subnormals included) and fp16 to fp32 with F16C;
 * the 2^8 and the scales are folded into the score scale and the softmax normaliser, so the inner
 * loops multiply nothing more. (E4M3's NaN byte would read as 480: writes never produce it from
 * finite values.)
 */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };
#define FP8_WIDEN 256.0f   /* the fp16 bit move gives the E4M3 value times 2^-8 */

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch's .to(bfloat16) */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* fp32 -> E4M3 (bias 7, no infinities, 0x7f NaN): nearest even, saturated at +-448. */
static inline uint8_t f32_to_e4m3(float f) {
    union { float f; uint32_t u; } v = { f };
    const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80u);
    v.u &= 0x7fffffffu;
    if (v.u > 0x7f800000u) return sign | 0x7f;                       /* NaN */
    if (v.f >= 448.0f) return sign | 0x7e;                           /* saturate (infinity too) */
    if (v.f < 0x1p-6f) return sign | (uint8_t)lrintf(v.f * 512.0f);  /* subnormal: k * 2^-9, 8 = 2^-6 */
    const uint32_t r = v.u + 0x7ffffu + ((v.u >> 20) & 1u);          /* mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}

static inline __m256 load_fp8x8(const uint8_t *p) {   /* 8 E4M3 bytes -> their values times 2^-8 */
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

static inline __m256 load_kv8(const void *base, int64_t index, int kind) {
    if (kind == KV_FP8) return load_fp8x8((const uint8_t *)base + index);
    return kind == KV_BF16 ? load_bf16x8((const uint16_t *)base + index) : _mm256_loadu_ps((const float *)base + index);
}

/* Keys and values sit in scattered pages of the pool: fetch a few rows ahead into L1 while the
 * current ones are multiplied (the hardware prefetcher loses the stream at every page border). */
static inline void prefetch_kv(const void *base, int64_t index, int64_t count, int kind) {
    const int64_t size = kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
    const char *p = (const char *)base + index * size;
    for (int64_t off = 0; off < count * size; off += 64)
        _mm_prefetch(p + off, _MM_HINT_T0);
}

/* Write the new tokens' K and V ([T, Hk, D], row strides given) into their slots; an fp8 pool
 * stores k / k_scale and v / v_scale. */
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache, void *v_cache,
              int kv_kind, const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t pool_slots,
              float k_scale, float v_scale) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hk; h++) {
            const int64_t dst = (h * pool_slots + slots[t]) * D;
            const float *ks = k + t * k_stride + h * D, *vs = v + t * v_stride + h * D;
            if (kv_kind == KV_FP8) {
                for (int64_t d = 0; d < D; d++) {
                    ((uint8_t *)k_cache)[dst + d] = f32_to_e4m3(ks[d] / k_scale);
                    ((uint8_t *)v_cache)[dst + d] = f32_to_e4m3(vs[d] / v_scale);
                }
            } else if (kv_kind == KV_BF16) {
                for (int64_t d = 0; d < D; d++) {
                    ((uint16_t *)k_cache)[dst + d] = f32_to_bf16(ks[d]);
                    ((uint16_t *)v_cache)[dst + d] = f32_to_bf16(vs[d]);
                }
            } else {
                for (int64_t d = 0; d < D; d++) {
                    ((float *)k_cache)[dst + d] = ks[d];
                    ((float *)v_cache)[dst + d] = vs[d];
                }
            }
        }
}

/* Scores of GN (<= 3) query heads against 4 keys (pool rows rows[0..3]), each key row loaded once
 * for all heads: one chain over d per (head, key), then a fixed 4-way tree, so a key's score does
 * not depend on the keys beside it. Head g's 4 scores go to s[g * ls .. + 4). */
#define DOT_ACC(g, a0, a1, a2, a3)                                                        \
    if (GN > g) {                                                                         \
        const __m256 qd = _mm256_loadu_ps(q + g * D + d);                                 \
        a0 = _mm256_fmadd_ps(qd, k0, a0);                                                 \
        a1 = _mm256_fmadd_ps(qd, k1, a1);                                                 \
        a2 = _mm256_fmadd_ps(qd, k2, a2);                                                 \
        a3 = _mm256_fmadd_ps(qd, k3, a3);                                                 \
    }
#define DOT_OUT(g, a0, a1, a2, a3)                                                        \
    if (GN > g) {                                                                         \
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  \
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)); \
        _mm_storeu_ps(s + g * ls, _mm_mul_ps(r, _mm_set1_ps(scale)));                     \
    }
static inline __attribute__((always_inline)) void
dot4(const int KIND, const int GN, const float *q, const void *k_cache, const int64_t *rows, int64_t D,
     float *s, int64_t ls, float scale) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0,
           c1 = a0, c2 = a0, c3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 k0 = load_kv8(k_cache, rows[0] + d, KIND), k1 = load_kv8(k_cache, rows[1] + d, KIND);
        const __m256 k2 = load_kv8(k_cache, rows[2] + d, KIND), k3 = load_kv8(k_cache, rows[3] + d, KIND);
        DOT_ACC(0, a0, a1, a2, a3) DOT_ACC(1, b0, b1, b2, b3) DOT_ACC(2, c0, c1, c2, c3)
    }
    DOT_OUT(0, a0, a1, a2, a3) DOT_OUT(1, b0, b1, b2, b3) DOT_OUT(2, c0, c1, c2, c3)
}
#undef DOT_ACC
#undef DOT_OUT

/* o[g][d0 .. d0 + 8 ND) += sum over keys i of p[g][i] * V[rows[i]] for GN query heads at once (the
 * values are loaded once for all of them); one chain per element, in key order. */
#define PV_ACC(g, i, a)                                                                   \
    if (GN > g && ND > i) a = _mm256_fmadd_ps(_mm256_set1_ps(p[g * ls + t]), v##i, a);
#define PV_IO(op, g, i, a)                                                                \
    if (GN > g && ND > i) op(g, i, a)
#define PV_ZERO(g, i, a) a = _mm256_setzero_ps();
#define PV_STORE(g, i, a) _mm256_storeu_ps(o + g * D + d0 + 8 * i, _mm256_mul_ps(a, _mm256_set1_ps(inv[g])));
#define PV_ALL(M, op)                                                                     \
    M(op, 0, 0, a00) M(op, 0, 1, a01) M(op, 0, 2, a02) M(op, 0, 3, a03)                   \
    M(op, 1, 0, a10) M(op, 1, 1, a11) M(op, 1, 2, a12) M(op, 1, 3, a13)                   \
    M(op, 2, 0, a20) M(op, 2, 1, a21) M(op, 2, 2, a22) M(op, 2, 3, a23)
static inline __attribute__((always_inline)) void
pv_block(const int KIND, const int GN, const int ND, const float *p, int64_t ls, const void *v_cache,
         const int64_t *rows, int64_t n, float *o, const float *inv, int64_t d0, int64_t D) {
    __m256 a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23;
    PV_ALL(PV_IO, PV_ZERO)
    for (int64_t t = 0; t < n; t++) {
        if (t + 8 < n)
            prefetch_kv(v_cache, rows[t + 8] + d0, 8 * ND, KIND);
        const __m256 v0 = load_kv8(v_cache, rows[t] + d0, KIND);
        const __m256 v1 = ND > 1 ? load_kv8(v_cache, rows[t] + d0 + 8, KIND) : v0;
        const __m256 v2 = ND > 2 ? load_kv8(v_cache, rows[t] + d0 + 16, KIND) : v0;
        const __m256 v3 = ND > 3 ? load_kv8(v_cache, rows[t] + d0 + 24, KIND) : v0;
        PV_ACC(0, 0, a00) PV_ACC(0, 1, a01) PV_ACC(0, 2, a02) PV_ACC(0, 3, a03)
        PV_ACC(1, 0, a10) PV_ACC(1, 1, a11) PV_ACC(1, 2, a12) PV_ACC(1, 3, a13)
        PV_ACC(2, 0, a20) PV_ACC(2, 1, a21) PV_ACC(2, 2, a22) PV_ACC(2, 3, a23)
    }
    PV_ALL(PV_IO, PV_STORE)
}
#undef PV_ACC
#undef PV_IO
#undef PV_ZERO
#undef PV_STORE
#undef PV_ALL

/* One (query, KV head) task: the G query heads sharing the KV head over keys rows[0 .. n). The
 * output is sum(p V) * v_mul / sum(p) (v_mul: the value scale of an fp8 pool, else 1). */
static inline __attribute__((always_inline)) void
attend(const int KIND, const float *q, const void *k_cache, const void *v_cache, const int64_t *rows, int64_t n,
       int64_t ls, float *scores, float *o, int64_t G, int64_t D, float scale, float v_mul) {
    float inv[G];
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gn = G - g0 < 3 ? (int)(G - g0) : 3;
        for (int64_t t = 0; t < n; t += 4) {
            for (int64_t i = t + 16; i < t + 20 && i < ls; i++)
                prefetch_kv(k_cache, rows[i], D, KIND);
            if (gn == 3) dot4(KIND, 3, q + g0 * D, k_cache, rows + t, D, scores + g0 * ls + t, ls, scale);
            else if (gn == 2) dot4(KIND, 2, q + g0 * D, k_cache, rows + t, D, scores + g0 * ls + t, ls, scale);
            else dot4(KIND, 1, q + g0 * D, k_cache, rows + t, D, scores + g0 * ls + t, ls, scale);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * ls;
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
        const __m256 m = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
            _mm256_storeu_ps(sg + t, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = hsum(acc);
        for (; t < n; t++) { sg[t] = exp1(sg[t] - mx); sum += sg[t]; }
        inv[g] = v_mul / sum;
    }
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gn = G - g0 < 3 ? (int)(G - g0) : 3;
        const float *p = scores + g0 * ls;
        float *og = o + g0 * D;
        int64_t d0 = 0;
        for (; d0 + 32 <= D; d0 += 32) {
            if (gn == 3) pv_block(KIND, 3, 4, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
            else if (gn == 2) pv_block(KIND, 2, 4, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
            else pv_block(KIND, 1, 4, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
        }
        for (; d0 < D; d0 += 8) {
            if (gn == 3) pv_block(KIND, 3, 1, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
            else if (gn == 2) pv_block(KIND, 2, 1, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
            else pv_block(KIND, 1, 1, p, ls, v_cache, rows, n, og, inv + g0, d0, D);
        }
    }
}

/* One query per new token: out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b over the first
 * seq_lens[b] keys of the sequence whose block table is row b (a decode, or one token of a prefill
 * chunk whose own K/V were just written), so a prompt token is computed exactly as if decoded. One
 * task per (query, KV head) handles the query heads that share that KV head (GQA), so keys and
 * values are loaded once for all of them. Every task's arithmetic is independent of the rest of
 * the batch. window > 0 keeps the last `window` keys. An fp8 pool's values are the bytes times
 * k_scale (v_scale); the scales are ignored for the other kinds. */
void paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     int kv_kind, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     float *out, int64_t out_stride, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                     int64_t block_size, int64_t pool_slots, float scale, int64_t window, float k_scale,
                     float v_scale) {
    const int64_t G = Hq / Hk;
    const float score_scale = kv_kind == KV_FP8 ? scale * (k_scale * FP8_WIDEN) : scale;
    const float v_mul = kv_kind == KV_FP8 ? v_scale * FP8_WIDEN : 1.0f;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)   /* a decode has B * Hk tasks: a few */
    for (int64_t b = 0; b < B; b++)
        for (int64_t hk = 0; hk < Hk; hk++) {
            const int64_t L = seq_lens[b];
            const int64_t start = (window > 0 && L > window) ? L - window : 0, n = L - start;
            const int64_t ls = (n + 3) & ~(int64_t)3;   /* n rounded up to whole 4-key blocks; rows past n
                                                          repeat a real row and their scores are unused */
            const int32_t *table = block_tables + b * bt_stride;
            int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * ls + sizeof(float) * G * ls);
            float *scores = (float *)(rows + ls);
            /* Page by page, not a division per key: this loop was a quarter of a decode task. */
            const int64_t head_row = hk * pool_slots;
            for (int64_t t = 0, pos = start; t < n;) {
                const int64_t page = pos / block_size, off = pos - page * block_size;
                const int64_t base = (head_row + (int64_t)table[page] * block_size) * D;
                for (int64_t o = off; o < block_size && t < n; o++, t++, pos++)
                    rows[t] = base + o * D;
            }
            for (int64_t t = n; t < ls; t++)
                rows[t] = rows[n - 1];
            const float *qb = q + b * q_stride + hk * G * D;
            float *ob = out + b * out_stride + hk * G * D;
            if (kv_kind == KV_FP8)
                attend(KV_FP8, qb, k_cache, v_cache, rows, n, ls, scores, ob, G, D, score_scale, v_mul);
            else if (kv_kind == KV_BF16)
                attend(KV_BF16, qb, k_cache, v_cache, rows, n, ls, scores, ob, G, D, score_scale, v_mul);
            else
                attend(KV_F32, qb, k_cache, v_cache, rows, n, ls, scores, ob, G, D, score_scale, v_mul);
            free(rows);
        }
}

/* ---- element-wise layers (rows of H contiguous floats) ----------------------------------------- */

/* o = rmsnorm(x) * weight over one row of H values (o may be x). */
static inline void norm_row(const float *x, const float *weight, float *o, int64_t H, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) { __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = hsum(acc);
    for (; i < H; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (i = 0; i < H; i++) o[i] = weight[i] * (x[i] * inv);
}

/* out = rmsnorm(x) * weight; with residual: residual = x + residual first, normalising that. */
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        if (residual) {
            float *r = residual + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += xr[i];
            xr = r;
        }
        norm_row(xr, weight, out + t * H, H, eps);
    }
}

/* Per-head RMSNorm (Qwen3's q/k norms): row t of x holds `heads` heads of D values at x + t * stride;
 * out[t, h] = rmsnorm(x[t, h]) * weight, out packed [T, heads, D] (out may be x with out_stride =
 * stride, normalising in place). */
void rms_norm_heads(const float *x, int64_t stride, float *out, int64_t out_stride, const float *weight, int64_t T,
                    int64_t heads, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (T * heads * D > 32768)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++)
            norm_row(x + t * stride + h * D, weight, out + t * out_stride + h * D, D, eps);
}

/* out[t] = silu(x[t, :d]) * x[t, d:] for a fused [T, 2d] gate/up projection. */
void silu_and_mul(const float *x, float *out, int64_t T, int64_t d) {
#pragma omp parallel for schedule(static) if (T * d > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < d; i++) o[i] = g[i] * (1.0f / (1.0f + exp1(-g[i]))) * u[i];
    }
}

/* Rotate q [T, Hq, D] and k [T, Hk, D] in place (row strides given; heads packed), NeoX/HF style:
 * the first and second halves of each head are the two coordinates of each pair. cos/sin are
 * [max_position, D / 2] tables. */
void rotary_neox(const int64_t *positions, float *q, int64_t q_stride, int64_t Hq, float *k, int64_t k_stride,
                 int64_t Hk, const float *cos_table, const float *sin_table, int64_t T, int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 64)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t h = 0; h < Hq + Hk; h++) {
            float *x = h < Hq ? q + t * q_stride + h * D : k + t * k_stride + (h - Hq) * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}
