/* NH fingerprint, first level and tree (see slurm_guard/fingerprint/nh.py for the construction
 * and its false-match bound). Integer arithmetic only: the output is bit-identical to the torch
 * specification `reference_fingerprint` and to the Triton kernel (tested).
 * Built by slurm_guard/kernels/native.py; CI compiles it with -Wall -Wextra -Werror.
 *
 * What limits it (AVX2; measured on a 2-core AMD EPYC VM, Zen 3, 3.1 GHz, no AVX-512): per
 * 64 bytes and both lanes the loop needs 16 vector ALU ops (4 add32 for the keys, 4 srli64,
 * 4 mul_epu32, 4 add64) and 6 loads (2 data, 4 keys). Zen 3 has four 256-bit integer pipes
 * (multiplies on two of them, shifts and shuffles on the other two, adds on all four; measured
 * with isolated instruction mixes) and two 256-bit load ports, so the ALU pipes bound it at
 * 4 cycles per 64 bytes (16 B/cycle, ~50 GB/s); the loads alone would allow 3 cycles. The loop
 * runs 4.7 cycles per 64 bytes on L1-resident data and 5.0 over a 4 MB tensor (~40 GB/s;
 * before this version 6.5, ~31 GB/s), while a float32 sum of the same 4 MB needs one load and
 * one add per 32 bytes and streams from L3 at 50-58 GB/s (torch) or ~70 GB/s (hand-written
 * AVX2). So 1e6 float32 elements (4 MB) can reach at most ~0.7x of torch's sum() here
 * (40/58; measured 0.51-0.73x over seven benchmark runs on the shared, loaded machine; in
 * interleaved runs beside the old kernel 0.37-0.73x against its 0.34-0.67x, always ahead),
 * while tensors in DRAM (1e7, 1e8 elements) are memory-bound at 0.7-1.0x
 * (benchmarks/fingerprint_throughput.py; the spread is other jobs' memory traffic).
 * 8 vector ops per 32 bytes is the minimum for two NH lanes with 32x32-bit multiplies: each
 * lane needs its own key add and product sum, and mul_epu32 reads only even dword slots, so
 * the 8 odd-slot words of a lane's two keyed vectors (per 64 bytes) must be moved into even
 * slots (a shift or shuffle: the same pipes; pairing words 8 apart instead of adjacent still
 * leaves 8 of them) or loaded again with their keys (12 loads per 64 bytes: slower). Going
 * faster on cache-resident data needs less work per byte, i.e. a different construction (one
 * NH lane measured ~1.35x faster at 4 MB, but its bound is 2^-32, not 2^-64), not scheduling.
 * Tensors streamed from DRAM take a variant of the same loop (see STREAM_MIN_BYTES, nh_block
 * and sg_rows): there the folded loads and block-by-block coefficients were 5-15% faster.
 * (The AVX-512 path below compiles with -mavx512f -Werror but has not run here: no AVX-512.) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Defined once, in Python (fingerprint/nh.py, fingerprint/tree.py), and passed with -D. */
#if !defined(NH_WORDS) || !defined(ROW) || !defined(LANES) || !defined(PRIME) || !defined(MAX_LEVELS)
#error "compile with -DNH_WORDS=... -DROW=... -DLANES=... -DPRIME=... -DMAX_LEVELS=... (see kernels/native.py)"
#endif
#if LANES != 2
#error "the kernel computes exactly two NH lanes"
#endif
#define BLOCK_BYTES (4 * NH_WORDS)
/* Software prefetch one block ahead: memory-resident tensors (1e8 float32) went from 0.53-0.78x
 * to 0.73-0.91x of a float32 sum() with it on an AVX2 EPYC (interleaved, loaded machine), and
 * it is neutral to slightly better (0-5%) on L2/L3-resident tensors, so it is always on; a
 * hint only (never faults past the end), and the output does not depend on it. */
#define PREFETCH_BYTES BLOCK_BYTES
/* STREAM_MIN_BYTES (from fingerprint/nh.py): above it a tensor is taken to stream from DRAM. */
#ifndef STREAM_MIN_BYTES
#error "compile with -DSTREAM_MIN_BYTES=... (see fingerprint.nh.kernel_defines)"
#endif
#define BLOCKS_PER_ROW (ROW / (4 * LANES))

/* nh_block leaves NH_PARTS partial sums per lane whose sum mod 2^64 is the lane's NH value:
 * the AVX2 loop stores its four 64-bit accumulator lanes and sg_rows adds them up after the
 * row, off the vector loop's critical path (3% over reducing inside the block). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define NH_PARTS 4
#else
#define NH_PARTS 1
#endif

/* NH of one full 4 KiB block in both lanes: out[lane * NH_PARTS + part]. Unaligned loads: a
 * byte tensor may start anywhere. Inlined so that the row loop keeps keys and pointers in
 * registers across blocks. */
static inline __attribute__((always_inline)) void nh_block(const uint8_t *p, const uint32_t *k0,
                                                           const uint32_t *k1,
                                                           uint64_t out[LANES * NH_PARTS],
                                                           const int stream) {
#if defined(__AVX512F__)
    (void)stream;
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    for (int i = 0; i < NH_WORDS; i += 32) {
        __builtin_prefetch(p + 4 * i + PREFETCH_BYTES);
        __builtin_prefetch(p + 4 * i + PREFETCH_BYTES + 64);
        __m512i m = _mm512_loadu_si512((const void *)(p + 4 * i));
        __m512i n = _mm512_loadu_si512((const void *)(p + 4 * i + 64));
        __m512i x = _mm512_add_epi32(m, _mm512_loadu_si512((const void *)(k0 + i)));
        __m512i y = _mm512_add_epi32(m, _mm512_loadu_si512((const void *)(k1 + i)));
        __m512i u = _mm512_add_epi32(n, _mm512_loadu_si512((const void *)(k0 + i + 16)));
        __m512i v = _mm512_add_epi32(n, _mm512_loadu_si512((const void *)(k1 + i + 16)));
        a0 = _mm512_add_epi64(a0, _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32)));
        a1 = _mm512_add_epi64(a1, _mm512_mul_epu32(y, _mm512_srli_epi64(y, 32)));
        b0 = _mm512_add_epi64(b0, _mm512_mul_epu32(u, _mm512_srli_epi64(u, 32)));
        b1 = _mm512_add_epi64(b1, _mm512_mul_epu32(v, _mm512_srli_epi64(v, 32)));
    }
    out[0] = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, b0));
    out[1] = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a1, b1));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
    for (int i = 0; i < NH_WORDS; i += 16) {
        __builtin_prefetch(p + 4 * i + PREFETCH_BYTES);
        __m256i m = _mm256_loadu_si256((const __m256i *)(p + 4 * i));
        __m256i n = _mm256_loadu_si256((const __m256i *)(p + 4 * i + 32));
        /* Cache-resident data: keep it in registers. Without this GCC folds each data load
         * into both lanes' adds (8 loads per 64 bytes instead of 6) and the loop runs 20-30%
         * slower; but on tensors streamed from DRAM the folded form was 5-15% faster (paired
         * runs at 400 MB), so `stream` keeps it there. */
        if (!stream) __asm__("" : "+x"(m), "+x"(n));
        __m256i x = _mm256_add_epi32(m, _mm256_loadu_si256((const __m256i *)(k0 + i)));
        __m256i y = _mm256_add_epi32(m, _mm256_loadu_si256((const __m256i *)(k1 + i)));
        __m256i u = _mm256_add_epi32(n, _mm256_loadu_si256((const __m256i *)(k0 + i + 8)));
        __m256i v = _mm256_add_epi32(n, _mm256_loadu_si256((const __m256i *)(k1 + i + 8)));
        a0 = _mm256_add_epi64(a0, _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32)));
        a1 = _mm256_add_epi64(a1, _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32)));
        b0 = _mm256_add_epi64(b0, _mm256_mul_epu32(u, _mm256_srli_epi64(u, 32)));
        b1 = _mm256_add_epi64(b1, _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32)));
    }
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi64(a0, b0));
    _mm256_storeu_si256((__m256i *)(out + NH_PARTS), _mm256_add_epi64(a1, b1));
#else
    (void)stream;
    uint64_t s0 = 0, s1 = 0;
    for (int i = 0; i < NH_WORDS; i += 2) {
        uint32_t m0, m1;
        memcpy(&m0, p + 4 * i, 4);
        memcpy(&m1, p + 4 * i + 4, 4);
        s0 += (uint64_t)(uint32_t)(m0 + k0[i]) * (uint64_t)(uint32_t)(m1 + k0[i + 1]);
        s1 += (uint64_t)(uint32_t)(m0 + k1[i]) * (uint64_t)(uint32_t)(m1 + k1[i + 1]);
    }
    out[0] = s0;
    out[1] = s1;
#endif
}

/* One block's NH values as the tree's 16-bit words, times their level-0 coefficients, into acc.
   Each term < 2^16 * 2^31 and a row has 8 * BLOCKS_PER_ROW = 1024 terms: < 2^57, exact. */
static inline __attribute__((always_inline)) void add_words(const uint64_t h[LANES * NH_PARTS],
                                                            const int64_t *c, uint64_t acc[2]) {
    for (int lane = 0; lane < LANES; lane++) {
        uint64_t nh = 0; /* mod 2^64, like NH itself */
        for (int part = 0; part < NH_PARTS; part++) nh += h[lane * NH_PARTS + part];
        for (int w = 0; w < 4; w++) {
            uint64_t word = (nh >> (16 * w)) & 0xFFFF;
            acc[0] += word * (uint64_t)c[0];
            acc[1] += word * (uint64_t)c[1];
            c += LANES;
        }
    }
}

/* Level-0 tree rows [row_begin, row_end): NH of the row's blocks, split into 16-bit words,
   hashed with level-0 coefficients. Blocks past the end contribute zero words (tree padding).
   Cache-resident tensors: all NH values of a row first, then the coefficients, so the vector
   loop runs back to back (3% faster at 4 MB). Tensors above STREAM_MIN_BYTES come from DRAM:
   block by block, which keeps memory requests flowing (the batched form was ~5% slower at
   400 MB). The same sums either way. */
int sg_rows(const uint8_t *data, int64_t nbytes, int64_t row_begin, int64_t row_end,
            const uint32_t *keys, const int64_t *coeffs, int64_t *rows) {
    int64_t nblocks = nbytes > 0 ? (nbytes + BLOCK_BYTES - 1) / BLOCK_BYTES : 1;
    int64_t nfull = nbytes / BLOCK_BYTES;
    const uint32_t *k0 = keys, *k1 = keys + NH_WORDS;
    const int stream = nbytes >= STREAM_MIN_BYTES;
    const int64_t per_block = 4 * LANES * LANES; /* coefficients per block */
    uint64_t h[BLOCKS_PER_ROW][LANES * NH_PARTS];
    uint8_t tail[BLOCK_BYTES];
    for (int64_t r = row_begin; r < row_end; r++) {
        int64_t first = r * BLOCKS_PER_ROW;
        int64_t last = first + BLOCKS_PER_ROW < nblocks ? first + BLOCKS_PER_ROW : nblocks;
        int64_t full = last < nfull ? last : nfull;
        uint64_t acc[2] = {0, 0};
        int64_t b = first;
        if (stream) {
            for (; b < full; b++) {
                nh_block(data + b * BLOCK_BYTES, k0, k1, h[0], 1);
                add_words(h[0], coeffs + (b - first) * per_block, acc);
            }
        } else {
            for (; b < full; b++) nh_block(data + b * BLOCK_BYTES, k0, k1, h[b - first], 0);
            for (int64_t j = 0; j < full - first; j++) add_words(h[j], coeffs + j * per_block, acc);
        }
        for (; b < last; b++) {
            int64_t off = b * BLOCK_BYTES;
            memset(tail, 0, BLOCK_BYTES);
            if (nbytes > off) memcpy(tail, data + off, (size_t)(nbytes - off));
            nh_block(tail, k0, k1, h[0], 0);
            add_words(h[0], coeffs + (b - first) * per_block, acc);
        }
        rows[2 * r] = (int64_t)(acc[0] % (uint64_t)PRIME);
        rows[2 * r + 1] = (int64_t)(acc[1] % (uint64_t)PRIME);
    }
    return 0;
}

/* One tree level over 16-bit words: words[i] for i < n, zero after; out gets ceil(n/ROW) rows. */
static int64_t compress(const int64_t *words, int64_t n, const int64_t *c, int64_t *out) {
    int64_t nrows = (n + ROW - 1) / ROW;
    if (nrows == 0) nrows = 1;
    for (int64_t r = 0; r < nrows; r++) {
        uint64_t acc0 = 0, acc1 = 0;
        for (int64_t j = 0; j < ROW && r * ROW + j < n; j++) {
            uint64_t w = (uint64_t)words[r * ROW + j];
            acc0 += w * (uint64_t)c[2 * j];
            acc1 += w * (uint64_t)c[2 * j + 1];
        }
        out[2 * r] = (int64_t)(acc0 % (uint64_t)PRIME);
        out[2 * r + 1] = (int64_t)(acc1 % (uint64_t)PRIME);
    }
    return nrows;
}

/* Levels 1.. of the tree over the level-0 rows, then the tail level: out[2]. 0 ok, -1 no memory,
   -2 more levels than coefficients. */
int sg_finish(const int64_t *rows, int64_t nrows, const int64_t *coeffs, const int64_t *tailv,
              int64_t ntail, int64_t *out) {
    int64_t cap = 2 * LANES * nrows + 3 * ntail + LANES * 2 + 8;
    int64_t *words = malloc(sizeof(int64_t) * cap);
    int64_t *vals = malloc(sizeof(int64_t) * (LANES * nrows + LANES));
    if (!words || !vals) { free(words); free(vals); return -1; }
    memcpy(vals, rows, sizeof(int64_t) * LANES * nrows);
    int level = 0;
    while (nrows > 1) {
        level++;
        if (level >= MAX_LEVELS) { free(words); free(vals); return -2; }
        int64_t n = 0;
        for (int64_t i = 0; i < LANES * nrows; i++) {
            words[n++] = vals[i] & 0xFFFF;
            words[n++] = vals[i] >> 16;
        }
        nrows = compress(words, n, coeffs + (int64_t)level * ROW * LANES, vals);
    }
    int64_t n = 0;
    for (int i = 0; i < LANES; i++) {
        words[n++] = vals[i] & 0xFFFF;
        words[n++] = vals[i] >> 16;
    }
    for (int64_t i = 0; i < ntail; i++) {
        uint64_t v = (uint64_t)tailv[i];
        words[n++] = (int64_t)(v & 0xFFFF);
        words[n++] = (int64_t)((v >> 16) & 0xFFFF);
        words[n++] = (int64_t)((v >> 32) & 0xFFFF);
    }
    compress(words, n, coeffs + (int64_t)(MAX_LEVELS - 1) * ROW * LANES, out);
    free(words);
    free(vals);
    return 0;
}

/* The whole fingerprint in one call (small and medium tensors). */
int sg_fingerprint(const uint8_t *data, int64_t nbytes, const uint32_t *keys,
                   const int64_t *coeffs, const int64_t *tailv, int64_t ntail, int64_t *out) {
    int64_t nblocks = nbytes > 0 ? (nbytes + BLOCK_BYTES - 1) / BLOCK_BYTES : 1;
    int64_t nrows = (nblocks + BLOCKS_PER_ROW - 1) / BLOCKS_PER_ROW;
    int64_t local[2 * 16];
    int64_t *rows = nrows <= 16 ? local : malloc(sizeof(int64_t) * 2 * nrows);
    if (!rows) return -1;
    sg_rows(data, nbytes, 0, nrows, keys, coeffs, rows);
    int rc = sg_finish(rows, nrows, coeffs, tailv, ntail, out);
    if (rows != local) free(rows);
    return rc;
}
