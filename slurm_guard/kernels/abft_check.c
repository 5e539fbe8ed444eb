/* The checksum passes of checked GEMMs (slurm_guard/abft/checked.py), for float32 on the CPU.
 *
 * A checked product out = A M (+ bias) is verified by signed block checksums: the rows of out are
 * summed in blocks of `block` rows, each row times its sign (+1 or -1, a fixed hash of the row
 * index, `checked.signs`), and compared with (the same signed sum of A's rows) M (+ the block's
 * sign sum times bias), a GEMM `block` times smaller that torch runs. The signs keep the checksum
 * row of correlated rows (activations with a common offset) as small as that of unrelated rows,
 * and with it the rounding of the float32 checksum GEMM; a wrong output element still changes
 * exactly one block checksum by its own error. Everything else is a pass over an operand:
 *
 *   sg_abft_stats:        one read of an operand A (n, d) gives its signed row-block sums (for the
 *                         checksum GEMM), the squared norms the rounding bound needs, and, for the
 *                         weight-gradient check whose checksum runs along A's other axis, the
 *                         signed sums of consecutive column blocks of each row;
 *   sg_abft_compare:      one read of the checked product gives its signed row-block sums and,
 *                         against the predicted checksums, the largest (residual / bound)^2;
 *   sg_abft_weight_norms: one read of a weight gives its squared row and column norms.
 *
 * Summation model (what slurm_guard/abft/bounds.py assumes): every block sum adds float32 partial
 * sums of at most SUM_GROUP (4) signed terms in float64: four rows at a time (add_rows4), or
 * four vectors of a row's column block at a time (signed_sum). A partial sum's roundings are then
 * bounded by its own four terms, not by the whole block, which makes the summation error
 * negligible next to the GEMM's at a third of the cost of converting every term to float64. The
 * operand's sums are rounded once to float32 for the checksum GEMM. Norms only scale the
 * bound: they are summed in float32 within a block and in float64 across blocks (the bound's 1.01
 * factor covers their rounding). The residual, the bound and their ratio are formed in float64.
 *
 * No threads; the results are deterministic for a given build.
 * Built by slurm_guard/kernels/native.py; CI compiles it with -Wall -Wextra -Werror. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(SUM_GROUP) || SUM_GROUP != 4
#error "compile with -DSUM_GROUP=4 (slurm_guard/abft/bounds.py): add_rows4 and signed_sum sum 4 terms in float32"
#endif

#define TILE 512 /* columns of the product summed at once in the compare pass (4 KiB) */
#define LANES 8  /* interleaved partial sums of a horizontal sum */
#define FLUSH 32 /* rows of float32 squares summed before they are added in float64 */

/* sum_j sign[j] p[j] over w consecutive floats: LANES interleaved float32 partial sums of at
 * most SUM_GROUP terms each, added to float64 lanes, which the tree of join_lanes joins. The
 * AVX2 path forms the same lanes (j mod LANES), the same groups and the same tree. */
static inline double join_lanes(const double *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static inline double signed_sum(const float *p, const float *sign, int64_t w) {
    double l[LANES] = {0};
    int64_t j = 0;
    const int64_t chunk = LANES * SUM_GROUP;
#if defined(__AVX2__)
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; j + chunk <= w; j += chunk) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(sign + j));
        for (int g = 1; g < SUM_GROUP; g++) {
            const int64_t o = j + g * LANES;
            v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(p + o), _mm256_loadu_ps(sign + o)));
        }
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    if (j == w) { /* join_lanes in registers: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs */
        __m256d t = _mm256_add_pd(lo, hi);
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
        return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
    _mm256_storeu_pd(l, lo);
    _mm256_storeu_pd(l + 4, hi);
#else
    for (; j + chunk <= w; j += chunk)
        for (int k = 0; k < LANES; k++) {
            float v = p[j + k] * sign[j + k];
            for (int g = 1; g < SUM_GROUP; g++) v += p[j + g * LANES + k] * sign[j + g * LANES + k];
            l[k] += (double)v;
        }
#endif
    for (int k = 0; j + k < w; k++) l[k % LANES] += (double)(p[j + k] * sign[j + k]);
    return join_lanes(l);
}

/* Four consecutive rows (row stride `stride`) of d floats, row r weighted by s[r] (+-1): their
 * float32 sum (((s0 x0[j] + s1 x1[j]) + s2 x2[j]) + s3 x3[j]) added to a float64 accumulator
 * acc[j]; and, if sq is not NULL, their squares to a float32 one, in row order. */
static void add_rows4(const float *x0, int64_t stride, int64_t d, const float *s, double *acc,
                      float *sq) {
    const float *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
    int64_t j = 0;
#if defined(__AVX2__)
    __m256 f0 = _mm256_set1_ps(s[0]), f1 = _mm256_set1_ps(s[1]), f2 = _mm256_set1_ps(s[2]),
           f3 = _mm256_set1_ps(s[3]);
    for (; j + 8 <= d; j += 8) {
        __m256 v0 = _mm256_loadu_ps(x0 + j), v1 = _mm256_loadu_ps(x1 + j),
               v2 = _mm256_loadu_ps(x2 + j), v3 = _mm256_loadu_ps(x3 + j);
        if (sq != NULL) {
            __m256 q = _mm256_add_ps(_mm256_loadu_ps(sq + j), _mm256_mul_ps(v0, v0));
            q = _mm256_add_ps(q, _mm256_mul_ps(v1, v1));
            q = _mm256_add_ps(q, _mm256_mul_ps(v2, v2));
            _mm256_storeu_ps(sq + j, _mm256_add_ps(q, _mm256_mul_ps(v3, v3)));
        }
        __m256 t = _mm256_add_ps(_mm256_mul_ps(v0, f0), _mm256_mul_ps(v1, f1));
        t = _mm256_add_ps(t, _mm256_mul_ps(v2, f2));
        t = _mm256_add_ps(t, _mm256_mul_ps(v3, f3));
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j),
                                                _mm256_cvtps_pd(_mm256_castps256_ps128(t))));
        _mm256_storeu_pd(acc + j + 4, _mm256_add_pd(_mm256_loadu_pd(acc + j + 4),
                                                    _mm256_cvtps_pd(_mm256_extractf128_ps(t, 1))));
    }
#endif
    for (; j < d; j++) {
        if (sq != NULL) sq[j] = (((sq[j] + x0[j] * x0[j]) + x1[j] * x1[j]) + x2[j] * x2[j]) + x3[j] * x3[j];
        acc[j] += (double)(((s[0] * x0[j] + s[1] * x1[j]) + s[2] * x2[j]) + s[3] * x3[j]);
    }
}

/* One pass over A (n, d), float32, contiguous. Row blocks are `block` rows (the last may be
 * shorter), column blocks `block` columns likewise; nb = ceil(n / block), nc = ceil(d / block).
 * row_sign (n,) and col_sign (d,) hold +-1. Every output is optional (NULL: not computed):
 *   rsum   (nb, d)  float32  sum of the block's rows times their signs (float64, then rounded);
 *   a_sq   (nb,)    float64  sum over the block of squared row norms;
 *   s_sq   (nb,)    float64  squared norm of the block's signed sum (needs rsum);
 *   col_sq (d,)     float64  squared column norms;
 *   cblk   (n, nc)  float32  each row's column blocks summed with col_sign (float64, rounded);
 *   cs_sq  (nc,)    float64  squared norm of a column block's signed sums over all rows;
 *   ca_sq  (nc,)    float64  sum over the column block of col_sq (needs col_sq).
 * Returns 0, -1 when scratch memory cannot be had, -2 for a bad argument. */
int sg_abft_stats(const float *a, int64_t n, int64_t d, int64_t block, const float *row_sign,
                  const float *col_sign, float *rsum, double *a_sq, double *s_sq, double *col_sq,
                  float *cblk, double *cs_sq, double *ca_sq) {
    if (block < 1 || n < 0 || d < 0) return -2;
    if ((rsum != NULL && row_sign == NULL) || (cblk != NULL && col_sign == NULL)) return -2;
    int64_t nb = (n + block - 1) / block, nc = (d + block - 1) / block;
    size_t width = (size_t)(d > 0 ? d : 1);
    float *restrict sq = (float *)calloc(width, sizeof(float));
    double *restrict rs = (double *)calloc(width, sizeof(double));
    double *restrict csum = (double *)calloc((size_t)(nc > 0 ? nc : 1), sizeof(double));
    if (sq == NULL || rs == NULL || csum == NULL) {
        free(sq), free(rs), free(csum);
        return -1;
    }
    int want_sq = a_sq != NULL || col_sq != NULL;
    if (col_sq != NULL) memset(col_sq, 0, (size_t)d * sizeof(double));
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = b * block, r1 = r0 + block < n ? r0 + block : n;
        if (rsum != NULL) memset(rs, 0, width * sizeof(double));
        if (want_sq) memset(sq, 0, width * sizeof(float));
        int64_t i = r0;
        for (; i + 4 <= r1; i += 4) {
            const float *x0 = a + i * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
            if (rsum != NULL) {
                add_rows4(x0, d, d, row_sign + i, rs, want_sq ? sq : NULL);
            } else if (want_sq) {
                for (int64_t j = 0; j < d; j++)
                    sq[j] = (((sq[j] + x0[j] * x0[j]) + x1[j] * x1[j]) + x2[j] * x2[j]) + x3[j] * x3[j];
            }
        }
        for (; i < r1; i++) {
            const float *row = a + i * d;
            if (rsum != NULL) {
                float s = row_sign[i];
                for (int64_t j = 0; j < d; j++) rs[j] += (double)(s * row[j]);
            }
            if (want_sq)
                for (int64_t j = 0; j < d; j++) sq[j] += row[j] * row[j];
        }
        if (cblk != NULL)
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = 0; c < nc; c++) {
                    int64_t c0 = c * block, w = c0 + block < d ? block : d - c0;
                    double v = signed_sum(a + r * d + c0, col_sign + c0, w);
                    cblk[r * nc + c] = (float)v;
                    csum[c] += v * v;
                }
        if (want_sq) {
            double t = 0.0;
            for (int64_t j = 0; j < d; j++) t += (double)sq[j];
            if (a_sq != NULL) a_sq[b] = t;
            if (col_sq != NULL)
                for (int64_t j = 0; j < d; j++) col_sq[j] += (double)sq[j];
        }
        if (rsum != NULL) {
            double t = 0.0;
            for (int64_t j = 0; j < d; j++) {
                rsum[b * d + j] = (float)rs[j];
                t += rs[j] * rs[j];
            }
            if (s_sq != NULL) s_sq[b] = t;
        }
    }
    if (cs_sq != NULL && cblk != NULL) memcpy(cs_sq, csum, (size_t)nc * sizeof(double));
    if (ca_sq != NULL && col_sq != NULL) {
        for (int64_t c = 0; c < nc; c++) {
            int64_t c0 = c * block, c1 = c0 + block < d ? c0 + block : d;
            double t = 0.0;
            for (int64_t j = c0; j < c1; j++) t += col_sq[j];
            ca_sq[c] = t;
        }
    }
    free(sq), free(rs), free(csum);
    return 0;
}

/* Squared row norms (r,) and column norms (c,), float64, of a weight (r, c), float32,
 * contiguous, in one read: four rows at a time, their squares added to LANES-wide row
 * accumulators and to float32 column accumulators that are added in float64 every FLUSH rows.
 * Returns 0, or -1 when scratch memory cannot be had. */
int sg_abft_weight_norms(const float *w, int64_t r, int64_t c, double *row_sq, double *col_sq) {
    if (r < 0 || c < 0) return -2;
    float *restrict sq = (float *)malloc((size_t)(c > 0 ? c : 1) * sizeof(float));
    if (sq == NULL) return -1;
    memset(col_sq, 0, (size_t)c * sizeof(double));
    int64_t body = c - c % LANES;
    for (int64_t r0 = 0; r0 < r; r0 += FLUSH) {
        int64_t r1 = r0 + FLUSH < r ? r0 + FLUSH : r;
        memset(sq, 0, (size_t)c * sizeof(float));
        int64_t i = r0;
        for (; i + 4 <= r1; i += 4) {
            const float *x0 = w + i * c, *x1 = x0 + c, *x2 = x1 + c, *x3 = x2 + c;
            float l0[LANES] = {0}, l1[LANES] = {0}, l2[LANES] = {0}, l3[LANES] = {0};
#if defined(__AVX2__)
            __m256 q0 = _mm256_setzero_ps(), q1 = q0, q2 = q0, q3 = q0;
            for (int64_t j = 0; j < body; j += LANES) {
                __m256 v0 = _mm256_loadu_ps(x0 + j), v1 = _mm256_loadu_ps(x1 + j),
                       v2 = _mm256_loadu_ps(x2 + j), v3 = _mm256_loadu_ps(x3 + j);
                v0 = _mm256_mul_ps(v0, v0), v1 = _mm256_mul_ps(v1, v1);
                v2 = _mm256_mul_ps(v2, v2), v3 = _mm256_mul_ps(v3, v3);
                __m256 t = _mm256_add_ps(_mm256_loadu_ps(sq + j), v0);
                t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t, v1), v2), v3);
                _mm256_storeu_ps(sq + j, t);
                q0 = _mm256_add_ps(q0, v0), q1 = _mm256_add_ps(q1, v1);
                q2 = _mm256_add_ps(q2, v2), q3 = _mm256_add_ps(q3, v3);
            }
            _mm256_storeu_ps(l0, q0), _mm256_storeu_ps(l1, q1);
            _mm256_storeu_ps(l2, q2), _mm256_storeu_ps(l3, q3);
#else
            for (int64_t j = 0; j < body; j += LANES)
                for (int k = 0; k < LANES; k++) {
                    float a0 = x0[j + k] * x0[j + k], a1 = x1[j + k] * x1[j + k],
                          a2 = x2[j + k] * x2[j + k], a3 = x3[j + k] * x3[j + k];
                    sq[j + k] = (((sq[j + k] + a0) + a1) + a2) + a3;
                    l0[k] += a0, l1[k] += a1, l2[k] += a2, l3[k] += a3;
                }
#endif
            for (int64_t j = body; j < c; j++) {
                float a0 = x0[j] * x0[j], a1 = x1[j] * x1[j], a2 = x2[j] * x2[j], a3 = x3[j] * x3[j];
                sq[j] = (((sq[j] + a0) + a1) + a2) + a3;
                l0[j - body] += a0, l1[j - body] += a1, l2[j - body] += a2, l3[j - body] += a3;
            }
            const float *lanes[4] = {l0, l1, l2, l3};
            for (int q = 0; q < 4; q++) {
                const float *l = lanes[q];
                row_sq[i + q] = (double)(((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])));
            }
        }
        for (; i < r1; i++) {
            const float *x = w + i * c;
            double t = 0.0;
            for (int64_t j = 0; j < c; j++) {
                float v = x[j] * x[j];
                sq[j] += v;
                t += (double)v;
            }
            row_sq[i] = t;
        }
        for (int64_t j = 0; j < c; j++) col_sq[j] += (double)sq[j];
    }
    free(sq);
    return 0;
}

/* One residual against its squared bound: keeps the largest residual^2 / bound2 in *best and
 * sets *bad for a NaN (a non-finite product or operand) or a bound that overflowed (operands
 * near float32's range: dividing by inf would make every residual look like 0). */
static inline void keep_worst(double residual, double bound2, double *best, int *bad) {
    double q = bound2 < INFINITY ? residual * residual / bound2 : NAN;
    if (!(q <= *best)) {
        if (q > *best)
            *best = q;
        else
            *bad = 1;
    }
}

/* The block's k1 and k24 coefficients, exactly as bounds.Factors forms them. */
static inline double coef_k1(const double *f, double nr) {
    return (2.0 * f[0] + (3.0 * nr + 8.0) * nr * f[2]) * f[3];
}
static inline double coef_k24(const double *f, double nr) {
    return ((2.0 * f[0] + (2.0 * nr + 8.0) * nr * f[2]) * nr + (2.0 * f[1] + 4.0 * f[2]) * nr * nr) *
           f[3];
}

/* The check of one product out (rows, p), float32, contiguous, rows blocked by `block`, row i
 * weighted by sign[i]:
 *   residual[b, c] = pred[b, c] + (sum_{i in b} sign[i]) bias[c] - sum_{i in b} sign[i] out[i, c]
 *   bound2[b, c]   = (k1(n_b) a_sq[b] + k3 s_sq[b]) m_sq[c] + k24(n_b) bias[c]^2 + floor
 * with k1, k3, k24 from the factors f = {per_element, check_gemm, uc2, scale, floor} exactly as
 * bounds.py forms them. bias may be NULL. Returns max residual^2 / bound2 over blocks and
 * columns, +inf if any is NaN (a non-finite product or operand must fail the check) or any
 * bound overflowed (a check that cannot bound the rounding cannot pass). */
double sg_abft_compare(const float *out, int64_t rows, int64_t p, int64_t block, const float *sign,
                       const float *pred, const float *bias, const double *a_sq,
                       const double *s_sq, const double *m_sq, const double *f) {
    const double floor2 = f[4], k3 = 2.0 * f[1] * f[3];
    double acc[TILE];
    double best = 0.0;
    int bad = 0;
    if (block < 1) return NAN;
    int64_t nb = (rows + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = b * block, r1 = r0 + block < rows ? r0 + block : rows;
        double nr = (double)(r1 - r0), k1 = coef_k1(f, nr), k24 = coef_k24(f, nr), signs = 0.0;
        for (int64_t i = r0; i < r1; i++) signs += (double)sign[i];
        double v = k1 * a_sq[b] + k3 * s_sq[b];
        for (int64_t c0 = 0; c0 < p; c0 += TILE) {
            int64_t w = c0 + TILE < p ? TILE : p - c0;
            memset(acc, 0, (size_t)w * sizeof(double));
            int64_t i = r0;
            for (; i + 4 <= r1; i += 4) add_rows4(out + i * p + c0, p, w, sign + i, acc, NULL);
            for (; i < r1; i++) {
                const float *row = out + i * p + c0;
                float s = sign[i];
                for (int64_t j = 0; j < w; j++) acc[j] += (double)(s * row[j]);
            }
            const float *pr = pred + b * p + c0;
            for (int64_t j = 0; j < w; j++) {
                double predicted = (double)pr[j], bound2 = v * m_sq[c0 + j] + floor2;
                if (bias != NULL) {
                    double beta = (double)bias[c0 + j];
                    predicted += signs * beta;
                    bound2 += k24 * beta * beta;
                }
                keep_worst(predicted - acc[j], bound2, &best, &bad);
            }
        }
    }
    return bad ? INFINITY : best;
}

/* sg_abft_compare for a product held transposed: out (R, C), float32, contiguous, is the
 * transpose of the checked product, whose row blocks are therefore column blocks of out,
 * column j weighted by sign[j]:
 *   residual[c, r] = pred[c, r] - sum_{j in column block c} sign[j] out[r, j]
 *   bound2[c, r]   = (k1(n_c) a_sq[c] + k3 s_sq[c]) m_sq[r] + floor
 * (pred (ceil(C / block), R); no bias). */
double sg_abft_compare_t(const float *out, int64_t R, int64_t C, int64_t block, const float *sign,
                         const float *pred, const double *a_sq, const double *s_sq,
                         const double *m_sq, const double *f) {
    const double floor2 = f[4], k3 = 2.0 * f[1] * f[3];
    double best = 0.0;
    int bad = 0;
    if (block < 1) return NAN;
    int64_t nc = (C + block - 1) / block;
    for (int64_t c = 0; c < nc; c++) {
        int64_t c0 = c * block, w = c0 + block < C ? block : C - c0;
        double v = coef_k1(f, (double)w) * a_sq[c] + k3 * s_sq[c];
        const float *pc = pred + c * R;
        for (int64_t r = 0; r < R; r++) {
            double res = (double)pc[r] - signed_sum(out + r * C + c0, sign + c0, w);
            keep_worst(res, v * m_sq[r] + floor2, &best, &bad);
        }
    }
    return bad ? INFINITY : best;
}
