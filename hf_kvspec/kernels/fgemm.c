/* fp32 few-row GEMM for CPU decoding: out[R, O] = x[R, I] @ W[O, I]^T (+ bias[O]), the weight read once for all
 * rows.
 *
 * Boundary: plain C over raw pointers, called through ctypes from hf_kvspec/kernels/fp32.py, which checks every
 * shape, dtype and contiguity before the call and makes the layout (pack_fp32); nothing here allocates, checks or
 * keeps state.
 *
 * Layout (``P = ceil(O / 16)`` panels of 16 output rows): panels [P, I, 16] fp32, panels[p, i, j] = W[16 p + j, i]
 * (rows past O are zero and never written). A panel is one contiguous stream of I * 64 bytes and panels follow one
 * another, so a call reads the whole weight front to back, which the hardware prefetcher follows.
 *
 * Micro-kernel (the classic register-blocked GEMM one): a tile of RB activation rows x 16 outputs keeps 2 RB
 * accumulators (8 outputs each) in registers; per input i it loads the panel's 16 weights once (2 vectors) and
 * meets each row's x[r, i] (broadcast) with 2 FMAs. RB <= 6: 12 accumulators + 2 weights + 1 broadcast fill the 16
 * ymm registers. Rows beyond 6 run as further tiles over the same panel, in slices of KC inputs (KC * 64 bytes stay
 * in L1 while every tile passes over them), the partial sums kept in ``out`` between slices. Each output is one
 * fp32 FMA chain over i in order, started from the bias, so it differs from other summation orders by fp32
 * rounding only. Many rows (prefills) run the same way, one panel at a time with x re-read from cache per panel;
 * x beyond the L2 cache (thousands of rows) would want blocking over rows too, which is not done.
 *
 * Built with -mavx2 -mfma when the CPU has them (the vector path), else as portable C (the scalar path); with
 * -fopenmp for calls on several threads.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK_ABI_VERSION 2 /* build.py's ABI_VERSION: a library reporting another value is rebuilt */

int qk_abi_version(void) { return QK_ABI_VERSION; }

#define NR 16 /* outputs per panel */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int fk_vector_path(void) { return 1; }

#define INLINE static inline __attribute__((always_inline))
#define RB_MAX 6
#define KC 256 /* inputs per slice when rows need several tiles: 16 KiB of a panel, beside 6 KiB of x, in L1 */
/* Prefetch (variants timed over the bundled model's shapes at R = 1..32 on an AVX2 Zen 3; the kept one is what
 * scripts/benchmark.py fgemm reports): one tile of 1-2 rows keeps up with the hardware prefetcher and ran slower
 * with software prefetch; one tile of 3-6 rows runs NEAR_AHEAD bytes ahead into L1; several tiles
 * fetch FAR_SLICES slices ahead into L2 while the later tiles compute from cache, so the memory stays busy. */
#define NEAR_ROWS 3
#define NEAR_AHEAD 4096
#define FAR_SLICES 2

/* the mask for the last panel's n < 16 valid outputs, as two 8-lane masks */
INLINE void tail_masks(int n, __m256i mask[2]) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    mask[0] = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
    mask[1] = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lanes);
}

/* what every tile of one call shares */
typedef struct {
    const float *x;     /* [R, I] */
    int64_t R, I;
    const float *bias;  /* [O] or NULL */
    float *out;         /* [R, O] */
    int64_t O;
    int64_t near_ahead; /* bytes ahead of the panel stream to prefetch into L1 (0: none) */
    int64_t far_ahead;  /* bytes ahead to prefetch into L2 (0: none) */
} gemm_call;

/* one tile's accumulators start from out (a later slice), the bias (the first slice) or zero */
INLINE void tile_start(const float *src, int n, const __m256i mask[2], __m256 *lo, __m256 *hi) {
    if (!src) {
        *lo = *hi = _mm256_setzero_ps();
    } else if (n == NR) {
        *lo = _mm256_loadu_ps(src);
        *hi = _mm256_loadu_ps(src + 8);
    } else {
        *lo = _mm256_maskload_ps(src, mask[0]);
        *hi = _mm256_maskload_ps(src + 8, mask[1]);
    }
}

INLINE void tile_store(float *dst, int n, const __m256i mask[2], __m256 lo, __m256 hi) {
    if (n == NR) {
        _mm256_storeu_ps(dst, lo);
        _mm256_storeu_ps(dst + 8, hi);
    } else {
        _mm256_maskstore_ps(dst, mask[0], lo);
        _mm256_maskstore_ps(dst + 8, mask[1], hi);
    }
}

/* the accumulators as named variables (in an array, gcc kept them on the stack: a store per FMA) */
#define FOR_ROWS(DO) DO(0) DO(1) DO(2) DO(3) DO(4) DO(5)
#define DECLARE(b) __m256 lo##b = _mm256_setzero_ps(), hi##b = lo##b;
#define START(b) if (RB > b) tile_start(first ? bias : dst + b * O, n, mask, &lo##b, &hi##b);
#define STEP(b) if (RB > b) {                                 \
        const __m256 xb = _mm256_broadcast_ss(xi + b * I);    \
        lo##b = _mm256_fmadd_ps(w0, xb, lo##b);               \
        hi##b = _mm256_fmadd_ps(w1, xb, hi##b);               \
    }
#define STORE(b) if (RB > b) tile_store(dst + b * O, n, mask, lo##b, hi##b);

/* rows r0..r0+RB-1 x the panel's outputs o0..o0+n-1 (n <= 16) over inputs k0..k1-1; first: the first slice */
INLINE void tile(const int RB, const gemm_call *c, const float *panel, int64_t k0, int64_t k1, int64_t o0,
                 int64_t r0, int n, int first) {
    const int64_t I = c->I, O = c->O, near = c->near_ahead, far = c->far_ahead;
    const float *bias = c->bias ? c->bias + o0 : NULL;
    float *dst = c->out + r0 * O + o0;
    __m256i mask[2];
    tail_masks(n, mask);
    FOR_ROWS(DECLARE)
    FOR_ROWS(START)
    const float *xi = c->x + r0 * I + k0;
    for (const float *w = panel + NR * k0, *end = panel + NR * k1; w < end; w += NR, xi++) {
        if (near) _mm_prefetch((const char *)w + near, _MM_HINT_T0);
        if (far) _mm_prefetch((const char *)w + far, _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        FOR_ROWS(STEP)
    }
    FOR_ROWS(STORE)
}

/* one function per tile height, not inlined into the panel loop: each gets the general registers to itself
 * (inlined, gcc spilled the loop's pointers to the stack) */
#define TILE_FN(rb)                                                                                        \
    __attribute__((noinline)) static void tile##rb(const gemm_call *c, const float *panel, int64_t k0,     \
                                                   int64_t k1, int64_t o0, int64_t r0, int n, int first) { \
        tile(rb, c, panel, k0, k1, o0, r0, n, first);                                                      \
    }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6)

typedef void (*tile_fn)(const gemm_call *, const float *, int64_t, int64_t, int64_t, int64_t, int, int);
static const tile_fn TILES[RB_MAX + 1] = {NULL, tile1, tile2, tile3, tile4, tile5, tile6};

/* every row against panels p0..p1-1 */
static void panels_range(const float *x, int64_t R, int64_t I, const float *panels, const float *bias, int64_t O,
                         float *out, int64_t p0, int64_t p1) {
    const int64_t tiles = (R + RB_MAX - 1) / RB_MAX;
    const int64_t slice = tiles == 1 ? I : KC;
    const gemm_call c = {x, R, I, bias, out, O, tiles == 1 && R >= NEAR_ROWS ? NEAR_AHEAD : 0,
                         tiles > 1 ? FAR_SLICES * KC * NR * (int64_t)sizeof(float) : 0};
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = panels + p * NR * I;
        const int64_t o0 = p * NR;
        const int n = O - o0 < NR ? (int)(O - o0) : NR;
        int64_t k0 = 0;
        do {  /* at least once: I = 0 still writes the bias */
            const int64_t k1 = k0 + slice < I ? k0 + slice : I;
            for (int64_t t = 0, r0 = 0; t < tiles; t++) {  /* tiles of balanced heights: e.g. 8 -> 4 + 4 */
                const int64_t rb = (R - r0 + tiles - t - 1) / (tiles - t);
                TILES[rb](&c, panel, k0, k1, o0, r0, n, k0 == 0);
                r0 += rb;
            }
            k0 = k1;
        } while (k0 < I);
    }
}

#else /* portable scalar path */

int fk_vector_path(void) { return 0; }

static void panels_range(const float *x, int64_t R, int64_t I, const float *panels, const float *bias, int64_t O,
                         float *out, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
        for (int64_t r = 0; r < R; r++)
            for (int j = 0; j < NR && p * NR + j < O; j++) {
                float sum = bias ? bias[p * NR + j] : 0.0f;
                for (int64_t i = 0; i < I; i++) sum += panels[(p * I + i) * NR + j] * x[r * I + i];
                out[r * O + p * NR + j] = sum;
            }
}

#endif

/* out[R, O] = x[R, I] @ W^T + bias over the panels [ceil(O / 16), I, 16]; bias may be NULL. threads > 1 splits
 * the panels evenly among that many OpenMP threads (where built with OpenMP): each output is computed by one
 * thread exactly as with one, so the result does not depend on the thread count. */
int fk_gemm(const float *x, int64_t R, int64_t I, const float *panels, const float *bias, int64_t O, float *out,
            int threads) {
    const int64_t P = (O + NR - 1) / NR;
#ifdef _OPENMP
    if (threads > 1 && P > 1) {
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
            panels_range(x, R, I, panels, bias, O, out, P * t / n, P * (t + 1) / n);
        }
        return 0;
    }
#endif
    (void)threads;
    panels_range(x, R, I, panels, bias, O, out, 0, P);
    return 0;
}

int fk_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
