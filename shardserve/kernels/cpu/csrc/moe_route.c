/* A MoE layer's routing with torch's bits: softmax over the experts, the top-k and (renormalize)
 * the picks' weights divided by their sum, as kernels/moe/reference.py's route_topk computes them
 * with torch.softmax, torch.topk and torch.sum on the CPU. The decoder stack (decoder_stack.c)
 * routes in C so a MoE layer needs no Python; the module path stays the oracle, so every float
 * operation here is the one torch does, in torch's order:
 *
 * - softmax (ATen's vectorized last-dim kernel): m = max of the row; e_i = exp(x_i - m) by torch's
 *   own vector exp (Sleef's, handed in as a function pointer: kernels/cpu/moe_route.py finds it in
 *   libtorch_cpu), p_i = e_i * (1 / sum). The sum runs in `lanes` accumulators (torch's vector
 *   width: 16 under its AVX-512 kernels, 8 under AVX2): lane j adds e_j, e_{j+lanes}, ... in turn,
 *   the last partial vector into the first lanes, and the lanes fold pairwise (j + lanes / 2 into
 *   j, halving); a row shorter than one vector is summed left to right.
 * - top-k: the k largest, largest first. Equal weights are interchangeable downstream (the experts
 *   kernel adds picks in expert order, weight by weight), except a tie across the k-th place: which
 *   expert torch keeps there is decided by its selection algorithm, so such rows (and rows with a
 *   NaN) are handed to a callback that asks torch.topk itself (kernels/cpu/moe_route.py).
 * - renormalize: torch.sum over the k picks (its AVX2 reduction, 8-wide vectors, in every build):
 *   under 8 picks, four accumulators taking every fourth pick, the picks past the last four added
 *   to the first, then the four folded left to right; 8 and more, the same over whole vectors of 8,
 *   then the leftover picks and the 8 lanes added to a scalar left to right.
 *
 * kernels/cpu/moe_route.py checks these bits against torch once per process before any layer
 * uses them (and keeps the module path where they differ).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Torch's vector exp for its AVX-512 (16 floats) or AVX2 (8 floats) kernels. */
typedef __m512 (*exp16_fn)(__m512);
typedef __m256 (*exp8_fn)(__m256);
/* torch.topk of one row (tied or NaN rows): probs [E] -> weights [k] (largest first) and ids [k]. */
typedef void (*topk_fn)(const float *probs, int64_t E, int64_t k, float *weights, int64_t *ids);

typedef struct {
    void *exp;         /* exp16_fn (lanes 16) or exp8_fn (lanes 8) */
    int64_t lanes;     /* torch's float vector width in its softmax kernel */
    void *topk;        /* topk_fn */
} RouteFns;

/* y[i] = exp(x[i]) for n values, through the vector exp a whole vector at a time (the last one
 * padded with zeros; exp works lane by lane, so the padding changes nothing). */
__attribute__((target("avx512f"))) static void exp_lanes16(void *fn, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        float buf[16] = {0};
        const int64_t c = n - i < 16 ? n - i : 16;
        memcpy(buf, x + i, sizeof(float) * c);
        _mm512_storeu_ps(buf, ((exp16_fn)fn)(_mm512_loadu_ps(buf)));
        memcpy(y + i, buf, sizeof(float) * c);
    }
}

static void exp_lanes8(void *fn, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        float buf[8] = {0};
        const int64_t c = n - i < 8 ? n - i : 8;
        memcpy(buf, x + i, sizeof(float) * c);
        _mm256_storeu_ps(buf, ((exp8_fn)fn)(_mm256_loadu_ps(buf)));
        memcpy(y + i, buf, sizeof(float) * c);
    }
}

/* The sum of e[0..n) as torch's softmax reduces it with `lanes` accumulators (header). */
static float softmax_sum(const float *e, int64_t n, int64_t lanes) {
    if (n < lanes) {
        float s = e[0];
        for (int64_t i = 1; i < n; i++) s += e[i];
        return s;
    }
    float acc[16];
    memcpy(acc, e, sizeof(float) * lanes);
    int64_t i = lanes;
    for (; i + lanes <= n; i += lanes)
        for (int64_t j = 0; j < lanes; j++) acc[j] += e[i + j];
    for (int64_t j = 0; i + j < n; j++) acc[j] += e[i + j];
    for (int64_t half = lanes / 2; half >= 1; half /= 2)
        for (int64_t j = 0; j < half; j++) acc[j] += acc[j + half];
    return acc[0];
}

/* probs[E] = softmax(x[E]) in torch's operations (header); tmp: E floats. */
static void softmax_row(const RouteFns *f, const float *x, float *probs, float *tmp, int64_t E) {
    float m = x[0];
    int nan = 0;
    for (int64_t e = 0; e < E; e++) {
        nan |= x[e] != x[e];
        if (x[e] > m)
            m = x[e];
    }
    if (nan) {   /* torch's vector maximum marks a NaN lane with all bits set, whatever NaN it met */
        const uint32_t ones = 0xffffffffu;
        memcpy(&m, &ones, sizeof m);
    }
    for (int64_t e = 0; e < E; e++) tmp[e] = x[e] - m;
    if (f->lanes == 16)
        exp_lanes16(f->exp, tmp, probs, E);
    else
        exp_lanes8(f->exp, tmp, probs, E);
    const float inv = 1.0f / softmax_sum(probs, E, f->lanes);
    for (int64_t e = 0; e < E; e++) probs[e] *= inv;
}

/* The k largest of p[E], largest first, into w / ids; 0, or 1 where torch's choice cannot be
 * told without its algorithm: a NaN, or a value equal to the k-th left out. */
static int top_k(const float *p, int64_t E, int64_t k, float *w, int64_t *ids) {
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {   /* insertion into the sorted picks so far */
        const float v = p[e];
        if (v != v)
            return 1;
        if (n < k)
            n++;
        else if (!(v > w[k - 1]))
            continue;
        int64_t j = n - 1;
        for (; j > 0 && v > w[j - 1]; j--) {
            w[j] = w[j - 1];
            ids[j] = ids[j - 1];
        }
        w[j] = v;
        ids[j] = e;
    }
    int64_t kept = 0, all = 0;   /* experts as large as the k-th: picked, and in all */
    for (int64_t j = 0; j < k; j++) kept += w[j] == w[k - 1];
    for (int64_t e = 0; e < E; e++) all += p[e] == w[k - 1];
    return all > kept;
}

/* torch.sum of w[0..k) (fp32, contiguous, its AVX2 reduction: header). */
static float picks_sum(const float *w, int64_t k) {
    if (k < 8) {   /* four accumulators over every fourth pick, the rest into the first */
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t whole = k / 4 * 4;
        for (int64_t i = 0; i < whole; i++) acc[i % 4] += w[i];
        for (int64_t i = whole; i < k; i++) acc[0] += w[i];
        return ((acc[0] + acc[1]) + acc[2]) + acc[3];
    }
    /* vectors of 8: four vector accumulators, then the leftover picks and the lanes into a scalar */
    const int64_t vectors = k / 8, whole = vectors / 4 * 4;
    float acc[4][8] = {{0.0f}};
    for (int64_t v = 0; v < whole; v++)
        for (int j = 0; j < 8; j++) acc[v % 4][j] += w[8 * v + j];
    for (int64_t v = whole; v < vectors; v++)
        for (int j = 0; j < 8; j++) acc[0][j] += w[8 * v + j];
    for (int a = 1; a < 4; a++)
        for (int j = 0; j < 8; j++) acc[0][j] += acc[a][j];
    float s = 0.0f;
    for (int64_t i = 8 * vectors; i < k; i++) s += w[i];
    for (int j = 0; j < 8; j++) s += acc[0][j];
    return s;
}

/* Routes T tokens: logits [T, E] (overwritten with the probabilities) -> weights [T, k] (fp32) and
 * ids [T, k] (int64), as route_topk returns them (its ids widened). tmp: E floats. */
void moe_route(const RouteFns *f, float *logits, int64_t T, int64_t E, int64_t k, int renormalize, float *weights,
               int64_t *ids, float *tmp) {
    for (int64_t t = 0; t < T; t++) {
        float *p = logits + t * E, *w = weights + t * k;
        int64_t *id = ids + t * k;
        softmax_row(f, p, p, tmp, E);
        if (top_k(p, E, k, w, id))
            ((topk_fn)f->topk)(p, E, k, w, id);
        if (renormalize) {
            const float s = picks_sum(w, k);
            for (int64_t j = 0; j < k; j++) w[j] /= s;
        }
    }
}
