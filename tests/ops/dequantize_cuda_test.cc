// Dequantize on the GPU against the CPU backend, bitwise, over every FP8 code and every kind of
// scale (the round trips in quantize_test.cc only see codes that quantize produces).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>

#include "octet/fp8/quantized_tensor.h"
#include "octet/ops/quantize.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;
using testing::bitwise_equal;
using testing::fresh_seed;

// The device decodes runs of ordinary codes by the hardware pair conversion and the rest by the
// formula (quantize.cu's decode_run): both must give the host's bits for every code under every
// kind of scale. Random bytes put NaN and inf codes in a share of the 16-byte runs (E5M2 about
// 40%, E4M3 about 12%), the first 256 bytes are every code once, and the scales are random
// normals with NaN, +-inf, 0 and a subnormal planted (E8M0: random exponents and its NaN, 0xFF).
// The 256 x 512 shape takes the kernel's aligned lookups (one scale, or 1-row blocks by shift),
// 130 x 200 the general one with a scalar tail; f32 output shows the NaN payloads too.
TEST(DequantizeCuda, EveryCodeUnderEveryScaleEqualsTheHost) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const float special_scales[] = {NAN, INFINITY, -INFINITY, 0.0f, 1e-40f};
  std::uniform_real_distribution<float> log2_scale(-20.0f, 20.0f);
  for (const auto [rows, cols] : {std::pair<int64_t, int64_t>{256, 512}, {130, 200}}) {
    for (ScalingMode mode : testing::kScalingModes) {
      for (DType fp8_dtype : {DType::e4m3, DType::e5m2}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " "
                                          << fp8::scaling_mode_name(mode) << " "
                                          << dtype_name(fp8_dtype));
        QuantizedTensor q = QuantizedTensor::allocate(rows, cols, fp8_dtype, mode,
                                                      {true, false}, Device::cpu());
        auto* codes = static_cast<uint8_t*>(q.data.raw_data());
        for (int64_t i = 0; i < rows * cols; ++i)
          codes[i] = static_cast<uint8_t>(i < 256 ? i : rng());
        const int64_t scales = q.scale_inv.numel();
        // Per tensor, each special scale gets a turn; with blocks they share one call.
        for (int turn = 0; turn < (scales == 1 ? 6 : 1); ++turn) {
          for (int64_t b = 0; b < scales; ++b) {
            const bool special = scales == 1 ? turn > 0 : b % 7 == 3;
            if (mode == ScalingMode::mxfp8_1x32) {
              static_cast<uint8_t*>(q.scale_inv.raw_data())[b] =
                  special ? 0xFF : static_cast<uint8_t>(127 + static_cast<int>(rng() % 41) - 20);
            } else {
              q.scale_inv.data<float>()[b] =
                  special ? special_scales[scales == 1 ? turn - 1 : (b / 7) % 5]
                          : std::exp2(log2_scale(rng));
            }
          }
          QuantizedTensor on_gpu = q;
          on_gpu.data = q.data.to(gpu);
          on_gpu.scale_inv = q.scale_inv.to(gpu);
          for (DType out_dtype : {DType::f32, DType::bf16}) {
            const Tensor expected = Tensor::empty({rows, cols}, out_dtype);
            ops::dequantize(q, expected);
            const Tensor out = Tensor::empty({rows, cols}, out_dtype, gpu);
            ops::dequantize(on_gpu, out);
            EXPECT_TRUE(bitwise_equal(expected, out))
                << dtype_name(out_dtype) << " output, scale turn " << turn;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace octet
