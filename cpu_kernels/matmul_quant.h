// The quantized-weight matmul (matmul_quant.cc) as the other families use it: a weight the fused decode ops read as
// q, scale[, offset] (decode_ops.cc), multiplied by matmul16.cc's matmul() as the weight type W_QUANT, whose rows
// kernel reads x as `prepare` left it.
#ifndef MSLITE_LLM_CPU_KERNELS_MATMUL_QUANT_H_
#define MSLITE_LLM_CPU_KERNELS_MATMUL_QUANT_H_

#include "common.h"

namespace msllm {

struct PreparedX;

// W [n, k] as q int8 [n, k] or uint8 [n, k / 2] (int4: byte j holds inputs 2j, 2j + 1 in its low, high nibble, each
// two's complement), scale (and offset) float32 [k / group, n]: W[o, i] = (q[o, i] + offset[i / group, o]) *
// scale[i / group, o]. What a rows kernel of type W_QUANT gets as `w`; `x` is the call's x as `prepare` made it.
struct QuantWeight {
  const void* q = nullptr;
  bool int4 = false;
  bool r16 = false;  // in bands of 16 rows (repack_int4_r16; int8: repack_int8_r16, biased too): read by an R16 op
                     // (registry.cc), set by read_quant_weight
  const float* scale = nullptr;
  const float* offset = nullptr;  // null: 0
  int64_t n = 0, k = 0, group = 0;
  const PreparedX* x = nullptr;
};

// x as the rows kernels read it (matmul_quant.cc says why and how); one per x and weight layout.
struct PreparedX {
  const float* x = nullptr;  // [rows, k] float32, as given
  int64_t rows = 0, k = 0, group = 0;
  bool int4 = false, int16 = false;  // int16: the integer form below was made (else the kernels read x)
  bool int8 = false;                  // x rounded to int8 per block of 32 (int4 weights, ACTIVATIONS_INT8): xq holds
                                      // the int8 integers too (the plain C++ and NEON forms read them), xb and xs
                                      // the same as the x86 forms read them
  bool int8w = false;                 // x rounded to int8 per block of 32 for banded int8 weights (ACTIVATIONS_INT8):
                                      // xb [rows, k] in input order, xs [rows, k / 64, 16] lanes 0-7 block 2s's scale,
                                      // 8-15 block 2s + 1's (xq holds the integers too)
  bool exact = false;                 // x split into two int16 parts (ACTIVATIONS_EXACT): each row's k low parts follow
                                      // its k high ones
  bool sums = false;                  // x's sums per group were made (weights with offsets read them; else 0)
  std::vector<int16_t> xq;            // [rows, k]: int8 weights in input order; int4, the even inputs, then the odd
  std::vector<float> scales;          // [rows, k / 32 + 2 k / group]: each block's scale, the sums of x per group
                                      // (`sums`), and of x as rounded per group
  std::vector<int8_t> xb;             // int8: [rows, k / 64, 128] per 64 inputs (two blocks): their 32 even inputs
                                      // twice, then their 32 odd ones twice (a weight row's 32 bytes' low, high
                                      // nibbles; twice: two weight rows share a zmm)
  std::vector<int8_t> xa;             // int8 for int4 bands in AMX tiles (`tiles`): [rows, k] per block of 32 its 16
                                      // even inputs then its 16 odd ones (a tile of A), rows padded past 16 to whole
                                      // tiles of 16 with zeros
  bool tiles = false;
  std::vector<float> xs;              // int8: [rows, k / 64, 16] the two blocks' scales per lane of the products
                                      // (4 lanes block 2s, 4 lanes 2s + 1, twice)
};

// Reads a quantized weight from an op's tensors: q at params[i], scale at i + 1 and, with `offset`, the offset at
// i + 2 (float32 [G, N] each). 0, or the ops' error code: 2 a dtype, 3 a rank, 4 shapes that do not fit.
int read_quant_weight(void** params, int* ndims, int64_t** shapes, const char** dtypes, int i, bool offset,
                      QuantWeight* w);

// int4 weights in bands of 16 rows, the layout the runtime gives the int4 matrices of a `--device cpu` folder at load
// where the fast form below runs (docs/architecture.md, "int4 in bands of 16 rows"): rows [0, n16) (n16 = n less
// n % 16) in bands of 16 consecutive rows; in a band, each block of 32 inputs (a row's 16 bytes 16b..16b+15) is 256
// bytes, 4 runs of 64: run j holds bytes 4j..4j+3 of each of the band's 16 rows in row order. The rows from n16 on stay
// as they were (row-major, where they already are). A permutation of the bytes within each band, in place.
// Requires k a multiple of 32 (else returns false, nothing changed).
bool repack_int4_r16(uint8_t* q, int64_t n, int64_t k);
// int8 weights likewise (docs/architecture.md, "int8 in bands of 16 rows"): every byte biased, q ^ 0x80 (q + 128 as an
// unsigned byte, which vpdpbusd multiplies by x's signed int8 as it is), and rows [0, n16) in bands of 16: in a band,
// each block of 32 inputs (a row's bytes 32b..32b+31) is 512 bytes, 8 runs of 64: run j holds bytes 4j..4j+3 of each
// of the band's 16 rows in row order. The rows from n16 on stay row-major (biased). Requires k a multiple of 32 (else
// returns false, nothing changed).
bool repack_int8_r16(int8_t* q, int64_t n, int64_t k);
// Whether an int8 weight of k inputs in groups of `group` takes the banded form (x in int8) on this machine in the
// default activations mode (what serves; check switches modes around its replays, and a banded weight in another mode
// goes through the float32 form): the AVX-512 VNNI form, K a multiple of 64, the group too or 32. Every other form
// reads a banded int8 weight through its float32 form, so the runtime repacks none there.
bool int8_r16_runs(int64_t k, int64_t group);
// Whether an int4 weight of k inputs in groups of `group` takes the banded form on this machine in the default
// activations mode (the AVX-512 VNNI and the AVX2 forms with x in int8; as int8_r16_runs): what the runtime repacks
// for.
bool r16_runs(int64_t k, int64_t group);
// While alive, read_quant_weight marks int4 weights as banded (the R16 ops of registry.cc); per thread.
struct R16Call {
  R16Call();
  ~R16Call();
};
// The outputs per pool task for weight w: pool.h's task_rows, whole bands for a banded weight.
int64_t quant_task_rows(const QuantWeight& w);

// Whether dtype is a quantized weight's q (int8, or uint8 for int4).
bool is_quant_dtype(const char* dtype);

// Makes `out` x [rows, w.k] as w's rows kernel reads it (reusable for any weight of the same k, group and int4).
void prepare(const float* x, int64_t rows, const QuantWeight& w, PreparedX* out);

// x prepared for each of ws[0..n) (weights read by one dispatch: q/k/v, gate/up), once per layout into px[0..n);
// each ws[i].x set
void prepare_each(const float* x, int64_t rows, QuantWeight* ws, int n, PreparedX* px);

// The rows kernel (common.h's RowsFn) for W_QUANT: `w` a QuantWeight whose `x` is prepared; the `x` argument unused.
RowsFn quant_rows_kernel();

// y [rows, n] = x [rows, k] . W^T (+ b [n]) for any rows: the rows kernel in the pool up to QUANT_ROWS_MAX rows (x
// prepared here), the buffered GEMM beyond.
void quant_matmul(const float* x, int64_t rows, const QuantWeight& w, const float* b, float* y);

constexpr int64_t QUANT_ROWS_MAX = 16;

// How the decode form rounds x (matmul_quant.cc says why): ACTIVATIONS_INT8 (the default: the fast path, whose rounding
// check's limit follows, lite_runtime/golden.py), for int4 weights whose K is a multiple of 64 and group 32 or a
// multiple of 64 x to int8 per block of 32, for the others to int16 per block of 32; ACTIVATIONS_INT16, x to int16 for
// every weight (the rounding a folder exported before the int8 form was checked in); ACTIVATIONS_EXACT, x split into a
// high and a low int16 part, x = s (h + l / 65534), so the products are float32's to its rounding (what check holds to
// the float32 reference's own rounding). Process-wide, read when x is prepared: MSLITE_LLM_QUANT_ACTIVATIONS (int8 |
// int16 | exact) at load, set_quant_activations after.
// ACTIVATIONS_EXACT also holds the rows kernel of bfloat16 weights to its float32 form (matmul16.h bf16_form).
enum Activations { ACTIVATIONS_INT8 = 0, ACTIVATIONS_EXACT = 1, ACTIVATIONS_INT16 = 2 };
int quant_activations();
void set_quant_activations(int mode);  // a negative mode: the default (the environment's, else int16)
// the quantized decode form this machine runs: "avx512_vnni", "avx2", "neon" or "generic"
const char* quant_form();
// whether banded int8 and int4 weights may take AMX tiles on this machine (matmul_quant.cc qbands_amx; tiles_on() the
// switch)
bool int8_tiles_here();
// whether the rows kernel (quant_rows_kernel) takes `rows` rows of x for w: up to QUANT_ROWS_MAX, and any number for
// banded int8 and int4 weights in the default activations (x in int8, as a decode step's: the prompt's rows then round
// x as the steps do; by AMX tiles where they run, else by the bands' vector form); else the float32 GEMM on packed
// weights (matmul16.cc)
bool quant_rows_take(const QuantWeight& w, int64_t rows);

// W's rows [n0, n0 + rows) over the inputs [k0, k0 + kc), as float32 (q + offset) * scale: dst[r * ld + i] (k0 and
// kc even for int4). What matmul16.cc's GEMM packs for the prompt's matmuls.
void dequantize_rows(const QuantWeight& w, int64_t n0, int64_t rows, int64_t k0, int64_t kc, float* dst, int64_t ld);

}  // namespace msllm

#endif  // MSLITE_LLM_CPU_KERNELS_MATMUL_QUANT_H_
