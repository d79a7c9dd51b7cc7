/* exp for the C kernels: a scalar version any CPU compiles and an eight-lane AVX2 one, same polynomial.
 * Included by the .c files beside it (kernels/native_build.py hashes this header into their builds). */
#ifndef TANDEM_CPU_SIMD_EXP_H
#define TANDEM_CPU_SIMD_EXP_H
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

/* exp(x), x clamped to [-87, 88], within ~2 ulp: exp(x) = 2^n * exp(r), r = x - n ln2, |r| <= ln2/2.
 * (libm's expf is a scalar call per element, and the compilers do not vectorize this form either.) */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) ~ 1.6e-38: the smallest normal float's neighbourhood */
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;    /* ln2 in two parts (Cody-Waite) */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n as a float's exponent field */
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef TANDEM_AVX2
/* exp_clamped on eight lanes, with fused multiply-adds where it multiplies and adds. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 big = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), big), big);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
#endif
