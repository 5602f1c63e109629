/* The C API from C11: quantization bit-exact against a reference encoder written here, the FP8
 * GEMM bit-exact on small integers, and their error paths (a status plus octet's message); the
 * modules are in capi_modules_test.c. main() seeds every group (OCTET_TEST_SEED overrides; the
 * seed is printed) and ends with "N passed, N failed". */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi_check.h"

/* ----------------------------------------------------------------------------------------------
 * Reference FP8 codes: the nearest code by search over all codes, ties to the even code,
 * saturating to the largest finite value (CUDA's __NV_SATFINITE). Independent of octet's encoder.
 */

static float decode_fp8(uint8_t code, int e5m2) {
  const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int e = (code & 0x7F) >> mbits, m = code & ((1 << mbits) - 1);
  float v = e == 0 ? ldexpf((float)m, 1 - bias - mbits)
                   : ldexpf(1.0f + (float)m / (1 << mbits), e - bias);
  return (code & 0x80) ? -v : v;
}
static uint8_t max_code(int e5m2) { return e5m2 ? 0x7B : 0x7E; }
static uint8_t encode_fp8(float v, int e5m2) {
  if (isnan(v)) return 0x7F;
  const uint8_t sign = signbit(v) ? 0x80 : 0;
  const float a = fabsf(v);
  uint8_t best = 0;
  for (int c = 1; c <= max_code(e5m2); ++c) {
    const float dc = fabsf(decode_fp8((uint8_t)c, e5m2) - a),
                db = fabsf(decode_fp8(best, e5m2) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = (uint8_t)c;
  }
  return (uint8_t)(sign | best);
}
static float float_floor_pow2(float s) {
  uint32_t bits;
  memcpy(&bits, &s, 4);
  bits &= 0xFF800000u;
  memcpy(&s, &bits, 4);
  return s;
}

/* Quantizes x [rows, cols] with `scale` and compares codes and scale_inv with the reference. */
static void expect_codes(octet_qtensor* q, int transposed, const float* x, int64_t rows,
                         int64_t cols, int e5m2, const float* block_scale, int64_t block) {
  DLManagedTensor *data = NULL, *sinv = NULL;
  OK(octet_qtensor_data(q, transposed, NULL, &data));
  OK(octet_qtensor_scale_inv(q, transposed, NULL, &sinv));
  if (!data || !sinv) return;
  const uint8_t* codes = (const uint8_t*)data->dl_tensor.data;
  const float* s_inv = (const float*)sinv->dl_tensor.data;
  int64_t mismatches = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float s = block_scale[block ? r * ((cols + block - 1) / block) + c / block : 0];
      const uint8_t want = encode_fp8(x[r * cols + c] * s, e5m2);
      const uint8_t got = transposed ? codes[c * rows + r] : codes[r * cols + c];
      mismatches += want != got;
    }
  CHECK(mismatches == 0, "%lld of %lld codes differ (transposed %d)", (long long)mismatches,
        (long long)(rows * cols), transposed);
  if (!transposed) {
    const int64_t n = numel(&sinv->dl_tensor);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += s_inv[i] != 1.0f / block_scale[i];
    CHECK(bad == 0, "%d of %lld scale_inv differ", bad, (long long)n);
  }
  release(data);
  release(sinv);
}

void test_recipes(void) {
  octet_recipe* r = NULL;
  const char* name = NULL;
  int kind = -1, len = 0;
  OK(octet_recipe_delayed(0, 16, OCTET_AMAX_MAX, OCTET_FORMAT_HYBRID, &r));
  OK(octet_recipe_name(r, &name));
  OK(octet_recipe_fields(r, &kind, NULL, NULL, &len, NULL, NULL));
  CHECK(name && strcmp(name, "fp8-delayed") == 0 && kind == 0 && len == 16, "%s", name);
  octet_recipe_destroy(r);
  OK(octet_recipe_current(1, OCTET_FORMAT_E4M3, &r));
  octet_recipe_destroy(r);
  OK(octet_recipe_block(&r));
  OK(octet_recipe_name(r, &name));
  CHECK(strcmp(name, "fp8-block") == 0, "%s", name);
  octet_recipe_destroy(r);
  OK(octet_recipe_mxfp8(&r));
  octet_recipe_destroy(r);
  OK(octet_recipe_from_name("fp8-current", &r));
  octet_recipe_destroy(r);
  FAILS(octet_recipe_delayed(0, 0, OCTET_AMAX_MAX, OCTET_FORMAT_HYBRID, &r),
        OCTET_ERROR_INVALID_ARGUMENT, "history");
  FAILS(octet_recipe_delayed(-1, 4, OCTET_AMAX_MAX, OCTET_FORMAT_HYBRID, &r),
        OCTET_ERROR_INVALID_ARGUMENT, "margin");
  FAILS(octet_recipe_current(0, (octet_fp8_format)7, &r), OCTET_ERROR_INVALID_ARGUMENT,
        "octet_fp8_format");
  FAILS(octet_recipe_from_name("fp9", &r), OCTET_ERROR_INVALID_ARGUMENT, "fp9");
  FAILS(octet_recipe_block(NULL), OCTET_ERROR_INVALID_ARGUMENT, "out must not be NULL");
  CHECK(octet_recipe_block(&r) == OCTET_OK && octet_last_error()[0] == '\0',
        "a success clears the last error: \"%s\"", octet_last_error());
  octet_recipe_destroy(r);
}

void test_quantize(void) {
  enum { ROWS = 37, COLS = 300 }; /* awkward on purpose: partial 1x128 blocks */
  static float x[ROWS * COLS];
  fill(x, ROWS * COLS, -3.0f, 3.0f);
  int64_t shape[2] = {ROWS, COLS};
  DLTensor xt = dl_f32(x, 2, shape);
  octet_quantize_options o;
  octet_qtensor* q = NULL;

  /* Per-tensor with a given scale, both copies, both formats. */
  for (int e5m2 = 0; e5m2 <= 1; ++e5m2) {
    float scale = 37.5f;
    int64_t one = 1;
    DLTensor st = dl_f32(&scale, 1, &one);
    octet_quantize_options_init(&o);
    o.dtype = e5m2 ? OCTET_E5M2 : OCTET_E4M3;
    o.columnwise = 1;
    o.scale = &st;
    OK(octet_quantize(&xt, &o, NULL, &q));
    expect_codes(q, 0, x, ROWS, COLS, e5m2, &scale, 0);
    expect_codes(q, 1, x, ROWS, COLS, e5m2, &scale, 0);
    /* dequantize = decode(code) * scale_inv, bitwise. */
    static float dq[ROWS * COLS];
    DLTensor dqt = dl_f32(dq, 2, shape);
    OK(octet_dequantize(q, 0, &dqt, NULL));
    DLManagedTensor* data = NULL;
    OK(octet_qtensor_data(q, 0, NULL, &data));
    int bad = 0;
    for (int i = 0; data && i < ROWS * COLS; ++i)
      bad += dq[i] != decode_fp8(((uint8_t*)data->dl_tensor.data)[i], e5m2) * (1.0f / scale);
    CHECK(bad == 0, "%d dequantized values differ", bad);
    release(data);
    octet_qtensor_destroy(q);
  }

  /* Ties round to the even code, large values saturate, tiny ones flush or go subnormal. */
  {
    static float ties[16] = {1.0625f, 1.1875f,       -1.0625f,      432.0f, 464.0f, 1000.0f,
                             -1e9f,   0.0009765625f, 0.0029296875f, 1e-9f,  0.0f,   -0.0f,
                             3.25f,   0.3125f,       240.0f,        13.0f};
    int64_t tie_shape[2] = {1, 16}, one_ = 1;
    float unit = 1.0f;
    DLTensor tt = dl_f32(ties, 2, tie_shape), ut = dl_f32(&unit, 1, &one_);
    for (int e5m2 = 0; e5m2 <= 1; ++e5m2) {
      octet_quantize_options_init(&o);
      o.dtype = e5m2 ? OCTET_E5M2 : OCTET_E4M3;
      o.scale = &ut;
      OK(octet_quantize(&tt, &o, NULL, &q));
      expect_codes(q, 0, ties, 1, 16, e5m2, &unit, 0);
      octet_qtensor_destroy(q);
    }
  }

  /* Current scaling (no scale given), with an amax output. */
  float amax_out = 0.5f, amax = 0;
  int64_t one = 1;
  DLTensor at = dl_f32(&amax_out, 1, &one);
  for (int i = 0; i < ROWS * COLS; ++i) amax = fmaxf(amax, fabsf(x[i]));
  octet_quantize_options_init(&o);
  o.amax = &at;
  OK(octet_quantize(&xt, &o, NULL, &q));
  float current = 448.0f / amax;
  expect_codes(q, 0, x, ROWS, COLS, 0, &current, 0);
  CHECK(amax_out == amax, "amax %g, expected %g", amax_out, amax);
  octet_qtensor_destroy(q);

  /* 1x128 blocks, power-of-2 scales (the default). */
  const int64_t blocks = (COLS + 127) / 128;
  static float block_scale[ROWS * ((COLS + 127) / 128)];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float m = 0;
      for (int64_t c = b * 128; c < COLS && c < b * 128 + 128; ++c)
        m = fmaxf(m, fabsf(x[r * COLS + c]));
      block_scale[r * blocks + b] = float_floor_pow2(m > 0 ? 448.0f / m : 1.0f);
    }
  octet_quantize_options_init(&o);
  o.mode = OCTET_BLOCK_1X128;
  OK(octet_quantize(&xt, &o, NULL, &q));
  expect_codes(q, 0, x, ROWS, COLS, 0, block_scale, 128);
  octet_qtensor_destroy(q);

  /* MXFP8: the round trip stays within E4M3's half-ulp (2^-4 relative) of each value, or for a
   * value in E4M3's subnormal range within half its step: 2^-10 of the block's scale 2^(floor(log2
   * amax) - 8), at most amax 2^-18 (2^-17 below leaves a margin). */
  octet_quantize_options_init(&o);
  o.mode = OCTET_MXFP8_1X32;
  OK(octet_quantize(&xt, &o, NULL, &q));
  static float dq[ROWS * COLS];
  DLTensor dqt = dl_f32(dq, 2, shape);
  OK(octet_dequantize(q, 0, &dqt, NULL));
  int far = 0;
  for (int i = 0; i < ROWS * COLS; ++i) {
    const int block0 = i - (i % COLS) % 32;
    float block_amax = 0.0f;
    for (int c = block0; c < block0 + 32 && c < i - i % COLS + COLS; ++c)
      block_amax = fmaxf(block_amax, fabsf(x[c]));
    far += fabsf(dq[i] - x[i]) > 0.0625f * fabsf(x[i]) + block_amax * 0x1p-17f;
  }
  CHECK(far == 0, "%d MXFP8 round trips off by more than 2^-4 relative", far);
  octet_qtensor_destroy(q);

  /* Bad input: every one a status and octet's message, none a crash or a copy. */
  octet_quantize_options_init(&o);
  static int32_t ints[4] = {1, 2, 3, 4};
  int64_t four = 4;
  DLTensor it = dl(ints, 1, &four, kDLInt, 32);
  FAILS(octet_quantize(&it, &o, NULL, &q), OCTET_ERROR_RUNTIME, "i32");
  int64_t strides[2] = {1, ROWS}; /* column-major view */
  DLTensor nc = xt;
  nc.strides = strides;
  FAILS(octet_quantize(&nc, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "contiguous");
  DLTensor opencl = xt;
  opencl.device.device_type = kDLOpenCL;
  FAILS(octet_quantize(&opencl, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "device type");
  DLTensor cuda = xt;
  cuda.device.device_type = kDLCUDA;
  cuda.device.device_id = 99;
  FAILS(octet_quantize(&cuda, &o, NULL, &q), OCTET_ERROR_RUNTIME, "cuda:99");
  /* Again: the GPU count is read once, and an unknown GPU stays an error after that. */
  FAILS(octet_quantize(&cuda, &o, NULL, &q), OCTET_ERROR_RUNTIME, "cuda:99");
  DLTensor misaligned = xt;
  misaligned.byte_offset = 2;
  FAILS(octet_quantize(&misaligned, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "aligned");
  DLTensor lanes = xt;
  lanes.dtype.lanes = 4;
  FAILS(octet_quantize(&lanes, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "dtype");
  float scale = 1.0f;
  DLTensor st = dl_f32(&scale, 1, &one);
  o.mode = OCTET_BLOCK_1X128;
  o.scale = &st;
  FAILS(octet_quantize(&xt, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "pass no scale");
  octet_quantize_options_init(&o);
  o.dtype = OCTET_BF16;
  FAILS(octet_quantize(&xt, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "OCTET_E4M3");
  octet_quantize_options_init(&o);
  o.rowwise = 0;
  FAILS(octet_quantize(&xt, &o, NULL, &q), OCTET_ERROR_INVALID_ARGUMENT, "copy");
  octet_quantize_options_init(&o);
  OK(octet_quantize(&xt, &o, NULL, &q));
  FAILS(octet_dequantize(q, 1, &xt, NULL), OCTET_ERROR_INVALID_ARGUMENT, "no transposed copy");
  int64_t wrong[2] = {COLS, ROWS};
  DLTensor wt = dl_f32(x, 2, wrong);
  FAILS(octet_dequantize(q, 0, &wt, NULL), OCTET_ERROR_RUNTIME, "[300, 37]");
  FAILS(octet_dequantize(NULL, 0, &xt, NULL), OCTET_ERROR_INVALID_ARGUMENT, "q must not be NULL");
  octet_qtensor_destroy(q);
}

/* D = A B^T on small integers: every product and sum is exact in f32, so bit-exact. */
void test_gemm(void) {
  enum { M = 32, N = 48, K = 64 };
  static float a[M * K], b[N * K], d[M * N], bias[N];
  for (int i = 0; i < M * K; ++i) a[i] = (float)((int)uniform(0, 17) - 8);
  for (int i = 0; i < N * K; ++i) b[i] = (float)((int)uniform(0, 17) - 8);
  for (int i = 0; i < N; ++i) bias[i] = (float)((int)uniform(0, 9) - 4);
  int64_t sa[2] = {M, K}, sb[2] = {N, K}, sd[2] = {M, N}, sbias[1] = {N}, one = 1;
  DLTensor at = dl_f32(a, 2, sa), bt = dl_f32(b, 2, sb), dt = dl_f32(d, 2, sd);
  DLTensor biast = dl_f32(bias, 1, sbias);
  float scale = 1.0f;
  DLTensor st = dl_f32(&scale, 1, &one);
  octet_quantize_options o;
  octet_quantize_options_init(&o);
  o.scale = &st;
  o.columnwise = 1;
  octet_qtensor *qa = NULL, *qb = NULL;
  OK(octet_quantize(&at, &o, NULL, &qa));
  OK(octet_quantize(&bt, &o, NULL, &qb));
  OK(octet_gemm_fp8(qa, 0, qb, 0, &biast, &dt, 1.0f, 0.0f, 0, NULL));
  int bad = 0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = bias[j];
      for (int k = 0; k < K; ++k) acc += a[i * K + k] * b[j * K + k];
      bad += d[i * N + j] != acc;
    }
  CHECK(bad == 0, "%d of %d GEMM outputs differ", bad, M * N);
  /* The transposed copies: A^T [K, M] as the A operand needs B [N, M]: a shape error. */
  FAILS(octet_gemm_fp8(qa, 1, qb, 0, NULL, &dt, 1.0f, 0.0f, 0, NULL), OCTET_ERROR_RUNTIME, "K");
  int64_t s17[2] = {17, K};
  DLTensor odd = dl_f32(a, 2, s17);
  octet_qtensor* q17 = NULL;
  OK(octet_quantize(&odd, &o, NULL, &q17));
  int64_t sd17[2] = {17, N};
  DLTensor d17 = dl_f32(d, 2, sd17);
  FAILS(octet_gemm_fp8(q17, 0, qb, 0, NULL, &d17, 1.0f, 0.0f, 0, NULL), OCTET_ERROR_RUNTIME, "16");
  octet_qtensor_destroy(q17);
  octet_qtensor_destroy(qa);
  octet_qtensor_destroy(qb);
}

int main(void) {
  const char* env = getenv("OCTET_TEST_SEED");
  const uint64_t seed = env ? strtoull(env, NULL, 10) : 20261201u;
  rng_state = seed ? seed : 1;
  int major = 0, minor = 0;
  const char* version = NULL;
  octet_version(&major, &minor, &version);
  printf("octet C API %d.%d (library %s), seed %llu (OCTET_TEST_SEED)\n", major, minor, version,
         (unsigned long long)seed);
  CHECK(major == OCTET_C_API_VERSION_MAJOR && minor == OCTET_C_API_VERSION_MINOR, "version %d.%d",
        major, minor);
  test_recipes();
  test_quantize();
  test_gemm();
  test_linear();
  test_normed_linear();
  test_mlp();
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed == 0 ? 0 : 1;
}
