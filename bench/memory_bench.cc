// Memory-bound benchmarks: the device-to-device copy ceiling itself, FP8 quantization (per-tensor
// with amax, 1x128 and 128x128 blocks, MXFP8; row-wise and transposed copies), dequantization and
// amax, each against the copy bandwidth measured in the same process.
#include "bench_util.h"

#if OCTET_WITH_CUDA

#include <string>

#include "octet/fp8/format.h"
#include "octet/ops/quantize.h"

namespace octet::bench {
namespace {

/// The activation: 16384 tokens x 8192 hidden, BF16 (268 MB).
constexpr int64_t kRows = 16384;
constexpr int64_t kCols = 8192;
constexpr const char* kShapeName = "16384x8192";
/// Per-tensor scale for inputs uniform in [-1, 1]: fp8_max / amax with amax = 1, so values fill
/// E4M3's range without saturating (what delayed scaling converges to).
constexpr float kInputScale = fp8::kE4M3Max;

/// Bytes per element under the convention: BF16 read, one byte per FP8 copy written.
constexpr double kBf16Bytes = 2;
constexpr double kFp8Bytes = 1;

struct QuantizeCase {
  const char* name;
  fp8::ScalingMode mode;
  fp8::Usage usage;
  bool amax;  ///< per_tensor: record amax in the same pass (delayed scaling's cast)
};

// The casts a training step runs: delayed scaling's cast-transpose with amax (and its row-wise
// half alone, which isolates the cost of the transposed copy), the block recipe's 1x128
// activations and 128x128 weights, and MXFP8; all but the row-wise case write both copies,
// because Hopper's TN-only GEMMs need the transposed one for dgrad and wgrad.
const QuantizeCase kQuantizeCases[] = {
    {"cast_transpose_amax", fp8::ScalingMode::per_tensor, {true, true}, true},
    {"quantize_rowwise_amax", fp8::ScalingMode::per_tensor, {true, false}, true},
    {"quantize_both", fp8::ScalingMode::block_1x128, {true, true}, false},
    {"quantize_both", fp8::ScalingMode::block_128x128, {true, true}, false},
    {"quantize_both", fp8::ScalingMode::mxfp8_1x32, {true, true}, false},
};

double bytes_of(const Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; }

void bm_copy(benchmark::State& state) {
  guarded(state, [&] {
    const auto bytes = static_cast<int64_t>(kCopyBytes);
    Tensor src = random_tensor({bytes}, DType::e4m3, kCopySlot);
    Tensor dst = Tensor::empty({bytes}, DType::u8, device());
    const double seconds = time_loop(state, [&] {
      OCTET_CHECK_CUDA(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), kCopyBytes,
                                       cudaMemcpyDeviceToDevice, stream()));
    });
    report_memory(state, seconds, 2.0 * kCopyBytes, 2.0 * kCopyBytes);
    state.SetLabel("the ceiling itself: cudaMemcpyAsync D2D, read + write");
  });
}

void bm_quantize(benchmark::State& state, const QuantizeCase& c) {
  guarded(state, [&] {
    copy_bandwidth();  // measured before the op, while the GPU is as warm as for the op
    Tensor x = random_tensor({kRows, kCols}, DType::bf16);
    fp8::QuantizedTensor q =
        fp8::QuantizedTensor::allocate(kRows, kCols, DType::e4m3, c.mode, c.usage, device());
    ops::QuantizeArgs args;
    if (c.mode == fp8::ScalingMode::per_tensor) args.scale = filled_f32({1}, kInputScale);
    if (c.amax) args.amax = Tensor::zeros({1}, DType::f32, device());
    const double seconds = time_loop(state, [&] { ops::quantize(x, q, args); });

    const double copies = (c.usage.rowwise ? 1 : 0) + (c.usage.columnwise ? 1 : 0);
    const double bytes = static_cast<double>(x.numel()) * (kBf16Bytes + copies * kFp8Bytes);
    const double actual = bytes_of(x) + bytes_of(q.data) + bytes_of(q.data_t) +
                          bytes_of(q.scale_inv) + bytes_of(q.scale_inv_t) + bytes_of(args.scale) +
                          2 * bytes_of(args.amax);  // amax is read and written
    report_memory(state, seconds, bytes, actual);
    state.SetLabel(c.usage.columnwise ? "bf16 -> e4m3 row-wise + transposed, vs D2D copy"
                                      : "bf16 -> e4m3 row-wise, vs D2D copy");
  });
}

void bm_dequantize(benchmark::State& state) {
  guarded(state, [&] {
    copy_bandwidth();
    fp8::QuantizedTensor q;
    q.mode = fp8::ScalingMode::per_tensor;
    q.dtype = DType::e4m3;
    q.rows = kRows;
    q.cols = kCols;
    q.data = random_tensor({kRows, kCols}, DType::e4m3);
    q.scale_inv = random_scales(fp8::scale_shape(q.mode, kRows, kCols));
    Tensor out = Tensor::empty({kRows, kCols}, DType::bf16, device());
    const double seconds = time_loop(state, [&] { ops::dequantize(q, out); });
    const double bytes = static_cast<double>(out.numel()) * (kFp8Bytes + kBf16Bytes);
    report_memory(state, seconds, bytes, bytes + bytes_of(q.scale_inv));
    state.SetLabel("e4m3 -> bf16, vs D2D copy");
  });
}

void bm_amax(benchmark::State& state) {
  guarded(state, [&] {
    copy_bandwidth();
    Tensor x = random_tensor({kRows, kCols}, DType::bf16);
    Tensor amax = Tensor::zeros({1}, DType::f32, device());
    const double seconds = time_loop(state, [&] { ops::amax(x, amax); });
    const double bytes = bytes_of(x);
    report_memory(state, seconds, bytes, bytes + 2 * bytes_of(amax));
    state.SetLabel("max|bf16|, vs D2D copy");
  });
}

std::string name(const std::string& op, std::string_view variant) {
  return "mem/" + op + "/" + std::string(variant) + "/" + kShapeName;
}

}  // namespace

void register_memory_benchmarks() {
  configure(benchmark::RegisterBenchmark("copy/d2d/2GiB", bm_copy));
  for (const QuantizeCase& c : kQuantizeCases) {
    configure(benchmark::RegisterBenchmark(name(c.name, fp8::scaling_mode_name(c.mode)).c_str(),
                                           [c](benchmark::State& s) { bm_quantize(s, c); }));
  }
  configure(benchmark::RegisterBenchmark(name("dequantize", "per_tensor").c_str(), bm_dequantize));
  configure(benchmark::RegisterBenchmark(name("amax", "bf16").c_str(), bm_amax));
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
