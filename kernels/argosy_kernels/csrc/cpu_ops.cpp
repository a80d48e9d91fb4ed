// Fused CPU kernels for the decode path. argosy_kernels/cpu_ops.py builds this file on first
// use and falls back to PyTorch where no compiler is available; each op has a pure-torch
// reference it is tested against (tests/kernels/test_cpu_ops.py).
//
// Why C++: a decode step of a small model is hundreds of tiny tensor ops, each paying a few
// microseconds of dispatch, and PyTorch's SDPA is built for long query blocks, not one query
// row per sequence. These are plain loops that gcc vectorizes (-O3 -march=native) and that
// at::parallel_for spreads over torch's own OpenMP threads.
//
// Rounding: for bfloat16 the elementwise ops round to bfloat16 after every step PyTorch's
// eager ops would round at, so they reproduce the eager results up to the order of float
// summation (and glibc's vector expf). Arithmetic is float32 throughout.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

// Round a float to the storage type and back: where eager PyTorch stores an intermediate.
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

void check_cpu_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// Calls body.template operator()<scalar_t>() for float32 or bfloat16.
template <typename Body>
void dispatch_float(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kBFloat16) {
    body.template operator()<c10::BFloat16>();
  } else {
    body.template operator()<float>();
  }
}

// ---- RMSNorm ---------------------------------------------------------------------------------
// out = weight * dtype(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm. With a
// residual: residual = dtype(residual + x) first, and the norm is taken of the new residual.
template <typename T>
void rms_norm_rows(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t dim,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      if (residual) {
        T* res = residual + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          h[i] = round_to<T>(static_cast<float>(res[i]) + static_cast<float>(xr[i]));
          res[i] = static_cast<T>(h[i]);
        }
      } else {
        for (int64_t i = 0; i < dim; ++i) h[i] = static_cast<float>(xr[i]);
      }
      float sum_sq = 0.f;
      for (int64_t i = 0; i < dim; ++i) sum_sq += h[i] * h[i];
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(h[i] * inv_rms));
    }
  });
}

// out = rms_norm(x); with a residual: residual += x in place first, out = rms_norm(residual).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps,
                const c10::optional<Tensor>& residual) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with unit stride in dim");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight must be a contiguous [dim] of x's dtype");
  TORCH_CHECK(!residual || (residual->is_contiguous() && residual->sizes() == x.sizes() &&
                            residual->scalar_type() == x.scalar_type()),
              "residual must be contiguous, shaped and typed like x");
  Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    rms_norm_rows<T>(out.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr,
                     x.data_ptr<T>(), weight.data_ptr<T>(), x.size(0), x.size(1), x.stride(0),
                     static_cast<float>(eps));
  });
  return out;
}

// ---- SiLU(gate) * up -------------------------------------------------------------------------
Tensor silu_and_mul(const Tensor& gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * dim] with unit stride in dim");
  const int64_t rows = gate_up.size(0), dim = gate_up.size(1) / 2, row_stride = gate_up.stride(0);
  Tensor out = at::empty({rows, dim}, gate_up.options());
  dispatch_float(gate_up.scalar_type(), [&]<typename T>() {
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = in + r * row_stride;
        const T* up = gate + dim;
        T* dst = o + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float silu = round_to<T>(g / (1.f + std::exp(-g)));
          dst[i] = static_cast<T>(silu * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// ---- Rotary embedding, in place ----------------------------------------------------------------
// x = x * cos + roll(x, D/2) * signed_sin (the sign of rotate_half lives in the table).
// The tables' width D (rot_dim) may be below head_dim: a partial rotary (Phi-4-mini) turns the
// first rot_dim values of each head, pairs (i, i + rot_dim / 2), and leaves the rest alone.
void rotary_embedding(Tensor qk, const Tensor& cos, const Tensor& signed_sin) {
  check_cpu_float(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [tokens, heads, head_dim] with contiguous heads");
  const int64_t tokens = qk.size(0), heads = qk.size(1);
  if (tokens == 0) return;
  const int64_t dim = cos.numel() / tokens, half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == tokens * dim &&
              signed_sin.numel() == tokens * dim && dim % 2 == 0 && dim <= qk.size(2) &&
              cos.scalar_type() == qk.scalar_type() && signed_sin.scalar_type() == qk.scalar_type(),
              "cos/signed_sin must be contiguous [tokens, rot_dim] of qk's dtype, rot_dim even and "
              "at most head_dim");
  const int64_t row_stride = qk.stride(0), head_stride = qk.stride(1);
  dispatch_float(qk.scalar_type(), [&]<typename T>() {
    T* x = qk.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = signed_sin.data_ptr<T>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> head(dim);
      for (int64_t t = begin; t < end; ++t) {
        const T* ct = c + t * dim;
        const T* st = s + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          T* xh = x + t * row_stride + h * head_stride;
          for (int64_t d = 0; d < dim; ++d) head[d] = static_cast<float>(xh[d]);
          for (int64_t d = 0; d < dim; ++d) {
            const float rolled = head[d < half ? d + half : d - half];
            xh[d] = static_cast<T>(round_to<T>(head[d] * static_cast<float>(ct[d])) +
                                   round_to<T>(rolled * static_cast<float>(st[d])));
          }
        }
      }
    });
  });
}

// ---- Write new K/V into their cache slots --------------------------------------------------------
// Plain caches take a copy; an int8 cache takes quantize_per_head_ref's result exactly:
// scale = float16(min(amax / 127, 65504)), q = round-half-away(x / scale) clamped to +-127.
// Compiled without fast-math so the division and rounding are IEEE, as in the reference.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
template <typename T>
void quantize_head(int8_t* q, c10::Half* scale, const T* x, int64_t dim) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const c10::Half s = static_cast<c10::Half>(std::min(amax / 127.0f, 65504.0f));
  const float sf = static_cast<float>(s);
  const float inv = sf > 0.f ? 1.0f / std::max(sf, 1e-30f) : 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float y = static_cast<float>(x[d]) * inv;
    const float r = y >= 0.f ? std::floor(y + 0.5f) : std::ceil(y - 0.5f);
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  *scale = s;
}
#pragma GCC pop_options

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor key_cache, Tensor value_cache,
                       const Tensor& slot_mapping, const c10::optional<Tensor>& k_scale,
                       const c10::optional<Tensor>& v_scale) {
  check_cpu_float(key, "key");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
              value.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "key/value must be [tokens, kv_heads, head_dim] with contiguous heads");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
              value_cache.scalar_type() == key_cache.scalar_type() &&
              (int8_cache || key_cache.scalar_type() == key.scalar_type()),
              "caches must be contiguous and of the key's dtype (or int8)");
  TORCH_CHECK(!int8_cache || (k_scale && v_scale && k_scale->scalar_type() == at::kHalf &&
                              v_scale->scalar_type() == at::kHalf && k_scale->is_contiguous() &&
                              v_scale->is_contiguous()),
              "an int8 cache needs contiguous float16 k_scale and v_scale");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), row = heads * dim;
  const int64_t num_slots = key_cache.numel() / row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache (", num_slots, " slots)");
  dispatch_float(key.scalar_type(), [&]<typename T>() {
    const T* k = key.data_ptr<T>();
    const T* v = value.data_ptr<T>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding: no slot
      const T* kt = k + t * key.stride(0);
      const T* vt = v + t * value.stride(0);
      if (int8_cache) {
        for (int64_t h = 0; h < heads; ++h) {
          quantize_head<T>(key_cache.data_ptr<int8_t>() + slot * row + h * dim,
                           k_scale->data_ptr<c10::Half>() + slot * heads + h, kt + h * dim, dim);
          quantize_head<T>(value_cache.data_ptr<int8_t>() + slot * row + h * dim,
                           v_scale->data_ptr<c10::Half>() + slot * heads + h, vt + h * dim, dim);
        }
      } else {
        std::copy_n(kt, row, key_cache.data_ptr<T>() + slot * row);
        std::copy_n(vt, row, value_cache.data_ptr<T>() + slot * row);
      }
    }
  });
}

// ---- Weight-only int8 GEMV (one token row) ----------------------------------------------------
// y[n] = dtype(scale[n] * sum_k x[k] * q[n, k]): batch-1 decode, where reading the weight is
// the whole cost. Eight output rows at a time share each x load; the rows two blocks ahead are
// prefetched into L2 (_MM_HINT_T1). Without that prefetch this loop streamed at a third of
// the memory bandwidth here (11 vs 34 GB/s on 2 threads; a T0 prefetch: 15 GB/s).
#ifdef __AVX512F__
constexpr int64_t kGemvRows = 8;

inline __m512 int8x16_to_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

void int8_gemv_rows(float* out, const float* x, const int8_t* rows, int64_t K) {
  __m512 acc[kGemvRows];
  for (int64_t r = 0; r < kGemvRows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t ahead = 2 * kGemvRows * K;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    for (int64_t r = 0; r < kGemvRows; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(rows + r * K + k + ahead), _MM_HINT_T1);
    for (int64_t u = 0; u < 64; u += 16) {
      const __m512 xv = _mm512_loadu_ps(x + k + u);
      for (int64_t r = 0; r < kGemvRows; ++r)
        acc[r] = _mm512_fmadd_ps(xv, int8x16_to_float(rows + r * K + k + u), acc[r]);
    }
  }
  for (int64_t r = 0; r < kGemvRows; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    for (int64_t t = k; t < K; ++t) sum += x[t] * static_cast<float>(rows[r * K + t]);
    out[r] = sum;
  }
}
#endif

Tensor int8_gemv(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x must be a contiguous [1, in_features]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous() &&
              qweight.size(1) == x.size(1), "qweight must be a contiguous int8 [out_features, in_features]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0) && scales.is_contiguous() &&
              scales.scalar_type() == x.scalar_type(), "scales must be a contiguous [out_features] of x's dtype");
  const int64_t N = qweight.size(0), K = qweight.size(1);
  Tensor out = at::empty({1, N}, x.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    std::vector<float> xf(K);
    const T* xp = x.data_ptr<T>();
    for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xp[k]);
    const int8_t* q = qweight.data_ptr<int8_t>();
    const T* sc = scales.data_ptr<T>();
    T* o = out.data_ptr<T>();
    auto row_dot = [&](int64_t n) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xf[k] * static_cast<float>(q[n * K + k]);
      return sum;
    };
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      int64_t n = begin;
#ifdef __AVX512F__
      float acc[kGemvRows];
      for (; n + kGemvRows <= end; n += kGemvRows) {
        int8_gemv_rows(acc, xf.data(), q + n * K, K);
        for (int64_t r = 0; r < kGemvRows; ++r)
          o[n + r] = static_cast<T>(acc[r] * static_cast<float>(sc[n + r]));
      }
#endif
      for (; n < end; ++n) o[n] = static_cast<T>(row_dot(n) * static_cast<float>(sc[n]));
    });
  });
  return out;
}

// x [M, K] float, qweight int8 [N, K], scales [N] of x's dtype.
void check_int8_operands(const Tensor& x, const Tensor& qweight, const Tensor& scales, const char* op) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [M, in_features]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous() &&
              qweight.size(1) == x.size(1), op, ": qweight must be a contiguous int8 [out_features, in_features]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0) && scales.scalar_type() == x.scalar_type(),
              op, ": scales must be [out_features] of x's dtype");
}

// int8 -> T, exactly (|q| <= 128 fits either significand).
template <typename T>
void widen_int8_rows(T* dst, const int8_t* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(int8x16_to_float(src + i)));
    }
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
}

#if defined(__AVX512BF16__)
// bfloat16, many token rows: the weights are the broadcast operand and 16 tokens share a
// register, so each widened weight pair feeds TB vdpbf16ps of 16 tokens from one broadcast.
// (The other way round, 16 weight rows per register, needs the row-major int8 weight
// transposed on every call.) tokens[(v * pairs + p) * 16 + t] is input pair p of token 16v + t.
// The buffer is thread-local and reused: a fresh one per call page-faulted (for a 4096-token
// prefill chunk the faults cost more than the copy).
const int32_t* token_pairs(const Tensor& x) {
  static thread_local std::vector<int32_t> buffer;
  const int64_t M = x.size(0), pairs = x.size(1) / 2, vecs = (M + 15) / 16;
  if (buffer.size() < static_cast<size_t>(vecs * pairs * 16)) buffer.resize(vecs * pairs * 16);
  const int32_t* x32 = reinterpret_cast<const int32_t*>(x.data_ptr<c10::BFloat16>());
  int32_t* out = buffer.data();
  for (int64_t v = 0; v < vecs; ++v)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16)  // 16 x 16 tiles: both sides stay in L1
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t m = v * 16 + t;
        for (int64_t p = p0; p < std::min(p0 + 16, pairs); ++p)
          out[(v * pairs + p) * 16 + t] = m < M ? x32[m * pairs + p] : 0;
      }
  return out;
}

// out[(r * TB + b) * 16 + t] = sum_p (weight row r, pair p) . (token 16b + t, pair p), for
// NR weight rows and TB token registers; the pair (r, p) is the int32 at w[r * rs + p * ps].
template <int NR, int TB>
void weight_broadcast_block(float* out, const int32_t* tokens, const int32_t* w, int64_t pairs,
                            int64_t rs, int64_t ps) {
  __m512 acc[NR][TB];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < TB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh xb[TB];
    for (int b = 0; b < TB; ++b) xb[b] = (__m512bh)_mm512_loadu_si512(tokens + (b * pairs + p) * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(w[r * rs + p * ps]);
      for (int b = 0; b < TB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wb, xb[b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < TB; ++b) _mm512_storeu_ps(out + (r * TB + b) * 16, acc[r][b]);
}

// o[m, n0 + r] = (scales ? scales[n0 + r] : 1) * sum_p w(r, p) . x(m, p) for `rows` (<= 16)
// bf16 weight rows laid out as weight_broadcast_block reads them, every token, 8 rows x 32
// tokens at a time.
void multiply_row_block(c10::BFloat16* o, const int32_t* tokens, const int32_t* w, int64_t rs, int64_t ps,
                        int64_t rows, int64_t n0, int64_t N, int64_t M, int64_t pairs,
                        const c10::BFloat16* scales) {
  constexpr int64_t kRows = 8, kTokenRegs = 2;
  float acc[kRows * kTokenRegs * 16];
  const int64_t vecs = (M + 15) / 16;
  for (int64_t v = 0; v < vecs; v += kTokenRegs) {
    const int64_t regs = std::min(kTokenRegs, vecs - v);
    const int32_t* tv = tokens + v * pairs * 16;
    for (int64_t r0 = 0; r0 < rows;) {
      const int64_t nr = rows - r0 >= kRows ? kRows : 1;
      const int32_t* wr = w + r0 * rs;
      if (nr == kRows && regs == 2) weight_broadcast_block<kRows, 2>(acc, tv, wr, pairs, rs, ps);
      else if (nr == kRows) weight_broadcast_block<kRows, 1>(acc, tv, wr, pairs, rs, ps);
      else if (regs == 2) weight_broadcast_block<1, 2>(acc, tv, wr, pairs, rs, ps);
      else weight_broadcast_block<1, 1>(acc, tv, wr, pairs, rs, ps);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t n = n0 + r0 + r;
        const float s = scales ? static_cast<float>(scales[n]) : 1.f;
        for (int64_t i = 0; i < regs * 16 && v * 16 + i < M; ++i)
          o[(v * 16 + i) * N + n] = static_cast<c10::BFloat16>(acc[r * regs * 16 + i] * s);
      }
      r0 += nr;
    }
  }
}

// int8_matmul for bfloat16 x (K even): per block of 16 weight rows, widen them once into an
// L1-sized buffer, then run every token through it.
Tensor int8_matmul_bf16(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  using BF16 = c10::BFloat16;
  constexpr int64_t kRowBlock = 16;
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), pairs = K / 2;
  const int32_t* tokens = token_pairs(x);
  Tensor out = at::empty({M, N}, x.options());
  const int8_t* q = qweight.data_ptr<int8_t>();
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 4, [&](int64_t begin, int64_t end) {
    std::vector<BF16> widened(kRowBlock * K);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kRowBlock, rows = std::min(kRowBlock, N - n0);
      widen_int8_rows(widened.data(), q + n0 * K, rows * K);
      multiply_row_block(out.data_ptr<BF16>(), tokens,
                         reinterpret_cast<const int32_t*>(widened.data()), pairs, 1, rows, n0, N, M,
                         pairs, scales.data_ptr<BF16>());
    }
  });
  return out;
}
#endif

// y [M, N] = (x @ q.T) * scales for several token rows. bfloat16 on AVX512-BF16: the kernel
// above. Otherwise the int8 weight is widened slice by slice into one reused buffer (about
// 1 MB, cache-resident) and multiplied there, instead of widening all of it into a fresh
// tensor per call, whose page faults alone cost more than the GEMM (16 ms for the 49152 x 576
// lm_head here).
Tensor int8_matmul(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  check_int8_operands(x, qweight, scales, "int8_matmul");
  const int64_t N = qweight.size(0), K = qweight.size(1);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && K % 2 == 0) return int8_matmul_bf16(x, qweight, scales.contiguous());
#endif
  const int64_t slice = std::max<int64_t>(16, (int64_t{1} << 19) / K);  // rows per slice
  // y.T is filled slice by slice (contiguous rows): at::mm of the widened slice and x.T ran
  // twice as fast here as at::linear into y's columns.
  Tensor out_t = at::empty({N, x.size(0)}, x.options());
  Tensor buffer = at::empty({std::min(slice, N), K}, x.options());
  const Tensor x_t = x.t();
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const int8_t* q = qweight.data_ptr<int8_t>();
    T* buf = buffer.data_ptr<T>();
    for (int64_t n0 = 0; n0 < N; n0 += slice) {
      const int64_t rows = std::min(slice, N - n0);
      at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
        widen_int8_rows(buf + begin * K, q + (n0 + begin) * K, (end - begin) * K);
      });
      Tensor dst = out_t.narrow(0, n0, rows);
      at::mm_out(dst, buffer.narrow(0, 0, rows), x_t);
    }
  });
  out_t.mul_(scales.unsqueeze(1));
  return out_t.t().contiguous();
}

#if defined(__AVX512BF16__)
// bfloat16, 2-16 token rows: the int8 weight is widened straight from its rows, 16 inputs of
// two rows per register (row a in the low half), and multiplied with 8 input pairs of a token
// broadcast to both halves; each lane sums one (row, pair slot), reduced per half at the end.
// RP such row pairs x M tokens of accumulators: every widened register feeds M dot products.
inline __m512bh widen_two_rows(const int8_t* a, const int8_t* b) {
  return _mm512_cvtne2ps_pbh(int8x16_to_float(b), int8x16_to_float(a));
}

// out[r * M + m] = sum_k q[r, k] x[m, k] for the 2 RP rows at q, k < K16 (a multiple of 16).
template <int RP, int M>
void int8_few_rows_block(float* out, const c10::BFloat16* x, const int8_t* q, int64_t K, int64_t K16) {
  __m512 acc[RP][M];
  for (int r = 0; r < RP; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t ahead = 2 * 2 * RP * K;  // two blocks on, into L2, as int8_gemv does
  for (int64_t k = 0; k < K16; k += 16) {
    if (k % 64 == 0)
      for (int r = 0; r < 2 * RP; ++r) _mm_prefetch(reinterpret_cast<const char*>(q + r * K + k + ahead), _MM_HINT_T1);
    __m512bh w[RP];
    for (int r = 0; r < RP; ++r) w[r] = widen_two_rows(q + 2 * r * K + k, q + (2 * r + 1) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k)));
      for (int r = 0; r < RP; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xb);
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int m = 0; m < M; ++m) {
      out[2 * r * M + m] = _mm512_mask_reduce_add_ps(0x00FF, acc[r][m]);
      out[(2 * r + 1) * M + m] = _mm512_mask_reduce_add_ps(0xFF00, acc[r][m]);
    }
}

template <int M>
void int8_few_rows(c10::BFloat16* o, const c10::BFloat16* x, const int8_t* q, const c10::BFloat16* sc,
                   int64_t N, int64_t K) {
  constexpr int RP = M <= 4 ? 4 : 2;  // RP * M <= 16 accumulators
  const int64_t K16 = K / 16 * 16;
  auto finish = [&](const float* acc, int64_t n0, int64_t rows) {  // k tail, scale, store
    for (int64_t r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m) {
        float sum = acc[r * M + m];
        for (int64_t k = K16; k < K; ++k)
          sum += static_cast<float>(x[m * K + k]) * static_cast<float>(q[(n0 + r) * K + k]);
        o[m * N + n0 + r] = static_cast<c10::BFloat16>(sum * static_cast<float>(sc[n0 + r]));
      }
  };
  const int64_t blocks = N / (2 * RP);
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    float acc[2 * RP * M];
    for (int64_t b = begin; b < end; ++b) {
      int8_few_rows_block<RP, M>(acc, x, q + b * 2 * RP * K, K, K16);
      finish(acc, b * 2 * RP, 2 * RP);
    }
  });
  for (int64_t n0 = blocks * 2 * RP; n0 < N; n0 += 2) {  // row tail: pairs, then a lone row
    float acc[2 * M] = {};
    if (n0 + 1 < N) int8_few_rows_block<1, M>(acc, x, q + n0 * K, K, K16);
    else for (int m = 0; m < M; ++m)
      for (int64_t k = 0; k < K16; ++k) acc[m] += static_cast<float>(x[m * K + k]) * static_cast<float>(q[n0 * K + k]);
    finish(acc, n0, std::min<int64_t>(2, N - n0));
  }
}

// Up to 8 tokens per pass (RP * M <= 16 accumulators); more tokens take more passes, which
// re-widen the weight but stay cheaper than one pass with 16 token broadcasts per widening.
template <int M = 1>
void int8_few_rows_pass(int64_t tokens, c10::BFloat16* o, const c10::BFloat16* x, const int8_t* q,
                        const c10::BFloat16* sc, int64_t N, int64_t K) {
  if constexpr (M < 8) {
    if (tokens != M) return int8_few_rows_pass<M + 1>(tokens, o, x, q, sc, N, K);
  }
  int8_few_rows<M>(o, x, q, sc, N, K);
}

Tensor int8_few_rows_matmul(const Tensor& x, const Tensor& qweight, const Tensor& scales) {
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1);
  Tensor out = at::empty({M, N}, x.options());
  for (int64_t m0 = 0; m0 < M; m0 += 8)
    int8_few_rows_pass(std::min<int64_t>(8, M - m0), out.data_ptr<c10::BFloat16>() + m0 * N,
                       x.data_ptr<c10::BFloat16>() + m0 * K, qweight.data_ptr<int8_t>(),
                       scales.data_ptr<c10::BFloat16>(), N, K);
  return out;
}
#endif

// Int8Linear's product on the CPU, the kernel picked by the number of token rows: int8_gemv
// for one; up to packed_max_tokens the few-row kernel above (bfloat16 on AVX512-BF16) or else
// PyTorch's packed kernel; int8_matmul above. The one rule both Int8Linear.forward and
// decode_layer follow.
Tensor int8_linear(const Tensor& x, const Tensor& qweight, const Tensor& scales, int64_t packed_max_tokens) {
  const int64_t M = x.size(0);
  if (M == 1) return int8_gemv(x, qweight, scales);
  if (M > packed_max_tokens) return int8_matmul(x, qweight, scales);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    check_int8_operands(x, qweight, scales, "int8_linear");
    return int8_few_rows_matmul(x, qweight, scales.contiguous());
  }
#endif
  return at::_weight_int8pack_mm(x, qweight, scales);
}

// ---- Weight-only int4 (group-wise scales and zeros) ---------------------------------------------
// w[n, k] = (q - 8) * s[g, n] + z[g, n], g = k / group, q in 0..15 (Int4Linear's convention).
// scales_and_zeros: [Kp / group, N, 2] in x's dtype (PyTorch's CPU int4 convention, kept).
// qweight (cpu_ops.pack_int4), uint8 [N, Kp / 2]: tiles of 16 output rows; each tile is a run of
// 64-byte blocks, one per 8 inputs. In a block, 16-bit word 2r + j holds the weights of row r
// for inputs 2f + j (f = 0..3) in its bits 4f..4f+3. So one load and a shift give a vector
// of (row, input pair) products for 16 rows, and a tile's 16 sums live in one register's
// lanes: no horizontal sums, and a group's 16 scales are one vector.
constexpr int64_t kInt4Tile = 16;

inline int64_t int4_groups(const Tensor& qweight, const Tensor& sz, int64_t group, const char* op) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              op, ": qweight must be a contiguous uint8 [out_features, in_features / 2]");
  TORCH_CHECK(qweight.size(0) % kInt4Tile == 0, op, ": out_features must be a multiple of 16");
  TORCH_CHECK(group > 0 && group % 8 == 0, op, ": group size must be a multiple of 8, got ", group);
  const int64_t Kp = qweight.size(1) * 2;
  TORCH_CHECK(Kp % group == 0, op, ": padded in_features ", Kp, " must be a multiple of the group size");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == Kp / group && sz.size(1) == qweight.size(0) && sz.size(2) == 2 &&
              sz.is_contiguous(), op, ": scales_and_zeros must be a contiguous [in_features / group, out_features, 2]");
  return Kp / group;
}

#if defined(__AVX512BF16__)
// A group's (scale, zero) pairs of a tile's 16 rows as two float32 vectors: in memory bf16 s is
// the low half of each 32-bit lane and z the high half, and a bf16 is the high half of its float32.
inline void int4_tile_scales_zeros(const c10::BFloat16* sz, __m512& s, __m512& z) {
  const __m512i pairs = _mm512_loadu_si512(sz);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// bfloat16 x, one tile, MR token rows: 0x4300 | q is the bfloat16 number 128 + q, so a shift
// and one vpternlog turn a field of 32 nibbles into bf16 weights that vdpbf16ps multiplies
// with a broadcast input pair, 32 products per instruction, exactly, into float32 lane sums.
// Per group, sum_k w x = s * sum_k (128 + q) x + (z - 136 s) * sum_k x, with sum_k x computed
// once per call. The tile's weights are unpacked once per block for all MR rows.
template <int MR>
void int4_tile_bf16(float* out, const c10::BFloat16* x, const float* xsum, const uint8_t* tile,
                    const c10::BFloat16* sz, int64_t N, int64_t K, int64_t group) {
  const __m512i mask = _mm512_set1_epi16(0x000F), one28 = _mm512_set1_epi16(0x4300);
  const int64_t blocks_per_group = group / 8, ng = K / group, tile_bytes = K / 2 * kInt4Tile;
  auto field = [&](__m512i v) { return (__m512bh)_mm512_ternarylogic_epi32(v, mask, one28, 0xEA); };  // (v & mask) | one28
  __m512 acc[MR], bias[MR];
  for (int m = 0; m < MR; ++m) acc[m] = bias[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 t[MR][2];
    for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + b * 64 + 2 * tile_bytes), _MM_HINT_T1);
      const __m512i w = _mm512_loadu_si512(tile + b * 64);
      const __m512bh f0 = field(w), f1 = field(_mm512_srli_epi16(w, 4)), f2 = field(_mm512_srli_epi16(w, 8));
      const __m512bh f3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), one28);
      for (int m = 0; m < MR; ++m) {
        const int32_t* xp = reinterpret_cast<const int32_t*>(x + m * K) + b * 4;  // input pairs
        t[m][0] = _mm512_dpbf16_ps(t[m][0], f0, (__m512bh)_mm512_set1_epi32(xp[0]));
        t[m][1] = _mm512_dpbf16_ps(t[m][1], f1, (__m512bh)_mm512_set1_epi32(xp[1]));
        t[m][0] = _mm512_dpbf16_ps(t[m][0], f2, (__m512bh)_mm512_set1_epi32(xp[2]));
        t[m][1] = _mm512_dpbf16_ps(t[m][1], f3, (__m512bh)_mm512_set1_epi32(xp[3]));
      }
    }
    _mm_prefetch(reinterpret_cast<const char*>(sz + g * N * 2 + 2 * kInt4Tile * 2), _MM_HINT_T1);
    __m512 s, z;
    int4_tile_scales_zeros(sz + g * N * 2, s, z);
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, z);
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(t[m][0], t[m][1]), s, acc[m]);
      bias[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * ng + g]), bias[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * kInt4Tile, _mm512_add_ps(acc[m], bias[m]));
}
#endif

// One tile, one token row, any dtype: the portable loop (float32, or no AVX512-BF16). The
// 16 rows are the inner loop, so gcc can vectorize it the way the intrinsics path works.
template <typename T>
void int4_tile(float* out, const T* x, const float* xsum, const uint8_t* tile, const T* sz,
               int64_t N, int64_t K, int64_t group) {
  for (int64_t r = 0; r < kInt4Tile; ++r) out[r] = 0.f;
  for (int64_t g = 0; g < K / group; ++g) {
    float dot[kInt4Tile] = {};
    for (int64_t b = g * group / 8; b < (g + 1) * group / 8; ++b) {
      const uint8_t* block = tile + b * 64;
      for (int64_t k = 0; k < 8; ++k) {  // input 8b + k = 2f + j: byte 2 (2r + j) + f / 2
        const int64_t f = k / 2, shift = 4 * (f % 2);
        const uint8_t* bytes = block + 2 * (k % 2) + f / 2;
        const float xk = static_cast<float>(x[b * 8 + k]);
        for (int64_t r = 0; r < kInt4Tile; ++r)
          dot[r] += static_cast<float>((bytes[4 * r] >> shift) & 15) * xk;
      }
    }
    for (int64_t r = 0; r < kInt4Tile; ++r) {
      const float s = static_cast<float>(sz[(g * N + r) * 2]), z = static_cast<float>(sz[(g * N + r) * 2 + 1]);
      out[r] += s * dot[r] + (z - 8.f * s) * xsum[g];
    }
  }
}

// Many token rows, bfloat16: a tile's 16 rows are dequantized once, w = q s + (z - 8 s)
// rounded to bfloat16, into a buffer where the pair (row r, input pair p) is the int32 at
// [p * 16 + r], and every token runs through it with int8_matmul's broadcast kernel. From
// 16 rows that beats unpacking each block again per 4 token rows (1.4-2.7x at 24-256 rows).
// A token's result there depends on no other token: the batch-invariant mode takes this path
// for any row count (many_rows_from = 1).
constexpr int64_t kInt4ManyRows = 16;
#if defined(__AVX512BF16__)
void dequantize_int4_tile(c10::BFloat16* buf, const uint8_t* tile, const c10::BFloat16* sz, int64_t N,
                          int64_t K, int64_t group) {
  const __m512i mask = _mm512_set1_epi16(0x000F);
  const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // lane 2r + j -> r
  const __m512i hi_rows = _mm512_add_epi32(lo_rows, _mm512_set1_epi32(8));
  const int64_t blocks_per_group = group / 8;
  for (int64_t g = 0; g < K / group; ++g) {
    __m512 s, z;
    int4_tile_scales_zeros(sz + g * N * 2, s, z);
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z - 8 s
    const __m512 s_lo = _mm512_permutexvar_ps(lo_rows, s), s_hi = _mm512_permutexvar_ps(hi_rows, s);
    const __m512 o_lo = _mm512_permutexvar_ps(lo_rows, offset), o_hi = _mm512_permutexvar_ps(hi_rows, offset);
    // Field f of block b: 16-bit lane 2r + j is q(r, 8b + 2f + j), i.e. pair 4b + f of row r.
    auto store = [&](__m512i q, int64_t pair) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)));
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, o_hi), _mm512_fmadd_ps(lo, s_lo, o_lo));
      _mm512_storeu_si512(buf + pair * 32, (__m512i)w);
    };
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const __m512i w = _mm512_loadu_si512(tile + b * 64);
      store(_mm512_and_si512(w, mask), 4 * b);
      store(_mm512_and_si512(_mm512_srli_epi16(w, 4), mask), 4 * b + 1);
      store(_mm512_and_si512(_mm512_srli_epi16(w, 8), mask), 4 * b + 2);
      store(_mm512_srli_epi16(w, 12), 4 * b + 3);
    }
  }
}

// A few tokens (the batch-invariant mode's decode rows): a tile's 16 weight rows in the lanes
// and one token pair broadcast, instead of 16 token lanes of which all but M idle. Each (token,
// row) sum is the same chain of vdpbf16ps as multiply_row_block's, pair 0 first, so the bits
// are; kRowLaneTiles tiles run side by side, as independent chains, to hide its latency.
constexpr int64_t kInt4RowLaneTokens = 4, kRowLaneTiles = 4;
template <int T>
void multiply_rows_in_lanes(c10::BFloat16* o, const int32_t* x32, const int32_t* const* w, int64_t n0,
                            int64_t N, int64_t M, int64_t pairs) {
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* xm = x32 + m * pairs;
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xm[p]);
      for (int t = 0; t < T; ++t)
        acc[t] = _mm512_dpbf16_ps(acc[t], xb, (__m512bh)_mm512_loadu_si512(w[t] + p * 16));
    }
    for (int t = 0; t < T; ++t) {
      alignas(64) float sums[kInt4Tile];
      _mm512_store_ps(sums, acc[t]);
      for (int64_t r = 0; r < kInt4Tile; ++r)
        o[m * N + n0 + t * kInt4Tile + r] = static_cast<c10::BFloat16>(sums[r]);
    }
  }
}

Tensor int4_matmul_many_rows(const Tensor& x, const Tensor& qweight, const Tensor& sz, int64_t group) {
  using BF16 = c10::BFloat16;
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1) * 2, tiles = N / kInt4Tile;
  Tensor out = at::empty({M, N}, x.options());
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const BF16* s = sz.data_ptr<BF16>();
  if (M <= kInt4RowLaneTokens) {
    const auto* x32 = reinterpret_cast<const int32_t*>(x.data_ptr<BF16>());
    const int64_t groups = (tiles + kRowLaneTiles - 1) / kRowLaneTiles;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<BF16> dequantized(kRowLaneTiles * kInt4Tile * K);
      const int32_t* w[kRowLaneTiles];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t first = g * kRowLaneTiles, count = std::min(kRowLaneTiles, tiles - first);
        for (int64_t t = 0; t < count; ++t) {
          BF16* buf = dequantized.data() + t * kInt4Tile * K;
          const int64_t n0 = (first + t) * kInt4Tile;
          dequantize_int4_tile(buf, q + n0 * (K / 2), s + n0 * 2, N, K, group);
          w[t] = reinterpret_cast<const int32_t*>(buf);
        }
        BF16* o = out.data_ptr<BF16>();
        const int64_t n0 = first * kInt4Tile;
        if (count == 4) multiply_rows_in_lanes<4>(o, x32, w, n0, N, M, K / 2);
        else if (count == 3) multiply_rows_in_lanes<3>(o, x32, w, n0, N, M, K / 2);
        else if (count == 2) multiply_rows_in_lanes<2>(o, x32, w, n0, N, M, K / 2);
        else multiply_rows_in_lanes<1>(o, x32, w, n0, N, M, K / 2);
      }
    });
    return out;
  }
  const int32_t* tokens = token_pairs(x);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<BF16> dequantized(kInt4Tile * K);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kInt4Tile;
      dequantize_int4_tile(dequantized.data(), q + n0 * (K / 2), s + n0 * 2, N, K, group);
      multiply_row_block(out.data_ptr<BF16>(), tokens, reinterpret_cast<const int32_t*>(dequantized.data()),
                         1, kInt4Tile, kInt4Tile, n0, N, M, K / 2, nullptr);
    }
  });
  return out;
}
#endif

// y [M, N] = x [M, Kp] @ w.T: the weight is read once per call (a quarter of bf16's bytes);
// below 16 rows (decode) each 64-byte block is unpacked once for up to 4 rows, from 16
// bfloat16 rows int4_matmul_many_rows takes over.
Tensor int4_matmul(const Tensor& x, const Tensor& qweight, const Tensor& sz, int64_t group,
                   int64_t many_rows_from = kInt4ManyRows) {
  const int64_t ng = int4_groups(qweight, sz, group, "int4_matmul");
  check_cpu_float(x, "x");
  const int64_t M = x.size(0), N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous(), "int4_matmul: x must be a contiguous [M, ", K, "]");
  TORCH_CHECK(sz.scalar_type() == x.scalar_type(), "int4_matmul: scales_and_zeros must have x's dtype");
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && M >= many_rows_from) return int4_matmul_many_rows(x, qweight, sz, group);
#endif
  Tensor out = at::empty({M, N}, x.options());
  dispatch_float(x.scalar_type(), [&]<typename T>() {
    const T* xp = x.data_ptr<T>();
    std::vector<float> xsum(M * ng, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xsum[m * ng + k / group] += static_cast<float>(xp[m * K + k]);
    const uint8_t* q = qweight.data_ptr<uint8_t>();
    const T* s = sz.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, N / kInt4Tile, 4, [&](int64_t begin, int64_t end) {
      float tile_out[4 * kInt4Tile];
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t n = tile * kInt4Tile;
        const uint8_t* qt = q + n * (K / 2);
        for (int64_t m = 0; m < M;) {
          int64_t rows = 1;
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            rows = std::min<int64_t>(4, M - m);
            const T* xm = xp + m * K;
            const float* sm = xsum.data() + m * ng;
            if (rows == 4) int4_tile_bf16<4>(tile_out, xm, sm, qt, s + n * 2, N, K, group);
            else if (rows == 3) int4_tile_bf16<3>(tile_out, xm, sm, qt, s + n * 2, N, K, group);
            else if (rows == 2) int4_tile_bf16<2>(tile_out, xm, sm, qt, s + n * 2, N, K, group);
            else int4_tile_bf16<1>(tile_out, xm, sm, qt, s + n * 2, N, K, group);
          } else
#endif
            int4_tile(tile_out, xp + m * K, xsum.data() + m * ng, qt, s + n * 2, N, K, group);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t r = 0; r < kInt4Tile; ++r) o[(m + i) * N + n + r] = static_cast<T>(tile_out[i * kInt4Tile + r]);
          m += rows;
        }
      }
    });
  });
  return out;
}

// ---- Operands of the paged attention ops ----------------------------------------------------------
// query [tokens, num_heads, head_dim] (rows may be strided), out contiguous like it, caches
// [num_blocks, block_size, num_kv_heads, head_dim] of the query's dtype or int8 with float16
// scales. Returns whether the cache is int8.
bool check_paged_attention_operands(const Tensor& out, const Tensor& query, const Tensor& key_cache,
                                    const Tensor& value_cache, const c10::optional<Tensor>& k_scale,
                                    const c10::optional<Tensor>& v_scale) {
  check_cpu_float(query, "query");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() &&
              out.scalar_type() == query.scalar_type(), "out must be contiguous and like query");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
              value_cache.sizes() == key_cache.sizes() && key_cache.size(3) == query.size(2),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(!int8_cache || (k_scale && v_scale), "an int8 cache needs k_scale and v_scale");
  TORCH_CHECK(!k_scale || (k_scale->scalar_type() == at::kHalf && k_scale->is_contiguous() &&
                           v_scale && v_scale->scalar_type() == at::kHalf && v_scale->is_contiguous()),
              "k_scale/v_scale must be contiguous float16");
  TORCH_CHECK(int8_cache || key_cache.scalar_type() == query.scalar_type(),
              "cache dtype must equal the query dtype (or be int8)");
  return int8_cache;
}

// ---- Paged decode attention -------------------------------------------------------------------
// One query token per sequence against its cached tokens, for the `group` query heads that
// share each kv head: scores in float32, exact softmax (max-subtracted), weighted sum of V.
// A task is (sequence, kv head, context split): where the batch has too few (sequence, kv
// head) pairs to keep every thread busy (batch 1: as many tasks as kv heads), each context is
// split into ranges of >= kDecodeSplitKeys keys whose partial results (max, sum, unnormalized
// output) are merged afterwards (flash-decoding). Nothing is gathered or padded. With a
// sliding window W (> 0) a query at position ctx - 1 sees only keys [ctx - W, ctx): the
// blocks before them are never read, and the splits divide the window. With a soft cap C (> 0:
// Gemma 2's attn_logit_softcapping) every scaled score s becomes C * tanh(s / C) before the
// softmax; 0 leaves the scores as they are (one branch per task, outside the key loops).
constexpr int64_t kDecodeSplitKeys = 256;

int64_t decode_splits(int64_t pairs, int64_t max_context) {
  const int64_t wanted = (4 * at::get_num_threads() + pairs - 1) / pairs;  // ~4 tasks per thread
  const int64_t most = (max_context + kDecodeSplitKeys - 1) / kDecodeSplitKeys;
  return std::max<int64_t>(1, std::min(wanted, most));
}

#if defined(__AVX512BF16__)
alignas(64) constexpr uint16_t kZeroRow[128] = {};  // stands in for keys past the end
constexpr int64_t kDecodePrefetchKeys = 64;

template <typename cache_t, int64_t D>
inline void prefetch_row(const cache_t* row) {
  for (int64_t i = 0; i < D * int64_t(sizeof(cache_t)); i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + i, _MM_HINT_T0);
}

// 16 values of an int8 cache row times its scale, as float32.
inline __m512 dequantize16(const int8_t* src, float scale) {
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(scale));
}

// Lane j of the result = the sum of v[j]'s 16 lanes: 15 adds over shuffled pairs (halving the
// width each stage) instead of 16 horizontal reductions. The stages leave v[j] in lane
// lane[j]; one permute puts it back in place.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: lanes 0-7 for v[i], 8-15 for v[i + 8]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: v[i], v[i + 8], v[i + 4], v[i + 12]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[i], t[i + 4], 0x88), _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[i], u[i + 2]), _mm512_unpackhi_ps(u[i], u[i + 2]));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // After the stages lane 4k + p holds v[{0, 2, 1, 3}[p] + {0, 8, 4, 12}[k]]; lane[j] is where v[j] is.
  const __m512i lane = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(lane, sum);
}

// scores[g * stride + t - first] = scale * q_g . k_t for keys [first, first + count) of kv head
// kvh, bf16 query, bf16 or int8 cache: 16 keys at a time, each key's dot product as D / 32
// vdpbf16ps over dim pairs (exact products, float32 sums), the 16 sums reduced together by
// hsum16. int8 rows are dequantized to bf16 first (16 at a time, in L1), as the torch path
// rounds them.
template <typename cache_t, int64_t D>
void decode_scores_bf16(float* scores, int64_t stride, const c10::BFloat16* q, int64_t group,
                        const cache_t* k_cache, const c10::Half* k_scale, const int32_t* blocks,
                        int64_t block_size, int64_t num_kv_heads, int64_t kvh, int64_t first, int64_t count,
                        float scale) {
  constexpr int64_t P = D / 32;  // registers of dim pairs per row
  const __m512 vscale = _mm512_set1_ps(scale);
  auto slot_of = [&](int64_t t) { return blocks[t / block_size] * block_size + t % block_size; };
  alignas(64) c10::BFloat16 k_buf[16 * D];  // int8 caches
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - t0);
    // The rows are strided (other kv heads between them) and a single core keeps too few
    // misses in flight to stream them at DRAM speed: ask for rows kDecodePrefetchKeys ahead.
    for (int64_t t = t0 + kDecodePrefetchKeys; t < std::min(count, t0 + kDecodePrefetchKeys + 16); ++t)
      prefetch_row<cache_t, D>(k_cache + (slot_of(first + t) * num_kv_heads + kvh) * D);
    const __m512i* rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) { rows[j] = reinterpret_cast<const __m512i*>(kZeroRow); continue; }
      const int64_t slot = slot_of(first + t0 + j);
      const cache_t* src = k_cache + (slot * num_kv_heads + kvh) * D;
      if constexpr (std::is_same_v<cache_t, int8_t>) {
        const float s = static_cast<float>(k_scale[slot * num_kv_heads + kvh]);
        for (int64_t i = 0; i < D / 16; ++i)
          _mm256_store_si256(reinterpret_cast<__m256i*>(k_buf + j * D + 16 * i),
                             (__m256i)_mm512_cvtneps_pbh(dequantize16(src + 16 * i, s)));
        rows[j] = reinterpret_cast<const __m512i*>(k_buf + j * D);
      } else {
        rows[j] = reinterpret_cast<const __m512i*>(src);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512bh qv[P];
      for (int64_t i = 0; i < P; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * i);
      __m512 acc[16];
      for (int64_t j = 0; j < 16; ++j) {
        acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int64_t i = 1; i < P; ++i)
          acc[j] = _mm512_dpbf16_ps(acc[j], qv[i], (__m512bh)_mm512_loadu_si512(rows[j] + i));
      }
      _mm512_mask_storeu_ps(scores + g * stride + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(hsum16(acc), vscale));
    }
  }
}

// acc[g * D + d] = sum over keys t of probs[g * stride + t - first] * v_t[d], bf16 or int8
// cache: up to 16 / (D / 16) heads' accumulators stay in registers while the keys stream past.
template <typename cache_t, int64_t D>
void decode_values_bf16(float* acc, const float* probs, int64_t stride, int64_t group,
                        const cache_t* v_cache, const c10::Half* v_scale, const int32_t* blocks,
                        int64_t block_size, int64_t num_kv_heads, int64_t kvh, int64_t first, int64_t count) {
  constexpr int64_t R = D / 16, kHeads = 16 / R;  // registers per row, heads per pass
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const int64_t heads = std::min(kHeads, group - g0);
    __m512 a[kHeads][R];
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t i = 0; i < R; ++i) a[h][i] = _mm512_setzero_ps();
    auto slot_of = [&](int64_t t) {
      const int64_t pos = first + t;
      return blocks[pos / block_size] * block_size + pos % block_size;
    };
    for (int64_t t = 0; t < count; ++t) {
      if (g0 == 0 && t + kDecodePrefetchKeys < count)
        prefetch_row<cache_t, D>(v_cache + (slot_of(t + kDecodePrefetchKeys) * num_kv_heads + kvh) * D);
      const int64_t slot = slot_of(t);
      const cache_t* src = v_cache + (slot * num_kv_heads + kvh) * D;
      __m512 v[R];
      if constexpr (std::is_same_v<cache_t, int8_t>) {
        const float s = static_cast<float>(v_scale[slot * num_kv_heads + kvh]);
        for (int64_t i = 0; i < R; ++i) v[i] = dequantize16(src + 16 * i, s);
      } else {  // bf16 -> float32: the bits shifted into the top half
        const auto* row = reinterpret_cast<const __m256i*>(src);
        for (int64_t i = 0; i < R; ++i)
          v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(row + i)), 16));
      }
      for (int64_t h = 0; h < heads; ++h) {
        const __m512 p = _mm512_set1_ps(probs[(g0 + h) * stride + t]);
        for (int64_t i = 0; i < R; ++i) a[h][i] = _mm512_fmadd_ps(p, v[i], a[h][i]);
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < R; ++i) _mm512_storeu_ps(acc + (g0 + h) * D + 16 * i, a[h][i]);
  }
}
#endif

template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void decode_attention_impl(Tensor& out, const Tensor& query, const Tensor& key_cache,
                           const Tensor& value_cache, const Tensor& block_tables,
                           const Tensor& context_lens, double scale,
                           const c10::optional<Tensor>& k_scale,
                           const c10::optional<Tensor>& v_scale, int64_t window, double softcap) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  // A compile-time head_dim (64, 128) lets gcc unroll and vectorize the inner loops fully.
  const int64_t head_dim = kHeadDim ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t q_stride = query.stride(0);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  const c10::Half* ks_ptr = k_scale ? k_scale->data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs_ptr = v_scale ? v_scale->data_ptr<c10::Half>() : nullptr;
  const int32_t* bt_ptr = block_tables.data_ptr<int32_t>();
  const int32_t* len_ptr = context_lens.data_ptr<int32_t>();
  const int64_t token_stride = num_kv_heads * head_dim;  // between tokens of one block
  const float fscale = static_cast<float>(scale);
  constexpr bool kVectorized =  // the AVX512-BF16 loops above
#if defined(__AVX512BF16__)
      std::is_same_v<scalar_t, c10::BFloat16> && (kHeadDim == 64 || kHeadDim == 128);
#else
      false;
#endif

  if (num_seqs == 0) return;
  // The keys a sequence's query sees: [lo(ctx), ctx), all of them without a window.
  auto lo = [&](int64_t ctx) { return window > 0 ? std::max<int64_t>(0, ctx - window) : int64_t(0); };
  int64_t max_context = *std::max_element(len_ptr, len_ptr + num_seqs);
  if (window > 0) max_context = std::min(max_context, window);
  const int64_t splits = decode_splits(num_seqs * num_kv_heads, max_context);
  // Split s of a context of n keys from lo: keys lo + [s * span, min(n, (s + 1) * span)).
  auto split_span = [&](int64_t ctx) { return ((ctx + splits - 1) / splits + 15) / 16 * 16; };
  // Partial results of split tasks: per task and head, the max score, the sum of exp(score -
  // max) and the output before dividing by that sum (only used when splits > 1).
  std::vector<float> part_max, part_sum, part_out;
  if (splits > 1) {
    const int64_t heads = num_seqs * num_kv_heads * splits * group;
    part_max.resize(heads);
    part_sum.resize(heads);
    part_out.resize(heads * head_dim);
  }

  at::parallel_for(0, num_seqs * num_kv_heads * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      // kv heads vary fastest: a thread's consecutive tasks read the same blocks' lines.
      const int64_t kvh = task % num_kv_heads, split = task / num_kv_heads % splits;
      const int64_t seq = task / num_kv_heads / splits;
      const int64_t ctx = len_ptr[seq], start = lo(ctx), n = ctx - start, span = split_span(n);
      const int64_t begin_key = std::min(n, split * span), count = std::min(n, begin_key + span) - begin_key;
      const int64_t first = start + begin_key;
      const int32_t* blocks = bt_ptr + seq * max_blocks;
      const scalar_t* q_in = q_ptr + seq * q_stride + kvh * group * head_dim;
      // Token t's K or V row of this kv head into `row`, as float32 (dequantized if int8).
      auto load_row = [&](const cache_t* cache, const c10::Half* scales, int64_t t) {
        const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
        const cache_t* src = cache + slot * token_stride + kvh * head_dim;
        const float s = scales ? static_cast<float>(scales[slot * num_kv_heads + kvh]) : 1.f;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(src[d]) * s;
      };
      scores.resize(group * count);
      if constexpr (kVectorized) {
#if defined(__AVX512BF16__)
        decode_scores_bf16<cache_t, kHeadDim>(scores.data(), count, reinterpret_cast<const c10::BFloat16*>(q_in),
                                              group, k_ptr, ks_ptr, blocks, block_size, num_kv_heads, kvh,
                                              first, count, fscale);
#endif
      } else {
        for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_in[i]) * fscale;
        for (int64_t t = 0; t < count; ++t) {  // scores[g, t] = q_g . k_t
          load_row(k_ptr, ks_ptr, first + t);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = q.data() + g * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
            scores[g * count + t] = dot;
          }
        }
      }
      if (softcap > 0) {  // transformers' order: scores / cap, tanh, * cap
        const float cap = static_cast<float>(softcap);
        for (int64_t i = 0; i < group * count; ++i) scores[i] = std::tanh(scores[i] / cap) * cap;
      }
      float* task_max = splits > 1 ? part_max.data() + task * group : nullptr;
      float* task_sum = splits > 1 ? part_sum.data() + task * group : nullptr;
      for (int64_t g = 0; g < group; ++g) {  // softmax over t (a split's: normalized at the merge)
        float* s = scores.data() + g * count;
        float mx = count ? s[0] : 0.f;
        for (int64_t t = 1; t < count; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < count; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        if (task_max) {
          task_max[g] = mx;
          task_sum[g] = sum;
        } else {
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < count; ++t) s[t] *= inv;
        }
      }
      if constexpr (kVectorized) {
#if defined(__AVX512BF16__)
        decode_values_bf16<cache_t, kHeadDim>(acc.data(), scores.data(), count, group, v_ptr, vs_ptr, blocks,
                                              block_size, num_kv_heads, kvh, first, count);
#endif
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < count; ++t) {  // acc_g += p[g, t] * v_t
          load_row(v_ptr, vs_ptr, first + t);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * count + t];
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      if (splits > 1) {
        std::copy(acc.begin(), acc.end(), part_out.begin() + task * group * head_dim);
        continue;
      }
      scalar_t* o = out_ptr + (seq * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<scalar_t>(acc[i]);
    }
  });
  if (splits == 1) return;

  // Merge each head's splits: rescale every split to the largest max, then divide by the sum.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / num_kv_heads, kvh = pair % num_kv_heads;
      const int64_t ctx = len_ptr[seq], n = ctx - lo(ctx), span = split_span(n);
      const int64_t used = (n + span - 1) / span;  // splits past the context hold no keys
      for (int64_t g = 0; g < group; ++g) {
        // Task (seq, split s, kvh) = (seq * splits + s) * num_kv_heads + kvh; heads g within.
        auto head = [&](int64_t s) { return ((seq * splits + s) * num_kv_heads + kvh) * group + g; };
        float mx = part_max[head(0)];
        for (int64_t s = 1; s < used; ++s) mx = std::max(mx, part_max[head(s)]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < used; ++s) {
          const int64_t h = head(s);
          const float w = std::exp(part_max[h] - mx);
          sum += part_sum[h] * w;
          const float* po = part_out.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += po[d] * w;
        }
        scalar_t* o = out_ptr + (seq * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[d] / sum);
      }
    }
  });
}

template <typename scalar_t, typename cache_t, typename... Args>
void dispatch_head_dim(Tensor& out, const Tensor& query, Args&&... args) {
  switch (query.size(2)) {
    case 64: return decode_attention_impl<scalar_t, cache_t, 64>(out, query, args...);
    case 128: return decode_attention_impl<scalar_t, cache_t, 128>(out, query, args...);
    default: return decode_attention_impl<scalar_t, cache_t, 0>(out, query, args...);
  }
}

void decode_attention(Tensor out, const Tensor& query, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& block_tables,
                      const Tensor& context_lens, double scale,
                      const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                      int64_t sliding_window, double softcap) {
  const bool int8_cache = check_paged_attention_operands(out, query, key_cache, value_cache, k_scale, v_scale);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && context_lens.is_contiguous() &&
              block_tables.size(0) >= query.size(0) && context_lens.size(0) >= query.size(0),
              "block_tables and context_lens must be contiguous int32 with a row per sequence");
  // Every context must be non-empty and lie inside its block-table row.
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < query.size(0); ++s)
    TORCH_CHECK(lens[s] > 0 && lens[s] <= block_tables.size(1) * key_cache.size(1),
                "context length ", lens[s], " of sequence ", s, " is empty or exceeds its block table");
  dispatch_float(query.scalar_type(), [&]<typename T>() {
    if (int8_cache)
      dispatch_head_dim<T, int8_t>(out, query, key_cache, value_cache, block_tables, context_lens, scale, k_scale,
                                   v_scale, sliding_window, softcap);
    else
      dispatch_head_dim<T, T>(out, query, key_cache, value_cache, block_tables, context_lens, scale, k_scale, v_scale,
                              sliding_window, softcap);
  });
}

// ---- Paged prefill attention (bfloat16, AVX512-BF16) -----------------------------------------
// Chunks of queries of one or more sequences: sequence s's queries [q_len, H, D] sit at
// positions seq_len - q_len .. seq_len - 1 and attend causally to its cached tokens
// 0 .. seq_len - 1 (the chunk's own K/V are written first). Flash attention: a task is (sequence,
// kv head, block of up to 16 query rows); key tiles of 32 tokens are read straight from the
// cache blocks; online softmax in float32; nothing gathered.
//
// A register's 16 lanes hold 16 (query row, query head) pairs of the task, row-major: 16 rows
// of one head for GQA group 1, or a decode row's `group` heads in one register. Lane i does the
// same arithmetic in the same order whichever pairs share its register, and its key tiles
// always start at key 0, 32, 64, ...; a tile past a lane's position is all masked and leaves it
// exactly as it was. So a query's output depends only on its own row and keys: not on how its
// prompt was cut into chunks, on the other sequences of the call, or on a prefix-cache hit (a
// decode row is a chunk of one query). The batch-invariant mode rests on that.
//
// The max and sum of the softmax run down the registers, never across lanes:
//   scores: lane i += q_i pair p . k_j pair p: q's pairs transposed once per task, each key
//           pair broadcast from the tile (vdpbf16ps, 32 products of bf16 each);
//   output: out[d] lane i += p_i pair j . v pair j [d]: probabilities rounded to bf16 and
//           paired by key, V's tile re-laid as (key 2j, key 2j + 1) pairs per dim.
// PyTorch's CPU flash kernel rounds the probabilities to bf16 the same way; it ran at ~100
// GFLOP/s here on SmolLM2's heads, this kernel at ~190 (docs/benchmarks/offline.md).
#if defined(__AVX512BF16__)
constexpr int64_t kLanes = 16;  // (query row, head) pairs per register
constexpr int64_t kPrefillRows = 16;  // query rows per task
constexpr int64_t kPrefillKeys = 32;  // keys per tile
constexpr float kMaskedScore = -1e30f;  // finite: the file is built with -ffast-math

// A key tile's K rows as pointers (into a bf16 cache, or into k_buf where an int8 cache is
// dequantized and rounded to bf16 as the torch path does), and its V rows re-laid as
// (key 2j, key 2j + 1) pairs per dim (int32 [kPrefillKeys / 2, D]). Keys past `count` are zero.
template <typename cache_t, int64_t D>
void load_kv_tile(const int32_t** k_rows, uint32_t* v_pairs, c10::BFloat16* k_buf, c10::BFloat16* v_buf,
                  const cache_t* k_cache, const cache_t* v_cache, const c10::Half* k_scale,
                  const c10::Half* v_scale, const int32_t* blocks, int64_t block_size, int64_t num_kv_heads,
                  int64_t kvh, int64_t first, int64_t count) {
  const int64_t token_stride = num_kv_heads * D;
  const uint16_t* v_rows[kPrefillKeys];
  for (int64_t j = 0; j < kPrefillKeys; ++j) {
    if (j >= count) {
      k_rows[j] = reinterpret_cast<const int32_t*>(kZeroRow);
      v_rows[j] = kZeroRow;
      continue;
    }
    const int64_t t = first + j, slot = blocks[t / block_size] * block_size + t % block_size;
    const cache_t* k_src = k_cache + slot * token_stride + kvh * D;
    const cache_t* v_src = v_cache + slot * token_stride + kvh * D;
    if constexpr (std::is_same_v<cache_t, int8_t>) {
      const float ks = static_cast<float>(k_scale[slot * num_kv_heads + kvh]);
      const float vs = static_cast<float>(v_scale[slot * num_kv_heads + kvh]);
      c10::BFloat16* k_dst = k_buf + j * D;
      c10::BFloat16* v_dst = v_buf + j * D;
      for (int64_t d = 0; d < D; ++d) {
        k_dst[d] = c10::BFloat16(static_cast<float>(k_src[d]) * ks);
        v_dst[d] = c10::BFloat16(static_cast<float>(v_src[d]) * vs);
      }
      k_rows[j] = reinterpret_cast<const int32_t*>(k_dst);
      v_rows[j] = reinterpret_cast<const uint16_t*>(v_dst);
    } else {
      k_rows[j] = reinterpret_cast<const int32_t*>(k_src);
      v_rows[j] = reinterpret_cast<const uint16_t*>(v_src);
    }
  }
  for (int64_t j = 0; j < kPrefillKeys / 2; ++j)
    for (int64_t d = 0; d < D; d += 16) {  // 16 dims of two keys -> 16 (even, odd) pairs
      const __m512i even = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v_rows[2 * j] + d)));
      const __m512i odd = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v_rows[2 * j + 1] + d)));
      _mm512_store_si512(v_pairs + j * D + d, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
}

// One register of 16 lanes against one key tile: update the running max m, sum l and the
// unnormalized output o ([D] registers of 16 lanes, in memory) with keys [0, valid_keys) of the
// tile; key j is masked for lane i when key_pos + j > positions[i] (causal) or, with a sliding
// window (> 0), key_pos + j <= positions[i] - window. min_pos and max_pos are the smallest and
// largest of the positions. softcap (> 0) caps the scaled scores to softcap * tanh(s / softcap)
// before the mask (0: not at all).
template <int64_t D>
void prefill_tile(float* o, float* m, float* l, const __m512i* q_pairs, const int32_t* const* k_rows,
                  const uint32_t* v_pairs, int64_t valid_keys, int64_t key_pos, __m512i positions,
                  int64_t min_pos, int64_t max_pos, int64_t window, float scale, float softcap) {
  alignas(64) float s[kPrefillKeys][kLanes];
  for (int64_t j0 = 0; j0 < valid_keys; j0 += 8) {  // 8 keys' scores at a time
    __m512 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh q = (__m512bh)q_pairs[p];
      for (int k = 0; k < 8; ++k)
        acc[k] = _mm512_dpbf16_ps(acc[k], q, (__m512bh)_mm512_set1_epi32(k_rows[j0 + k][p]));
    }
    for (int k = 0; k < 8; ++k) _mm512_store_ps(s[j0 + k], _mm512_mul_ps(acc[k], _mm512_set1_ps(scale)));
  }
  if (softcap > 0)  // transformers' order: scores / cap, tanh, * cap
    for (int64_t j = 0; j < valid_keys; ++j)
      for (int64_t i = 0; i < kLanes; ++i) s[j][i] = std::tanh(s[j][i] / softcap) * softcap;
  __m512 mx = _mm512_loadu_ps(m);
  for (int64_t j = 0; j < kPrefillKeys; ++j) {
    __m512 sj = _mm512_load_ps(s[j]);
    if (j >= valid_keys) {
      sj = _mm512_set1_ps(kMaskedScore);
    } else if (key_pos + j > min_pos) {  // past some lane's position: mask those lanes
      __mmask16 seen = _mm512_cmpge_epi32_mask(positions, _mm512_set1_epi32(static_cast<int32_t>(key_pos + j)));
      if (window > 0 && key_pos + j + window <= max_pos)
        seen &= _mm512_cmplt_epi32_mask(positions, _mm512_set1_epi32(static_cast<int32_t>(key_pos + j + window)));
      sj = _mm512_mask_mov_ps(_mm512_set1_ps(kMaskedScore), seen, sj);
    } else if (window > 0 && key_pos + j + window <= max_pos) {  // before some lane's window
      const __mmask16 seen =
          _mm512_cmplt_epi32_mask(positions, _mm512_set1_epi32(static_cast<int32_t>(key_pos + j + window)));
      sj = _mm512_mask_mov_ps(_mm512_set1_ps(kMaskedScore), seen, sj);
    }
    _mm512_store_ps(s[j], sj);
    mx = _mm512_max_ps(mx, sj);
  }
  // Every lane sees key 0 in the first tile, so from then on its max is a real score and its
  // masked keys get exp(-1e30 - max) = 0; so does the first tile's alpha (m starts masked). A
  // lane whose max did not move keeps alpha = 1 exactly (not a vector expf's idea of exp(0)):
  // an all-masked tile must leave it bit for bit as it was.
  alignas(64) float mxa[kLanes], alpha[kLanes];
  _mm512_store_ps(mxa, mx);
  for (int64_t j = 0; j < kPrefillKeys; ++j)
    for (int64_t i = 0; i < kLanes; ++i) s[j][i] = std::exp(s[j][i] - mxa[i]);
  if (window > 0) {
    // A lane's window may start past this tile (the task's tiles start at its first row's
    // window): its max is then still the masked score, and exp(masked - max) was 1. Its keys
    // weigh 0 instead, so such a tile leaves the lane exactly as it was (alpha is 1, since
    // its max did not move), and a query's output does not depend on its task.
    for (int64_t i = 0; i < kLanes; ++i)
      if (mxa[i] == kMaskedScore)
        for (int64_t j = 0; j < kPrefillKeys; ++j) s[j][i] = 0.f;
  }
  for (int64_t i = 0; i < kLanes; ++i) alpha[i] = m[i] == mxa[i] ? 1.f : std::exp(m[i] - mxa[i]);
  __m512 sum = _mm512_setzero_ps();
  __m512i p_pairs[kPrefillKeys / 2];
  for (int64_t j = 0; j < kPrefillKeys / 2; ++j) {
    const __m512 a = _mm512_load_ps(s[2 * j]), b = _mm512_load_ps(s[2 * j + 1]);
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    p_pairs[j] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  const __m512 alpha_v = _mm512_load_ps(alpha);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha_v, sum));
  _mm512_storeu_ps(m, mx);
  const int64_t pairs = (valid_keys + 1) / 2;
  for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8 dims' accumulators at a time
    __m512 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_mul_ps(_mm512_loadu_ps(o + (d0 + k) * kLanes), alpha_v);
    for (int64_t j = 0; j < pairs; ++j) {
      const uint32_t* vp = v_pairs + j * D + d0;
      for (int k = 0; k < 8; ++k)
        acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)p_pairs[j], (__m512bh)_mm512_set1_epi32(vp[k]));
    }
    for (int k = 0; k < 8; ++k) _mm512_storeu_ps(o + (d0 + k) * kLanes, acc[k]);
  }
}

// One sequence's part of a varlen call: its query rows [q_start, q_start + q_len) of the
// flattened batch, the tokens in its cache after this step, its block table row.
struct AttentionSeq {
  int64_t q_start, q_len, seq_len;
  const int32_t* blocks;
};

template <typename cache_t, int64_t D>
void varlen_attention_impl(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                           const std::vector<AttentionSeq>& seqs, double scale,
                           const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                           int64_t window, double softcap) {
  const int64_t num_heads = query.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_stride = query.stride(0);
  const auto* q_ptr = query.data_ptr<c10::BFloat16>();
  auto* out_ptr = out.data_ptr<c10::BFloat16>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  const c10::Half* ks_ptr = k_scale ? k_scale->data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs_ptr = v_scale ? v_scale->data_ptr<c10::Half>() : nullptr;
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);
  struct Task {
    int64_t seq, kvh, row0, rows, cost;
  };
  // A task's first key tile: key 0, or with a sliding window the tile holding its first row's
  // first key (a multiple of kPrefillKeys, so a query sees the same tiles in any task).
  auto first_key = [&](int64_t first_pos) {
    return window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / kPrefillKeys * kPrefillKeys : int64_t(0);
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s)
    for (int64_t row0 = 0; row0 < seqs[s].q_len; row0 += kPrefillRows) {
      const int64_t rows = std::min(kPrefillRows, seqs[s].q_len - row0);
      const int64_t first_pos = seqs[s].seq_len - seqs[s].q_len + row0;
      const int64_t keys = first_pos + rows - first_key(first_pos);
      const int64_t registers = (rows * group + kLanes - 1) / kLanes;
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) tasks.push_back({s, kvh, row0, rows, keys * registers});
    }
  // Costliest first, dealt round-robin to the threads: later query blocks see more keys, and
  // a long chunk's tasks beside decode rows' differ by hundreds of times.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (threads == 0) return;
  constexpr int64_t kMaxRegisters = kPrefillRows * 16 / kLanes;  // group <= 16
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> q_pairs(kMaxRegisters * D / 2);
    const int32_t* k_rows[kPrefillKeys];
    alignas(64) c10::BFloat16 k_buf[kPrefillKeys * D], v_buf[kPrefillKeys * D];  // int8 caches
    alignas(64) uint32_t v_pairs[kPrefillKeys / 2 * D];
    std::vector<float> o(kMaxRegisters * D * kLanes), m(kMaxRegisters * kLanes), l(kMaxRegisters * kLanes);
    for (int64_t worker = begin; worker < end; ++worker)
      for (int64_t t = worker; t < num_tasks; t += threads) {
        const Task& task = tasks[t];
        const AttentionSeq& seq = seqs[task.seq];
        const int64_t first_pos = seq.seq_len - seq.q_len + task.row0;  // of the task's row 0
        const int64_t pairs = task.rows * group, registers = (pairs + kLanes - 1) / kLanes;
        // Lane i of register r holds pair r * 16 + i = (row, head g of this kv head); lanes
        // past the last pair repeat it (computed, never written).
        __m512i positions[kMaxRegisters];
        int64_t min_pos[kMaxRegisters], max_pos[kMaxRegisters];
        for (int64_t r = 0; r < registers; ++r) {
          alignas(64) int32_t pos[kLanes];
          for (int64_t p = 0; p < D / 2; ++p) {
            alignas(64) int32_t lanes[kLanes];
            for (int64_t i = 0; i < kLanes; ++i) {
              const int64_t pair = std::min(r * kLanes + i, pairs - 1), row = pair / group;
              const int64_t h = task.kvh * group + pair % group;
              lanes[i] = reinterpret_cast<const int32_t*>(q_ptr + (seq.q_start + task.row0 + row) * q_stride + h * D)[p];
              pos[i] = static_cast<int32_t>(first_pos + row);
            }
            q_pairs[r * D / 2 + p] = _mm512_load_si512(lanes);
          }
          positions[r] = _mm512_load_si512(pos);
          min_pos[r] = pos[0];
          max_pos[r] = pos[kLanes - 1];  // rows ascend along the lanes; spare lanes repeat the last
        }
        std::fill(o.begin(), o.begin() + registers * D * kLanes, 0.f);
        std::fill(m.begin(), m.begin() + registers * kLanes, kMaskedScore);
        std::fill(l.begin(), l.begin() + registers * kLanes, 0.f);
        const int64_t keys = first_pos + task.rows;  // causal: the last row sees keys < keys
        for (int64_t key_pos = first_key(first_pos); key_pos < keys; key_pos += kPrefillKeys) {
          const int64_t valid = std::min(kPrefillKeys, keys - key_pos);
          load_kv_tile<cache_t, D>(k_rows, v_pairs, k_buf, v_buf, k_ptr, v_ptr, ks_ptr, vs_ptr, seq.blocks,
                                   block_size, num_kv_heads, task.kvh, key_pos, valid);
          for (int64_t r = 0; r < registers; ++r)
            prefill_tile<D>(o.data() + r * D * kLanes, m.data() + r * kLanes, l.data() + r * kLanes,
                            q_pairs.data() + r * D / 2, k_rows, v_pairs, valid, key_pos, positions[r],
                            min_pos[r], max_pos[r], window, fscale, fsoftcap);
        }
        for (int64_t pair = 0; pair < pairs; ++pair) {
          const int64_t r = pair / kLanes, i = pair % kLanes, row = pair / group;
          const int64_t h = task.kvh * group + pair % group;
          const float* orr = o.data() + r * D * kLanes;
          const float inv = 1.f / l[r * kLanes + i];
          c10::BFloat16* dst = out_ptr + ((seq.q_start + task.row0 + row) * num_heads + h) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = c10::BFloat16(orr[d * kLanes + i] * inv);
        }
      }
  });
}
#endif

bool has_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Both attention ops below: check the operands shared by them (`op` names the caller in the
// errors), then run varlen_attention_impl for the cache dtype and head size.
bool check_varlen_operands(const char* op, const Tensor& out, const Tensor& query, const Tensor& key_cache,
                           const Tensor& value_cache, const c10::optional<Tensor>& k_scale,
                           const c10::optional<Tensor>& v_scale) {
  TORCH_CHECK(has_avx512_bf16(), op, " needs AVX512-BF16 (see cpu_ops.has_avx512_bf16)");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16, "query must be bfloat16");
  return check_paged_attention_operands(out, query, key_cache, value_cache, k_scale, v_scale);
}

void run_varlen_attention(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                          const std::vector<AttentionSeq>& seqs, double scale,
                          const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                          bool int8_cache, int64_t window, double softcap) {
#if defined(__AVX512BF16__)
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "prefill attention supports head_dim 64 and 128");
  TORCH_CHECK(query.size(1) / key_cache.size(2) <= 16, "prefill attention supports up to 16 query heads per kv head");
  auto run = [&]<typename cache_t>() {
    if (head_dim == 64)
      varlen_attention_impl<cache_t, 64>(out, query, key_cache, value_cache, seqs, scale, k_scale, v_scale, window,
                                         softcap);
    else
      varlen_attention_impl<cache_t, 128>(out, query, key_cache, value_cache, seqs, scale, k_scale, v_scale, window,
                                          softcap);
  };
  if (int8_cache) run.template operator()<int8_t>();
  else run.template operator()<c10::BFloat16>();
#endif
}

// out [q_len, H, D] (contiguous) = attention of query [q_len, H, D] (rows may be strided) at
// positions seq_len - q_len .. seq_len - 1 over keys 0 .. seq_len - 1 of block_table's blocks.
void prefill_attention(Tensor out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_table, int64_t seq_len, double scale,
                       const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                       int64_t sliding_window, double softcap) {
  const bool int8_cache = check_varlen_operands("prefill_attention", out, query, key_cache, value_cache, k_scale, v_scale);
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "block_table must be one contiguous int32 row");
  TORCH_CHECK(seq_len >= query.size(0) && seq_len <= block_table.size(0) * key_cache.size(1),
              "seq_len ", seq_len, " is shorter than the chunk or exceeds the block table");
  if (query.size(0) == 0) return;
  const std::vector<AttentionSeq> seqs{{0, query.size(0), seq_len, block_table.data_ptr<int32_t>()}};
  run_varlen_attention(out, query, key_cache, value_cache, seqs, scale, k_scale, v_scale, int8_cache, sliding_window,
                       softcap);
}

// The same for several sequences in one call: sequence s's queries are rows
// query_start_loc[s] .. query_start_loc[s + 1] - 1, its tokens in cache seq_lens[s], its blocks
// block_tables[s]. A decode row is a sequence with one query.
void varlen_attention(Tensor out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                      const Tensor& block_tables, const Tensor& query_start_loc, const Tensor& seq_lens,
                      double scale, const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                      int64_t sliding_window, double softcap) {
  const bool int8_cache = check_varlen_operands("varlen_attention", out, query, key_cache, value_cache, k_scale, v_scale);
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.size(0) == num_seqs,
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.numel() == num_seqs + 1,
              "seq_lens must be int32 [num_seqs] and query_start_loc int32 [num_seqs + 1]");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "query_start_loc must run from 0 to the number of query rows");
  std::vector<AttentionSeq> seqs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && lens[s] >= q_len && lens[s] <= block_tables.size(1) * key_cache.size(1),
                "sequence ", s, ": ", q_len, " queries, seq_len ", lens[s],
                " (must be >= the queries and fit the block table)");
    if (q_len > 0) seqs.push_back({starts[s], q_len, lens[s], block_tables.data_ptr<int32_t>() + s * block_tables.size(1)});
  }
  run_varlen_attention(out, query, key_cache, value_cache, seqs, scale, k_scale, v_scale, int8_cache, sliding_window,
                       softcap);
}

// ---- One decoder layer of a decode step ----------------------------------------------------------
// models/llama.py's DecoderLayer on its fused bfloat16 CPU path, for a batch of single-token
// sequences, in one call: at batch 1 a small model's step spent as long in Python between the
// ~17 op calls of each layer as in the ops. The same kernels run in the same order on the same
// tensors (models/cpu_decode.py; tests/runtime/engine/test_cpu_decode_layers.py compares the
// two paths token for token). A linear is (kind, tensors, param):
//   0: oneDNN-prepacked bf16 (PackedLinear): {packed_weight[, bias]}, param = has bias;
//   1: int4 in cpu_ops layout (Int4Linear): {qweight, scales_and_zeros}, param = group size;
//   2: int8 per channel (Int8Linear): {qweight, scales}, param = its packed_max_tokens
//      (int8_linear picks the kernel, as for Int8Linear.forward).
// q_norm/k_norm (Qwen3, both or neither): each query/key head RMS-normalized over head_dim
// after the qkv projection and its LoRA deltas, before the rotary (norm_heads).
// invariant: the batch-invariant mode's kernels, whose result for a row does not depend on
// the number of rows, as the module path runs them: a single bf16 row padded with a zero row
// (models/cpu_linear.py PackedLinear.min_rows), int4's many-row path and int8_matmul for any
// row count (quantization/int4_linear.py, int8_linear.py).
Tensor apply_linear(const Tensor& x, at::TensorList w, int64_t kind, int64_t param, bool invariant = false) {
  if (kind == 0 && invariant && x.size(0) < 2) {
    Tensor padded = at::empty({2, x.size(1)}, x.options());
    padded.narrow(0, 0, x.size(0)).copy_(x);
    padded.narrow(0, x.size(0), 2 - x.size(0)).zero_();
    return apply_linear(padded, w, kind, param).narrow(0, 0, x.size(0));
  }
  if (kind == 0) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w[0], param ? c10::IValue(w[1]) : c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  if (kind == 1) return int4_matmul(x, w[0], w[1], param, invariant ? 1 : kInt4ManyRows);
  TORCH_CHECK(kind == 2, "decode_layer: unknown linear kind ", kind);
  return invariant ? int8_matmul(x, w[0], w[1]) : int8_linear(x, w[0], w[1], param);
}

// ---- LoRA delta of one adapter after one projection ------------------------------------------
// out[r] += scale * (x[r] A^T) B^T for the rows `rows` (every row when `rows` is empty). Both
// the module path (lora/batch.py) and decode_layer call this, so they agree exactly. Up to
// kLoraFusedMaxRows bfloat16 rows it is one pass in float32 (one rounding, at the end): at
// decode sizes the ~5 ATen ops per projection cost more in dispatch than in FLOPs. Larger
// batches (prefill chunks) use at::linear, whose GEMMs are faster there. The batch-invariant
// mode passes fused_max_rows = -1 (no limit): a row's fused result does not depend on the others.
constexpr int64_t kLoraFusedMaxRows = 16;

void lora_add(Tensor out, const Tensor& x, const Tensor& rows, const Tensor& a, const Tensor& b,
              double scale, int64_t fused_max_rows = kLoraFusedMaxRows) {
  const bool all_rows = !rows.defined() || rows.numel() == 0;
  const int64_t n = all_rows ? x.size(0) : rows.numel();
  if ((fused_max_rows >= 0 && n > fused_max_rows) || x.scalar_type() != at::kBFloat16) {
    if (all_rows) {
      out.add_(at::linear(at::linear(x, a), b).mul(scale));
    } else {
      out.index_add_(0, rows, at::linear(at::linear(x.index_select(0, rows), a), b).mul(scale));
    }
    return;
  }
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
                  a.size(1) == x.size(1) && b.size(1) == a.size(0) && out.dim() == 2 &&
                  out.size(1) == b.size(0) && out.stride(1) == 1 &&
                  a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "lora_add: x [T, in], A [k, in], B [out, k], out [T, out], bfloat16, contiguous");
  const int64_t in = x.size(1), k = a.size(0), n_out = b.size(0);
  const int64_t* ids = all_rows ? nullptr : rows.data_ptr<int64_t>();
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* ap = a.data_ptr<c10::BFloat16>();
  const auto* bp = b.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t out_stride = out.stride(0);
  std::vector<float> t(n * k);  // x[r] A^T, kept in float32
  at::parallel_for(0, n * k, 8, [&](int64_t begin, int64_t end) {
    for (int64_t ij = begin; ij < end; ++ij) {
      const int64_t i = ij / k, j = ij % k;
      const c10::BFloat16* xr = xp + (ids ? ids[i] : i) * in;
      const c10::BFloat16* aj = ap + j * in;
      float acc = 0.f;
      for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(xr[c]) * static_cast<float>(aj[c]);
      t[ij] = acc;
    }
  });
  at::parallel_for(0, n_out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const c10::BFloat16* bq = bp + p * k;
      for (int64_t i = 0; i < n; ++i) {
        const float* ti = t.data() + i * k;
        float acc = 0.f;
        for (int64_t j = 0; j < k; ++j) acc += ti[j] * static_cast<float>(bq[j]);
        c10::BFloat16& dst = op[(ids ? ids[i] : i) * out_stride + p];
        dst = static_cast<c10::BFloat16>(static_cast<float>(dst) + static_cast<float>(scale) * acc);
      }
    }
  });
}

// The LoRA deltas after one projection in decode_layer. `lora` holds, for each adapter in the
// step, its rows, then (A, B) for qkv, o, gate_up and down (empty tensors for a projection the
// adapter leaves alone); `scales` one per adapter.
constexpr int64_t kLoraStride = 9;

void add_lora(Tensor& out, const Tensor& x, at::TensorList lora, at::ArrayRef<double> scales,
              int64_t projection, int64_t fused_max_rows) {
  for (size_t g = 0; g < scales.size(); ++g) {
    const Tensor& rows = lora[g * kLoraStride];
    const Tensor& a = lora[g * kLoraStride + 1 + 2 * projection];
    const Tensor& b = lora[g * kLoraStride + 2 + 2 * projection];
    if (a.numel() == 0) continue;
    // Every row on this adapter: no gather/scatter (an empty `rows` says so).
    lora_add(out, x, rows.numel() == x.size(0) ? Tensor() : rows, a, b, scales[g], fused_max_rows);
  }
}

// Qwen3's per-head q/k norms, in place inside qkv [tokens, (heads + 2 kv_heads) * head_dim]:
// every query head through q_norm and every key head through k_norm (RMSNorm over head_dim).
// The module path (models/llama.py Attention._norm_heads) runs rms_norm on a copy of the heads
// as [tokens * heads, head_dim] rows; this calls the same rms_norm_rows on each token's heads,
// rows head_dim apart, with out == x (it reads a row into floats before writing it), so the
// bits are the same.
void norm_heads(Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim, double eps) {
  for (const Tensor* w : {&q_norm, &k_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == head_dim && w->is_contiguous() &&
                w->scalar_type() == qkv.scalar_type(),
                "decode_layer: q_norm/k_norm must be contiguous [head_dim] of hidden's dtype");
  TORCH_CHECK(qkv.stride(1) == 1, "decode_layer: qkv must have unit stride in its columns");
  const int64_t tokens = qkv.size(0), row_stride = qkv.stride(0), q_size = num_heads * head_dim;
  const float feps = static_cast<float>(eps);
  dispatch_float(qkv.scalar_type(), [&]<typename T>() {
    T* base = qkv.data_ptr<T>();
    const T* qw = q_norm.data_ptr<T>();
    const T* kw = k_norm.data_ptr<T>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        T* q = base + t * row_stride;
        T* k = q + q_size;
        rms_norm_rows<T>(q, nullptr, q, qw, num_heads, head_dim, head_dim, feps);
        rms_norm_rows<T>(k, nullptr, k, kw, num_kv_heads, head_dim, head_dim, feps);
      }
    });
  });
}

// hidden [tokens, hidden] is updated in place to the layer's output.
void decode_layer(Tensor hidden, const Tensor& input_norm, const Tensor& post_norm, double eps,
                  at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                  at::IntArrayRef kinds, at::IntArrayRef params, Tensor key_cache, Tensor value_cache,
                  const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                  const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& context_lens,
                  const Tensor& cos, const Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads,
                  double scale, at::TensorList lora, at::ArrayRef<double> lora_scales,
                  const c10::optional<Tensor>& query_start_loc, const c10::optional<Tensor>& q_norm,
                  const c10::optional<Tensor>& k_norm, int64_t sliding_window) {
  TORCH_CHECK(kinds.size() == 4 && params.size() == 4, "decode_layer: one kind and param per linear");
  TORCH_CHECK(lora.size() == lora_scales.size() * kLoraStride,
              "decode_layer: lora needs rows and 4 (A, B) pairs per adapter");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layer: hidden must be a contiguous [tokens, hidden]");
  const int64_t tokens = hidden.size(0), head_dim = key_cache.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // Batch-invariant mode (models/cpu_decode.py): the rows are chunks of sequences (block_tables
  // and context_lens per sequence, query_start_loc their rows), attention is varlen_attention,
  // the linears take their row-count-independent kernels (apply_linear) and LoRA deltas the
  // fused pass: the module path's kernels, so the same bits.
  const bool invariant = query_start_loc.has_value();
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_layer: q_norm and k_norm come together");
  const int64_t lora_fused_max_rows = invariant ? -1 : kLoraFusedMaxRows;
  Tensor x = rms_norm(hidden, input_norm, eps, c10::nullopt);
  Tensor qkv = apply_linear(x, qkv_w, kinds[0], params[0], invariant);
  add_lora(qkv, x, lora, lora_scales, 0, lora_fused_max_rows);
  if (q_norm) norm_heads(qkv, *q_norm, *k_norm, num_heads, num_kv_heads, head_dim, eps);  // Qwen3
  Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  rotary_embedding(qk, cos, signed_sin);
  const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  reshape_and_cache(qk.narrow(1, num_heads, num_kv_heads), v, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  Tensor attn = at::empty({tokens, num_heads, head_dim}, hidden.options());
  if (invariant)
    varlen_attention(attn, qk.narrow(1, 0, num_heads), key_cache, value_cache, block_tables, *query_start_loc,
                     context_lens, scale, k_scale, v_scale, sliding_window, /*softcap=*/0.0);
  else
    decode_attention(attn, qk.narrow(1, 0, num_heads), key_cache, value_cache, block_tables, context_lens,
                     scale, k_scale, v_scale, sliding_window, /*softcap=*/0.0);
  const Tensor attn_flat = attn.view({tokens, q_size});
  Tensor o = apply_linear(attn_flat, o_w, kinds[1], params[1], invariant);
  add_lora(o, attn_flat, lora, lora_scales, 1, lora_fused_max_rows);
  x = rms_norm(o, post_norm, eps, hidden);  // hidden += o first
  Tensor gate_up = apply_linear(x, gate_up_w, kinds[2], params[2], invariant);
  add_lora(gate_up, x, lora, lora_scales, 2, lora_fused_max_rows);
  const Tensor act = silu_and_mul(gate_up);
  Tensor down = apply_linear(act, down_w, kinds[3], params[3], invariant);
  add_lora(down, act, lora, lora_scales, 3, lora_fused_max_rows);
  hidden.add_(down);
}

}  // namespace

TORCH_LIBRARY(argosy_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual=None) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, int packed_max_tokens) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor qweight, Tensor scales_and_zeros, int group_size, "
        "int many_rows_from=16) -> Tensor");  // 16: kInt4ManyRows
  m.def("rotary_embedding(Tensor(a!) qk, Tensor cos, Tensor signed_sin) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None, int sliding_window=0, float softcap=0.0) -> ()");
  m.def("has_avx512_bf16() -> bool", &has_avx512_bf16);  // no tensor: a catch-all kernel
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, int seq_len, float scale, Tensor? k_scale=None, Tensor? v_scale=None, "
        "int sliding_window=0, float softcap=0.0) -> ()");
  m.def("varlen_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None, int sliding_window=0, float softcap=0.0) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor rows, Tensor a, Tensor b, float scale, "
        "int fused_max_rows=16) -> ()");  // 16: kLoraFusedMaxRows
  m.def("decode_layer(Tensor(a!) hidden, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qkv, "
        "Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] kinds, int[] params, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, Tensor cos, Tensor signed_sin, int num_heads, "
        "int num_kv_heads, float scale, Tensor[] lora, float[] lora_scales, Tensor? query_start_loc=None, "
        "Tensor? q_norm=None, Tensor? k_norm=None, int sliding_window=0) -> ()");
}

TORCH_LIBRARY_IMPL(argosy_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_matmul", &int4_matmul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("varlen_attention", &varlen_attention);
  m.impl("decode_layer", &decode_layer);
  m.impl("lora_add", &lora_add);
}

// decode_layer's tensor lists hold oneDNN-prepacked weights, whose dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(argosy_cpu, MkldnnCPU, m) {
  m.impl("decode_layer", &decode_layer);
}
