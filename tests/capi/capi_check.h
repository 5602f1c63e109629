/* What the C API's tests share: the counters and check macros, a seeded generator, DLPack
 * helpers over caller memory (capi_check.c), and the test groups main() runs. */
#ifndef OCTET_TESTS_CAPI_CHECK_H
#define OCTET_TESTS_CAPI_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "octet/octet.h"

extern int passed, failed, skipped;

#define CHECK(cond, ...)                                                \
  do {                                                                  \
    if (cond) {                                                         \
      ++passed;                                                         \
    } else {                                                            \
      ++failed;                                                         \
      fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                     \
      fprintf(stderr, "\n");                                            \
    }                                                                   \
  } while (0)

/* A call that must succeed. */
#define OK(call) CHECK((call) == OCTET_OK, "%s", octet_last_error())

/* A call that must fail with `status` and a message containing `needle`. */
#define FAILS(call, status, needle)                                                         \
  do {                                                                                      \
    octet_status st_ = (call);                                                              \
    CHECK(st_ == (status) && strstr(octet_last_error(), (needle)) != NULL,                  \
          "status %d (expected %d), message \"%s\" (expected to contain \"%s\")", (int)st_, \
          (int)(status), octet_last_error(), (needle));                                     \
  } while (0)

/* xorshift64*, seeded by main(). */
extern uint64_t rng_state;
float uniform(float lo, float hi);
void fill(float* x, int64_t n, float lo, float hi);

/* A DLTensor over caller memory (row-major, compact). */
DLTensor dl(void* data, int ndim, int64_t* shape, uint8_t code, uint8_t bits);
DLTensor dl_f32(float* data, int ndim, int64_t* shape);

/* A DLManagedTensor whose deleter counts its calls in deleter_calls (octet_linear_forward
 * consumes its input). */
extern int deleter_calls;
DLManagedTensor managed(DLTensor t);

int64_t numel(const DLTensor* t);
void release(DLManagedTensor* t);
/* Bytes of two managed tensors are equal. */
int same_bytes(const DLManagedTensor* a, const DLManagedTensor* b);

/* The test groups: recipes, quantization and the GEMM (capi_test.c); the modules
 * (capi_modules_test.c). */
void test_recipes(void);
void test_quantize(void);
void test_gemm(void);
void test_linear(void);
void test_normed_linear(void);
void test_mlp(void);

#endif
