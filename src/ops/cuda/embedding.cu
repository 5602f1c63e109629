// CUDA backend of the embedding family: token + position embedding (forward and backward) and the
// fused softmax + cross-entropy. Every sum runs in the CPU reference's order, with no float atomics
// (DESIGN.md rule 3):
//
// embedding_backward, token table. dwte[v] needs the rows whose id is v, in increasing row order.
//   1. keys[r] = ids[r] (vocab for a bad id: a bucket nobody reads), values[r] = r;
//   2. CUB's radix sort of (key, row) pairs. LSD radix sort is stable and the rows arrive in
//      increasing order, so each key's rows stay in increasing order: the output is unique, no
//      matter how CUB schedules its passes (its internal atomics count integers only);
//   3. one thread per sorted position marks where each key's run begins and ends (each run has
//      exactly one first and one last position, so every slot is written by one thread);
//   4. one CTA per (vocab row, 256-column slice): each thread walks its key's run in order,
//      acc = ((0 + dout[r0]) + dout[r1]) + ..., then dwte[v] += acc. Unused vocab rows are left
//      untouched.
// embedding_backward, position table: one CTA per (position, column slice), summing the batch in
// order. Both equal the CPU reference bit for bit.
//
// cross_entropy: one CTA of kCrossEntropyLanes threads per row; max, then the sum of
// expf(l - max), each in fixed_order_reduce.h's order, then the gradient row. A row that fits in
// shared memory is read from global memory once (staged there, 16-byte loads when aligned) and
// reduced from there; a longer row is read from global memory by each of the three passes. Both
// kernels perform the same operations on the same values: their bits are the same.
//
// Ids and targets: see embedding.cc. With check_ids a launcher waits for its kernels and throws
// for the lowest bad row; without it, a bad row gets NaN (forward output, loss and gradient row) or
// adds to no token row (backward; its position row still gets it), and no memory outside the
// tables is touched.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/embedding_backend.h"
#include "ops/fixed_order_reduce.h"

namespace octet::ops::cuda {
namespace {

/// Threads per CTA of the embedding kernels: each CTA covers this many consecutive columns of a
/// row, so a warp reads 128 contiguous bytes of f32.
constexpr int kColumnThreads = 256;
/// Threads per CTA of the element-wise kernels over sorted positions.
constexpr int kPositionThreads = 256;
/// Bytes of one vectorized global load or store (LDG.128 / STG.128 / LDS.128).
constexpr int kPackBytes = 16;
/// Static shared memory of the cross-entropy kernels: the reduction tree's lanes.
constexpr size_t kCrossEntropyTreeBytes = sizeof(float) * kCrossEntropyLanes;
/// 16-byte packs each thread of the staged cross-entropy kernel loads before it stores them to
/// shared memory: 8 x 512 threads = 64 KiB of a row in flight per CTA, enough to cover DRAM
/// latency even at one CTA per SM (an f32 row of 50304 logits).
constexpr int kStageLoadsInFlight = 8;
/// CTAs per SM the staged cross-entropy kernel's registers must allow: a bf16 row of GPT-2's 50304
/// logits (98 KiB) leaves room for two in an H200 SM's 228 KiB of shared memory.
constexpr int kStagedCtasPerSm = 2;

__device__ __forceinline__ float load_float(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load_float(const uint16_t* x, int64_t i) {
  return fp8::decode_bf16(x[i]);
}
__device__ __forceinline__ void store_float(float* out, int64_t i, float value) { out[i] = value; }
__device__ __forceinline__ void store_float(uint16_t* out, int64_t i, float value) {
  out[i] = fp8::encode_bf16(value);
}

/// Elements of T in one 16-byte pack.
template <typename T>
constexpr int kPackElems = kPackBytes / static_cast<int>(sizeof(T));

/// kPackElems<T> consecutive elements: one 16-byte load or store.
template <typename T>
struct alignas(kPackBytes) RowPack {
  T v[kPackElems<T>];
};

/// Records a bad row for BadIdFlag (no-op when checking is off): the flag keeps the maximum of
/// rows - row, i.e. the lowest bad row. An integer atomic: exact, order-independent.
__device__ __forceinline__ void record_bad_row(int* flag, int64_t row, int64_t rows) {
  if (flag != nullptr) atomicMax(flag, static_cast<int>(rows - row));
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// out[r, c] = wte[ids[r], c] (+ wpe[r % seq, c]). Grid: (rows, column slices).
template <typename Out>
__global__ void embedding_forward_kernel(const int32_t* __restrict__ ids,
                                         const float* __restrict__ wte,
                                         const float* __restrict__ wpe, Out* __restrict__ out,
                                         int64_t rows, int64_t dim, int64_t vocab, int64_t seq,
                                         int* bad_row_flag) {
  const int64_t r = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kColumnThreads + threadIdx.x;
  if (c >= dim) return;
  const int32_t id = ids[r];
  if (id < 0 || id >= vocab) {
    if (c == 0) record_bad_row(bad_row_flag, r, rows);
    store_float(out, r * dim + c, NAN);
    return;
  }
  float x = wte[id * dim + c];
  if (wpe != nullptr) x = x + wpe[(r % seq) * dim + c];  // no "+ 0" without positions (keeps -0)
  store_float(out, r * dim + c, x);
}

/// keys[r] = ids[r], or vocab for an id outside [0, vocab); rows_out[r] = r.
__global__ void embedding_sort_keys_kernel(const int32_t* __restrict__ ids,
                                           uint32_t* __restrict__ keys,
                                           int32_t* __restrict__ row_index, int64_t rows,
                                           int64_t vocab, int* bad_row_flag) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int32_t id = ids[r];
  const bool bad = id < 0 || id >= vocab;
  if (bad) record_bad_row(bad_row_flag, r, rows);
  keys[r] = static_cast<uint32_t>(bad ? vocab : id);
  row_index[r] = static_cast<int32_t>(r);
}

/// For each key v < vocab present in the sorted keys: run_begin[v] and run_end[v] delimit its run
/// of sorted positions. Absent keys keep their zeroed (empty) run.
__global__ void embedding_runs_kernel(const uint32_t* __restrict__ sorted_keys,
                                      int32_t* __restrict__ run_begin,
                                      int32_t* __restrict__ run_end, int64_t rows, int64_t vocab) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= rows) return;
  const uint32_t key = sorted_keys[p];
  if (key >= vocab) return;
  if (p == 0 || sorted_keys[p - 1] != key) run_begin[key] = static_cast<int32_t>(p);
  if (p == rows - 1 || sorted_keys[p + 1] != key) run_end[key] = static_cast<int32_t>(p + 1);
}

/// dwte[v, c] += sum over v's run of dout[row, c], in increasing row order. Grid: (vocab, column
/// slices).
template <typename T>
__global__ void embedding_token_grad_kernel(const T* __restrict__ dout,
                                            const int32_t* __restrict__ sorted_rows,
                                            const int32_t* __restrict__ run_begin,
                                            const int32_t* __restrict__ run_end,
                                            float* __restrict__ dwte, int64_t dim) {
  const int64_t v = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kColumnThreads + threadIdx.x;
  const int32_t begin = run_begin[v];
  const int32_t end = run_end[v];
  if (begin == end || c >= dim) return;
  float acc = 0.0f;
  for (int32_t k = begin; k < end; ++k) acc += load_float(dout, sorted_rows[k] * dim + c);
  dwte[v * dim + c] += acc;
}

/// dwpe[t, c] += sum over the batch of dout[b*seq + t, c], in increasing b. Grid: (seq, column
/// slices).
template <typename T>
__global__ void embedding_position_grad_kernel(const T* __restrict__ dout, float* __restrict__ dwpe,
                                               int64_t rows, int64_t dim, int64_t seq) {
  const int64_t t = blockIdx.x;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kColumnThreads + threadIdx.x;
  if (c >= dim) return;
  float acc = 0.0f;
  for (int64_t r = t; r < rows; r += seq) acc += load_float(dout, r * dim + c);
  dwpe[t * dim + c] += acc;
}

/// A row of cross_entropy whose target is outside [0, vocab): an ignored row (target < 0) gets
/// loss 0 and a zero gradient, an out-of-range target (a bad row) NaN. Returns whether the row was
/// one; the whole CTA gets the same answer (one target per CTA).
template <typename T>
__device__ __forceinline__ bool cross_entropy_bad_target(int32_t target, int64_t r, float* losses,
                                                         T* d, int64_t rows, int64_t vocab,
                                                         int* bad_row_flag) {
  if (target >= 0 && target < vocab) return false;
  const bool ignored = target < 0;
  if (threadIdx.x == 0) {
    if (!ignored) record_bad_row(bad_row_flag, r, rows);
    losses[r] = ignored ? 0.0f : NAN;
  }
  if (d != nullptr)
    for (int64_t j = threadIdx.x; j < vocab; j += kCrossEntropyLanes)
      store_float(d, j, ignored ? 0.0f : NAN);
  return true;
}

/// One CTA per row: losses[r] = (m + logf(s)) - l[target], dlogits[r, j] = (expf(l_j - m) / s -
/// [j == target]) * grad_scale, with m the max and s the sum of expf(l_j - m) in the fixed order.
/// The max m of the row `l` (global or shared memory) and s = the sum of expf(l_j - m), each in
/// fixed_order_reduce.h's order; thread 0 writes the row's loss (m + logf(s)) - l[target]. Every
/// thread of the CTA calls it and gets {m, s}.
template <typename T>
__device__ __forceinline__ float2 softmax_stats(const T* l, int64_t vocab, int32_t target,
                                                float* loss, float* shared) {
  const float m = fixed_order_reduce_block<kCrossEntropyLanes, float>(
      vocab, MaxOp{}, [l](int64_t j) { return load_float(l, j); }, shared);
  const float s = fixed_order_reduce_block<kCrossEntropyLanes, float>(
      vocab, SumOp{}, [l, m](int64_t j) { return expf(load_float(l, j) - m); }, shared);
  if (threadIdx.x == 0) *loss = (m + logf(s)) - load_float(l, target);
  return make_float2(m, s);
}

/// Reads the row from global memory in each pass: for rows too long for shared memory.
template <typename T>
__global__ void __launch_bounds__(kCrossEntropyLanes)
    cross_entropy_kernel(const T* logits, const int32_t* __restrict__ targets,
                         float* __restrict__ losses, T* dlogits, int64_t rows, int64_t vocab,
                         float grad_scale, int* bad_row_flag) {
  // logits and dlogits carry no __restrict__: the gradient may overwrite the logits in place.
  __shared__ float shared[kCrossEntropyLanes];
  const int64_t r = blockIdx.x;
  const T* l = logits + r * vocab;
  T* d = dlogits != nullptr ? dlogits + r * vocab : nullptr;
  const int32_t target = targets[r];
  if (cross_entropy_bad_target(target, r, losses, d, rows, vocab, bad_row_flag)) return;
  const auto [m, s] = softmax_stats(l, vocab, target, losses + r, shared);
  if (d == nullptr) return;
  __syncthreads();  // logits[target] is read before any gradient is stored over it
  for (int64_t j = threadIdx.x; j < vocab; j += kCrossEntropyLanes) {
    const float p = expf(load_float(l, j) - m) / s;
    store_float(d, j, (j == target ? p - 1.0f : p) * grad_scale);
  }
}

/// Copies the row l[0, vocab) into `row` (shared memory). kVec: vocab is a multiple of
/// kPackElems<T> and l is 16-byte aligned, so the copy goes by 16-byte packs, kStageLoadsInFlight
/// loads per thread issued before their stores; otherwise element by element. The caller
/// synchronizes before reading `row`.
template <typename T, bool kVec>
__device__ __forceinline__ void stage_row(const T* l, T* row, int64_t vocab) {
  if constexpr (kVec) {
    const auto* src = reinterpret_cast<const RowPack<T>*>(l);
    auto* dst = reinterpret_cast<RowPack<T>*>(row);
    const int64_t packs = vocab / kPackElems<T>;
    for (int64_t base = threadIdx.x; base < packs;
         base += int64_t{kStageLoadsInFlight} * kCrossEntropyLanes) {
      RowPack<T> v[kStageLoadsInFlight];
#pragma unroll
      for (int i = 0; i < kStageLoadsInFlight; ++i) {
        const int64_t p = base + int64_t{i} * kCrossEntropyLanes;
        if (p < packs) v[i] = src[p];
      }
#pragma unroll
      for (int i = 0; i < kStageLoadsInFlight; ++i) {
        const int64_t p = base + int64_t{i} * kCrossEntropyLanes;
        if (p < packs) dst[p] = v[i];
      }
    }
  } else {
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < vocab; j += kCrossEntropyLanes) row[j] = l[j];
  }
}

// cross_entropy_kernel reads each row from global memory three times (max, sum, gradient): at
// GPT-2's shape (8192 rows x vocab 50304, bf16 logits, 100 KB a row) a row falls out of the L2
// between the passes, so DRAM moves about 1.5 times the unavoidable bytes (one read of the
// logits, one write of the gradient; docs/PERFORMANCE.md has the profile). This kernel reads the
// row once into shared memory and takes the three passes from there.

/// cross_entropy_kernel for a row that fits in shared memory (vocab * sizeof(T) bytes of dynamic
/// shared memory): the same operations on the same values, so the same bits, with the row read
/// from global memory once. kVec (see stage_row) also requires a 16-byte aligned dlogits: the
/// gradient is then written by 16-byte packs.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kCrossEntropyLanes, kStagedCtasPerSm)
    cross_entropy_staged_kernel(const T* logits, const int32_t* __restrict__ targets,
                                float* __restrict__ losses, T* dlogits, int64_t rows, int64_t vocab,
                                float grad_scale, int* bad_row_flag) {
  // logits and dlogits carry no __restrict__: the gradient may overwrite the logits in place.
  extern __shared__ uint4 staged_raw[];  // the row: vocab elements of T, 16-byte aligned
  __shared__ float shared[kCrossEntropyLanes];
  static_assert(sizeof(shared) == kCrossEntropyTreeBytes, "the launcher's budget assumes it");
  T* row = reinterpret_cast<T*>(staged_raw);
  const int64_t r = blockIdx.x;
  const T* l = logits + r * vocab;
  T* d = dlogits != nullptr ? dlogits + r * vocab : nullptr;
  const int32_t target = targets[r];
  if (cross_entropy_bad_target(target, r, losses, d, rows, vocab, bad_row_flag)) return;
  stage_row<T, kVec>(l, row, vocab);
  // Every thread's global reads of the row come before this barrier and every gradient store after
  // it, so dlogits == logits is safe.
  __syncthreads();
  // Lane t reads elements t, t + kCrossEntropyLanes, ...: consecutive threads, consecutive
  // elements (no bank conflicts).
  const auto [m, s] = softmax_stats(row, vocab, target, losses + r, shared);
  if (d == nullptr) return;
  if constexpr (kVec) {
    const auto* src = reinterpret_cast<const RowPack<T>*>(row);
    auto* dst = reinterpret_cast<RowPack<T>*>(d);
    const int64_t packs = vocab / kPackElems<T>;
    for (int64_t p = threadIdx.x; p < packs; p += kCrossEntropyLanes) {
      const RowPack<T> in = src[p];  // consecutive threads, consecutive 16 bytes
      RowPack<T> out;
#pragma unroll
      for (int k = 0; k < kPackElems<T>; ++k) {
        const int64_t j = p * kPackElems<T> + k;
        const float q = expf(load_float(in.v, k) - m) / s;
        store_float(out.v, k, (j == target ? q - 1.0f : q) * grad_scale);
      }
      dst[p] = out;
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kCrossEntropyLanes) {
      const float q = expf(load_float(row, j) - m) / s;
      store_float(d, j, (j == target ? q - 1.0f : q) * grad_scale);
    }
  }
}

// ----------------------------------------------------------------------------
// Bad-id reporting

/// The device flag of one call: allocated (zeroed) only when checking, read back by check().
class BadIdFlag {
 public:
  BadIdFlag(bool enabled, const Device& device) {
    if (enabled) flag_ = Tensor::zeros({1}, DType::i32, device);
  }
  int* data() const { return flag_.defined() ? flag_.data<int32_t>() : nullptr; }

  /// When checking: waits for the kernels before it and throws naming the lowest bad row of
  /// `ids` (rows values in all), its value and `limit`.
  void check(const Tensor& ids, int64_t limit, bool negative_ignores, const char* op,
             const char* what) const {
    if (!flag_.defined()) return;
    const int32_t flag = flag_.to(Device::cpu()).data<int32_t>()[0];
    if (flag == 0) return;
    const int64_t row = ids.numel() - flag;
    const int32_t value = ids.view({-1}).slice(row, row + 1).to(Device::cpu()).data<int32_t>()[0];
    throw_bad_id(op, what, row, value, limit, negative_ignores);
  }

 private:
  Tensor flag_;
};

/// gridDim.y for `dim` columns.
unsigned column_slices(int64_t dim, const char* op) {
  const int64_t slices = ceil_div(dim, kColumnThreads);
  OCTET_CHECK(slices <= kMaxGridY, op, ": dim ", dim, " exceeds the supported ",
              kMaxGridY * kColumnThreads);
  return static_cast<unsigned>(slices);
}

/// Bits that hold every key in [0, vocab] (vocab is the bad-id bucket).
int key_bits(int64_t vocab) {
  int bits = 1;
  while ((int64_t{1} << bits) <= vocab) ++bits;
  return bits;
}

template <typename T>
void launch_embedding_grads(const T* dout, const Tensor& ids, int64_t seq, const Tensor& dwte,
                            const Tensor& dwpe, int* bad_row_flag, cudaStream_t stream) {
  const Device& device = dwte.device();
  const int64_t rows = ids.numel();
  const int64_t vocab = dwte.size(0);
  const int64_t dim = dwte.size(1);
  const unsigned slices = column_slices(dim, "embedding_backward");
  OCTET_CHECK(vocab < INT32_MAX, "embedding_backward: vocabulary ", vocab,
              " too large for 32-bit sort keys");

  // Workspaces, stream-ordered on octet's stream (freed after the kernels that use them).
  Tensor keys = Tensor::empty({rows}, DType::i32, device);
  Tensor sorted_keys = Tensor::empty({rows}, DType::i32, device);
  Tensor row_index = Tensor::empty({rows}, DType::i32, device);
  Tensor sorted_rows = Tensor::empty({rows}, DType::i32, device);
  Tensor run_begin = Tensor::zeros({vocab}, DType::i32, device);
  Tensor run_end = Tensor::zeros({vocab}, DType::i32, device);
  auto* keys_data = static_cast<uint32_t*>(keys.raw_data());
  auto* sorted_keys_data = static_cast<uint32_t*>(sorted_keys.raw_data());

  const auto position_blocks = static_cast<unsigned>(ceil_div(rows, kPositionThreads));
  embedding_sort_keys_kernel<<<position_blocks, kPositionThreads, 0, stream>>>(
      ids.data<int32_t>(), keys_data, row_index.data<int32_t>(), rows, vocab, bad_row_flag);
  OCTET_CHECK_LAUNCH();

  const int end_bit = key_bits(vocab);
  const int items = static_cast<int>(rows);  // rows <= INT32_MAX (checked by the dispatcher)
  size_t temp_bytes = 0;
  OCTET_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, keys_data, sorted_keys_data, row_index.data<int32_t>(),
      sorted_rows.data<int32_t>(), items, 0, end_bit, stream));
  Tensor temp = Tensor::empty({static_cast<int64_t>(temp_bytes)}, DType::u8, device);
  OCTET_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
      temp.raw_data(), temp_bytes, keys_data, sorted_keys_data, row_index.data<int32_t>(),
      sorted_rows.data<int32_t>(), items, 0, end_bit, stream));

  embedding_runs_kernel<<<position_blocks, kPositionThreads, 0, stream>>>(
      sorted_keys_data, run_begin.data<int32_t>(), run_end.data<int32_t>(), rows, vocab);
  OCTET_CHECK_LAUNCH();

  embedding_token_grad_kernel<<<dim3(static_cast<unsigned>(vocab), slices), kColumnThreads, 0,
                                stream>>>(dout, sorted_rows.data<int32_t>(),
                                          run_begin.data<int32_t>(), run_end.data<int32_t>(),
                                          dwte.data<float>(), dim);
  OCTET_CHECK_LAUNCH();

  if (dwpe.defined()) {
    embedding_position_grad_kernel<<<dim3(static_cast<unsigned>(seq), slices), kColumnThreads, 0,
                                     stream>>>(dout, dwpe.data<float>(), rows, dim, seq);
    OCTET_CHECK_LAUNCH();
  }
}

/// Whether p is 16-byte aligned (nullptr is).
bool pack_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackBytes == 0; }

/// Launches cross_entropy_staged_kernel<T, kVec> with `smem` bytes of dynamic shared memory, after
/// opting the kernel in to `budget` bytes once per device.
template <typename T, bool kVec>
void launch_cross_entropy_staged(const T* logits, const int32_t* targets, float* losses, T* dlogits,
                                 int64_t rows, int64_t vocab, float grad_scale, int* bad_row_flag,
                                 size_t smem, size_t budget, const Device& device,
                                 cudaStream_t stream) {
  const auto kernel = cross_entropy_staged_kernel<T, kVec>;
  if (smem > kDefaultDynamicSmemBytes) {
    static octet::cuda::PerDeviceFlag opted_in;
    opt_in_shared_memory(kernel, budget, device, opted_in);
  }
  kernel<<<static_cast<unsigned>(rows), kCrossEntropyLanes, smem, stream>>>(
      logits, targets, losses, dlogits, rows, vocab, grad_scale, bad_row_flag);
  OCTET_CHECK_LAUNCH();
}

/// cross_entropy on one dtype: the staged kernel when a row fits in the dynamic shared memory a
/// CTA may opt into (the device's limit less the kernel's static shared memory), with 16-byte
/// packs when the row and both pointers allow; the three-pass kernel otherwise.
template <typename T>
void launch_cross_entropy(const T* logits, const int32_t* targets, float* losses, T* dlogits,
                          int64_t rows, int64_t vocab, float grad_scale, int* bad_row_flag,
                          const Device& device, cudaStream_t stream) {
  const size_t optin = octet::cuda::properties(device).sharedMemPerBlockOptin;
  const size_t budget = optin > kCrossEntropyTreeBytes ? optin - kCrossEntropyTreeBytes : 0;
  const size_t row_bytes = static_cast<size_t>(vocab) * sizeof(T);
  if (row_bytes > budget) {
    cross_entropy_kernel<<<static_cast<unsigned>(rows), kCrossEntropyLanes, 0, stream>>>(
        logits, targets, losses, dlogits, rows, vocab, grad_scale, bad_row_flag);
    OCTET_CHECK_LAUNCH();
    return;
  }
  // Row r starts at r * vocab elements: with vocab a multiple of a pack, every row is aligned.
  const bool vec = vocab % kPackElems<T> == 0 && pack_aligned(logits) && pack_aligned(dlogits);
  if (vec) {
    launch_cross_entropy_staged<T, true>(logits, targets, losses, dlogits, rows, vocab, grad_scale,
                                         bad_row_flag, row_bytes, budget, device, stream);
  } else {
    launch_cross_entropy_staged<T, false>(logits, targets, losses, dlogits, rows, vocab, grad_scale,
                                          bad_row_flag, row_bytes, budget, device, stream);
  }
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

void embedding_forward(const Tensor& ids, const Tensor& wte, const Tensor& wpe, int64_t seq,
                       const Tensor& out, bool check_ids) {
  const Device& device = out.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t rows = ids.numel();
  const int64_t vocab = wte.size(0);
  const int64_t dim = wte.size(1);
  const dim3 grid(static_cast<unsigned>(rows), column_slices(dim, "embedding_forward"));
  const float* positions = wpe.defined() ? wpe.data<float>() : nullptr;
  BadIdFlag flag(check_ids, device);
  if (out.dtype() == DType::bf16) {
    embedding_forward_kernel<<<grid, kColumnThreads, 0, stream>>>(
        ids.data<int32_t>(), wte.data<float>(), positions, static_cast<uint16_t*>(out.raw_data()),
        rows, dim, vocab, seq, flag.data());
  } else {
    embedding_forward_kernel<<<grid, kColumnThreads, 0, stream>>>(
        ids.data<int32_t>(), wte.data<float>(), positions, out.data<float>(), rows, dim, vocab, seq,
        flag.data());
  }
  OCTET_CHECK_LAUNCH();
  flag.check(ids, vocab, false, "embedding_forward", "ids");
}

void embedding_backward(const Tensor& ids, const Tensor& dout, int64_t seq, const Tensor& dwte,
                        const Tensor& dwpe, bool check_ids) {
  const Device& device = dwte.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  BadIdFlag flag(check_ids, device);
  if (dout.dtype() == DType::bf16) {
    launch_embedding_grads(static_cast<const uint16_t*>(dout.raw_data()), ids, seq, dwte, dwpe,
                           flag.data(), stream);
  } else {
    launch_embedding_grads(dout.data<float>(), ids, seq, dwte, dwpe, flag.data(), stream);
  }
  flag.check(ids, dwte.size(0), false, "embedding_backward", "ids");
}

void cross_entropy(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                   const Tensor& dlogits, float grad_scale, bool check_ids) {
  const Device& device = logits.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t rows = logits.rows();
  const int64_t vocab = logits.cols();
  OCTET_CHECK(rows <= INT32_MAX, "cross_entropy: at most ", INT32_MAX, " rows are supported, got ",
              logits.describe());
  BadIdFlag flag(check_ids, device);
  const int32_t* target_data = targets.data<int32_t>();
  float* loss_data = losses.data<float>();
  if (logits.dtype() == DType::bf16) {
    launch_cross_entropy(static_cast<const uint16_t*>(logits.raw_data()), target_data, loss_data,
                         dlogits.defined() ? static_cast<uint16_t*>(dlogits.raw_data()) : nullptr,
                         rows, vocab, grad_scale, flag.data(), device, stream);
  } else {
    launch_cross_entropy(logits.data<float>(), target_data, loss_data,
                         dlogits.defined() ? dlogits.data<float>() : nullptr, rows, vocab,
                         grad_scale, flag.data(), device, stream);
  }
  flag.check(targets, vocab, true, "cross_entropy", "targets");
}

}  // namespace octet::ops::cuda
