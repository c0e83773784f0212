// Paged attention for the CPU that reads each sequence's K/V where it sits in the paged cache, instead of
// copying its blocks out for every layer as torch_paged_attention does. The same contract otherwise; built on
// first use by nanoserve/layers/cpu_attention.py, vectorized with PyTorch's own at::vec (AVX2, AVX-512, NEON).
//
// The cache layout inside a block is this kernel's own, per KV head:
//   k_cache [num_blocks, num_kv_heads, head_dim, block_size]: keys transposed, so one vector holds one dimension
//           of several keys, and q . k for all of them is head_dim multiply-adds (no sum across a vector);
//   v_cache [num_blocks, num_kv_heads, block_size, head_dim]: a value is a row, added to the output with weight p.
// Blocks keep their size and ids, so swapping, copy-on-write and the prefix cache move them as before.
// The cache holds float32, or with kv_cache_dtype="fp8" float8 e4m3 bytes, turned into floats block by block as
// they are read (at::vec has no fp8 loads): a quarter of the bytes to bring from memory, and a few operations each.
#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

using Vec = at::vec::Vectorized<float>;

// The first `count` floats at p as a vector (the rest zero): the last vector of a block or a head may be short.
static Vec load(const float* p, int64_t count) { return count == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, count); }

// Ask for the next block's cache lines while this one is computed: the blocks of a sequence are scattered, so the
// hardware prefetcher, which follows a run of addresses, starts over at each block.
static void prefetch(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// The largest finite e4m3 value: larger ones saturate, as in vLLM's kernels (older versions of c10 made them NaN).
constexpr float FP8_MAX = 448.f;
// An e4m3 byte (sign, 4 exponent bits with bias 7, 3 mantissa bits) as a float, in integer steps without branches
// that the compiler vectorizes (a table lookup it does not). A normal value's bits move into a float32's, whose
// exponent bias is 127: 120 more. A subnormal one (exponent bits 0) is its mantissa x 2^-9, computed as a normal
// float: a float32 subnormal in between would cost a microcode assist per vector, many times the loop's own time.
static inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

static inline float fp8_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24, exponent_mantissa = b & 0x7F;
  const uint32_t normal = (exponent_mantissa << 20) + (120u << 23);
  const uint32_t subnormal = float_bits(float(exponent_mantissa) * 0x1p-9f);
  const uint32_t is_normal = 0u - uint32_t(exponent_mantissa >= 8);  // all ones or all zeros: a select, no branch
  const uint32_t bits = sign | (normal & is_normal) | (subnormal & ~is_normal);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The `n` values at element `offset` of a cache as floats: in place in a float32 cache; an fp8 cache's converted
// into `buffer` (what torch_paged_attention's .to(q.dtype) does to the blocks it copies).
static const float* read_floats(const char* cache, bool fp8, int64_t offset, int64_t n, float* buffer) {
  if (!fp8) return reinterpret_cast<const float*>(cache) + offset;
  const auto* bytes = reinterpret_cast<const uint8_t*>(cache) + offset;
  for (int64_t i = 0; i < n; i++) buffer[i] = fp8_to_float(bytes[i]);
  return buffer;
}

// Rows of queries computed together: each vector of keys or values loaded serves four rows' multiply-adds, and
// the four running sums are independent chains (one chain would wait for each multiply-add to finish).
constexpr int64_t R = 4;

// k, v: this step's [num_tokens, num_kv_heads, head_dim], written to their slots (block * block_size + offset),
// as float32 or as fp8 (`convert`: rounded to the nearest e4m3 value, as PyTorch's .to() rounds).
template <typename T, typename Convert>
static void store(const float* kp, const float* vp, T* kc, T* vc, const int64_t* slots, int64_t num_tokens,
                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, Convert convert) {
  for (int64_t t = 0; t < num_tokens; t++) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; h++) {
      const int64_t head = (block * num_kv_heads + h) * head_dim * block_size, src = (t * num_kv_heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; d++) kc[head + d * block_size + offset] = convert(kp[src + d]);
      std::transform(vp + src, vp + src + head_dim, vc + head + offset * head_dim, convert);
    }
  }
}

void store_kvcache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  k = k.contiguous(), v = v.contiguous(), slot_mapping = slot_mapping.contiguous();
  const int64_t num_kv_heads = k.size(1), head_dim = k.size(2), block_size = k_cache.size(1);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    auto to_fp8 = [](float x) { return c10::Float8_e4m3fn(std::clamp(x, -FP8_MAX, FP8_MAX)); };
    store(kp, vp, k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>(), slots, k.size(0),
          num_kv_heads, head_dim, block_size, to_fp8);
  } else {
    store(kp, vp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots, k.size(0), num_kv_heads, head_dim,
          block_size, [](float x) { return x; });
  }
}

// q: [num_tokens, num_heads, head_dim], the batch's new tokens, sequence after sequence; block_tables:
// [num_seqs, max_blocks] (int32); context_lens: [num_seqs] (int32); cu_seqlens_q: [num_seqs + 1] (int32).
// Returns softmax(q k^T * scale) v over each token's causal context, [num_tokens, num_heads, head_dim]; with
// window > 0 over its last `window` positions only (sliding-window attention; the blocks before them are not read).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor cu_seqlens_q,
                              double scale, int64_t window) {
  q = q.contiguous(), block_tables = block_tables.contiguous();
  const int64_t num_heads = q.size(1), head_dim = q.size(2), block_size = k_cache.size(1),
                num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t block_stride = num_kv_heads * head_dim * block_size, head_stride = head_dim * block_size;
  const int *tables = block_tables.data_ptr<int>(), *ctx = context_lens.data_ptr<int>(),
            *cu_q = cu_seqlens_q.data_ptr<int>();
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t itemsize = k_cache.element_size();
  const float* qp = q.data_ptr<float>();
  const char *kp = static_cast<const char*>(k_cache.data_ptr()), *vp = static_cast<const char*>(v_cache.data_ptr());
  auto out = torch::zeros_like(q);
  float* op = out.data_ptr<float>();
  // A work item is up to `tile` new tokens of one sequence: a long prefill spreads over the threads.
  const int64_t tile = 16;
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, its first new token in the item)
  for (int64_t s = 0; s < context_lens.size(0); s++)
    for (int64_t t = cu_q[s]; t < cu_q[s + 1]; t += tile) items.emplace_back(s, t);

  auto attend = [&](int64_t s, int64_t t0, std::vector<float>& scores, std::vector<int64_t>& visible,
                    std::vector<int64_t>& first, std::vector<float>& buffer) {
    const int64_t t1 = std::min<int64_t>(t0 + tile, cu_q[s + 1]), rows = (t1 - t0) * group;
    // Causal, aligned bottom-right: new token t (counted in the batch) sits at position first_pos + t.
    const int64_t first_pos = ctx[s] - (cu_q[s + 1] - cu_q[s]) - cu_q[s];
    const int64_t num_blocks = (first_pos + t1 + block_size - 1) / block_size, width = num_blocks * block_size;
    const int* table = tables + s * max_blocks;
    scores.resize(rows * width);
    visible.resize(rows), first.resize(rows);
    // Row r is new token t0 + r / group and query head h * group + r % group: the heads that share KV head h
    // are rows of one pass over its keys, so each key is read once for all of them (grouped-query attention).
    for (int64_t r = 0; r < rows; r++) visible[r] = first_pos + t0 + r / group + 1;
    for (int64_t r = 0; r < rows; r++) first[r] = window > 0 ? std::max<int64_t>(0, visible[r] - window) : 0;
    const int64_t first_block = first[0] / block_size;  // row 0 sees the earliest keys: blocks before are skipped
    auto row = [&](int64_t r) { return (r / group) * num_heads * head_dim + (r % group) * head_dim; };
    for (int64_t h = 0; h < num_kv_heads; h++) {
      const float* q_rows = qp + (t0 * num_heads + h * group) * head_dim;
      float* out_rows = op + (t0 * num_heads + h * group) * head_dim;
      for (int64_t b = first_block; b < num_blocks; b++) {  // 1. scores = q . k * scale, block by block
        const float* k = read_floats(kp, fp8, table[b] * block_stride + h * head_stride, head_stride, buffer.data());
        if (b + 1 < num_blocks)
          prefetch(kp + (table[b + 1] * block_stride + h * head_stride) * itemsize, head_stride * itemsize);
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
          const float* qr[R];  // past the last row: the last row again, computed and not stored
          for (int64_t i = 0; i < R; i++) qr[i] = q_rows + row(std::min(r0 + i, rows - 1));
          for (int64_t c = 0; c < block_size; c += Vec::size()) {
            const int64_t n = std::min<int64_t>(Vec::size(), block_size - c);
            Vec acc[R] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
            for (int64_t d = 0; d < head_dim; d++) {
              const Vec keys = load(k + d * block_size + c, n);  // dimension d of n keys
              for (int64_t i = 0; i < R; i++) acc[i] = at::vec::fmadd(Vec(qr[i][d]), keys, acc[i]);
            }
            for (int64_t i = 0; i < std::min(R, rows - r0); i++)
              (acc[i] * Vec(scale)).store(scores.data() + (r0 + i) * width + b * block_size + c, n);
          }
        }
      }
      for (int64_t r = 0; r < rows; r++) {  // 2. softmax over each row's visible keys, in place; 0 elsewhere
        float* p = scores.data() + r * width;
        std::fill(p, p + first[r], 0.f);
        p += first[r];
        const int64_t n = visible[r] - first[r];
        const float max = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, p, n);
        at::vec::map([max](Vec x) { return (x - Vec(max)).exp_u20(); }, p, p, n);
        const float sum = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, p, n);
        at::vec::map([sum](Vec x) { return x / Vec(sum); }, p, p, n);
        std::fill(p + n, scores.data() + (r + 1) * width, 0.f);
      }
      for (int64_t b = first_block; b < num_blocks; b++) {  // 3. out = p . v, block by block
        const float* v = read_floats(vp, fp8, table[b] * block_stride + h * head_stride, head_stride, buffer.data());
        if (b + 1 < num_blocks)
          prefetch(vp + (table[b + 1] * block_stride + h * head_stride) * itemsize, head_stride * itemsize);
        for (int64_t r0 = 0; r0 < rows; r0 += R) {
          const int64_t real = std::min(R, rows - r0);  // rows past the last: the last row, not stored
          const int64_t keys = std::min(block_size, visible[r0 + real - 1] - b * block_size);  // the most any sees
          const float* p[R];
          float* o[R];
          for (int64_t i = 0; i < R; i++) {
            p[i] = scores.data() + std::min(r0 + i, rows - 1) * width + b * block_size;
            o[i] = out_rows + row(std::min(r0 + i, rows - 1));
          }
          for (int64_t c = 0; c < head_dim; c += Vec::size()) {
            const int64_t n = std::min<int64_t>(Vec::size(), head_dim - c);
            Vec acc[R];
            for (int64_t i = 0; i < R; i++) acc[i] = load(o[i] + c, n);
            for (int64_t j = 0; j < keys; j++) {
              const Vec value = load(v + j * head_dim + c, n);  // n dimensions of value j
              for (int64_t i = 0; i < R; i++) acc[i] = at::vec::fmadd(Vec(p[i][j]), value, acc[i]);
            }
            for (int64_t i = 0; i < real; i++) acc[i].store(o[i] + c, n);
          }
        }
      }
    }
  };
  // Each thread takes the next item once it is done with one: items differ in cost (context, new tokens).
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, buffer(fp8 ? head_stride : 0);  // buffer: one fp8 block of one head, as floats
    std::vector<int64_t> visible, first;
    for (int64_t i; (i = next++) < (int64_t)items.size();)
      attend(items[i].first, items[i].second, scores, visible, first, buffer);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache, read in place");
  m.def("store_kvcache", &store_kvcache, "write new K/V into their cache slots, in this kernel's layout");
}
