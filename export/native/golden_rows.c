/* The golden reference's quantized rows (export/network/quantize.py FolderRows.rows_into), in plain C.
 *
 * Written for the reference alone and built into the export's own library (setup.py: export.native._native), sharing
 * no code and no header with the graphs' kernels (cpu_kernels/): the golden references are the proof of those
 * kernels, so they must not be computed by them (docs/architecture.md, "Quantized folders"). What it computes is
 * numpy's rows_into value for value (tests/test_quantize.py holds the two equal, bit for bit, on every byte and every
 * group layout): one float32 product per value, nothing fused, no reordering, so the compiler has nothing to round
 * differently. It only runs faster: numpy's int4 path is a 256-entry gather and a broadcast multiply, passes over the
 * block that cost 3x a bfloat16 block's widening; here one loop that the compiler vectorizes makes each value from its
 * nibble and the group's scale, at about the widening's pace. The matrix products stay BLAS's (reference.py).
 *
 * Both functions write rows [0, rows) of `out` (float32, rows x width, contiguous) from the layer's stored rows `q`
 * (contiguous) and their scales `scale` (float32, rows x groups, contiguous; groups == 1: per channel, the scale is
 * applied to the outputs by FolderRows.finish, and here each value is multiplied by 1, which changes none of them).
 * `width` is a multiple of `groups`, and for int4 the group's width is even (a byte never spans two groups:
 * export/network/quantize.py checks both at export).
 */
#include <stdint.h>

/* int4, two per byte (input 2j in the low nibble, 2j + 1 in the high; two's complement): value * the group's scale */
void golden_int4_rows(const uint8_t *restrict q, int64_t rows, int64_t width, const float *restrict scale,
                      int64_t groups, float *restrict out) {
  const int64_t group_width = width / groups, group_bytes = group_width / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = groups > 1 ? scale[r * groups + g] : 1.0f; /* per channel: times 1, exact */
      const uint8_t *b = q + r * (width / 2) + g * group_bytes;
      float *o = out + r * width + g * group_width;
      for (int64_t j = 0; j < group_bytes; ++j) {
        o[2 * j] = (float)(((b[j] & 15) ^ 8) - 8) * s;
        o[2 * j + 1] = (float)(((b[j] >> 4) ^ 8) - 8) * s;
      }
    }
  }
}

/* int8: value * the group's scale */
void golden_int8_rows(const int8_t *restrict q, int64_t rows, int64_t width, const float *restrict scale,
                      int64_t groups, float *restrict out) {
  const int64_t group_width = width / groups;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t *b = q + r * width + g * group_width;
      float *o = out + r * width + g * group_width;
      const float s = groups > 1 ? scale[r * groups + g] : 1.0f; /* per channel: times 1, exact */
      for (int64_t k = 0; k < group_width; ++k) o[k] = (float)b[k] * s;
    }
  }
}
