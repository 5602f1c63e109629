/* The C API tests' shared helpers (capi_check.h). */
#include "capi_check.h"

int passed = 0, failed = 0, skipped = 0;

uint64_t rng_state;
float uniform(float lo, float hi) { /* xorshift64*, top 24 bits */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  uint64_t r = rng_state * 2685821657736338717ULL;
  return lo + (hi - lo) * (float)(r >> 40) / 16777216.0f;
}
void fill(float* x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) x[i] = uniform(lo, hi);
}

DLTensor dl(void* data, int ndim, int64_t* shape, uint8_t code, uint8_t bits) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}
DLTensor dl_f32(float* data, int ndim, int64_t* shape) {
  return dl(data, ndim, shape, kDLFloat, 32);
}

int deleter_calls = 0;
static void count_deleter(DLManagedTensor* self) {
  (void)self;
  ++deleter_calls;
}
DLManagedTensor managed(DLTensor t) {
  DLManagedTensor m;
  memset(&m, 0, sizeof m);
  m.dl_tensor = t;
  m.deleter = count_deleter;
  return m;
}

int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}
void release(DLManagedTensor* t) {
  if (t && t->deleter) t->deleter(t);
}

int same_bytes(const DLManagedTensor* a, const DLManagedTensor* b) {
  const int64_t n = numel(&a->dl_tensor) * a->dl_tensor.dtype.bits / 8;
  return numel(&a->dl_tensor) == numel(&b->dl_tensor) &&
         memcmp(a->dl_tensor.data, b->dl_tensor.data, (size_t)n) == 0;
}

