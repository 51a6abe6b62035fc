// Test driver for the CPU kernel library (cpu_kernels/*.cc) built for another architecture
// (tests/test_neon_kernels.py): calls MsliteLlmGemv / MsliteLlmGemvBias as MindSpore's aot CPU kernel does, on seeded
// random inputs, and writes each case (its shapes, inputs and output) to the file named by argv[1], for Python to
// check against float64 references; with argv[2], MsliteLlmPagedAttention in the CPU prefill graph's form (a
// prompt's queries, each over its sequence's positions up to its own, read from the paged cache's blocks through
// a block table that runs backwards) at head sizes 64 and 80, written there the same way.
// The first line of stdout is MsliteLlmIsa(): the code path the library chose.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

extern "C" {
int MsliteLlmGemv(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                  void* extra);
int MsliteLlmGemvBias(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra);
int MsliteLlmPagedAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra);
int MsliteLlmQuantMatmulOffset(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                               void* stream, void* extra);
int MsliteLlmQuantMatmul(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                         void* extra);
const char* MsliteLlmIsa();
void MsliteLlmSetThreads(int threads);
}

static uint64_t state = 88172645463325252ull;
static float uniform() {  // xorshift64: the same inputs on every machine
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return float((state >> 11) * (1.0 / 9007199254740992.0)) * 2.f - 1.f;
}

static uint16_t to_half(float f) {  // round to nearest even, finite normal values only (|f| < 1 here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, abs = u & 0x7fffffffu;
  if (abs < 0x38800000u) return uint16_t(sign);  // below the smallest normal half: zero, fine for a test
  const uint32_t rounded = abs + 0x0fffu + ((abs >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// queries [n, H*D] of one sequence at lengths 1..n over K, V pools [NB, KH, BS, D], the sequence in blocks M..1
// (its table runs backwards; block 0 the null block): (D, n, rc, BS, NB), q, k, v, table [M], out. Head sizes 64
// and 80 over float32 caches, then 64 over bfloat16 ones (k and v written rounded, as the kernel read them)
static void attention_cases(std::FILE* out) {
  const int64_t h = 14, kh = 2, s = 160, n = 150, bs = 32, m = s / bs, nb = m + 1;
  for (int64_t c = 0; c < 3; ++c) {
    const int64_t d = c == 1 ? 80 : 64;
    const bool kv16 = c == 2;
    std::vector<float> q(n * h * d), k(nb * kh * bs * d), v(nb * kh * bs * d), y(n * h * d, -1.f);
    std::vector<uint16_t> k16(k.size()), v16(v.size());
    for (float& x : q) x = 3.f * uniform();
    for (float& x : k) x = uniform();
    for (float& x : v) x = uniform();
    for (size_t i = 0; kv16 && i < k.size(); ++i) {
      k16[i] = to_bf16(k[i]), v16[i] = to_bf16(v[i]);
      const uint32_t ku = uint32_t(k16[i]) << 16, vu = uint32_t(v16[i]) << 16;
      std::memcpy(&k[i], &ku, 4);
      std::memcpy(&v[i], &vu, 4);
    }
    std::vector<int32_t> valid(n), rows(n, 0), table(m);
    for (int64_t i = 0; i < n; ++i) valid[i] = int32_t(i + 1);
    for (int64_t j = 0; j < m; ++j) table[j] = int32_t(m - j);
    int64_t sq[2] = {n, h * d}, sc[4] = {nb, kh, bs, d}, sn[1] = {n}, st[2] = {1, m};
    void* params[7] = {q.data(), kv16 ? static_cast<void*>(k16.data()) : k.data(),
                       kv16 ? static_cast<void*>(v16.data()) : v.data(), valid.data(), rows.data(), table.data(),
                       y.data()};
    int64_t* shapes[7] = {sq, sc, sc, sn, sn, st, sq};
    int ndims[7] = {2, 4, 4, 1, 1, 2, 2};
    const char* cache = kv16 ? "bfloat16" : "float32";
    const char* types[7] = {"float32", cache, cache, "int32", "int32", "int32", "float32"};
    const int rc = MsliteLlmPagedAttention(7, params, ndims, shapes, types, nullptr, nullptr);
    const int64_t head[5] = {d, n, rc, bs, nb};
    std::fwrite(head, sizeof head, 1, out);
    std::fwrite(q.data(), 4, q.size(), out);
    std::fwrite(k.data(), 4, k.size(), out);
    std::fwrite(v.data(), 4, v.size(), out);
    std::fwrite(table.data(), 4, table.size(), out);
    std::fwrite(y.data(), 4, y.size(), out);
  }
}

// MsliteLlmQuantMatmul(Offset), 37 outputs: int8 and int4, groups of 32 and 128 and per channel over 256 inputs
// (the decode form), per channel over 100 (the plain float form), with and without offsets, 1, 2, 3 and 5 rows:
// (int4, group, offset, rows, k, n, rc), x, q as stored, scale, [offset,] y
static void quant_cases(std::FILE* out) {
  const int64_t n = 37;
  for (int int4 = 0; int4 < 2; ++int4)
    for (int64_t k : {256, 100})
      for (int64_t group : {32, 128, 0})
        for (int offset = 0; offset < 2; ++offset)
          for (int64_t rows : {1, 2, 3, 5}) {
            if (k == 100 && group != 0) continue;
            const int64_t g = group ? group : k, groups = k / g, qbytes = int4 ? n * k / 2 : n * k;
            std::vector<float> x(rows * k), scale(groups * n), off(groups * n), y(rows * n, -1.f);
            std::vector<uint8_t> q(qbytes);
            for (float& v : x) v = 2.f * uniform();
            for (uint8_t& v : q) v = uint8_t(int(128.f * (uniform() + 1.f)) & 255);
            for (float& v : scale) v = 0.01f * (uniform() + 1.5f);
            for (float& v : off) v = 3.f * uniform();
            int64_t sx[2] = {rows, k}, sq[2] = {n, int4 ? k / 2 : k}, ss[2] = {groups, n}, sy[2] = {rows, n};
            void* params[5] = {x.data(), q.data(), scale.data(), offset ? off.data() : y.data(), y.data()};
            int64_t* shapes[5] = {sx, sq, ss, offset ? ss : sy, sy};
            int ndims[5] = {2, 2, 2, 2, 2};
            const char* types[5] = {"float32", int4 ? "uint8" : "int8", "float32", "float32", "float32"};
            const int rc = offset ? MsliteLlmQuantMatmulOffset(5, params, ndims, shapes, types, nullptr, nullptr)
                                  : MsliteLlmQuantMatmul(4, params, ndims, shapes, types, nullptr, nullptr);
            const int64_t head[7] = {int4, g, offset, rows, k, n, rc};
            std::fwrite(head, sizeof head, 1, out);
            std::fwrite(x.data(), 4, x.size(), out);
            std::fwrite(q.data(), 1, q.size(), out);
            std::fwrite(scale.data(), 4, scale.size(), out);
            if (offset) std::fwrite(off.data(), 4, off.size(), out);
            std::fwrite(y.data(), 4, y.size(), out);
          }
}

// argv: the GEMV cases' file [, the attention cases' file [, the quantized matmul cases' file]]
int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) return 2;
  std::FILE* out = std::fopen(argv[1], "wb");
  if (!out) return 2;
  std::printf("%s\n", MsliteLlmIsa());
  MsliteLlmSetThreads(2);
  const int64_t rows_list[] = {1, 2, 3, 4, 5, 17};
  const int64_t in_list[] = {7, 64, 899};
  const int64_t outs = 37;
  const char* dtypes[] = {"float32", "float16", "bfloat16"};
  for (int d = 0; d < 3; ++d)
    for (int64_t rows : rows_list)
      for (int64_t in : in_list)
        for (int bias = 0; bias < 2; ++bias) {
          std::vector<float> x(rows * in), b(outs), y(rows * outs, -1.f), wf(outs * in);
          for (float& v : x) v = uniform();
          for (float& v : wf) v = uniform();
          for (float& v : b) v = uniform();
          std::vector<uint16_t> wh(outs * in);
          for (int64_t i = 0; i < outs * in; ++i) wh[i] = d == 1 ? to_half(wf[i]) : to_bf16(wf[i]);
          void* w = d == 0 ? static_cast<void*>(wf.data()) : static_cast<void*>(wh.data());
          int64_t sx[2] = {rows, in}, sw[2] = {outs, in}, sb[1] = {outs}, sy[2] = {rows, outs};
          void* params[4] = {x.data(), w, bias ? static_cast<void*>(b.data()) : y.data(), y.data()};
          int64_t* shapes[4] = {sx, sw, bias ? sb : sy, sy};
          int ndims[4] = {2, 2, bias ? 1 : 2, 2};
          const char* types[4] = {"float32", dtypes[d], "float32", "float32"};
          const int rc = bias ? MsliteLlmGemvBias(4, params, ndims, shapes, types, nullptr, nullptr)
                              : MsliteLlmGemv(3, params, ndims, shapes, types, nullptr, nullptr);
          const int64_t head[6] = {d, rows, in, outs, bias, rc};
          std::fwrite(head, sizeof head, 1, out);
          std::fwrite(x.data(), 4, x.size(), out);
          std::fwrite(w, d == 0 ? 4 : 2, outs * in, out);
          std::fwrite(b.data(), 4, b.size(), out);
          std::fwrite(y.data(), 4, y.size(), out);
        }
  std::fclose(out);
  if (argc == 3) {
    std::FILE* att = std::fopen(argv[2], "wb");
    if (!att) return 2;
    attention_cases(att);
    std::fclose(att);
  }
  if (argc == 4) {
    std::FILE* quant = std::fopen(argv[3], "wb");
    if (!quant) return 2;
    quant_cases(quant);
    std::fclose(quant);
  }
  return 0;
}
