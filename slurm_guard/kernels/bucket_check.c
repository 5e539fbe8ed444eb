/* The fused per-bucket check of the DDP communication hook: one read of the bucket gives
 *   S = sum_i (+-1)_i x_i   (the conservation sketch; signs from a counter-based hash),
 *   A = sum_i |x_i|         (the L1 norm that bounds the sketch's rounding),
 * both accumulated in float64 in one fixed order, so every implementation (this file, the
 * torch specification `slurm_guard.kernels.sketch.reference_check` and the Triton kernel)
 * returns the same bits for the same input, whatever the thread count.
 *
 * The order (see sketch.py for the full definition): the input, padded with +0.0 to whole
 * chunks of CHUNK = 2^CHUNK_LOG2 elements, is summed per chunk by a halving tree
 * (y_i = x_i + x_{i+h}, h = CHUNK/2, ..., 1); the chunk values, padded with +0.0 to a power of
 * two, by the same tree. Sign of element e: bit (e mod 32) of mix(mix((e >> 5) ^ s0) ^ s1),
 * mix = the 32-bit finaliser below. Multiplying by -1 is a sign-bit flip: exact.
 *
 * with_l1 = 0 skips A (the averaged bucket needs only S: its rounding is bounded through the
 * local buckets' L1 norms): about a quarter less arithmetic, the same S bits, A reported as 0.0
 * and the flag taken from S instead (non-finite iff some element is, for 16/32-bit inputs).
 *
 * divisor > 1 (float32/float64 only) first divides each chunk in place, IEEE division, then
 * checks it while it is still in L1: the averaged bucket's division by the world size and its
 * sketch share one read of the bucket instead of two. A power-of-two divisor is applied as a
 * multiplication by its exact reciprocal: one correctly rounded operation on the same exact
 * quotient, so the same bits as the division.
 *
 * Built by slurm_guard/kernels/native.py; CI compiles it with -Wall -Wextra -Werror. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(CHUNK_LOG2) || !defined(MIX_M1) || !defined(MIX_M2)
#error "compile with -DCHUNK_LOG2=... -DMIX_M1=... -DMIX_M2=... (see kernels/native.py)"
#endif
#define CHUNK (1 << CHUNK_LOG2)
#define STREAMS 8 /* the first three tree levels are formed in registers from 8 streams */
#define SPAN (CHUNK / STREAMS)
#define WORDS (CHUNK / 32)
#define SIGN64 0x8000000000000000ULL
#define DOUBLE_MAX 1.7976931348623157e308
/* Forced inlining with a literal with_l1 gives one specialised copy per variant: no branch in
 * the inner loops and no A arithmetic in the sketch-only one. */
#define INLINE static inline __attribute__((always_inline))

enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3 };

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= (uint32_t)MIX_M1;
    x ^= x >> 15;
    x *= (uint32_t)MIX_M2;
    x ^= x >> 16;
    return x;
}

static inline double bits_double(uint64_t u) {
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static inline uint64_t double_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

/* float16 -> float64, exact (including subnormals, infinities and NaN). */
static inline double f16_to_double(uint16_t h) {
    uint64_t sign = (uint64_t)(h >> 15) << 63;
    uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) {
        double v = (double)m * 0x1p-24;
        return bits_double(double_bits(v) | sign);
    }
    uint64_t exp = e == 31 ? 0x7FF : (uint64_t)(e - 15 + 1023);
    return bits_double(sign | (exp << 52) | ((uint64_t)m << 42));
}

static inline double load_f32(const void *p, int64_t i) {
    float v;
    memcpy(&v, (const char *)p + 4 * i, 4);
    return (double)v;
}
static inline double load_f64(const void *p, int64_t i) {
    double v;
    memcpy(&v, (const char *)p + 8 * i, 8);
    return v;
}
static inline double load_f16(const void *p, int64_t i) {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return f16_to_double(h);
}
static inline double load_bf16(const void *p, int64_t i) {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return (double)v;
}

/* In-place halving tree over n = 2^k doubles; returns the sum in the tree's order. */
static double tree(double *v, int64_t n) {
    for (int64_t h = n / 2; h >= 1; h /= 2)
        for (int64_t i = 0; i < h; i++) v[i] = v[i] + v[i + h];
    return v[0];
}

/* One full chunk starting at element `first` (global index, for the signs) of data p.
 * Levels h = CHUNK/2, CHUNK/4, CHUNK/8 are formed from 8 streams at offsets k * SPAN in the
 * order of the halving tree; the remaining SPAN values go through tree(). */
#define DEFINE_CHUNK(NAME, LOAD)                                                              \
    INLINE void NAME(const void *p, int64_t first, uint32_t s0, uint32_t s1, double *out,     \
                     const int with_l1) {                                                     \
        uint32_t words[WORDS];                                                                \
        uint32_t w0 = (uint32_t)(first >> 5);                                                 \
        for (int w = 0; w < WORDS; w++) words[w] = mix32(mix32((w0 + (uint32_t)w) ^ s0) ^ s1); \
        double vs[SPAN], va[SPAN];                                                            \
        for (int ib = 0; ib < SPAN / 32; ib++) {                                              \
            uint64_t wk[STREAMS];                                                             \
            for (int k = 0; k < STREAMS; k++) wk[k] = words[ib + k * (SPAN / 32)];            \
            for (int j = 0; j < 32; j++) {                                                    \
                int64_t i = (int64_t)ib * 32 + j;                                             \
                double s[STREAMS], a[STREAMS];                                                \
                for (int k = 0; k < STREAMS; k++) {                                           \
                    uint64_t u = double_bits(LOAD(p, i + (int64_t)k * SPAN));                 \
                    s[k] = bits_double(u ^ (((wk[k] >> j) & 1) << 63));                       \
                    if (with_l1) a[k] = bits_double(u & ~SIGN64);                             \
                }                                                                             \
                vs[i] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));    \
                if (with_l1)                                                                  \
                    va[i] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); \
            }                                                                                 \
        }                                                                                     \
        out[0] = tree(vs, SPAN);                                                              \
        out[1] = with_l1 ? tree(va, SPAN) : 0.0;                                              \
    }

#if !defined(__AVX2__)
DEFINE_CHUNK(chunk_f32, load_f32)
#endif
DEFINE_CHUNK(chunk_f64, load_f64)
DEFINE_CHUNK(chunk_f16, load_f16)
DEFINE_CHUNK(chunk_bf16, load_bf16)

#if defined(__AVX2__)
/* The same chunk for float32 with AVX2: signs applied in float32 (a sign-bit flip is exact either
 * side of the widening), 8 elements of each stream per step, the same tree order. */
INLINE void chunk_f32_avx2(const void *p, int64_t first, uint32_t s0, uint32_t s1, double *out,
                           const int with_l1) {
    uint32_t words[WORDS];
    uint32_t w0 = (uint32_t)(first >> 5);
    for (int w = 0; w < WORDS; w++) words[w] = mix32(mix32((w0 + (uint32_t)w) ^ s0) ^ s1);
    double vs[SPAN], va[SPAN];
    const float *x = (const float *)p;
    const __m256i top = _mm256_set1_epi32((int)0x80000000u);
    const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
    __m256i shift[4];
    for (int q = 0; q < 4; q++)
        shift[q] = _mm256_setr_epi32(31 - 8 * q, 30 - 8 * q, 29 - 8 * q, 28 - 8 * q,
                                     27 - 8 * q, 26 - 8 * q, 25 - 8 * q, 24 - 8 * q);
    for (int ib = 0; ib < SPAN / 32; ib++) {
        __m256i wk[STREAMS];
        for (int k = 0; k < STREAMS; k++) wk[k] = _mm256_set1_epi32((int)words[ib + k * (SPAN / 32)]);
        for (int q = 0; q < 4; q++) {
            int64_t i = (int64_t)ib * 32 + 8 * q;
            __m256d slo[STREAMS], shi[STREAMS], alo[STREAMS], ahi[STREAMS];
            for (int k = 0; k < STREAMS; k++) {
                __m256 v = _mm256_loadu_ps(x + i + (int64_t)k * SPAN);
                __m256i m = _mm256_and_si256(_mm256_sllv_epi32(wk[k], shift[q]), top);
                __m256 sv = _mm256_xor_ps(v, _mm256_castsi256_ps(m));
                slo[k] = _mm256_cvtps_pd(_mm256_castps256_ps128(sv));
                shi[k] = _mm256_cvtps_pd(_mm256_extractf128_ps(sv, 1));
                if (with_l1) {
                    alo[k] = _mm256_and_pd(slo[k], abs_mask);
                    ahi[k] = _mm256_and_pd(shi[k], abs_mask);
                }
            }
#define TREE8(a) _mm256_add_pd(_mm256_add_pd(_mm256_add_pd(a[0], a[4]), _mm256_add_pd(a[2], a[6])), \
                               _mm256_add_pd(_mm256_add_pd(a[1], a[5]), _mm256_add_pd(a[3], a[7])))
            _mm256_storeu_pd(vs + i, TREE8(slo));
            _mm256_storeu_pd(vs + i + 4, TREE8(shi));
            if (with_l1) {
                _mm256_storeu_pd(va + i, TREE8(alo));
                _mm256_storeu_pd(va + i + 4, TREE8(ahi));
            }
#undef TREE8
        }
    }
    out[0] = tree(vs, SPAN);
    out[1] = with_l1 ? tree(va, SPAN) : 0.0;
}
#endif

static int elem_size(int dtype) {
    switch (dtype) {
    case DT_F32: return 4;
    case DT_F64: return 8;
    case DT_F16: case DT_BF16: return 2;
    default: return 0;
    }
}

/* x[0..m) /= divisor in place, IEEE division (divisor exact in the type: <= 2^24). */
static void divide_in_place(void *p, int dtype, int64_t m, int64_t divisor) {
    int pow2 = (divisor & (divisor - 1)) == 0;
    if (dtype == DT_F32) {
        float *x = (float *)p, d = (float)divisor, r = 1.0f / d;
        if (pow2)
            for (int64_t i = 0; i < m; i++) x[i] *= r;
        else
            for (int64_t i = 0; i < m; i++) x[i] /= d;
    } else {
        double *x = (double *)p, d = (double)divisor, r = 1.0 / d;
        if (pow2)
            for (int64_t i = 0; i < m; i++) x[i] *= r;
        else
            for (int64_t i = 0; i < m; i++) x[i] /= d;
    }
}

/* Chunks [c_begin, c_end) of an n-element bucket: sketch partials to ps[c], L1 partials to
 * pa[c] (with_l1 only; pa may be NULL otherwise), each chunk divided in place first when
 * divisor > 1. The last chunk, if partial, is copied into a zero-padded buffer first. Threads
 * may run disjoint chunk ranges concurrently. */
INLINE void check_chunks(void *data, int dtype, int size, int64_t n, int64_t c_begin,
                         int64_t c_end, uint32_t s0, uint32_t s1, double *ps, double *pa,
                         const int with_l1, int64_t divisor) {
    for (int64_t c = c_begin; c < c_end; c++) {
        int64_t first = c * CHUNK;
        const void *p = (const char *)data + first * size;
        if (divisor > 1 && n > first)
            divide_in_place((char *)data + first * size, dtype, n - first < CHUNK ? n - first : CHUNK,
                            divisor);
        uint64_t tail[CHUNK]; /* 8-byte elements at most */
        if (first + CHUNK > n) {
            memset(tail, 0, sizeof tail);
            if (n > first) memcpy(tail, p, (size_t)((n - first) * size));
            p = tail;
        }
        double out[2];
        switch (dtype) {
#if defined(__AVX2__)
        case DT_F32: chunk_f32_avx2(p, first, s0, s1, out, with_l1); break;
#else
        case DT_F32: chunk_f32(p, first, s0, s1, out, with_l1); break;
#endif
        case DT_F64: chunk_f64(p, first, s0, s1, out, with_l1); break;
        case DT_F16: chunk_f16(p, first, s0, s1, out, with_l1); break;
        default: chunk_bf16(p, first, s0, s1, out, with_l1); break;
        }
        ps[c] = out[0];
        if (with_l1) pa[c] = out[1];
    }
}

/* check_chunks with a run-time with_l1; returns 0, -1 for an unknown dtype, -3 for a divisor
 * outside [1, 2^24] or with a 16-bit dtype (those buckets are divided before the reduction). */
int sg_check_chunks(void *data, int dtype, int64_t n, int64_t c_begin, int64_t c_end,
                    uint32_t s0, uint32_t s1, double *ps, double *pa, int with_l1,
                    int64_t divisor) {
    int size = elem_size(dtype);
    if (size == 0) return -1;
    if (divisor < 1 || divisor > (1 << 24) || (divisor > 1 && size == 2)) return -3;
    if (with_l1)
        check_chunks(data, dtype, size, n, c_begin, c_end, s0, s1, ps, pa, 1, divisor);
    else
        check_chunks(data, dtype, size, n, c_begin, c_end, s0, s1, ps, pa, 0, divisor);
    return 0;
}

/* The chunk partials (ps, pa: `padded` = a power of two >= nchunks entries, zero past nchunks)
 * reduced by the halving tree, in place: out = {S, A, 1.0 if A is not finite else 0.0}; without
 * with_l1 (pa unused) {S, 0.0, 1.0 if S is not finite else 0.0}. */
void sg_check_finish(double *ps, double *pa, int64_t padded, double *out, int with_l1) {
    out[0] = tree(ps, padded);
    if (with_l1) {
        out[1] = tree(pa, padded);
        out[2] = out[1] <= DOUBLE_MAX ? 0.0 : 1.0; /* NaN compares false */
    } else {
        out[1] = 0.0;
        out[2] = out[0] <= DOUBLE_MAX && out[0] >= -DOUBLE_MAX ? 0.0 : 1.0;
    }
}

/* The whole check in one call (one thread). scratch: 2 * padded doubles (padded without
 * with_l1). */
int sg_check(void *data, int dtype, int64_t n, uint32_t s0, uint32_t s1, double *scratch,
             int64_t padded, double *out, int with_l1, int64_t divisor) {
    int64_t nchunks = n > 0 ? (n + CHUNK - 1) / CHUNK : 1;
    if (padded < nchunks) return -2;
    double *ps = scratch, *pa = with_l1 ? scratch + padded : NULL;
    for (int64_t i = nchunks; i < padded; i++) {
        ps[i] = 0.0;
        if (with_l1) pa[i] = 0.0;
    }
    int rc = sg_check_chunks(data, dtype, n, 0, nchunks, s0, s1, ps, pa, with_l1, divisor);
    if (rc != 0) return rc;
    sg_check_finish(ps, pa, padded, out, with_l1);
    return 0;
}
