// CPU GEMM: the reference semantics of octet::ops::gemm, and fast enough to train small models.
//
// The contract (docs/NUMERICS.md cites it; the CUDA backend is measured against it):
//  1. Each operand is materialized as f32 values. Dense f32/bf16 elements are decoded. An FP8
//     element is decode_fp8(q) * scale_inv of its block, where for data stored [rows, cols]:
//       per_tensor     scale_inv[0]
//       block_1x128    scale_inv[row, col / 128]
//       block_128x128  scale_inv[row / 128, col / 128]
//       mxfp8_1x32     decode_e8m0(scale_inv[row, col / 32])
//     (FP8 is TN-only, so for A "row" is its M index and for B, stored [N, K], its N index.)
//  2. acc(m, n) = sum over k = 0, 1, ..., K-1, in increasing order, in ONE f32 accumulator that
//     starts at +0.0f, of the f32 product a(m, k) * b(k, n), rounded before it is added (no FMA).
//  3. out = alpha * acc; then out = out + beta * D_old when beta != 0 (D_old is not read when
//     beta == 0, so it may hold garbage); then out = out + bias[n] when a bias is given (a bf16
//     bias is decoded first). Every step is one f32 operation, in this order.
//     With an addend C (beta is then 0): out = round_D(alpha * acc), i.e. rounded to D's dtype
//     (encode_bf16 for a bf16 D, nothing for f32), then out = out + bias[n], then
//     out = out + C[m, n] (decoded). The extra rounding models cuBLASLt's BF16 epilogue, which
//     behaves as if the product were rounded before the additions; without an addend the
//     reference keeps its single rounding (docs/NUMERICS.md). For an f32 D the result is
//     bitwise that of the GEMM with its bias followed by a separate f32 add of C.
//  4. D stores out (f32), or encode_bf16(out) (round-to-nearest-even) for a bf16 D.
// The accumulation mode (fast / split) only concerns tensor cores; it does not change this.
//
// How it is fast without changing that per-element order: op(A) is packed into panels of kMr rows
// and op(B) into panels of kNr columns (both k-major), and a register-tiled micro-kernel keeps
// kMr x kNr independent accumulators, each still summing its k in increasing order. K is cut into
// kKc-long slices for cache reuse; the partial sums wait in an f32 tile between slices, which
// loses nothing (an f32 stored and reloaded is the same f32). OpenMP splits the [M, N] output
// into kMc x kNc blocks.

// The per-element order above forbids contracting a * b + acc into an FMA.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/int_math.h"
#include "octet/fp8/format.h"
#include "ops/gemm_backend.h"

namespace octet::ops::cpu {
namespace {

// Micro-kernel tile: kMr x kNr accumulators. 6 x 16 fills 12 of AVX2's 16 vector registers with
// accumulators and leaves room for the two B vectors and an A broadcast (the BLIS Haswell shape).
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
// Cache blocking: a kKc x kNr B panel (16 KiB) stays in L1 while it sweeps the kMc rows of A; a
// kMc x kKc block of A (96 KiB) and a kKc x kNc block of B (256 KiB) fit in a core's L2.
constexpr int64_t kKc = 256;
constexpr int64_t kMc = 16 * kMr;
constexpr int64_t kNc = 16 * kNr;
// Below this many multiply-adds a GEMM runs on one thread: forking and joining an OpenMP team
// costs microseconds, about what 2^18 multiply-adds take in the micro-kernel.
constexpr int64_t kParallelMinMacs = int64_t{1} << 18;
static_assert(kMc % kMr == 0 && kNc % kNr == 0, "blocks must hold whole micro-tiles");

// ----------------------------------------------------------------------------
// Materializing and packing operands

/// Reads element (r, c) of an FP8 operand's data as stored ([rows, cols], row-major) as f32, its
/// block's scale applied (contract step 1). pack_panels takes it for block scales; per-tensor
/// FP8 goes through a table of the codes already times the scale.
class Fp8ElementReader {
 public:
  explicit Fp8ElementReader(const GemmOperand& x)
      : mode_(x.mode),
        cols_(x.data.cols()),
        data_(static_cast<const uint8_t*>(x.data.raw_data())),
        scale_(static_cast<const uint8_t*>(x.scale_inv.raw_data())),
        scale_cols_(x.scale_inv.cols()) {
    for (int v = 0; v < 256; ++v)
      fp8_lut_[v] = fp8::decode_fp8(static_cast<uint8_t>(v), x.data.dtype());
  }

  float operator()(int64_t r, int64_t c) const {
    return fp8_lut_[data_[r * cols_ + c]] * scale(r, c);
  }

 private:
  float scale(int64_t r, int64_t c) const {
    const auto* f = reinterpret_cast<const float*>(scale_);
    switch (mode_) {
      case fp8::ScalingMode::per_tensor:
        return f[0];
      case fp8::ScalingMode::block_1x128:
        return f[r * scale_cols_ + c / fp8::kBlock];
      case fp8::ScalingMode::block_128x128:
        return f[(r / fp8::kBlock) * scale_cols_ + c / fp8::kBlock];
      case fp8::ScalingMode::mxfp8_1x32:
        return fp8::decode_e8m0(scale_[r * scale_cols_ + c / fp8::kMxBlock]);
    }
    return 0.0f;
  }

  fp8::ScalingMode mode_;
  int64_t cols_;
  const uint8_t* data_;
  const uint8_t* scale_;
  int64_t scale_cols_;
  std::array<float, 256> fp8_lut_{};
};

/// Packs the [outer, k] matrix op(X) (outer = M for A, N for B) into panels of `width` outer
/// indices: panel p holds element (p * width + w, k) at [p][k][w]; outer indices past the end are
/// zero. `k_contiguous`: X is stored [outer, K]; otherwise [K, outer]. `load(r, c)` reads stored
/// element (r, c) as f32; the loops walk the stored rows in memory order either way.
template <typename Load>
std::vector<float> pack_with(Load load, bool k_contiguous, int64_t outer, int64_t k, int64_t width,
                             bool parallel) {
  const int64_t panels = ceil_div(outer, width);
  std::vector<float> packed(static_cast<size_t>(panels * width * k));  // zeros past the end
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = packed.data() + p * width * k;
    const int64_t o0 = p * width, valid = std::min(width, outer - o0);
    if (k_contiguous) {
      for (int64_t w = 0; w < valid; ++w) {
        for (int64_t kk = 0; kk < k; ++kk) dst[kk * width + w] = load(o0 + w, kk);
      }
    } else {
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t w = 0; w < valid; ++w) dst[kk * width + w] = load(kk, o0 + w);
      }
    }
  }
  return packed;
}

/// pack_with over x's elements: dense f32 and bf16 and per-tensor FP8 (through a table of the 256
/// codes already times the scale: the same f32 product per element) read directly, block-scaled
/// FP8 through Fp8ElementReader.
std::vector<float> pack_panels(const GemmOperand& x, bool k_contiguous, int64_t outer, int64_t k,
                               int64_t width, bool parallel) {
  const int64_t cols = x.data.cols();
  const DType dtype = x.data.dtype();
  if (dtype == DType::f32) {
    const float* f = x.data.data<float>();
    return pack_with([=](int64_t r, int64_t c) { return f[r * cols + c]; }, k_contiguous, outer, k,
                     width, parallel);
  }
  if (dtype == DType::bf16) {
    const auto* bits = static_cast<const uint16_t*>(x.data.raw_data());
    return pack_with([=](int64_t r, int64_t c) { return fp8::decode_bf16(bits[r * cols + c]); },
                     k_contiguous, outer, k, width, parallel);
  }
  if (is_fp8(dtype) && x.mode == fp8::ScalingMode::per_tensor) {
    const float scale = x.scale_inv.data<float>()[0];
    std::array<float, 256> scaled{};
    for (int v = 0; v < 256; ++v)
      scaled[v] = fp8::decode_fp8(static_cast<uint8_t>(v), dtype) * scale;
    const auto* codes = static_cast<const uint8_t*>(x.data.raw_data());
    return pack_with([&](int64_t r, int64_t c) { return scaled[codes[r * cols + c]]; },
                     k_contiguous, outer, k, width, parallel);
  }
  return pack_with(Fp8ElementReader(x), k_contiguous, outer, k, width, parallel);
}

// ----------------------------------------------------------------------------
// Micro-kernel

/// Eight floats: one AVX register, two SSE registers.
constexpr int64_t kVecWidth = 8;
using Vec = float __attribute__((vector_size(kVecWidth * sizeof(float))));
constexpr int64_t kVecsPerRow = kNr / kVecWidth;
static_assert(kNr % kVecWidth == 0, "a micro-tile row is whole vectors");

/// tile[kMr][ldt] (+)= a_panel[kc][kMr] x b_panel[kc][kNr]; starts from zero when `first`.
/// Each accumulator adds its products in increasing k (contract step 2).
__attribute__((always_inline)) inline void micro_kernel(int64_t kc, const float* a, const float* b,
                                                        float* tile, int64_t ldt, bool first) {
  Vec acc[kMr][kVecsPerRow];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kMr; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVecsPerRow; ++v) {
      if (first) {
        acc[r][v] = Vec{};
      } else {
        std::memcpy(&acc[r][v], tile + r * ldt + v * kVecWidth, sizeof(Vec));
      }
    }
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    Vec bv[kVecsPerRow];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVecsPerRow; ++v)
      std::memcpy(&bv[v], b + kk * kNr + v * kVecWidth, sizeof(Vec));
#pragma GCC unroll 16
    for (int64_t r = 0; r < kMr; ++r) {
      const float av = a[kk * kMr + r];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVecsPerRow; ++v) {
        const Vec product = bv[v] * av;
        acc[r][v] = acc[r][v] + product;
      }
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < kMr; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVecsPerRow; ++v)
      std::memcpy(tile + r * ldt + v * kVecWidth, &acc[r][v], sizeof(Vec));
  }
}

/// acc for one kMc x kNc block of D (fewer tiles at the edges), all of K, into tile[kMc][kNc];
/// a_packed and b_packed point at the block's first row tile and first column panel. Compiled for
/// AVX2 and for the baseline ISA; the loader picks one at startup. Neither clone enables FMA, and
/// the results are identical.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
void compute_block(const float* a_packed, const float* b_packed, int64_t k, int64_t row_tiles,
                   int64_t col_panels, float* tile) {
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    for (int64_t j = 0; j < col_panels; ++j) {
      const float* b = b_packed + j * kNr * k + k0 * kNr;
      for (int64_t i = 0; i < row_tiles; ++i) {
        const float* a = a_packed + i * kMr * k + k0 * kMr;
        micro_kernel(kc, a, b, tile + i * kMr * kNc + j * kNr, kNc, k0 == 0);
      }
    }
  }
}

// ----------------------------------------------------------------------------
// Epilogue

/// Element i of an f32 or bf16 buffer as f32.
float load_f32(const void* data, DType dtype, int64_t i) {
  return dtype == DType::f32 ? static_cast<const float*>(data)[i]
                             : fp8::decode_bf16(static_cast<const uint16_t*>(data)[i]);
}

/// f32 value v as D's dtype would store it (round-to-nearest-even for bf16).
float round_to(DType dtype, float v) {
  return dtype == DType::f32 ? v : fp8::decode_bf16(fp8::encode_bf16(v));
}

/// Contract steps 3 and 4 for rows [m0, m0 + rows) and columns [n0, n0 + cols) of D, with D's
/// dtype and which terms are present fixed at compile time (the loop then has no branches).
template <DType kD, bool kAddend, bool kBeta, bool kBias>
void epilogue_rows(const float* tile, int64_t rows, int64_t cols, int64_t m0, int64_t n0,
                   const Tensor& d, const GemmArgs& args, const float* bias, int64_t n) {
  void* const d_data = d.raw_data();
  const void* const addend = kAddend ? args.addend.raw_data() : nullptr;
  const float alpha = args.alpha, beta = args.beta;
  for (int64_t r = 0; r < rows; ++r) {
    const float* acc = tile + r * kNc;
    const int64_t row = (m0 + r) * n + n0;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = row + c;
      float out = alpha * acc[c];
      if constexpr (kAddend) out = round_to(kD, out);
      if constexpr (kBeta) {
        const float scaled_old = beta * load_f32(d_data, kD, i);
        out = out + scaled_old;
      }
      if constexpr (kBias) out = out + bias[n0 + c];
      if constexpr (kAddend) out = out + load_f32(addend, kD, i);
      if constexpr (kD == DType::f32) {
        static_cast<float*>(d_data)[i] = out;
      } else {
        static_cast<uint16_t*>(d_data)[i] = fp8::encode_bf16(out);
      }
    }
  }
}

/// A pointer to the epilogue_rows instance for D's dtype and the terms `args` has.
using Epilogue = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, const Tensor&,
                          const GemmArgs&, const float*, int64_t);

template <DType kD, bool kAddend, bool kBeta>
Epilogue pick_bias(bool bias) {
  return bias ? &epilogue_rows<kD, kAddend, kBeta, true>
              : &epilogue_rows<kD, kAddend, kBeta, false>;
}

template <DType kD>
Epilogue pick_terms(bool addend, bool beta, bool bias) {
  if (addend) return beta ? pick_bias<kD, true, true>(bias) : pick_bias<kD, true, false>(bias);
  return beta ? pick_bias<kD, false, true>(bias) : pick_bias<kD, false, false>(bias);
}

Epilogue pick_epilogue(const Tensor& d, const GemmArgs& args) {
  const bool addend = args.addend.defined(), beta = args.beta != 0.0f, bias = args.bias.defined();
  return d.dtype() == DType::f32 ? pick_terms<DType::f32>(addend, beta, bias)
                                 : pick_terms<DType::bf16>(addend, beta, bias);
}

}  // namespace

void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape) {
  const int64_t m = shape.m, n = shape.n, k = shape.k;
  // op(A) is k-contiguous when A is not transposed; op(B) [K, N] when B is (B^T stored [N, K]).
  const bool parallel = m * n * k >= kParallelMinMacs;
  const std::vector<float> a_packed = pack_panels(a, !a.transpose, m, k, kMr, parallel);
  const std::vector<float> b_packed = pack_panels(b, b.transpose, n, k, kNr, parallel);
  std::vector<float> bias;
  if (args.bias.defined()) {
    bias.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) bias[j] = load_f32(args.bias.raw_data(), args.bias.dtype(), j);
  }

  const Epilogue epilogue = pick_epilogue(d, args);
  const int64_t row_blocks = ceil_div(m, kMc), col_blocks = ceil_div(n, kNc);
#pragma omp parallel if (parallel)
  {
    std::vector<float> tile(static_cast<size_t>(kMc * kNc));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t ib = 0; ib < row_blocks; ++ib) {
      for (int64_t jb = 0; jb < col_blocks; ++jb) {
        const int64_t m0 = ib * kMc, n0 = jb * kNc;
        const int64_t rows = std::min(kMc, m - m0), cols = std::min(kNc, n - n0);
        compute_block(a_packed.data() + m0 * k, b_packed.data() + n0 * k, k, ceil_div(rows, kMr),
                      ceil_div(cols, kNr), tile.data());
        epilogue(tile.data(), rows, cols, m0, n0, d, args, bias.data(), n);
      }
    }
  }
}

}  // namespace octet::ops::cpu
