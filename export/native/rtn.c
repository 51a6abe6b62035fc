/* Round-to-nearest of float rows into the folder's integers, as export/network/quantize.py rtn() defines it, in plain C.
 *
 * The export's own code, not the graphs' kernels' (it shares nothing with cpu_kernels/). Each value goes through the
 * float32 operations numpy's rtn() applies, in the same order (a division by the group's scale, rounding to the
 * nearest integer with ties to even, the zero point added, the clip), so the integers, scales and offsets are numpy's
 * bit for bit (tests/test_quantize.py holds them equal); it reads each group twice from cache instead of numpy's
 * passes over a 32 MB block, and packs int4 as it goes.
 *
 * Rounding: (u + 1.5 * 2^23) - 1.5 * 2^23 is rint(u) for |u| < 2^22 in the default rounding mode (the sum lands where
 * the float32 step is 1, rounded to nearest even), which vectorizes where a call to rintf() would not. Here |u| never
 * reaches 2^9: u is a value over its group's scale (at most 2^bits steps from the zero point), and a scale of 0 is 1.
 * Only the sign of a zero can differ from rintf's, which no integer, scale or offset keeps. -std=c99 keeps the
 * compiler from contracting or reassociating any of it (no -ffast-math).
 *
 * w: rows x inputs, float32 (bf16 == 0) or bfloat16 bits (bf16 == 1, widened exactly); group: inputs per scale (0:
 * per channel). q: int8 rows x inputs (bits 8), or int4 packed two per byte, input 2j in the low nibble (bits 4):
 * rows x inputs / 2. scale, offset: rows x groups (offset only without `symmetric`). Returns 0; 1 when a group holds
 * a value that is not finite (numpy's rtn() then decides what that means); 2 when out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const float ROUND = 12582912.0f; /* 1.5 * 2^23 */

int export_rtn_rows(const void *w, int bf16, int64_t rows, int64_t inputs, int bits, int64_t group, int symmetric,
                    void *q, float *scale, float *offset) {
  const int64_t g = group == 0 ? inputs : group, groups = inputs / g;
  const float half = (float)(1 << (bits - 1)), top = half - 1.0f, levels = (float)((1 << bits) - 1);
  float *x = (float *)malloc((size_t)g * sizeof(float)), *u = (float *)malloc((size_t)g * sizeof(float));
  int rc = 0;
  if (!x || !u) {
    rc = 2;
    goto done;
  }
  for (int64_t r = 0; r < rows && !rc; ++r) {
    for (int64_t k = 0; k < groups; ++k) {
      const int64_t first = r * inputs + k * g;
      if (bf16) {
        const uint16_t *b = (const uint16_t *)w + first;
        for (int64_t i = 0; i < g; ++i) {
          const uint32_t bits32 = (uint32_t)b[i] << 16;
          memcpy(x + i, &bits32, sizeof(float));
        }
      } else {
        memcpy(x, (const float *)w + first, (size_t)g * sizeof(float));
      }
      /* the order of a min, a max or a sum of zeros changes no result, so they may run in vector lanes
       * (-fopenmp-simd: the pragma alone, no OpenMP runtime) */
      float lo = x[0], hi = x[0], check = 0.0f;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : check)
      for (int64_t i = 0; i < g; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        check += x[i] - x[i]; /* NaN once any value is infinite or NaN */
      }
      if (check != 0.0f) {
        rc = 1;
        break;
      }
      float s, zero = 0.0f;
      if (symmetric) {
        s = (hi > -lo ? hi : -lo) / top;
      } else {
        lo = lo < 0.0f ? lo : 0.0f;
        hi = hi > 0.0f ? hi : 0.0f;
        s = (hi - lo) / levels;
      }
      if (s == 0.0f) s = 1.0f;
      if (!symmetric) {
        zero = (-lo / s + ROUND) - ROUND;
        zero = zero < 0.0f ? 0.0f : (zero > levels ? levels : zero);
        offset[r * groups + k] = half - zero;
      }
      scale[r * groups + k] = s;
      const float low = symmetric ? -top : 0.0f, high = symmetric ? top : levels, shift = symmetric ? 0.0f : half;
      for (int64_t i = 0; i < g; ++i) {
        float v = (x[i] / s + ROUND) - ROUND;
        v += zero;
        v = v < low ? low : (v > high ? high : v);
        u[i] = v - shift;
      }
      if (bits == 8) {
        int8_t *out = (int8_t *)q + first;
        for (int64_t i = 0; i < g; ++i) out[i] = (int8_t)(int)u[i];
      } else {
        uint8_t *out = (uint8_t *)q + first / 2;
        for (int64_t i = 0; i < g / 2; ++i)
          out[i] = (uint8_t)(((int)u[2 * i] & 15) | (((int)u[2 * i + 1] & 15) << 4));
      }
    }
  }
done:
  free(x);
  free(u);
  return rc;
}
