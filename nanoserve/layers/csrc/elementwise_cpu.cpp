// The elementwise chains between the matmuls, one pass each over the activations (as vLLM's CPU build does with
// its own kernels): RMSNorm with its residual add, SwiGLU's silu(gate) * up, RoPE on q and k. Eager PyTorch runs
// each chain as 5 to 10 ops, each reading and writing every activation; in decode each op costs more in dispatch
// than in arithmetic. The PyTorch versions to read are layers/layernorm.py, activation.py, rotary_embedding.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <optional>

using Vec = at::vec::Vectorized<float>;

// Enough rows per thread that waking a second thread pays (a decode step's few rows stay on one).
static int64_t grain(int64_t row_size) { return std::max<int64_t>(1, 131072 / row_size); }

// x: [tokens, heads, size] with its last dimension contiguous (a view of q or k in the fused qkv output is fine),
// or [tokens, size]. With residual (same shape, contiguous): x + residual is normalized and also returned, the
// next layer's residual. Each row: x / sqrt(mean(x^2) + eps) * weight, in the order layernorm.py computes it.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                                   double eps) {
  const bool with_residual = residual.has_value();
  auto x3 = x.dim() == 2 ? x.unsqueeze(1) : x;
  const int64_t tokens = x3.size(0), heads = x3.size(1), size = x3.size(2);
  TORCH_CHECK(x3.stride(2) == 1 && weight.is_contiguous(), "rms_norm: rows must be contiguous");
  auto out = torch::empty({tokens, heads, size}, x.options());
  auto sum = with_residual ? torch::empty_like(out) : torch::Tensor();
  const auto res = with_residual ? residual->contiguous() : torch::Tensor();  // kept alive while r points into it
  const float *w = weight.data_ptr<float>(), *r = with_residual ? res.data_ptr<float>() : nullptr;
  const float* xp = x3.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = with_residual ? sum.data_ptr<float>() : nullptr;
  const int64_t s0 = x3.stride(0), s1 = x3.stride(1), n = Vec::size();
  at::parallel_for(0, tokens * heads, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; row++) {
      const float* in = xp + (row / heads) * s0 + (row % heads) * s1;
      float* o = op + row * size;
      if (with_residual) {  // x + residual, written out: it is both this norm's input and the next residual
        for (int64_t c = 0; c < size; c += n) {
          const int64_t m = std::min(n, size - c);
          (Vec::loadu(in + c, m) + Vec::loadu(r + row * size + c, m)).store(sp + row * size + c, m);
        }
        in = sp + row * size;
      }
      Vec squares(0.f);
      for (int64_t c = 0; c < size; c += n) {
        const Vec v = Vec::loadu(in + c, std::min(n, size - c));  // loadu with a count fills the rest with 0
        squares = squares + v * v;
      }
      const float scale = 1.f / std::sqrt(at::vec::vec_reduce_all<float>(
          [](Vec a, Vec b) { return a + b; }, squares) / size + static_cast<float>(eps));
      for (int64_t c = 0; c < size; c += n) {
        const int64_t m = std::min(n, size - c);
        (Vec::loadu(in + c, m) * Vec(scale) * Vec::loadu(w + c, m)).store(o + c, m);
      }
    }
  });
  auto shape = x.sizes();
  return {out.view(shape), with_residual ? sum.view(shape) : x};
}

// x: [tokens, 2 * d], the fused [gate | up] projection; returns silu(gate) * up, [tokens, d].
torch::Tensor silu_and_mul(torch::Tensor x) {
  x = x.contiguous();
  const int64_t tokens = x.size(0), d = x.size(1) / 2, n = Vec::size();
  auto out = torch::empty({tokens, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++)
      for (int64_t c = 0; c < d; c += n) {
        const int64_t m = std::min(n, d - c);
        const Vec gate = Vec::loadu(xp + t * 2 * d + c, m), up = Vec::loadu(xp + t * 2 * d + d + c, m);
        (gate / (Vec(1.f) + gate.neg().exp()) * up).store(op + t * d + c, m);
      }
  });
  return out;
}

// q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], last dimension contiguous (views of the fused qkv
// output are fine); cos_sin_cache: [max_position, head_dim], cos | sin. Rotates each (x1, x2) half pair of every
// head by its token's angles: x1 cos - x2 sin, x2 cos + x1 sin. Returns new contiguous q and k.
std::vector<torch::Tensor> rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                            torch::Tensor cos_sin_cache) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos_sin_cache.is_contiguous(), "rotary_embedding: layout");
  positions = positions.contiguous();
  const int64_t tokens = q.size(0), half = q.size(2) / 2, n = Vec::size();
  auto q_out = torch::empty(q.sizes(), q.options()), k_out = torch::empty(k.sizes(), k.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  struct Part { const float* in; int64_t heads, s0, s1; float* out; };
  const Part parts[2] = {{q.data_ptr<float>(), q.size(1), q.stride(0), q.stride(1), q_out.data_ptr<float>()},
                         {k.data_ptr<float>(), k.size(1), k.stride(0), k.stride(1), k_out.data_ptr<float>()}};
  at::parallel_for(0, tokens, grain((q.size(1) + k.size(1)) * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      const float *cos = cache + pos[t] * 2 * half, *sin = cos + half;
      for (const Part& part : parts)
        for (int64_t h = 0; h < part.heads; h++) {
          const float* x = part.in + t * part.s0 + h * part.s1;
          float* o = part.out + (t * part.heads + h) * 2 * half;
          for (int64_t c = 0; c < half; c += n) {
            const int64_t m = std::min(n, half - c);
            const Vec x1 = Vec::loadu(x + c, m), x2 = Vec::loadu(x + half + c, m);
            const Vec cs = Vec::loadu(cos + c, m), sn = Vec::loadu(sin + c, m);
            (x1 * cs - x2 * sn).store(o + c, m);
            (x2 * cs + x1 * sn).store(o + half + c, m);
          }
        }
    }
  });
  return {q_out, k_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, with the residual add first if one is given: (out, residual)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up on the fused [gate | up] projection");
  m.def("rotary_embedding", &rotary_embedding, "RoPE on q and k: (q, k)");
}
