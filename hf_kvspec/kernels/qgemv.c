/* Weight-only quantized GEMV / small GEMM for CPU decoding: out[R, O] = x[R, I] @ dequant(W)[O, I]^T (+ bias[O]).
 *
 * Boundary: plain C over raw pointers, called through ctypes from hf_kvspec/kernels/quantized.py, which checks
 * every shape, dtype and contiguity before the call; nothing here checks or keeps state (the one allocation is a
 * per-call scratch of 16 I bytes, for int4 with 4 or more rows). The layouts
 * are made by quantize_int8 / quantize_int4 there (the comments below restate them).
 *
 * Layouts (``Ob = ceil(O / 4)``: output rows are interleaved 4 at a time, so the kernel reads one sequential
 * stream, which the hardware prefetcher follows; padded rows have zero codes and scales and are never written):
 * int8   codes [Ob, ceil(I / 8), 4, 8] int8 (inputs zero-padded to a multiple of 8), scales [4 Ob] fp32:
 *        W[o, i] = code(o, i) * scales[o]
 * int4   codes [Ob, I / 32, 4, 16] uint8, scales and offsets [Ob, G, 4] fp16, G = I / group:
 *        W[o, i] = q(o, i) * scale(o, g) + offset(o, g), g = i / group, q in 0..15, where in each block of 32
 *        inputs (16 bytes per row) byte j holds input j in its low nibble and input j + 16 in its high one.
 *
 * Accumulation is fp32 throughout; a row's int8 scale is applied once to its sum. One activation row: the codes
 * are widened in registers and meet x directly (int4: each group's scale and offset are applied to its partial
 * sums). Several rows: all of them run against a block of 4 output rows while it sits in L1, so the weights are
 * read from memory once; int8 codes are widened again per chunk of 3 rows, int4 codes (dearer to unpack) are
 * dequantized once per block into an fp32 scratch when there is more than one chunk. Which path wins was measured
 * (scripts/benchmark.py qgemv).
 * Entry points return 0, or -1 when the scratch cannot be allocated.
 *
 * Built with -mavx2 -mfma -mf16c when the CPU has them (the vector path), else as portable C (the scalar path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK_ABI_VERSION 2

int qk_abi_version(void) { return QK_ABI_VERSION; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int qk_vector_path(void) { return 1; }

#define INLINE static inline __attribute__((always_inline))
#define RB_MAX 3 /* activation rows per tile: 4 x 3 accumulators + 3 activations + 1 weight = 16 ymm registers */

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE __m256 i8_widen(const int8_t *p) {  /* 8 int8 codes -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* acc[a][b] += codes of row a (8 inputs at chunk) * xs[b] (8 floats each) */
INLINE void i8_chunk(const int RB, __m256 acc[4][RB_MAX], const int8_t *chunk, const float *const xs[RB_MAX]) {
    __m256 xv[RB_MAX];
    for (int b = 0; b < RB; b++) xv[b] = _mm256_loadu_ps(xs[b]);
    for (int a = 0; a < 4; a++) {
        __m256 w = i8_widen(chunk + 8 * a);
        for (int b = 0; b < RB; b++) acc[a][b] = _mm256_fmadd_ps(w, xv[b], acc[a][b]);
    }
}

/* int8, output rows o0..o0+3 (one interleaved block [Ic][4][8]) x activation rows r0..r0+RB-1 */
INLINE void i8_tile(const int RB, const float *x, int64_t I, const int8_t *block, const float *scales,
                    const float *bias, int64_t O, float *out, int64_t o0, int64_t r0) {
    __m256 acc[4][RB_MAX];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < RB; b++) acc[a][b] = _mm256_setzero_ps();
    const int64_t full = I / 8, rest = I % 8;
    const float *xs[RB_MAX];
    for (int64_t c = 0; c < full; c++) {
        for (int b = 0; b < RB; b++) xs[b] = x + (r0 + b) * I + 8 * c;
        i8_chunk(RB, acc, block + 32 * c, xs);
    }
    if (rest) {  /* the last partial chunk: activations copied into zero-padded rows (its codes are zero-padded) */
        float tail[RB_MAX][8] = {{0}};
        for (int b = 0; b < RB; b++) {
            memcpy(tail[b], x + (r0 + b) * I + 8 * full, rest * sizeof(float));
            xs[b] = tail[b];
        }
        i8_chunk(RB, acc, block + 32 * full, xs);
    }
    for (int a = 0; a < 4 && o0 + a < O; a++)
        for (int b = 0; b < RB; b++)
            out[(r0 + b) * O + o0 + a] = hsum8(acc[a][b]) * scales[o0 + a] + (bias ? bias[o0 + a] : 0.0f);
}

/* int4 with more rows than one tile: a block's weights are dequantized once into an fp32 scratch [I / 8][4][8]
 * (in L1), then every RB-row chunk of x runs against it, so the unpacking is not repeated per chunk (int8's
 * widening is cheaper than the scratch's stores and loads: measured, so int8 widens per chunk). acc += w * x. */
INLINE void f32_tile(const int RB, const float *x, int64_t I, const float *scratch, __m256 acc[4][RB_MAX],
                     int64_t r0) {
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < RB; b++) acc[a][b] = _mm256_setzero_ps();
    for (int64_t c = 0; c < I / 8; c++) {  /* I is a multiple of 32 for int4 */
        __m256 xv[RB_MAX];
        for (int b = 0; b < RB; b++) xv[b] = _mm256_loadu_ps(x + (r0 + b) * I + 8 * c);
        for (int a = 0; a < 4; a++) {
            const __m256 w = _mm256_load_ps(scratch + 32 * c + 8 * a);
            for (int b = 0; b < RB; b++) acc[a][b] = _mm256_fmadd_ps(w, xv[b], acc[a][b]);
        }
    }
}

/* out[r0 + b, o0 + a] = sum(acc[a][b]) + bias[o0 + a] */
INLINE void store_tile(const int RB, __m256 acc[4][RB_MAX], const float *bias, int64_t O, float *out, int64_t o0,
                       int64_t r0) {
    for (int a = 0; a < 4 && o0 + a < O; a++)
        for (int b = 0; b < RB; b++) out[(r0 + b) * O + o0 + a] = hsum8(acc[a][b]) + (bias ? bias[o0 + a] : 0.0f);
}

/* every RB_MAX-row chunk of x (then the 1 or 2 left) against the scratch of output rows o0..o0+3 */
static void scratch_rows(const float *x, int64_t R, int64_t I, const float *scratch, const float *bias, int64_t O,
                         float *out, int64_t o0) {
    __m256 acc[4][RB_MAX];
    int64_t r0 = 0;
    for (; r0 + RB_MAX <= R; r0 += RB_MAX) {
        f32_tile(RB_MAX, x, I, scratch, acc, r0);
        store_tile(RB_MAX, acc, bias, O, out, o0, r0);
    }
    if (R - r0 == 2) {
        f32_tile(2, x, I, scratch, acc, r0);
        store_tile(2, acc, bias, O, out, o0, r0);
    } else if (R - r0 == 1) {
        f32_tile(1, x, I, scratch, acc, r0);
        store_tile(1, acc, bias, O, out, o0, r0);
    }
}

static float *scratch_alloc(int64_t I) {  /* [I / 8][4][8] floats, 32-byte aligned (a multiple of 32 bytes) */
    return (float *)aligned_alloc(32, (size_t)(I / 8) * 32 * sizeof(float));
}

int qk_int8_gemm(const float *x, int64_t R, int64_t I, const int8_t *codes, const float *scales,
                 const float *bias, int64_t O, float *out) {
    const int64_t block_bytes = 4 * 8 * ((I + 7) / 8);
    for (int64_t o0 = 0; o0 < O; o0 += 4) {
        const int8_t *block = codes + (o0 / 4) * block_bytes;
        int64_t r0 = 0;
        for (; r0 + RB_MAX <= R; r0 += RB_MAX) i8_tile(RB_MAX, x, I, block, scales, bias, O, out, o0, r0);
        if (R - r0 == 2) i8_tile(2, x, I, block, scales, bias, O, out, o0, r0);
        if (R - r0 == 1) i8_tile(1, x, I, block, scales, bias, O, out, o0, r0);
    }
    return 0;
}

/* int4 codes of one row in a 32-input block (16 bytes) -> 4 vectors of 8 codes, for inputs +0, +8, +16, +24 */
INLINE void i4_widen(const uint8_t *p, __m256 q[4]) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}

/* int4, one activation row: sum_i (q s + m) x = sum_g s_g (sum_{i in g} q x) + sum_g m_g xsum_g, so the codes meet
 * x undequantized and each group's scale is applied once to its partial sums (one FMA chain per output row: more
 * chains spill registers, which measured slower). */
INLINE void i4_tile_row(const float *x, const uint8_t *block, const uint16_t *scales, const uint16_t *offsets,
                        int64_t G, int64_t group, const float *xsum, const float *bias, int64_t O, float *out,
                        int64_t o0) {
    __m256 acc[4];
    __m128 offset_sum = _mm_setzero_ps();
    for (int a = 0; a < 4; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 dot[4];
        for (int a = 0; a < 4; a++) dot[a] = _mm256_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
            const uint8_t *p = block + 2 * i;  /* 4 rows x 16 bytes per 32 inputs */
            for (int a = 0; a < 4; a++) {
                __m256 q[4];
                i4_widen(p + 16 * a, q);
                dot[a] = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(x + i), dot[a]);
                dot[a] = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + i + 8), dot[a]);
                dot[a] = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + i + 16), dot[a]);
                dot[a] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + i + 24), dot[a]);
            }
        }
        float s[4];
        _mm_storeu_ps(s, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + 4 * g))));
        __m128 m = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(offsets + 4 * g)));
        offset_sum = _mm_fmadd_ps(m, _mm_set1_ps(xsum[g]), offset_sum);
        for (int a = 0; a < 4; a++)
            acc[a] = _mm256_fmadd_ps(dot[a], _mm256_set1_ps(s[a]), acc[a]);
    }
    float off[4];
    _mm_storeu_ps(off, offset_sum);
    for (int a = 0; a < 4 && o0 + a < O; a++) out[o0 + a] = hsum8(acc[a]) + off[a] + (bias ? bias[o0 + a] : 0.0f);
}

/* int4, 2-3 activation rows: each weight is dequantized in registers (q * s + m) and meets those rows */
INLINE void i4_tile(const int RB, const float *x, int64_t I, const uint8_t *block, const uint16_t *scales,
                    const uint16_t *offsets, int64_t G, int64_t group, const float *bias, int64_t O, float *out,
                    int64_t o0, int64_t r0) {
    __m256 acc[4][RB_MAX];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < RB; b++) acc[a][b] = _mm256_setzero_ps();
    static const int x_offset[4] = {0, 8, 16, 24};
    for (int64_t g = 0; g < G; g++) {
        float s[4], m[4];
        _mm_storeu_ps(s, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + 4 * g))));
        _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(offsets + 4 * g))));
        for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
            const uint8_t *p = block + 2 * i;
            for (int a = 0; a < 4; a++) {
                __m256 q[4];
                i4_widen(p + 16 * a, q);
                for (int k = 0; k < 4; k++) {
                    __m256 w = _mm256_fmadd_ps(q[k], _mm256_set1_ps(s[a]), _mm256_set1_ps(m[a]));
                    for (int b = 0; b < RB; b++)
                        acc[a][b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (r0 + b) * I + i + x_offset[k]),
                                                    acc[a][b]);
                }
            }
        }
    }
    for (int a = 0; a < 4 && o0 + a < O; a++)
        for (int b = 0; b < RB; b++) out[(r0 + b) * O + o0 + a] = hsum8(acc[a][b]) + (bias ? bias[o0 + a] : 0.0f);
}

/* int4 block of 4 output rows -> fp32 scratch [I / 8][4][8]: w = q * s + m (one rounding) */
INLINE void i4_dequantize_block(const uint8_t *block, const uint16_t *scales, const uint16_t *offsets, int64_t G,
                                int64_t group, float *scratch) {
    for (int64_t g = 0; g < G; g++) {
        float s[4], m[4];
        _mm_storeu_ps(s, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + 4 * g))));
        _mm_storeu_ps(m, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(offsets + 4 * g))));
        for (int64_t i = g * group; i < (g + 1) * group; i += 32)
            for (int a = 0; a < 4; a++) {
                __m256 q[4];
                i4_widen(block + 2 * i + 16 * a, q);
                for (int k = 0; k < 4; k++)  /* q[k] holds inputs i + 8k .. i + 8k + 7 */
                    _mm256_store_ps(scratch + 4 * (i + 8 * k) + 8 * a,
                                    _mm256_fmadd_ps(q[k], _mm256_set1_ps(s[a]), _mm256_set1_ps(m[a])));
            }
    }
}

int qk_int4_gemm(const float *x, int64_t R, int64_t I, const uint8_t *codes, const uint16_t *scales,
                 const uint16_t *offsets, int64_t group, const float *bias, int64_t O, float *out) {
    const int64_t G = I / group;
    if (R == 1) {
        float stack_sums[1024], *xsum = G <= 1024 ? stack_sums : (float *)malloc(G * sizeof(float));
        if (!xsum) return -1;
        for (int64_t g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) sum += x[i];
            xsum[g] = sum;
        }
        for (int64_t o0 = 0; o0 < O; o0 += 4)
            i4_tile_row(x, codes + o0 * (I / 2), scales + o0 * G, offsets + o0 * G, G, group, xsum, bias, O, out,
                        o0);
        if (xsum != stack_sums) free(xsum);
        return 0;
    }
    if (R <= RB_MAX) {  /* one chunk of rows: a scratch would only add its stores and loads */
        for (int64_t o0 = 0; o0 < O; o0 += 4) {
            const uint8_t *block = codes + o0 * (I / 2);
            if (R == 3) i4_tile(3, x, I, block, scales + o0 * G, offsets + o0 * G, G, group, bias, O, out, o0, 0);
            else i4_tile(2, x, I, block, scales + o0 * G, offsets + o0 * G, G, group, bias, O, out, o0, 0);
        }
        return 0;
    }
    float *scratch = scratch_alloc(I);
    if (!scratch) return -1;
    for (int64_t o0 = 0; o0 < O; o0 += 4) {
        i4_dequantize_block(codes + o0 * (I / 2), scales + o0 * G, offsets + o0 * G, G, group, scratch);
        scratch_rows(x, R, I, scratch, bias, O, out, o0);
    }
    free(scratch);
    return 0;
}

#else /* portable scalar path */

int qk_vector_path(void) { return 0; }

#define INLINE_SCALAR static inline

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE_SCALAR int64_t i8_index(int64_t o, int64_t i, int64_t I) {
    return ((o / 4) * ((I + 7) / 8) + i / 8) * 32 + (o % 4) * 8 + i % 8;
}

int qk_int8_gemm(const float *x, int64_t R, int64_t I, const int8_t *codes, const float *scales,
                  const float *bias, int64_t O, float *out) {
    for (int64_t o = 0; o < O; o++)
        for (int64_t r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < I; i++) sum += (float)codes[i8_index(o, i, I)] * x[r * I + i];
            out[r * O + o] = sum * scales[o] + (bias ? bias[o] : 0.0f);
        }
    return 0;
}

INLINE_SCALAR int i4_code(const uint8_t *codes, int64_t o, int64_t i, int64_t I) {
    uint8_t byte = codes[(o / 4) * 2 * I + (i / 32) * 64 + (o % 4) * 16 + i % 16];
    return (i % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
}

int qk_int4_gemm(const float *x, int64_t R, int64_t I, const uint8_t *codes, const uint16_t *scales,
                  const uint16_t *offsets, int64_t group, const float *bias, int64_t O, float *out) {
    const int64_t G = I / group;
    for (int64_t o = 0; o < O; o++)
        for (int64_t r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < I; i++) {
                int64_t k = (o / 4) * G * 4 + (i / group) * 4 + o % 4;
                float w = (float)i4_code(codes, o, i, I) * half_to_float(scales[k]) + half_to_float(offsets[k]);
                sum += w * x[r * I + i];
            }
            out[r * O + o] = sum + (bias ? bias[o] : 0.0f);
        }
    return 0;
}

#endif
