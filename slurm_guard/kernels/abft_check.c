/* The checksum passes of checked GEMMs (slurm_guard/abft/checked.py), for float32 on the CPU.
 *
 * A checked product out = A M (+ bias) is verified by block checksums: the rows of out are summed
 * in blocks of `block` rows and compared with (sum of the block's rows of A) M (+ n_b bias), a
 * GEMM `block` times smaller that torch runs. Everything else is a pass over an operand, and as
 * torch ops those passes are ~90 small calls per layer and step; here they are two:
 *
 *   sg_abft_stats:   one read of an operand A (n, d) gives its row-block sums (float32, for the
 *                    checksum GEMM), the squared norms the rounding bound needs (float64), and,
 *                    for the weight-gradient check whose checksum runs along A's other axis, the
 *                    sums of consecutive column blocks of each row;
 *   sg_abft_compare: one read of the checked product gives its row-block sums and, against the
 *                    predicted checksums, the largest (residual / bound)^2 over blocks and columns.
 *
 * Summation model (what slurm_guard/abft/bounds.py assumes): every block sum is a float32 sum of
 * n_b terms whose partial sums are no larger than the sum of the terms' magnitudes: n_b - 1
 * roundings of at most u32 times that. Row-block sums add rows one after another (recursive
 * summation); column-block sums use 8 interleaved partial sums joined by a fixed tree, which has
 * the same count of roundings and the same partial-sum bound. Norms only scale the bound: they
 * are summed in float32 within a block and in float64 across blocks, so long operands stay
 * accurate (the bound's 1.01 factor covers their rounding). The residual, the bound and their
 * ratio are formed in float64.
 *
 * The results do not depend on threads (there are none here) and are deterministic.
 * Built by slurm_guard/kernels/native.py; CI compiles it with -Wall -Wextra -Werror. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define TILE 512 /* columns of the product summed at once in the compare pass (2 KiB) */
#define LANES 8  /* interleaved partial sums of a horizontal sum: one AVX register */

/* The fixed tree joining 8 lanes; the AVX path below forms the same sums with hadd. */
static inline float join8(const float *l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Sum of w consecutive floats: LANES interleaved float32 partial sums, joined by join8. */
static inline float lane_sum(const float *p, int64_t w) {
    float l[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= w; j += LANES)
        for (int k = 0; k < LANES; k++) l[k] += p[j + k];
    for (int k = 0; j + k < w; k++) l[k] += p[j + k];
    return join8(l);
}

/* Sum of the squares of w consecutive floats, the same way. */
static inline float lane_sum_sq(const float *p, int64_t w) {
    float l[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= w; j += LANES)
        for (int k = 0; k < LANES; k++) l[k] += p[j + k] * p[j + k];
    for (int k = 0; j + k < w; k++) l[k] += p[j + k] * p[j + k];
    return join8(l);
}

/* Column-block sums of 4 consecutive rows (row stride d) into out[0], out[nc], out[2 nc],
 * out[3 nc] for every column block: the same lanes and tree as lane_sum, 4 rows at a time. */
static void block_sums4(const float *x, int64_t d, int64_t block, int64_t nc, float *out) {
    for (int64_t c = 0; c < nc; c++) {
        int64_t c0 = c * block, w = c0 + block < d ? block : d - c0;
#if defined(__AVX__)
        if (w % LANES == 0) {
            __m256 l[4];
            for (int r = 0; r < 4; r++) {
                const float *p = x + r * d + c0;
                __m256 v = _mm256_loadu_ps(p);
                for (int64_t j = LANES; j < w; j += LANES) v = _mm256_add_ps(v, _mm256_loadu_ps(p + j));
                l[r] = v;
            }
            /* hadd: (l0+l1, l2+l3 | l4+l5, l6+l7) per row, then the pairs, then the halves */
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(l[0], l[1]), _mm256_hadd_ps(l[2], l[3]));
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            float o[4];
            _mm_storeu_ps(o, t);
            for (int r = 0; r < 4; r++) out[r * nc + c] = o[r];
            continue;
        }
#endif
        for (int r = 0; r < 4; r++) out[r * nc + c] = lane_sum(x + r * d + c0, w);
    }
}

/* One pass over A (n, d), float32, contiguous. Row blocks are `block` rows (the last may be
 * shorter), column blocks `block` columns likewise; nb = ceil(n / block), nc = ceil(d / block).
 * Every output is optional (NULL: not computed):
 *   rsum   (nb, d)  float32  sum of the block's rows (in row order);
 *   a_sq   (nb,)    float64  sum over the block of squared row norms;
 *   s_sq   (nb,)    float64  ||rsum[b]||^2 (needs rsum);
 *   col_sq (d,)     float64  squared column norms;
 *   row_sq (n,)     float64  squared row norms;
 *   cblk   (n, nc)  float32  sums of each row's column blocks;
 *   cs_sq  (nc,)    float64  ||cblk[:, c]||^2 (needs cblk);
 *   ca_sq  (nc,)    float64  sum over the column block of col_sq (needs col_sq).
 * Returns 0, or -1 when scratch memory cannot be had. */
int sg_abft_stats(const float *a, int64_t n, int64_t d, int64_t block, float *rsum, double *a_sq,
                  double *s_sq, double *col_sq, double *row_sq, float *cblk, double *cs_sq,
                  double *ca_sq) {
    if (block < 1 || n < 0 || d < 0) return -2;
    int64_t nb = (n + block - 1) / block, nc = (d + block - 1) / block;
    int want_sq = a_sq != NULL || col_sq != NULL;
    float *restrict sq = NULL;
    if (want_sq) {
        sq = (float *)malloc((size_t)(d > 0 ? d : 1) * sizeof(float));
        if (sq == NULL) return -1;
    }
    if (col_sq != NULL) memset(col_sq, 0, (size_t)d * sizeof(double));
    if (cs_sq != NULL && cblk != NULL) memset(cs_sq, 0, (size_t)nc * sizeof(double));
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = b * block, r1 = r0 + block < n ? r0 + block : n;
        float *restrict rs = rsum != NULL ? rsum + b * d : NULL;
        if (rs != NULL) memset(rs, 0, (size_t)d * sizeof(float));
        if (sq != NULL) memset(sq, 0, (size_t)d * sizeof(float));
        int64_t i = r0;
        for (; i + 4 <= r1; i += 4) {
            const float *x0 = a + i * d, *x1 = x0 + d, *x2 = x1 + d, *x3 = x2 + d;
            if (rs != NULL && sq != NULL) {
                for (int64_t j = 0; j < d; j++) {
                    float v0 = x0[j], v1 = x1[j], v2 = x2[j], v3 = x3[j];
                    rs[j] = (((rs[j] + v0) + v1) + v2) + v3;
                    sq[j] = (((sq[j] + v0 * v0) + v1 * v1) + v2 * v2) + v3 * v3;
                }
            } else if (rs != NULL) {
                for (int64_t j = 0; j < d; j++) rs[j] = (((rs[j] + x0[j]) + x1[j]) + x2[j]) + x3[j];
            } else if (sq != NULL) {
                for (int64_t j = 0; j < d; j++)
                    sq[j] = (((sq[j] + x0[j] * x0[j]) + x1[j] * x1[j]) + x2[j] * x2[j]) + x3[j] * x3[j];
            }
            if (row_sq != NULL)
                for (int r = 0; r < 4; r++) row_sq[i + r] = (double)lane_sum_sq(x0 + r * d, d);
            if (cblk != NULL) block_sums4(x0, d, block, nc, cblk + i * nc);
        }
        for (; i < r1; i++) {
            const float *row = a + i * d;
            if (rs != NULL)
                for (int64_t j = 0; j < d; j++) rs[j] += row[j];
            if (sq != NULL)
                for (int64_t j = 0; j < d; j++) sq[j] += row[j] * row[j];
            if (row_sq != NULL) row_sq[i] = (double)lane_sum_sq(row, d);
            if (cblk != NULL)
                for (int64_t c = 0; c < nc; c++) {
                    int64_t c0 = c * block, w = c0 + block < d ? block : d - c0;
                    cblk[i * nc + c] = lane_sum(row + c0, w);
                }
        }
        if (cs_sq != NULL && cblk != NULL)
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = 0; c < nc; c++)
                    cs_sq[c] += (double)cblk[r * nc + c] * (double)cblk[r * nc + c];
        if (sq != NULL) {
            double t = 0.0;
            for (int64_t j = 0; j < d; j++) t += (double)sq[j];
            if (a_sq != NULL) a_sq[b] = t;
            if (col_sq != NULL)
                for (int64_t j = 0; j < d; j++) col_sq[j] += (double)sq[j];
        }
        if (s_sq != NULL && rs != NULL) {
            double t = 0.0;
            for (int64_t j = 0; j < d; j++) t += (double)rs[j] * (double)rs[j];
            s_sq[b] = t;
        }
    }
    if (ca_sq != NULL && col_sq != NULL) {
        for (int64_t c = 0; c < nc; c++) {
            int64_t c0 = c * block, c1 = c0 + block < d ? c0 + block : d;
            double t = 0.0;
            for (int64_t j = c0; j < c1; j++) t += col_sq[j];
            ca_sq[c] = t;
        }
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

/* The check of one product out (rows, p), float32, contiguous, rows blocked by `block`:
 *   residual[b, c] = pred[b, c] + n_b bias[c] - sum_{i in b} out[i, c]
 *   bound2[b, c]   = (k1(n_b) a_sq[b] + k3 s_sq[b]) m_sq[c] + k24(n_b) bias[c]^2 + floor
 * with k1, k3, k24 from the factors f = {per_element, check_gemm, uc2, scale, floor} exactly as
 * bounds.py forms them. bias may be NULL. Returns max residual^2 / bound2 over blocks and
 * columns, +inf if any is NaN (a non-finite product or operand must fail the check) or any
 * bound overflowed (operands near float32's range: a check that cannot bound the rounding
 * cannot pass, it would otherwise divide every residual by inf and see nothing). */
double sg_abft_compare(const float *out, int64_t rows, int64_t p, int64_t block,
                       const float *pred, const float *bias, const double *a_sq,
                       const double *s_sq, const double *m_sq, const double *f) {
    const double per_element = f[0], check_gemm = f[1], uc2 = f[2], scale = f[3], floor2 = f[4];
    const double k3 = 2.0 * check_gemm * scale;
    float acc[TILE];
    double best = 0.0;
    int bad = 0;
    if (block < 1) return NAN;
    int64_t nb = (rows + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        int64_t r0 = b * block, r1 = r0 + block < rows ? r0 + block : rows;
        double nr = (double)(r1 - r0);
        double k1 = (2.0 * per_element + (3.0 * nr + 8.0) * nr * uc2) * scale;
        double k24 = ((2.0 * per_element + (2.0 * nr + 8.0) * nr * uc2) * nr +
                      (2.0 * check_gemm + 4.0 * uc2) * nr * nr) *
                     scale;
        double v = k1 * a_sq[b] + k3 * s_sq[b];
        for (int64_t c0 = 0; c0 < p; c0 += TILE) {
            int64_t w = c0 + TILE < p ? TILE : p - c0;
            memset(acc, 0, (size_t)w * sizeof(float));
            int64_t i = r0;
            for (; i + 4 <= r1; i += 4) {
                const float *y0 = out + i * p + c0, *y1 = y0 + p, *y2 = y1 + p, *y3 = y2 + p;
                for (int64_t j = 0; j < w; j++) acc[j] = (((acc[j] + y0[j]) + y1[j]) + y2[j]) + y3[j];
            }
            for (; i < r1; i++) {
                const float *row = out + i * p + c0;
                for (int64_t j = 0; j < w; j++) acc[j] += row[j];
            }
            const float *pr = pred + b * p + c0;
            for (int64_t j = 0; j < w; j++) {
                double predicted = (double)pr[j], bound2 = v * m_sq[c0 + j] + floor2;
                if (bias != NULL) {
                    double beta = (double)bias[c0 + j];
                    predicted += nr * beta;
                    bound2 += k24 * beta * beta;
                }
                keep_worst(predicted - (double)acc[j], bound2, &best, &bad);
            }
        }
    }
    return bad ? INFINITY : best;
}

/* sg_abft_compare for a product held transposed: out (R, C), float32, contiguous, is the
 * transpose of the checked product, whose row blocks are therefore column blocks of out:
 *   residual[c, r] = pred[c, r] - sum_{j in column block c} out[r, j]
 *   bound2[c, r]   = (k1(n_c) a_sq[c] + k3 s_sq[c]) m_sq[r] + floor
 * (pred (ceil(C / block), R); no bias). The block sums are lane sums (see lane_sum). */
double sg_abft_compare_t(const float *out, int64_t R, int64_t C, int64_t block, const float *pred,
                         const double *a_sq, const double *s_sq, const double *m_sq,
                         const double *f) {
    const double per_element = f[0], check_gemm = f[1], uc2 = f[2], scale = f[3], floor2 = f[4];
    const double k3 = 2.0 * check_gemm * scale;
    double best = 0.0;
    int bad = 0;
    if (block < 1) return NAN;
    int64_t nc = (C + block - 1) / block;
    for (int64_t c = 0; c < nc; c++) {
        int64_t c0 = c * block, w = c0 + block < C ? block : C - c0;
        double nr = (double)w;
        double k1 = (2.0 * per_element + (3.0 * nr + 8.0) * nr * uc2) * scale;
        double v = k1 * a_sq[c] + k3 * s_sq[c];
        const float *pc = pred + c * R;
        for (int64_t r = 0; r < R; r++) {
            double res = (double)pc[r] - (double)lane_sum(out + r * C + c0, w);
            keep_worst(res, v * m_sq[r] + floor2, &best, &bad);
        }
    }
    return bad ? INFINITY : best;
}
