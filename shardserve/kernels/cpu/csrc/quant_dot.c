/* Integer dot products for GGUF blocks on the CPU: the 32-value formats (Q4_0, Q4_1, Q8_0) and the
 * K-quants' 256-value super-blocks (Q4_K, Q5_K, Q6_K), compiled with quant_ops.c into one library by
 * shardserve/kernels/cpu/quant_ops.py.
 *
 *   y[M, N] = x[M, K] @ W^T (+ bias), x and y fp32, W [N, K] in blocks of 32 values.
 *
 * Why integers: expanding every weight to fp32 costs more work per weight than the bf16 panel kernel
 * spends, so the fp32-activation kernels in quant_ops.c lose to it. Here each row of x is quantized
 * once per call to int8 blocks of 32 (scale amax / 127, round to nearest even), and a block of
 * weights times a block of x is an integer dot product of byte pairs (AVX2: vpmaddubsw + vpmaddwd;
 * AVX-512 VNNI: vpdpbusd), scaled once in fp32:
 *   Q4_0  d_w (q - 8)      -> d_w d_x (sum q x_q - 8 sum x_q)
 *   Q4_1  d_w q + m_w      -> d_w d_x sum q x_q + m_w (d_x sum x_q)
 *   Q8_0  d_w q (signed)   -> d_w d_x sum q x_q
 * The byte instructions multiply unsigned by signed bytes: 4-bit values are unsigned already (Q4_0's
 * -8 becomes an integer correction), Q8_0 weights get +128 and a -128 sum x_q correction on VNNI
 * (no 16-bit step to overflow) and the sign trick on AVX2 (|w| times x carrying w's sign). A
 * correction is the initial value of the integer accumulator.
 *
 * Layout (gguf_repack8, once at load; the file's bytes, rows padded to a multiple of 8):
 * groups of 8 weight rows, block after block; one group-block holds the 8 rows' scales (fp16), for
 * Q4_1 their mins, then the values in 4-byte chunks: chunk c is bytes 4c..4c+3 of rows 0..7, one
 * 32-byte vector. A vector lane is then one weight row, and one vpdpbusd multiplies 4 values of 8
 * rows by the same 4 bytes of x broadcast: the lanes end the block as the 8 rows' dot products, one
 * scale vector (8 d_w times d_x) converts them, and y's 8 outputs are stored with no horizontal sum.
 * (In a 4-bit block byte j holds value j in its low nibble and value j + 16 in its high one.)
 *
 * K-quants: a super-block spans 8 blocks of x, and each block of x meets weights with scales of
 * their own, so it is one integer dot product (two for Q6_K) scaled in fp32, as above:
 *   Q4_K / Q5_K  sub-block j of 32: d sc_j q - dmin mn_j (q 4 or 5 bits, sc and mn 6 bits)
 *                -> (d sc_j) d_x sum q x_q - (dmin mn_j) (d_x sum x_q): Q4_1 with per-block d and m
 *   Q6_K         16 values: d sc (q - 32) (q 6 bits, sc int8), two per block of x
 *                -> (d sc_h) d_x (sum q x_q - 32 sum x_q) per half h: q multiplies unsigned, the
 *                   -32 sum x_q of each half is its integer correction (c16)
 * d sc is formed in fp32 as gguf's dequantization forms it. A group-block holds one super-block of
 * 8 rows: Q4_K / Q5_K: d[8], dmin[8] (fp16), sc[j][8] and mn[j][8] (the 6-bit values unpacked to a
 * byte each: the only bytes not the file's, 16 per row instead of 12), then (Q5_K) the 32 bytes of
 * fifth bits and the 128 bytes of nibbles in 4-byte chunks as above: chunk c of nibble pair p
 * holds values 4c..4c+3 of sub-blocks 2p (low nibbles) and 2p + 1 (high); Q6_K (the file's bytes,
 * 210 per row): d[8], scales[16][8], then ql's 128 and qh's 64 bytes in 4-byte chunks, in the
 * order the kernel reads them (Q6K_QL / Q6K_QH: each half of the super-block's ql chunks 0-7, its
 * qh chunks, its ql chunks 8-15; read in file order, the jumps between ql and qh cost half the
 * speed when the weights stream from memory). Two x-blocks' 8 weight vectors each are shifted and
 * masked out of one load of the chunks they share (k_value says which bits). Q6_K's halves are
 * scaled apart because 16 sc-weighted products of ~16-bit x can pass 2^31.
 *
 * The price is x's rounding: to 8 bits (one level, llama.cpp's numerics: an error up to 1/254 of
 * each block's largest value, enough to change the embedded model's answers), or to ~16 bits with two
 * int8 levels (the default, see L2_UNITS: twice the byte multiplies, which decode, bound by the
 * weight bytes, hardly feels; prefills do). quant_ops.c's fp32-activation kernels stay as the exact path
 * (SHARDSERVE_GGUF_ACTIVATIONS=fp32).
 *
 * Paths, picked per call by `isa`: 0 scalar C, 1 AVX2 (2, AVX-512 without VNNI, takes it too: wider
 * byte multiplies would halve the instruction count, not the bytes read), 3 AVX-512 VNNI on 256-bit
 * vectors. Batch invariance: x's rows are quantized one by one, and y[m, n] is one fixed sequence
 * of operations (integer sums are exact; the float steps go block by block) whatever M is and
 * wherever row m sits; threads split only groups of weight rows.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* A K-quant group-block: one 256-value super-block of 8 rows (offsets; see the layout above). */
enum {
    K_D = 0, K_DMIN = 16, K_SC = 32, K_MN = 96, Q4K_QS = 160, Q4K_BYTES = 1184,   /* Q4_K */
    Q5K_QH = 160, Q5K_QS = 416, Q5K_BYTES = 1440,                                  /* Q5_K (K_D .. K_MN too) */
    Q6K_SC = 16, Q6K_Q = 144, Q6K_BYTES = 1680,                                      /* Q6_K (K_D too) */
};
/* Q6_K's values in the order the kernels read them: per half h of the super-block, ql's chunks
 * 16h..16h + 7, qh's chunks 8h..8h + 7, ql's chunks 16h + 8..16h + 15 (see the layout above). */
#define Q6K_QL(k) (Q6K_Q + 768 * ((k) / 16) + 512 * (((k) / 8) % 2) + 32 * ((k) % 8))
#define Q6K_QH(k) (Q6K_Q + 768 * ((k) / 8) + 256 + 32 * ((k) % 8))

#define AI static inline __attribute__((always_inline))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

float gguf_half_to_float(const uint8_t *p);   /* quant_ops.c */
void gguf_k_scale_min(const uint8_t *s, int j, int *sc, int *mn);   /* quant_ops.c: Q4_K / Q5_K's 6-bit pairs */

/* Bytes of one block of one row in the file, and where its values start; 0 for other types. */
static int block_bytes(int type, int *values_at) {
    *values_at = type == Q4_1 ? 4 : 2;
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 0;
}

static int is_k(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* Values per block of the file (32, or 256 for a K-quant super-block) and the bytes of one block of
 * a group of 8 rows as gguf_repack8 writes it; 0 for other types. */
static int group_block(int type, int *values) {
    int at;
    *values = is_k(type) ? 256 : 32;
    switch (type) {
    case Q4_K: return Q4K_BYTES;
    case Q5_K: return Q5K_BYTES;
    case Q6_K: return Q6K_BYTES;
    default: return 8 * block_bytes(type, &at);
    }
}

/* One row's super-block `src` (the file's bytes) into row r of group-block `dst`. */
static void repack_k(int type, const uint8_t *src, uint8_t *dst, int r) {
    if (type == Q6_K) {   /* ql[128], qh[64], scales[16], d */
        memcpy(dst + K_D + 2 * r, src + 208, 2);
        for (int s = 0; s < 16; s++) dst[Q6K_SC + 8 * s + r] = src[192 + s];
        for (int c = 0; c < 32; c++) memcpy(dst + Q6K_QL(c) + 4 * r, src + 4 * c, 4);
        for (int c = 0; c < 16; c++) memcpy(dst + Q6K_QH(c) + 4 * r, src + 128 + 4 * c, 4);
        return;
    }
    /* d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: qh[32],) qs[128] */
    memcpy(dst + K_D + 2 * r, src, 2);
    memcpy(dst + K_DMIN + 2 * r, src + 2, 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        gguf_k_scale_min(src + 4, j, &sc, &mn);
        dst[K_SC + 8 * j + r] = (uint8_t)sc;
        dst[K_MN + 8 * j + r] = (uint8_t)mn;
    }
    const int qs = type == Q4_K ? Q4K_QS : Q5K_QS;
    if (type == Q5_K)
        for (int c = 0; c < 8; c++) memcpy(dst + Q5K_QH + 32 * c + 4 * r, src + 16 + 4 * c, 4);
    for (int c = 0; c < 32; c++) memcpy(dst + qs + 32 * c + 4 * r, src + (type == Q4_K ? 16 : 48) + 4 * c, 4);
}

/* The unsigned integer of value i (0..31) of x-block j (0..7) of row r in a K group-block: Q4_K
 * 0..15, Q5_K 0..31, Q6_K 0..63 (its weight is q - 32). */
static int k_value(int type, const uint8_t *gb, int r, int j, int i) {
    const int c = i / 4, t = i % 4;
    if (type == Q6_K) {
        const int lo = (gb[Q6K_QL(16 * (j / 4) + 8 * (j % 2) + c) + 4 * r + t] >> (4 * ((j % 4) / 2))) & 15;
        const int hi = (gb[Q6K_QH(8 * (j / 4) + c) + 4 * r + t] >> (2 * (j % 4))) & 3;
        return lo | hi << 4;
    }
    int q = (gb[(type == Q4_K ? Q4K_QS : Q5K_QS) + 256 * (j / 2) + 32 * c + 4 * r + t] >> (4 * (j & 1))) & 15;
    if (type == Q5_K) q |= ((gb[Q5K_QH + 32 * c + 4 * r + t] >> j) & 1) << 4;
    return q;
}

/* File rows [N][nb blocks] -> groups of 8 rows (see the layout above); `out` holds
 * ceil(N / 8) * nb * group_block(type) bytes. Returns -1 for a type this file does not multiply. */
int gguf_repack8(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    int at = 2, unit;
    const int bytes = is_k(type) ? (type == Q4_K ? 144 : type == Q5_K ? 176 : 210) : block_bytes(type, &at);
    const int gbytes = group_block(type, &unit), chunks = type == Q8_0 ? 8 : 4, scales = at / 2;
    if (!gbytes || K % unit)
        return -1;
    const int64_t nb = K / unit, groups = (N + 7) / 8;
    memset(out, 0, (size_t)(groups * nb * gbytes));
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (g * nb + b) * gbytes;
            for (int r = 0; r < 8 && g * 8 + r < N; r++) {
                const uint8_t *src = w + ((g * 8 + r) * nb + b) * bytes;
                if (is_k(type)) {
                    repack_k(type, src, dst, r);
                    continue;
                }
                for (int s = 0; s < scales; s++) memcpy(dst + 16 * s + 2 * r, src + 2 * s, 2);
                for (int c = 0; c < chunks; c++) memcpy(dst + 16 * scales + 32 * c + 4 * r, src + at + 4 * c, 4);
            }
        }
    return 0;
}

/* Row r of K group-block gb expanded to fp32 (256 values) as quant_ops.c's expansion does it. */
static void rows_k(int type, const uint8_t *gb, int r, float *o) {
    const float d = gguf_half_to_float(gb + K_D + 2 * r);
    for (int j = 0; j < 8; j++) {
        if (type == Q6_K) {
            for (int i = 0; i < 32; i++)
                o[32 * j + i] = (d * (float)(int8_t)gb[Q6K_SC + 8 * (2 * j + i / 16) + r]) *
                                (float)(k_value(type, gb, r, j, i) - 32);
            continue;
        }
        const float ds = d * (float)gb[K_SC + 8 * j + r];
        const float dm = gguf_half_to_float(gb + K_DMIN + 2 * r) * (float)gb[K_MN + 8 * j + r];
        for (int i = 0; i < 32; i++) o[32 * j + i] = ds * (float)k_value(type, gb, r, j, i) - dm;
    }
}

/* Rows `ids` of a regrouped weight expanded to fp32 [n][K] (an embedding lookup), with the values
 * quant_ops.c's expansion gives: (q - 8) d, q d + m, q d, and the K-quants' (rows_k). Returns -1
 * for another type. */
int gguf_rows8(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t n, float *out) {
    int at = 2, unit;
    const int bytes = block_bytes(type, &at), qs = 8 * at, gbytes = group_block(type, &unit);
    if (!gbytes || K % unit)
        return -1;
    const int64_t nb = K / unit;
#pragma omp parallel for schedule(static) if (n * K > 65536)
    for (int64_t j = 0; j < n; j++) {
        const int r = (int)(ids[j] % 8);
        if (is_k(type)) {
            for (int64_t b = 0; b < nb; b++) rows_k(type, w + ((ids[j] / 8) * nb + b) * gbytes, r, out + j * K + 256 * b);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((ids[j] / 8) * nb + b) * 8 * bytes;
            const float d = gguf_half_to_float(blk + 2 * r), m = type == Q4_1 ? gguf_half_to_float(blk + 16 + 2 * r) : 0;
            float *o = out + j * K + 32 * b;
            for (int c = 0; c < (type == Q8_0 ? 8 : 4); c++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t v = blk[qs + 32 * c + 4 * r + t];
                    if (type == Q8_0) {
                        o[4 * c + t] = (float)(int8_t)v * d;
                    } else if (type == Q4_0) {
                        o[4 * c + t] = (float)((v & 15) - 8) * d;
                        o[16 + 4 * c + t] = (float)((v >> 4) - 8) * d;
                    } else {
                        o[4 * c + t] = (float)(v & 15) * d + m;
                        o[16 + 4 * c + t] = (float)(v >> 4) * d + m;
                    }
                }
        }
    }
    return 0;
}

/* ---- quantizing x --------------------------------------------------------------------------------- */

/* x quantized: per row m and block b, 32 int8 values, the scale, the scaled sum (Q4_1's min term)
 * and the integer correction (0 where none). */
typedef struct {
    int8_t *q;     /* [M][K] */
    int8_t *q2;    /* [M][K] the second level (levels == 2), else NULL */
    float *d;      /* [M][nb] the scale of one unit of the (combined) integer value */
    float *s;      /* [M][nb] d * sum of the block's (combined) values */
    int32_t *c;    /* [M][nb] */
    int32_t *c16;  /* [M][nb][2] Q6_K: -32 times the (combined) sum of each half-block of 16 */
    int64_t K, nb;
    int levels;
} Acts;

/* Two levels: x = d1 q1 + d2 q2 with d1 = amax / 127 and d2 = d1 / 254 (q2 rounds the residual
 * x - d1 q1, at most d1 / 2, to +-127), so x ~ d2 (254 q1 + q2): 16-bit precision from 8-bit
 * multiplies. The kernels compute 254 * dot(w, q1) + dot(w, q2) in integers. */
#define L2_UNITS 32258.0f   /* 127 * 254 */

static void quantize_row_c(const float *x, int64_t nb, int8_t *q, int8_t *q2, float *d, int32_t *sum) {
    for (int64_t b = 0; b < nb; b++, x += 32, q += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f, d1 = amax / 127.0f;
        const float id2 = amax > 0.0f ? L2_UNITS / amax : 0.0f;
        int s = 0;
        for (int i = 0; i < 32; i++) {
            const int v = (int)nearbyintf(x[i] * id);   /* the default rounding: to nearest, ties even */
            q[i] = (int8_t)v;
            if (q2) {
                int v2 = (int)nearbyintf((x[i] - (float)v * d1) * id2);
                v2 = v2 > 127 ? 127 : v2 < -127 ? -127 : v2;
                q2[32 * b + i] = (int8_t)v2;
                s += 254 * v + v2;
            } else {
                s += v;
            }
        }
        d[b] = q2 ? amax / L2_UNITS : d1;
        sum[b] = s;
    }
}

/* The same values as quantize_row_c (the same IEEE operations; vcvtps2dq rounds to nearest even). */
AVX2_TARGET AI __m256i pack_bytes(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    /* packs work per 128-bit lane: the dwords come out as 0-3 of i0, i1, i2, i3, then 4-7 of each. */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX2_TARGET AI int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The second level of 8 values with first level i (see quantize_row_c). */
AVX2_TARGET AI __m256i level2(__m256 v, __m256i i, __m256 d1, __m256 id2) {
    const __m256i j = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(i), d1)), id2));
    return _mm256_min_epi32(_mm256_max_epi32(j, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
}

AVX2_TARGET static void quantize_row_avx2(const float *x, int64_t nb, int8_t *q, int8_t *q2, float *d, int32_t *sum) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < nb; b++, x += 32, q += 32) {
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
                     v3 = _mm256_loadu_ps(x + 24);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs), _mm256_and_ps(v1, abs)),
                                       _mm256_max_ps(_mm256_and_ps(v2, abs), _mm256_and_ps(v3, abs)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        const float amax = _mm_cvtss_f32(m);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id)),
                      i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
        _mm256_storeu_si256((__m256i *)q, pack_bytes(i0, i1, i2, i3));
        int32_t s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
        if (q2) {
            const __m256 d1 = _mm256_set1_ps(amax / 127.0f), id2 = _mm256_set1_ps(amax > 0.0f ? L2_UNITS / amax : 0.0f);
            const __m256i j0 = level2(v0, i0, d1, id2), j1 = level2(v1, i1, d1, id2), j2 = level2(v2, i2, d1, id2),
                          j3 = level2(v3, i3, d1, id2);
            _mm256_storeu_si256((__m256i *)(q2 + 32 * b), pack_bytes(j0, j1, j2, j3));
            s = 254 * s + hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(j0, j1), _mm256_add_epi32(j2, j3)));
        }
        d[b] = q2 ? amax / L2_UNITS : amax / 127.0f;
        sum[b] = s;
    }
}

static void quantize_x(int isa, int type, const float *x, int64_t ldx, int64_t m, const Acts *a) {
    const int64_t o = m * a->nb;
    int8_t *q2 = a->levels == 2 ? a->q2 + m * a->K : 0;
    if (isa >= 1)
        quantize_row_avx2(x + m * ldx, a->nb, a->q + m * a->K, q2, a->d + o, a->c + o);
    else
        quantize_row_c(x + m * ldx, a->nb, a->q + m * a->K, q2, a->d + o, a->c + o);
    /* c holds the sums until here; the weights' offset makes them the correction. */
    const int offset = type == Q4_0 ? 8 : (type == Q8_0 && isa == 3 ? 128 : 0);
    for (int64_t b = o; b < o + a->nb; b++) {
        a->s[b] = a->d[b] * (float)a->c[b];
        a->c[b] *= -offset;
    }
    if (type != Q6_K)
        return;
    /* Q6_K multiplies q = w + 32 (unsigned): each 16-value half (its own scale) takes -32 sum x. */
    const int8_t *q = a->q + m * a->K;
    for (int64_t h = 0; h < 2 * a->nb; h++) {
        int s1 = 0, s2 = 0;
        for (int i = 0; i < 16; i++) {
            s1 += q[16 * h + i];
            if (q2) s2 += q2[16 * h + i];
        }
        a->c16[2 * o + h] = -32 * (q2 ? 254 * s1 + s2 : s1);
    }
}

/* ---- scalar: one weight row r of group `grp` times row m of x ------------------------------------ */

static float dot_scalar(int type, const uint8_t *grp, int bytes, int r, const Acts *a, int64_t m) {
    const int qs = type == Q4_1 ? 32 : 16;
    float acc = 0.0f, macc = 0.0f;
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = grp + b * 8 * bytes;
        const int64_t i = m * a->nb + b;
        int dot = 0;
        for (int level = 0; level < a->levels; level++) {
            const int8_t *x = (level ? a->q2 : a->q) + m * a->K + 32 * b;
            int part = 0;
            for (int c = 0; c < (type == Q8_0 ? 8 : 4); c++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t v = blk[qs + 32 * c + 4 * r + t];
                    if (type == Q8_0)
                        part += (int8_t)v * x[4 * c + t];
                    else
                        part += ((v & 15) - (type == Q4_0 ? 8 : 0)) * x[4 * c + t] +
                                ((v >> 4) - (type == Q4_0 ? 8 : 0)) * x[16 + 4 * c + t];
                }
            dot = 254 * dot + part;
        }
        acc += (gguf_half_to_float(blk + 2 * r) * a->d[i]) * (float)dot;
        if (type == Q4_1) macc += gguf_half_to_float(blk + 16 + 2 * r) * a->s[i];
    }
    return acc + macc;
}

/* K-quants: per x-block j of a super-block, Q4_K / Q5_K as Q4_1 with scale d sc_j and min -dmin mn_j;
 * Q6_K two halves of 16 with scales d sc (signed q - 32 here; the vector paths take q and c16). */
static float dot_scalar_k(int type, const uint8_t *grp, int r, const Acts *a, int64_t m) {
    const int gbytes = type == Q4_K ? Q4K_BYTES : type == Q5_K ? Q5K_BYTES : Q6K_BYTES;
    float acc = 0.0f, macc = 0.0f;
    for (int64_t sb = 0; sb < a->nb / 8; sb++) {
        const uint8_t *gb = grp + sb * gbytes;
        const float d = gguf_half_to_float(gb + K_D + 2 * r);
        for (int j = 0; j < 8; j++) {
            const int64_t b = 8 * sb + j, i = m * a->nb + b;
            int dot[2] = {0, 0};
            for (int level = 0; level < a->levels; level++) {
                const int8_t *x = (level ? a->q2 : a->q) + m * a->K + 32 * b;
                int part[2] = {0, 0};
                for (int e = 0; e < 32; e++)
                    part[e / 16] += (k_value(type, gb, r, j, e) - (type == Q6_K ? 32 : 0)) * x[e];
                for (int h = 0; h < 2; h++) dot[h] = 254 * dot[h] + part[h];
            }
            if (type == Q6_K) {
                for (int h = 0; h < 2; h++)
                    acc += ((d * (float)(int8_t)gb[Q6K_SC + 8 * (2 * j + h) + r]) * a->d[i]) * (float)dot[h];
            } else {
                acc += ((d * (float)gb[K_SC + 8 * j + r]) * a->d[i]) * (float)(dot[0] + dot[1]);
                macc -= (gguf_half_to_float(gb + K_DMIN + 2 * r) * (float)gb[K_MN + 8 * j + r]) * a->s[i];
            }
        }
    }
    return acc + macc;
}

/* ---- AVX2 and VNNI: a group of 8 weight rows times MR (<= 4) rows of x ----------------------------- */

/* The 8 int32 lanes of one block: lane j = weight row j's dot product with x's block at xb. The
 * weight vectors w0..w7 are prepared once per block for all MR rows (see PREP_*). */
AVX2_TARGET AI __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* AVX2: u8 x s8 pairs summed to int16 (no overflow: |q| <= 15 or sign trick), then pairs to int32. */
AVX2_TARGET AI __m256i mul4_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

AVX2_TARGET AI __m256i dots_avx2(const int TYPE, const __m256i *w, const int8_t *xb, __m256i lo) {
    __m256i hi = _mm256_setzero_si256();
    if (TYPE == Q8_0) {   /* w holds |w|, x takes w's sign: w[4 + c] keeps the signed bytes */
        for (int c = 0; c < 8; c += 2) {
            lo = _mm256_add_epi32(lo, mul4_avx2(w[c / 2], _mm256_sign_epi8(bcast4(xb + 4 * c), w[4 + c / 2])));
            hi = _mm256_add_epi32(hi, mul4_avx2(w[8 + c / 2], _mm256_sign_epi8(bcast4(xb + 4 * c + 4), w[12 + c / 2])));
        }
    } else {
        for (int c = 0; c < 4; c++) {
            lo = _mm256_add_epi32(lo, mul4_avx2(w[c], bcast4(xb + 4 * c)));
            hi = _mm256_add_epi32(hi, mul4_avx2(w[4 + c], bcast4(xb + 16 + 4 * c)));
        }
    }
    return _mm256_add_epi32(lo, hi);
}

VNNI_TARGET AI __m256i dots_vnni(const int TYPE, const __m256i *w, const int8_t *xb, __m256i lo) {
    __m256i hi = _mm256_setzero_si256();
    if (TYPE == Q8_0) {
        for (int c = 0; c < 8; c += 2) {
            lo = _mm256_dpbusd_epi32(lo, w[c], bcast4(xb + 4 * c));
            hi = _mm256_dpbusd_epi32(hi, w[c + 1], bcast4(xb + 4 * c + 4));
        }
    } else {
        for (int c = 0; c < 4; c++) {
            lo = _mm256_dpbusd_epi32(lo, w[c], bcast4(xb + 4 * c));
            hi = _mm256_dpbusd_epi32(hi, w[4 + c], bcast4(xb + 16 + 4 * c));
        }
    }
    return _mm256_add_epi32(lo, hi);
}

/* With LV == 2 levels: 254 * dots(q1) + dots(q2), the correction added once. */
AVX2_TARGET AI __m256i block_avx2(const int TYPE, const int LV, const __m256i *w, const int8_t *xb, const int8_t *xb2,
                                  int32_t corr) {
    const __m256i c = TYPE == Q4_0 ? _mm256_set1_epi32(corr) : _mm256_setzero_si256();
    if (LV == 1) return dots_avx2(TYPE, w, xb, c);
    const __m256i first = dots_avx2(TYPE, w, xb, _mm256_setzero_si256());
    return dots_avx2(TYPE, w, xb2, _mm256_add_epi32(_mm256_mullo_epi32(first, _mm256_set1_epi32(254)), c));
}

VNNI_TARGET AI __m256i block_vnni(const int TYPE, const int LV, const __m256i *w, const int8_t *xb, const int8_t *xb2,
                                  int32_t corr) {
    const __m256i c = TYPE == Q4_1 ? _mm256_setzero_si256() : _mm256_set1_epi32(corr);
    if (LV == 1) return dots_vnni(TYPE, w, xb, c);
    const __m256i first = dots_vnni(TYPE, w, xb, _mm256_setzero_si256());
    return dots_vnni(TYPE, w, xb2, _mm256_add_epi32(_mm256_mullo_epi32(first, _mm256_set1_epi32(254)), c));
}

/* Weight vectors of a group-block: 4-bit types: w[0..3] low nibbles of chunks 0..3 (values 4c..4c+3),
 * w[4..7] high nibbles (values 16 + 4c..). Q8_0 on AVX2: w[0..3] |chunks 0, 2, 4, 6|, w[4..7] those
 * chunks signed, w[8..15] the same for chunks 1, 3, 5, 7; on VNNI: w[c] = chunk c + 128. */
AVX2_TARGET AI void prep_avx2(const int TYPE, const uint8_t *qs, __m256i *w) {
    if (TYPE == Q8_0) {
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            w[(c & 1) * 8 + c / 2] = _mm256_abs_epi8(v);
            w[(c & 1) * 8 + 4 + c / 2] = v;
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        w[c] = _mm256_and_si256(v, low);
        w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

VNNI_TARGET AI void prep_vnni(const int TYPE, const uint8_t *qs, __m256i *w) {
    if (TYPE == Q8_0) {
        for (int c = 0; c < 8; c++)
            w[c] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), _mm256_set1_epi8(-128));
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        w[c] = _mm256_and_si256(v, low);
        w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

/* Row r of the tile, one block: acc += float(dots) * (d_w * d_x); Q4_1: macc += m_w * (d_x sum x_q). */
#define ROW(r, BLOCK_FN)                                                                             \
    if (MR > r) {                                                                                    \
        const int64_t i = (m + r) * a->nb + b;                                                       \
        const int64_t at = (m + r) * a->K + 32 * b;                                                  \
        const __m256i dots = BLOCK_FN(TYPE, LV, w, a->q + at, LV == 2 ? a->q2 + at : 0, a->c[i]);    \
        acc##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(dw, _mm256_set1_ps(a->d[i])), acc##r); \
        if (TYPE == Q4_1) macc##r = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[i]), macc##r);          \
    }
#define STORE(r)                                                                                     \
    if (MR > r) {                                                                                    \
        __m256 out = _mm256_add_ps(acc##r, macc##r);                                                 \
        if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias8));                                  \
        if (cols == 8) _mm256_storeu_ps(y + (m + r) * ldy, out);                                     \
        else {                                                                                       \
            float tmp[8];                                                                            \
            _mm256_storeu_ps(tmp, out);                                                              \
            memcpy(y + (m + r) * ldy, tmp, sizeof(float) * cols);                                    \
        }                                                                                            \
    }
/* The accumulators are named variables, not arrays: gcc spills arrays of vectors to the stack. */
#define TILE(PREP_FN, BLOCK_FN, NW)                                                                  \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, macc0 = acc0, macc1 = acc0, \
           macc2 = acc0, macc3 = acc0, mw = acc0;                                                    \
    for (int64_t b = 0; b < a->nb; b++) {                                                            \
        const uint8_t *blk = grp + b * 8 * bytes;                                                    \
        __m256i w[NW];                                                                               \
        PREP_FN(TYPE, blk + (TYPE == Q4_1 ? 32 : 16), w);                                            \
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));                   \
        if (TYPE == Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));        \
        ROW(0, BLOCK_FN) ROW(1, BLOCK_FN) ROW(2, BLOCK_FN) ROW(3, BLOCK_FN)                          \
    }                                                                                                \
    float bias8[8] = {0};   /* the last group's bias, not read past its end */                     \
    if (bias) memcpy(bias8, bias, sizeof(float) * cols);                                             \
    STORE(0) STORE(1) STORE(2) STORE(3)

AVX2_TARGET AI void tile_avx2(const int MR, const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t m,
                              float *y, int64_t ldy, int cols, const float *bias) {
    TILE(prep_avx2, block_avx2, 16)
}

VNNI_TARGET AI void tile_vnni(const int MR, const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t m,
                              float *y, int64_t ldy, int cols, const float *bias) {
    TILE(prep_vnni, block_vnni, 8)
}

/* K-quants. A super-block's x-block j: w[c] holds values 4c..4c+3 of the 8 rows as unsigned bytes
 * (see k_value), and the 8 rows' dot products come out as two halves, values 0..15 (chunks 0..3)
 * and 16..31 (4..7): Q6_K scales each half on its own. With two levels, 254 (x << 8 - x << 1)
 * times the first level's dots plus the second's, the correction (Q6_K: c16) added once. */
AVX2_TARGET AI __m256i times254(__m256i v) { return _mm256_sub_epi32(_mm256_slli_epi32(v, 8), _mm256_slli_epi32(v, 1)); }

AVX2_TARGET AI void kdots_avx2(const __m256i *w, const int8_t *xb, __m256i *lo, __m256i *hi) {
    for (int c = 0; c < 4; c++) {
        *lo = _mm256_add_epi32(*lo, mul4_avx2(w[c], bcast4(xb + 4 * c)));
        *hi = _mm256_add_epi32(*hi, mul4_avx2(w[4 + c], bcast4(xb + 16 + 4 * c)));
    }
}

VNNI_TARGET AI void kdots_vnni(const __m256i *w, const int8_t *xb, __m256i *lo, __m256i *hi) {
    for (int c = 0; c < 4; c++) {
        *lo = _mm256_dpbusd_epi32(*lo, w[c], bcast4(xb + 4 * c));
        *hi = _mm256_dpbusd_epi32(*hi, w[4 + c], bcast4(xb + 16 + 4 * c));
    }
}

#define KBLOCK(NAME, TARGET, DOTS)                                                                   \
    TARGET AI void NAME(const int LV, const __m256i *w, const int8_t *xb, const int8_t *xb2, int32_t c0, int32_t c1, \
                        __m256i *lo, __m256i *hi) {                                                  \
        if (LV == 1) {                                                                               \
            *lo = _mm256_set1_epi32(c0);                                                             \
            *hi = _mm256_set1_epi32(c1);                                                             \
            DOTS(w, xb, lo, hi);                                                                     \
            return;                                                                                  \
        }                                                                                            \
        *lo = *hi = _mm256_setzero_si256();                                                          \
        DOTS(w, xb, lo, hi);                                                                         \
        *lo = _mm256_add_epi32(times254(*lo), _mm256_set1_epi32(c0));                                \
        *hi = _mm256_add_epi32(times254(*hi), _mm256_set1_epi32(c1));                                \
        DOTS(w, xb2, lo, hi);                                                                        \
    }
KBLOCK(kblock_avx2, AVX2_TARGET, kdots_avx2)
KBLOCK(kblock_vnni, VNNI_TARGET, kdots_vnni)
#undef KBLOCK

/* The weight bytes of two x-blocks of group-block gb, ja into wa and jb into wb (kpair says which),
 * from one load of the chunks they share (the same instructions on both paths). */
#define KPREP(NAME, TARGET)                                                                          \
    TARGET AI void NAME(const int TYPE, const uint8_t *gb, int p, __m256i *wa, __m256i *wb) {        \
        const __m256i low = _mm256_set1_epi8(15);                                                    \
        if (TYPE == Q6_K) {   /* p = 2h + s: x-blocks 4h + s (low nibbles) and 4h + s + 2 (high) */  \
            const int h = p / 2, s = p % 2;                                                          \
            const uint8_t *ql = gb + Q6K_QL(16 * h + 8 * s), *qh = gb + Q6K_QH(8 * h);              \
            const __m256i three = _mm256_set1_epi8(3);                                               \
            for (int c = 0; c < 8; c++) {                                                            \
                const __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 32 * c));                \
                const __m256i u = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qh + 32 * c)), 2 * s); \
                wa[c] = _mm256_or_si256(_mm256_and_si256(l, low), _mm256_slli_epi16(_mm256_and_si256(u, three), 4)); \
                wb[c] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), low),              \
                                        _mm256_and_si256(u, _mm256_set1_epi8(48)));                  \
            }                                                                                        \
            return;                                                                                  \
        }                                                                                            \
        /* Q4_K / Q5_K: x-blocks 2p (low nibbles) and 2p + 1 (high) */                               \
        const uint8_t *qs = gb + (TYPE == Q4_K ? Q4K_QS : Q5K_QS) + 256 * p;                         \
        for (int c = 0; c < 8; c++) {                                                                \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));                    \
            wa[c] = _mm256_and_si256(v, low);                                                        \
            wb[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                                  \
            if (TYPE == Q5_K) {   /* fifth bits 2p and 2p + 1 of each byte, to bit 4 */              \
                const __m256i u = _mm256_loadu_si256((const __m256i *)(gb + Q5K_QH + 32 * c));       \
                const __m256i sixteen = _mm256_set1_epi8(16);                                        \
                wa[c] = _mm256_or_si256(wa[c], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(u, 2 * p), 4), sixteen)); \
                wb[c] = _mm256_or_si256(wb[c], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(u, 2 * p + 1), 4), sixteen)); \
            }                                                                                        \
        }                                                                                            \
    }
KPREP(kprep_avx2, AVX2_TARGET)
KPREP(kprep_vnni, VNNI_TARGET)
#undef KPREP

/* The 8 rows' scale vectors as fp32: d * byte (Q4_K / Q5_K unsigned 6-bit, Q6_K signed int8). */
AVX2_TARGET AI __m256 kscale(__m256 d, const uint8_t *p, int is_signed) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)));
}

/* Row r of the tile, x-block b: acc += float(dots) * (d sc * d_x) (Q6_K: per half), macc -= dmin mn * (d_x sum x_q). */
#define KROW(r, BLOCK_FN)                                                                            \
    if (MR > r) {                                                                                    \
        const int64_t i = (m + r) * a->nb + b;                                                       \
        const int64_t at = (m + r) * a->K + 32 * b;                                                  \
        __m256i lo, hi;                                                                              \
        BLOCK_FN(LV, w, a->q + at, LV == 2 ? a->q2 + at : 0, TYPE == Q6_K ? a->c16[2 * i] : 0,      \
                 TYPE == Q6_K ? a->c16[2 * i + 1] : 0, &lo, &hi);                                    \
        const __m256 dx = _mm256_set1_ps(a->d[i]);                                                   \
        if (TYPE == Q6_K) {                                                                          \
            acc##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(ds, dx), acc##r);         \
            acc##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(dm, dx), acc##r);         \
        } else {                                                                                     \
            acc##r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_mul_ps(ds, dx), acc##r); \
            macc##r = _mm256_fnmadd_ps(dm, _mm256_set1_ps(a->s[i]), macc##r);                        \
        }                                                                                            \
    }
/* x-block j of the super-block with weight vectors w. ds, dm: Q4_K / Q5_K the x-block's d sc and
 * dmin mn; Q6_K its two halves' d sc. */
#define KSTEP(J, W, BLOCK_FN)                                                                        \
    {                                                                                                \
        const int j = J;                                                                             \
        const __m256i *w = W;                                                                        \
        const int64_t b = 8 * sb + j;                                                                \
        const __m256 ds = TYPE == Q6_K ? kscale(d, gb + Q6K_SC + 16 * j, 1) : kscale(d, gb + K_SC + 8 * j, 0); \
        const __m256 dm = TYPE == Q6_K ? kscale(d, gb + Q6K_SC + 16 * j + 8, 1) : kscale(dmin, gb + K_MN + 8 * j, 0); \
        KROW(0, BLOCK_FN) KROW(1, BLOCK_FN) KROW(2, BLOCK_FN) KROW(3, BLOCK_FN)                      \
    }
#define KTILE(PREP_FN, BLOCK_FN)                                                                     \
    const int gbytes = TYPE == Q4_K ? Q4K_BYTES : TYPE == Q5_K ? Q5K_BYTES : Q6K_BYTES;              \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, macc0 = acc0, macc1 = acc0, \
           macc2 = acc0, macc3 = acc0;                                                               \
    (void)bytes;                                                                                     \
    for (int64_t sb = 0; sb < a->nb / 8; sb++) {                                                     \
        const uint8_t *gb = grp + sb * gbytes;                                                       \
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + K_D)));             \
        const __m256 dmin = TYPE == Q6_K ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + K_DMIN))); \
        for (int p = 0; p < 4; p++) {                                                                \
            __m256i wa[8], wb[8];                                                                    \
            PREP_FN(TYPE, gb, p, wa, wb);                                                            \
            KSTEP(TYPE == Q6_K ? 4 * (p / 2) + p % 2 : 2 * p, wa, BLOCK_FN)                          \
            KSTEP(TYPE == Q6_K ? 4 * (p / 2) + p % 2 + 2 : 2 * p + 1, wb, BLOCK_FN)                  \
        }                                                                                            \
    }                                                                                                \
    float bias8[8] = {0};                                                                            \
    if (bias) memcpy(bias8, bias, sizeof(float) * cols);                                             \
    STORE(0) STORE(1) STORE(2) STORE(3)

AVX2_TARGET AI void ktile_avx2(const int MR, const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a,
                               int64_t m, float *y, int64_t ldy, int cols, const float *bias) {
    KTILE(kprep_avx2, kblock_avx2)
}

VNNI_TARGET AI void ktile_vnni(const int MR, const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a,
                               int64_t m, float *y, int64_t ldy, int cols, const float *bias) {
    KTILE(kprep_vnni, kblock_vnni)
}

#undef KROW
#undef KSTEP
#undef KTILE
#undef ROW
#undef STORE
#undef TILE

/* All M rows of x times one group: tiles of 4 rows, then the rest (constant MR and TYPE each). */
#define GROUP(TILE_FN)                                                                              \
    int64_t m = 0;                                                                                  \
    for (; m + 4 <= M; m += 4) TILE_FN(4, TYPE, LV, grp, bytes, a, m, y, ldy, cols, bias);              \
    switch (M - m) {                                                                                \
    case 3: TILE_FN(3, TYPE, LV, grp, bytes, a, m, y, ldy, cols, bias); break;                          \
    case 2: TILE_FN(2, TYPE, LV, grp, bytes, a, m, y, ldy, cols, bias); break;                          \
    case 1: TILE_FN(1, TYPE, LV, grp, bytes, a, m, y, ldy, cols, bias); break;                          \
    default: break;                                                                                 \
    }

AVX2_TARGET AI void group_avx2(const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                               int64_t ldy, int cols, const float *bias) {
    GROUP(tile_avx2)
}

VNNI_TARGET AI void group_vnni(const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                               int64_t ldy, int cols, const float *bias) {
    GROUP(tile_vnni)
}

AVX2_TARGET AI void kgroup_avx2(const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                                int64_t ldy, int cols, const float *bias) {
    GROUP(ktile_avx2)
}

VNNI_TARGET AI void kgroup_vnni(const int TYPE, const int LV, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                                int64_t ldy, int cols, const float *bias) {
    GROUP(ktile_vnni)
}

#undef GROUP

AVX2_TARGET static void any_group_avx2(int type, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                                       int64_t ldy, int cols, const float *bias) {
    const int two = a->levels == 2;
    if (type == Q4_0) two ? group_avx2(Q4_0, 2, grp, bytes, a, M, y, ldy, cols, bias)
                          : group_avx2(Q4_0, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q4_1) two ? group_avx2(Q4_1, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : group_avx2(Q4_1, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q8_0) two ? group_avx2(Q8_0, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : group_avx2(Q8_0, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q4_K) two ? kgroup_avx2(Q4_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : kgroup_avx2(Q4_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q5_K) two ? kgroup_avx2(Q5_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : kgroup_avx2(Q5_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else two ? kgroup_avx2(Q6_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
             : kgroup_avx2(Q6_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
}

VNNI_TARGET static void any_group_vnni(int type, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                                       int64_t ldy, int cols, const float *bias) {
    const int two = a->levels == 2;
    if (type == Q4_0) two ? group_vnni(Q4_0, 2, grp, bytes, a, M, y, ldy, cols, bias)
                          : group_vnni(Q4_0, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q4_1) two ? group_vnni(Q4_1, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : group_vnni(Q4_1, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q8_0) two ? group_vnni(Q8_0, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : group_vnni(Q8_0, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q4_K) two ? kgroup_vnni(Q4_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : kgroup_vnni(Q4_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else if (type == Q5_K) two ? kgroup_vnni(Q5_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
                               : kgroup_vnni(Q5_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
    else two ? kgroup_vnni(Q6_K, 2, grp, bytes, a, M, y, ldy, cols, bias)
             : kgroup_vnni(Q6_K, 1, grp, bytes, a, M, y, ldy, cols, bias);
}

/* ---- entry point ---------------------------------------------------------------------------------- */

/* One group of weight rows times all M rows of x into y[:, 0..cols) (row stride ldy). */
static void one_group(int isa, int type, const uint8_t *grp, int bytes, const Acts *a, int64_t M, float *y,
                      int64_t ldy, int cols, const float *b) {
    if (isa == 3)
        any_group_vnni(type, grp, bytes, a, M, y, ldy, cols, b);
    else if (isa >= 1)
        any_group_avx2(type, grp, bytes, a, M, y, ldy, cols, b);
    else
        for (int64_t m = 0; m < M; m++)
            for (int r = 0; r < cols; r++) {
                const float s = is_k(type) ? dot_scalar_k(type, grp, r, a, m) : dot_scalar(type, grp, bytes, r, a, m);
                y[m * ldy + r] = b ? s + b[r] : s;
            }
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias[N]), W repacked by gguf_repack8,
 * x quantized to `levels` (1 or 2) int8 levels. isa: 0 scalar, 1 or 2 AVX2, 3 AVX-512 VNNI (the
 * caller checks the CPU has it). gated: W is a merged [gate; up] pair of N / 2 rows each (N / 2 a
 * multiple of 8, no bias) and y[M, N / 2] = silu(x W_gate^T) * (x W_up^T), the two groups of each
 * output computed by one thread (the MLP without a pass over the [M, N] product). Returns -1 for a
 * type other than Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K, K not a multiple of its block, levels
 * not 1 or 2 or a gated N that does not split into groups, -2 when out of memory. */
/* Acts for M rows of K values in one allocation (free(acts.q) releases it), or q == NULL. */
static Acts acts_alloc(int64_t M, int64_t K, int levels) {
    const int64_t nb = K / 32;
    Acts a = {.K = K, .nb = nb, .levels = levels};
    char *mem = malloc((size_t)(levels * M * K + M * nb * 20));
    if (!mem)
        return a;
    a.q = (int8_t *)mem;
    a.q2 = levels == 2 ? a.q + M * K : 0;
    a.d = (float *)(mem + levels * M * K);
    a.s = a.d + M * nb;
    a.c = (int32_t *)(a.s + M * nb);
    a.c16 = a.c + M * nb;
    return a;
}

int gguf_linear_q8(int isa, int type, int levels, int gated, const float *x, int64_t ldx, const uint8_t *w,
                   const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    int unit;
    const int gbytes = group_block(type, &unit), bytes = gbytes / 8;   /* bytes: a row's block (32-value types) */
    if (!gbytes || K % unit || (levels != 1 && levels != 2) || (gated && (N % 16 || bias)))
        return -1;
    const int64_t wblocks = K / unit, groups = gated ? N / 16 : (N + 7) / 8, up = gated ? N / 16 : 0;
    Acts a = acts_alloc(M, K, levels);
    if (!a.q)
        return -2;
    int failed = 0;
#pragma omp parallel if (M * N * K > 65536)
    {
        float *pair = gated ? malloc(sizeof(float) * 16 * M) : 0;   /* a gate group's and its up group's outputs */
        if (gated && !pair) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_x(isa, type, x, ldx, m, &a);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *grp = w + g * wblocks * gbytes;
            if (!gated) {
                const int cols = N - 8 * g < 8 ? (int)(N - 8 * g) : 8;
                one_group(isa, type, grp, bytes, &a, M, y + 8 * g, ldy, cols, bias ? bias + 8 * g : 0);
            } else if (pair) {
                one_group(isa, type, grp, bytes, &a, M, pair, 16, 8, 0);
                one_group(isa, type, grp + up * wblocks * gbytes, bytes, &a, M, pair + 8, 16, 8, 0);
                for (int64_t m = 0; m < M; m++)
                    for (int j = 0; j < 8; j++) {
                        const float v = pair[16 * m + j];
                        y[m * ldy + 8 * g + j] = v / (1.0f + expf(-v)) * pair[16 * m + 8 + j];
                    }
            }
        }
        free(pair);
    }
    free(a.q);
    return failed ? -2 : 0;
}

/* ---- a MoE layer's experts in one call ------------------------------------------------------------ */

/* Row m of `a` as a one-row Acts (the group kernels address rows from their Acts). */
static Acts acts_row(const Acts *a, int64_t m) {
    Acts r = *a;
    r.q = a->q + m * a->K;
    r.q2 = a->q2 ? a->q2 + m * a->K : 0;
    r.d = a->d + m * a->nb;
    r.s = a->s + m * a->nb;
    r.c = a->c + m * a->nb;
    r.c16 = a->c16 + 2 * m * a->nb;
    return r;
}

/* y[T, H] = sum over each token's picks, in ascending expert id, of weight * down(silu(gate) * up)
 * for experts kept as gguf_linear_q8 weights: w13 (gate rows then up rows, 2I of H inputs) and w2
 * (H rows of I inputs) regrouped by gguf_repack8, expert e's at w13 + e * w13_bytes and w2 + e *
 * w2_bytes. ids / weights: [T, top_k] picks (int64; -1: an expert held elsewhere, skipped) and their
 * fp32 routing weights. x is quantized once per token, each pick's activation once; every (pick,
 * 8-row group) is one task of one parallel region. Per pick, the same operations as gguf_linear_q8
 * gated then plain on that pick's row, and the sum is torch_moe.fused_moe's (zero, then each
 * expert's y * weight added in expert order): the same bits as one call per expert, batch invariant.
 * Returns -1 for shapes or types the kernels do not take, -2 when out of memory. */
int gguf_moe_q8(int isa, int type13, int type2, int levels, const float *x, int64_t T, int64_t H, int64_t I,
                const int64_t *ids, const float *weights, int64_t top_k, const uint8_t *w13, int64_t w13_bytes,
                const uint8_t *w2, int64_t w2_bytes, float *y) {
    int unit13, unit2;
    const int gb13 = group_block(type13, &unit13), gb2 = group_block(type2, &unit2);
    if (!gb13 || !gb2 || H % unit13 || I % unit2 || I % 8 || (levels != 1 && levels != 2))
        return -1;
    const int64_t P = T * top_k, groups13 = I / 8, groups2 = (H + 7) / 8;
    const int64_t wb13 = H / unit13, wb2 = I / unit2;
    Acts ax = acts_alloc(T, H, levels), aa = acts_alloc(P, I, levels);
    float *act = malloc(sizeof(float) * P * I), *out = malloc(sizeof(float) * P * H);
    int failed = !ax.q || !aa.q || !act || !out;
#pragma omp parallel if (!failed && P * (2 * I * H + H * I) > 65536)
    if (!failed) {
        float pair[16];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize_x(isa, type13, x, H, t, &ax);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < P * groups13; task++) {
            const int64_t p = task / groups13, g = task % groups13, e = ids[p];
            if (e < 0)
                continue;
            const Acts row = acts_row(&ax, p / top_k);
            const uint8_t *grp = w13 + e * w13_bytes + g * wb13 * gb13;
            one_group(isa, type13, grp, gb13 / 8, &row, 1, pair, 16, 8, 0);
            one_group(isa, type13, grp + groups13 * wb13 * gb13, gb13 / 8, &row, 1, pair + 8, 16, 8, 0);
            for (int j = 0; j < 8; j++) {
                const float v = pair[j];
                act[p * I + 8 * g + j] = v / (1.0f + expf(-v)) * pair[8 + j];
            }
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++)
            if (ids[p] >= 0)
                quantize_x(isa, type2, act, I, p, &aa);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < P * groups2; task++) {
            const int64_t p = task / groups2, g = task % groups2, e = ids[p];
            if (e < 0)
                continue;
            const Acts row = acts_row(&aa, p);
            const int cols = H - 8 * g < 8 ? (int)(H - 8 * g) : 8;
            one_group(isa, type2, w2 + e * w2_bytes + g * wb2 * gb2, gb2 / 8, &row, 1, out + p * H + 8 * g, H, cols,
                      0);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *yt = y + t * H;
            for (int64_t h = 0; h < H; h++) yt[h] = 0.0f;
            int64_t done = -1;   /* the last expert id added: picks are added in ascending id */
            for (int64_t n = 0; n < top_k; n++) {
                int64_t best = -1;
                for (int64_t j = 0; j < top_k; j++) {
                    const int64_t e = ids[t * top_k + j];
                    if (e > done && (best < 0 || e < ids[t * top_k + best]))
                        best = j;
                }
                if (best < 0)
                    break;
                const int64_t p = t * top_k + best;
                done = ids[p];
                const float w = weights[p];
                for (int64_t h = 0; h < H; h++) yt[h] += out[p * H + h] * w;
            }
        }
    }
    free(ax.q);
    free(aa.q);
    free(act);
    free(out);
    return failed ? -2 : 0;
}
