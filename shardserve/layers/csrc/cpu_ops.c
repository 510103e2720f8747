/* CPU kernels for x86 with AVX2 + FMA (compiled on first use by shardserve/layers/cpu_ops.py).
 *
 * linear_bf16w: y[M,N] = x[M,K] (fp32) @ w[N,K]^T (bf16) + bias[N] (fp32, optional).
 *   Weights stay bf16 in memory (half the bytes of fp32, which is what decode is bound by) and are
 *   widened to fp32 in registers; products accumulate in fp32. Every output element is computed
 *   by the same sequence of operations whatever M is and wherever its row sits in the batch, so a
 *   request gets bit-identical results alone or batched (batch invariance by construction).
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

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
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

/* MR rows of x against NR rows of w (bf16, or its exact fp32 widening when WF32), all MR x NR
 * accumulators in registers. Per output element the arithmetic is always the same: lane-wise FMAs
 * over k in steps of 8, hsum, the K % 8 tail, then the bias. */
static inline __attribute__((always_inline)) void
tile(const int MR, const int NR, const int WF32, const float *x, int64_t ldx, const void *w, int64_t ldw,
     float *y, int64_t ldy, int64_t K, const float *bias) {
    const uint16_t *wh = (const uint16_t *)w;
    const float *wf = (const float *)w;
    __m256 acc[4][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[8];
        for (int j = 0; j < NR; j++) wv[j] = WF32 ? _mm256_loadu_ps(wf + j * ldw + k) : load_bf16x8(wh + j * ldw + k);
        for (int i = 0; i < MR; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t t = k; t < K; t++)
                s += x[i * ldx + t] * (WF32 ? wf[j * ldw + t] : bf16_to_f32(wh[j * ldw + t]));
            if (bias) s += bias[j];
            y[i * ldy + j] = s;
        }
}

/* One weight row (single-stream decode) against 8 weight rows at a time: more loads in flight. */
static void gemv_rows(const float *x, const uint16_t *w, const float *bias, float *y, int64_t n0, int64_t n1,
                      int64_t K) {
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) tile(1, 8, 0, x, 0, w + n * K, K, y + n, 0, K, bias ? bias + n : 0);
    for (; n < n1; n++) tile(1, 1, 0, x, 0, w + n * K, K, y + n, 0, K, bias ? bias + n : 0);
}

#define TILE(MR, NR) tile(MR, NR, 1, x, ldx, w, ldw, y, ldy, K, bias)

/* Several rows against an fp32 weight panel; MR <= 4, NR <= 3 (12 accumulators + 4 registers). */
static void tile_f32(int mr, int nr, const float *x, int64_t ldx, const float *w, int64_t ldw,
                     float *y, int64_t ldy, int64_t K, const float *bias) {
    switch (mr * 4 + nr) {
    case 4 * 4 + 3: TILE(4, 3); break;
    case 4 * 4 + 2: TILE(4, 2); break;
    case 4 * 4 + 1: TILE(4, 1); break;
    case 3 * 4 + 3: TILE(3, 3); break;
    case 3 * 4 + 2: TILE(3, 2); break;
    case 3 * 4 + 1: TILE(3, 1); break;
    case 2 * 4 + 3: TILE(2, 3); break;
    case 2 * 4 + 2: TILE(2, 2); break;
    case 2 * 4 + 1: TILE(2, 1); break;
    case 1 * 4 + 3: TILE(1, 3); break;
    case 1 * 4 + 2: TILE(1, 2); break;
    default: TILE(1, 1); break;
    }
}

/* Work is split into (row chunk, weight panel) pairs. A panel of NC weight rows is widened to fp32
 * once into a per-thread buffer (L2-resident), then swept over a chunk of up to MC rows of x, so
 * the bf16->fp32 conversion is paid once per 64 rows instead of once per 4. */
void linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                  float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    const int64_t MC = 64, NC = 48;
    if (M == 1) {
        const int64_t per = ((N + 7) / 8 + 1) / 2 * 8;   /* two contiguous halves, in whole tiles */
#pragma omp parallel for schedule(static) if (N * K > 65536)
        for (int part = 0; part < 2; part++) {
            const int64_t n0 = part * per < N ? part * per : N, n1 = (part + 1) * per < N ? (part + 1) * per : N;
            gemv_rows(x, w, bias, y, n0, n1, K);
        }
        return;
    }
    const int64_t m_chunks = (M + MC - 1) / MC, n_panels = (N + NC - 1) / NC;
#pragma omp parallel if (M * N * K > 65536)
    {
        float *panel = (float *)malloc(sizeof(float) * NC * K);
#pragma omp for collapse(2) schedule(static)
        for (int64_t np = 0; np < n_panels; np++)
            for (int64_t mc = 0; mc < m_chunks; mc++) {
                const int64_t m_end = (mc + 1) * MC < M ? (mc + 1) * MC : M;
                const int64_t n_end = (np + 1) * NC < N ? (np + 1) * NC : N;
                for (int64_t i = 0; i < (n_end - np * NC) * K; i++) panel[i] = bf16_to_f32(w[np * NC * K + i]);
                for (int64_t n = np * NC; n < n_end; n += 3) {
                    const int nr = n_end - n < 3 ? (int)(n_end - n) : 3;
                    for (int64_t m = mc * MC; m < m_end; m += 4) {
                        const int mr = m_end - m < 4 ? (int)(m_end - m) : 4;
                        tile_f32(mr, nr, x + m * ldx, ldx, panel + (n - np * NC) * K, K, y + m * ldy + n, ldy, K,
                                 bias ? bias + n : 0);
                    }
                }
            }
        free(panel);
    }
}

/* ---- paged KV cache ---------------------------------------------------------------------------
 * Cache layout (TorchAttentionBackend's): one [num_kv_heads, num_blocks, block_size, head_dim]
 * tensor for K and one for V, fp32 or bf16 (kv_bf16). A token at slot s = block * block_size +
 * offset of head h lives at row h * num_blocks * block_size + s. head_dim must be a multiple of 8.
 */

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch's .to(bfloat16) */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline __m256 load_kv8(const void *base, int64_t index, int kv_bf16) {
    return kv_bf16 ? load_bf16x8((const uint16_t *)base + index) : _mm256_loadu_ps((const float *)base + index);
}

/* Write the new tokens' K and V ([T, Hk, D], row strides given) into their slots. */
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache, void *v_cache,
              int kv_bf16, const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t pool_slots) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hk; h++) {
            const int64_t dst = (h * pool_slots + slots[t]) * D;
            const float *ks = k + t * k_stride + h * D, *vs = v + t * v_stride + h * D;
            if (kv_bf16) {
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

/* One new token per request (decode): out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b, reading
 * request b's keys through its block table. One task per (request, KV head) handles the query heads
 * that share that KV head (GQA), so each key and value row is loaded once for all of them. Every
 * task's arithmetic is independent of the rest of the batch. window > 0 keeps the last `window` keys. */
void paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            int kv_bf16, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            float *out, int64_t out_stride, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                            int64_t block_size, int64_t pool_slots, float scale, int64_t window) {
    const int64_t G = Hq / Hk;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t hk = 0; hk < Hk; hk++) {
            const int64_t L = seq_lens[b];
            const int64_t start = (window > 0 && L > window) ? L - window : 0;
            const int32_t *table = block_tables + b * bt_stride;
            const int64_t head_base = hk * pool_slots;
            float *scores = (float *)malloc(sizeof(float) * G * (L - start + 1));
            float maxs[G], sums[G];
            for (int64_t g = 0; g < G; g++) maxs[g] = -INFINITY;
            for (int64_t t = start; t < L; t++) {
                const int64_t row = (head_base + (int64_t)table[t / block_size] * block_size + t % block_size) * D;
                for (int64_t g = 0; g < G; g++) {
                    const float *qv = q + b * q_stride + (hk * G + g) * D;
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), load_kv8(k_cache, row + d, kv_bf16), acc);
                    const float s = hsum(acc) * scale;
                    scores[g * (L - start) + (t - start)] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *sg = scores + g * (L - start);
                const __m256 m = _mm256_set1_ps(maxs[g]);
                __m256 acc = _mm256_setzero_ps();
                int64_t i = 0;
                for (; i + 8 <= L - start; i += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));
                    _mm256_storeu_ps(sg + i, e);
                    acc = _mm256_add_ps(acc, e);
                }
                float sum = hsum(acc);
                for (; i < L - start; i++) { sg[i] = exp1(sg[i] - maxs[g]); sum += sg[i]; }
                sums[g] = sum;
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + b * out_stride + (hk * G + g) * D;
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
            }
            for (int64_t t = start; t < L; t++) {
                const int64_t row = (head_base + (int64_t)table[t / block_size] * block_size + t % block_size) * D;
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 vv = load_kv8(v_cache, row + d, kv_bf16);
                    for (int64_t g = 0; g < G; g++) {
                        float *o = out + b * out_stride + (hk * G + g) * D + d;
                        const __m256 p = _mm256_set1_ps(scores[g * (L - start) + (t - start)]);
                        _mm256_storeu_ps(o, _mm256_fmadd_ps(p, vv, _mm256_loadu_ps(o)));
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float *o = out + b * out_stride + (hk * G + g) * D;
                const __m256 inv = _mm256_set1_ps(1.f / sums[g]);
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
            }
            free(scores);
        }
}

/* ---- element-wise layers (rows of H contiguous floats) ----------------------------------------- */

/* out = rmsnorm(x) * weight; with residual: residual = x + residual first, normalising that. */
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T * H > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        if (residual) {
            float *r = residual + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += xr[i];
            xr = r;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) { __m256 v = _mm256_loadu_ps(xr + i); acc = _mm256_fmadd_ps(v, v, acc); }
        float ss = hsum(acc);
        for (; i < H; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) o[i] = weight[i] * (xr[i] * inv);
    }
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
