/* GGUF block-quantized linear layers on the CPU, compiled on first use by
 * shardserve/kernels/cpu/quant_ops.py (plain C, no torch headers; called through ctypes).
 *
 *   y[M, N] = x[M, K] @ W^T (+ bias), x and y fp32, W [N, K] stored as the file's blocks: each row
 *   is K / UNIT blocks of BYTES bytes (Q4_0 / Q4_1 / Q8_0: 32 values per block; Q4_K / Q5_K /
 *   Q6_K: 256 values per super-block). Block layouts follow the GGUF specification.
 *
 * How: each thread takes a share of the weight rows (N); for one row it expands the blocks into a
 * per-thread fp32 row buffer (K floats, stays in L1/L2), then multiplies that row with every row of
 * x, four at a time. So each weight byte is read from memory once per call whatever M is, and the
 * activations stay fp32 (no 8-bit activation rounding).
 *
 * Three code paths in one library, picked per call by `isa`: 0 scalar C, 1 AVX2 + FMA + F16C,
 * 2 AVX-512 (F, BW, VL; 3, AVX-512 with VNNI, takes it too: VNNI matters only to the int8 kernels
 * of quant_dot.c). gguf_cpu_isa() says the best one this CPU runs; the wrapper lets an environment
 * switch force a lower one.
 *
 * Batch invariance (as in cpu_ops.c): y[m, n] is one fixed sequence of operations whatever M is and
 * wherever row m sits; threads split only across weight rows. Expanding a block uses a multiply then
 * an add (never a fused multiply-add), so the vector and scalar expansions give the same values.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define AI static inline __attribute__((always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* Values per block and bytes per block; 0 for a type this library does not multiply. */
int gguf_block_info(int type, int *bytes) {
    switch (type) {
    case Q4_0: *bytes = 18; return 32;
    case Q4_1: *bytes = 20; return 32;
    case Q8_0: *bytes = 34; return 32;
    case Q4_K: *bytes = 144; return 256;
    case Q5_K: *bytes = 176; return 256;
    case Q6_K: *bytes = 210; return 256;
    default: *bytes = 0; return 0;
    }
}

int gguf_cpu_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        return __builtin_cpu_supports("avx512vnni") ? 3 : 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
    return 0;
}

/* IEEE half -> float, exact (every half is a float). */
AI float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else {   /* subnormal: man * 2^-24 */
        float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

float gguf_half_to_float(const uint8_t *p) { return half_to_float(p); }   /* for quant_dot.c */

/* ---- expanding blocks into fp32, plain C (every path uses these for the K-quants) -------------- */

AI void expand_q4_0(const uint8_t *b, float *out) {
    const float d = half_to_float(b);
    for (int i = 0; i < 16; i++) {
        out[i] = (float)((b[2 + i] & 15) - 8) * d;
        out[i + 16] = (float)((b[2 + i] >> 4) - 8) * d;
    }
}

AI void expand_q4_1(const uint8_t *b, float *out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int i = 0; i < 16; i++) {
        out[i] = (float)(b[4 + i] & 15) * d + m;
        out[i + 16] = (float)(b[4 + i] >> 4) * d + m;
    }
}

AI void expand_q8_0(const uint8_t *b, float *out) {
    const float d = half_to_float(b);
    for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)b[2 + i] * d;
}

/* The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block, from its 12 scale bytes. */
AI void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

void gguf_k_scale_min(const uint8_t *s, int j, int *sc, int *mn) { k_scale_min(s, j, sc, mn); }   /* for quant_dot.c */

/* Q4_K: d, dmin (halves), 12 scale bytes, 128 bytes of nibbles; sub-block j (32 values) is the low
 * (even j) or high (odd j) nibbles of bytes 32 * (j / 2) ..; value = d * sc * q - dmin * mn. */
AI void expand_q4_k(const uint8_t *b, float *out) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int i = 0; i < 32; i++) out[32 * j + i] = ds * (float)((q[i] >> shift) & 15) - dm;
    }
}

/* Q5_K: as Q4_K with a fifth bit: bit j of high-bit byte i belongs to value i of sub-block j. */
AI void expand_q5_k(const uint8_t *b, float *out) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int i = 0; i < 32; i++)
            out[32 * j + i] = ds * (float)(((q[i] >> shift) & 15) | (((qh[i] >> j) & 1) << 4)) - dm;
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed 8-bit scales (one per 16
 * values), d (half). Value e = 128 h + r: low nibble of byte 64 h + r % 64 (high nibble when
 * r >= 64), high bits (byte 32 h + r % 32) >> 2 (r / 32); q - 32 times d * scale[e / 16]. */
AI void expand_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_to_float(b + 208);
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[64 * h + r % 64] >> (r < 64 ? 0 : 4)) & 15;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        out[e] = (d * (float)scales[e / 16]) * (float)((lo | (hi << 4)) - 32);
    }
}

AI void expand_row_c(int type, const uint8_t *row, int64_t K, float *out) {
    int bytes;
    const int unit = gguf_block_info(type, &bytes);
    for (int64_t b = 0; b < K / unit; b++, row += bytes, out += unit) {
        switch (type) {
        case Q4_0: expand_q4_0(row, out); break;
        case Q4_1: expand_q4_1(row, out); break;
        case Q8_0: expand_q8_0(row, out); break;
        case Q4_K: expand_q4_k(row, out); break;
        case Q5_K: expand_q5_k(row, out); break;
        default: expand_q6_k(row, out); break;
        }
    }
}

/* ---- scalar path -------------------------------------------------------------------------------- */

static void rows_scalar(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                        const float *bias, float *y, int64_t ldy, int64_t M, int64_t n, int64_t K, float *buf) {
    expand_row_c(type, w + n * row_bytes, K, buf);
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float a[4] = {0, 0, 0, 0};
        for (int64_t k = 0; k < K; k += 4)   /* K is a multiple of 32 */
            for (int l = 0; l < 4; l++) a[l] += xm[k + l] * buf[k + l];
        const float s = (a[0] + a[1]) + (a[2] + a[3]);
        y[m * ldy + n] = bias ? s + bias[n] : s;
    }
}

/* ---- AVX2 -------------------------------------------------------------------------------------- */

AVX2_TARGET AI float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AVX2_TARGET AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2_TARGET AI __m256 bytes_to_ps8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* The 32-value formats, eight values at a time: nibbles (or bytes) widened, then (q * d) + m. */
AVX2_TARGET AI void expand_block_avx2(const int type, const uint8_t *row, __m256 *v) {
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    const __m256 d = _mm256_set1_ps(half_f16c(row));
    if (type == Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(row + 2)), q1 = _mm_loadu_si128((const __m128i *)(row + 18));
        v[0] = bytes_to_ps8(q0);
        v[1] = bytes_to_ps8(_mm_srli_si128(q0, 8));
        v[2] = bytes_to_ps8(q1);
        v[3] = bytes_to_ps8(_mm_srli_si128(q1, 8));
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(row + (type == Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        if (type == Q4_0) {
            lo = _mm_sub_epi8(lo, eight);
            hi = _mm_sub_epi8(hi, eight);
        }
        v[0] = bytes_to_ps8(lo);
        v[1] = bytes_to_ps8(_mm_srli_si128(lo, 8));
        v[2] = bytes_to_ps8(hi);
        v[3] = bytes_to_ps8(_mm_srli_si128(hi, 8));
    }
    for (int i = 0; i < 4; i++) v[i] = _mm256_mul_ps(v[i], d);
    if (type == Q4_1) {
        const __m256 m = _mm256_set1_ps(half_f16c(row + 2));
        for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(v[i], m);
    }
}

AVX2_TARGET static void expand_row_avx2(int type, const uint8_t *row, int64_t K, float *out) {
    int bytes;
    gguf_block_info(type, &bytes);
    for (int64_t b = 0; b < K / 32; b++, row += bytes, out += 32) {
        __m256 v[4];
        switch (type) {
        case Q4_0: expand_block_avx2(Q4_0, row, v); break;
        case Q4_1: expand_block_avx2(Q4_1, row, v); break;
        case Q8_0: expand_block_avx2(Q8_0, row, v); break;
        default: expand_row_c(type, row, K, out); return;
        }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 8 * i, v[i]);
    }
}

/* MR rows of x times one expanded weight row: four accumulators per x row, vector v of the row
 * feeding accumulator v % 4, summed (0 + 1) + (2 + 3), then across lanes. */
#define ACC4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float *xi = x + i * ldx + k;                                                               \
        a##i##0 = _mm256_fmadd_ps(_mm256_loadu_ps(xi), _mm256_loadu_ps(wr + k), a##i##0);                \
        a##i##1 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), _mm256_loadu_ps(wr + k + 8), a##i##1);        \
        a##i##2 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 16), _mm256_loadu_ps(wr + k + 16), a##i##2);      \
        a##i##3 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 24), _mm256_loadu_ps(wr + k + 24), a##i##3);      \
    }
#define OUT4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float s = hsum8(_mm256_add_ps(_mm256_add_ps(a##i##0, a##i##1), _mm256_add_ps(a##i##2, a##i##3))); \
        y[i * ldy] = bias ? s + *bias : s;                                                               \
    }

AVX2_TARGET AI void dot_avx2(const int MR, const float *x, int64_t ldx, const float *wr, float *y, int64_t ldy,
                             int64_t K, const float *bias) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t k = 0; k < K; k += 32) {
        ACC4(0) ACC4(1) ACC4(2)
    }
    OUT4(0) OUT4(1) OUT4(2)
}
#undef ACC4
#undef OUT4

/* The same chains as dot_avx2 with each block expanded in registers (M <= 3, 32-value types). */
#define ACC4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float *xi = x + i * ldx + 32 * b;                                                          \
        a##i##0 = _mm256_fmadd_ps(_mm256_loadu_ps(xi), v[0], a##i##0);                                   \
        a##i##1 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), v[1], a##i##1);                               \
        a##i##2 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 16), v[2], a##i##2);                              \
        a##i##3 = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 24), v[3], a##i##3);                              \
    }
#define OUT4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float s = hsum8(_mm256_add_ps(_mm256_add_ps(a##i##0, a##i##1), _mm256_add_ps(a##i##2, a##i##3))); \
        y[i * ldy] = bias ? s + *bias : s;                                                               \
    }

AVX2_TARGET AI void dot_blocks_avx2(const int MR, const int TYPE, const float *x, int64_t ldx, const uint8_t *row,
                                    int bytes, float *y, int64_t ldy, int64_t K, const float *bias) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        expand_block_avx2(TYPE, row + b * bytes, v);
        ACC4(0) ACC4(1) ACC4(2)
    }
    OUT4(0) OUT4(1) OUT4(2)
}
#undef ACC4
#undef OUT4

#define BLOCKS_MR(T)                                                                    \
    switch (M) {                                                                        \
    case 3: dot_blocks_avx2(3, T, x, ldx, row, bytes, y + n, ldy, K, b); return;        \
    case 2: dot_blocks_avx2(2, T, x, ldx, row, bytes, y + n, ldy, K, b); return;        \
    default: dot_blocks_avx2(1, T, x, ldx, row, bytes, y + n, ldy, K, b); return;       \
    }

AVX2_TARGET static void rows_avx2(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                                  const float *bias, float *y, int64_t ldy, int64_t M, int64_t n, int64_t K,
                                  float *buf) {
    const float *b = bias ? bias + n : 0;
    if (M <= 3 && (type == Q4_0 || type == Q4_1 || type == Q8_0)) {
        const uint8_t *row = w + n * row_bytes;
        const int bytes = (int)(row_bytes / (K / 32));
        if (type == Q4_0) { BLOCKS_MR(Q4_0) }
        if (type == Q4_1) { BLOCKS_MR(Q4_1) }
        BLOCKS_MR(Q8_0)
    }
    expand_row_avx2(type, w + n * row_bytes, K, buf);
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) dot_avx2(3, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b);
    if (M - m == 2) dot_avx2(2, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b);
    if (M - m == 1) dot_avx2(1, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b);
}

#undef BLOCKS_MR

/* ---- AVX-512 ----------------------------------------------------------------------------------- */

AVX512_TARGET AI __m512 bytes_to_ps16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

AVX512_TARGET AI void expand_block_avx512(const int type, const uint8_t *row, __m512 *v0, __m512 *v1) {
    const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    const __m512 d = _mm512_set1_ps(half_f16c(row));
    __m512 a, b;
    if (type == Q8_0) {
        a = bytes_to_ps16(_mm_loadu_si128((const __m128i *)(row + 2)));
        b = bytes_to_ps16(_mm_loadu_si128((const __m128i *)(row + 18)));
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(row + (type == Q4_1 ? 4 : 2)));
        __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        if (type == Q4_0) {
            lo = _mm_sub_epi8(lo, eight);
            hi = _mm_sub_epi8(hi, eight);
        }
        a = bytes_to_ps16(lo);
        b = bytes_to_ps16(hi);
    }
    a = _mm512_mul_ps(a, d);
    b = _mm512_mul_ps(b, d);
    if (type == Q4_1) {
        const __m512 m = _mm512_set1_ps(half_f16c(row + 2));
        a = _mm512_add_ps(a, m);
        b = _mm512_add_ps(b, m);
    }
    *v0 = a;
    *v1 = b;
}

AVX512_TARGET static void expand_row_avx512(int type, const uint8_t *row, int64_t K, float *out) {
    int bytes;
    gguf_block_info(type, &bytes);
    for (int64_t b = 0; b < K / 32; b++, row += bytes, out += 32) {
        __m512 v0, v1;
        switch (type) {
        case Q4_0: expand_block_avx512(Q4_0, row, &v0, &v1); break;
        case Q4_1: expand_block_avx512(Q4_1, row, &v0, &v1); break;
        case Q8_0: expand_block_avx512(Q8_0, row, &v0, &v1); break;
        default: expand_row_c(type, row, K, out); return;
        }
        _mm512_storeu_ps(out, v0);
        _mm512_storeu_ps(out + 16, v1);
    }
}

/* As dot_avx2 with 16 lanes: vector v of the row (16 values) feeds accumulator v % 4; K is a
 * multiple of 32, so a tail of two vectors goes to accumulators 0 and 1. */
#define ACC4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float *xi = x + i * ldx + k;                                                               \
        a##i##0 = _mm512_fmadd_ps(_mm512_loadu_ps(xi), _mm512_loadu_ps(wr + k), a##i##0);                \
        a##i##1 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + 16), _mm512_loadu_ps(wr + k + 16), a##i##1);      \
        if (k + 64 <= K) {                                                                               \
            a##i##2 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + 32), _mm512_loadu_ps(wr + k + 32), a##i##2);  \
            a##i##3 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + 48), _mm512_loadu_ps(wr + k + 48), a##i##3);  \
        }                                                                                                \
    }
#define OUT4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a##i##0, a##i##1),               \
                                                           _mm512_add_ps(a##i##2, a##i##3)));             \
        y[i * ldy] = bias ? s + *bias : s;                                                               \
    }

AVX512_TARGET AI void dot_avx512(const int MR, const float *x, int64_t ldx, const float *wr, float *y, int64_t ldy,
                                 int64_t K, const float *bias) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t k = 0; k < K; k += 64) {
        ACC4(0) ACC4(1) ACC4(2) ACC4(3)
    }
    OUT4(0) OUT4(1) OUT4(2) OUT4(3)
}
#undef ACC4
#undef OUT4

/* The same chains as dot_avx512 with each block expanded in registers (M <= 4, 32-value types):
 * block b's two vectors are vectors 2b, 2b + 1 of the row, so they feed accumulators 0, 1 (even b)
 * or 2, 3 (odd b), as in dot_avx512. */
#define ACC4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float *xi = x + i * ldx + 32 * b;                                                          \
        if (b & 1) {                                                                                     \
            a##i##2 = _mm512_fmadd_ps(_mm512_loadu_ps(xi), v0, a##i##2);                                 \
            a##i##3 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + 16), v1, a##i##3);                            \
        } else {                                                                                         \
            a##i##0 = _mm512_fmadd_ps(_mm512_loadu_ps(xi), v0, a##i##0);                                 \
            a##i##1 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + 16), v1, a##i##1);                            \
        }                                                                                                \
    }
#define OUT4(i)                                                                                          \
    if (MR > i) {                                                                                        \
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a##i##0, a##i##1),               \
                                                           _mm512_add_ps(a##i##2, a##i##3)));             \
        y[i * ldy] = bias ? s + *bias : s;                                                               \
    }

AVX512_TARGET AI void dot_blocks_avx512(const int MR, const int TYPE, const float *x, int64_t ldx, const uint8_t *row,
                                        int bytes, float *y, int64_t ldy, int64_t K, const float *bias) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 v0, v1;
        expand_block_avx512(TYPE, row + b * bytes, &v0, &v1);
        ACC4(0) ACC4(1) ACC4(2) ACC4(3)
    }
    OUT4(0) OUT4(1) OUT4(2) OUT4(3)
}
#undef ACC4
#undef OUT4

#define BLOCKS_MR(T)                                                                    \
    switch (M) {                                                                        \
    case 4: dot_blocks_avx512(4, T, x, ldx, row, bytes, y + n, ldy, K, b); return;      \
    case 3: dot_blocks_avx512(3, T, x, ldx, row, bytes, y + n, ldy, K, b); return;      \
    case 2: dot_blocks_avx512(2, T, x, ldx, row, bytes, y + n, ldy, K, b); return;      \
    default: dot_blocks_avx512(1, T, x, ldx, row, bytes, y + n, ldy, K, b); return;     \
    }

AVX512_TARGET static void rows_avx512(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                                      const float *bias, float *y, int64_t ldy, int64_t M, int64_t n, int64_t K,
                                      float *buf) {
    const float *b = bias ? bias + n : 0;
    if (M <= 4 && (type == Q4_0 || type == Q4_1 || type == Q8_0)) {
        const uint8_t *row = w + n * row_bytes;
        const int bytes = (int)(row_bytes / (K / 32));
        if (type == Q4_0) { BLOCKS_MR(Q4_0) }
        if (type == Q4_1) { BLOCKS_MR(Q4_1) }
        BLOCKS_MR(Q8_0)
    }
    expand_row_avx512(type, w + n * row_bytes, K, buf);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_avx512(4, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b);
    switch (M - m) {
    case 3: dot_avx512(3, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b); break;
    case 2: dot_avx512(2, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b); break;
    case 1: dot_avx512(1, x + m * ldx, ldx, buf, y + m * ldy + n, ldy, K, b); break;
    default: break;
    }
}

#undef BLOCKS_MR

/* ---- entry points ------------------------------------------------------------------------------- */

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias[N]); W: N rows of row_bytes
 * bytes of `type` blocks. isa: 0 scalar, 1 AVX2, 2 or 3 AVX-512 (the caller checks the CPU has it).
 * Returns 0, or -1 for a type or K this library cannot multiply. */
int gguf_linear(int isa, int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int bytes;
    const int unit = gguf_block_info(type, &bytes);
    if (!unit || K % unit || row_bytes != K / unit * bytes)
        return -1;
#pragma omp parallel if (M * N * K > 65536)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * ((K + 15) / 16 * 16));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (isa >= 2)
                rows_avx512(type, x, ldx, w, row_bytes, bias, y, ldy, M, n, K, buf);
            else if (isa == 1)
                rows_avx2(type, x, ldx, w, row_bytes, bias, y, ldy, M, n, K, buf);
            else
                rows_scalar(type, x, ldx, w, row_bytes, bias, y, ldy, M, n, K, buf);
        }
        free(buf);
    }
    return 0;
}

/* Rows of W expanded to fp32 [N, K] with the scalar expansion (the values every path multiplies). */
int gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, float *out, int64_t N, int64_t K) {
    int bytes;
    const int unit = gguf_block_info(type, &bytes);
    if (!unit || K % unit || row_bytes != K / unit * bytes)
        return -1;
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) expand_row_c(type, w + n * row_bytes, K, out + n * K);
    return 0;
}
