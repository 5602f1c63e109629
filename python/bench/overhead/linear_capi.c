/* Per-call host time of one Linear forward+backward through the C API (include/octet/octet.h),
 * the same work as linear_cpp.cc: autocast enter, forward, exit, backward, finalize_backward,
 * and releasing the outputs and the record.
 *   linear_capi DEVICE M K N CALLS  ->  one JSON line {"us": wall, "cpu_us": this thread's CPU}
 * (medians per call, in microseconds).
 * DEVICE is cpu or cuda:N; with CUDA, build with -DLINEAR_CAPI_CUDA and link cudart. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "octet/octet.h"
#ifdef LINEAR_CAPI_CUDA
#include <cuda_runtime_api.h>
#endif

#define OK(call)                                                         \
  do {                                                                   \
    if ((call) != OCTET_OK) {                                            \
      fprintf(stderr, "%s failed: %s\n", #call, octet_last_error());     \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

static double now(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void* device_buffer(DLDevice device, size_t bytes, float value) {
  float* host = malloc(bytes);
  for (size_t i = 0; i < bytes / sizeof(float); ++i) host[i] = value;
  if (device.device_type == kDLCPU) return host;
#ifdef LINEAR_CAPI_CUDA
  void* d = NULL;
  cudaSetDevice(device.device_id);
  cudaMalloc(&d, bytes);
  cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice);
  free(host);
  return d;
#else
  fprintf(stderr, "built without CUDA\n");
  exit(2);
#endif
}

static void synchronize(DLDevice device) {
#ifdef LINEAR_CAPI_CUDA
  if (device.device_type == kDLCUDA) cudaStreamSynchronize(NULL);
#else
  (void)device;
#endif
}

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s DEVICE M K N CALLS\n", argv[0]);
    return 2;
  }
  DLDevice device = {kDLCPU, 0};
  if (strncmp(argv[1], "cuda", 4) == 0) {
    device.device_type = kDLCUDA;
    device.device_id = argv[1][4] == ':' ? atoi(argv[1] + 5) : 0;
  }
  int64_t x_shape[2] = {atoll(argv[2]), atoll(argv[3])};
  int64_t dy_shape[2] = {atoll(argv[2]), atoll(argv[4])};
  const int calls = atoi(argv[5]);

  octet_linear* lin = NULL;
  octet_recipe* recipe = NULL;
  octet_registry* registry = NULL;
  OK(octet_linear_create(x_shape[1], dy_shape[1], 1, device, 1, OCTET_F32, &lin));
  OK(octet_recipe_delayed(0, 1024, OCTET_AMAX_MAX, OCTET_FORMAT_HYBRID, &recipe));
  OK(octet_registry_create(&registry));
  DLTensor x = {0}, dy = {0};
  x.data = device_buffer(device, (size_t)(x_shape[0] * x_shape[1]) * 4, 0.5f);
  dy.data = device_buffer(device, (size_t)(dy_shape[0] * dy_shape[1]) * 4, 0.25f);
  x.device = dy.device = device;
  x.ndim = dy.ndim = 2;
  x.dtype.code = dy.dtype.code = kDLFloat;
  x.dtype.bits = dy.dtype.bits = 32;
  x.dtype.lanes = dy.dtype.lanes = 1;
  x.shape = x_shape;
  dy.shape = dy_shape;

  double* wall = malloc(sizeof(double) * (size_t)calls);
  double* cpu = malloc(sizeof(double) * (size_t)calls);
  for (int i = -20; i < calls; ++i) {
    const double w = now(CLOCK_MONOTONIC), c = now(CLOCK_THREAD_CPUTIME_ID);
    DLManagedTensor xm;
    memset(&xm, 0, sizeof xm);
    xm.dl_tensor = x;  /* no deleter: x stays the caller's */
    DLManagedTensor *y = NULL, *dx = NULL;
    octet_saved* saved = NULL;
    OK(octet_autocast_enter(recipe, registry));
    OK(octet_linear_forward(lin, &xm, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved));
    OK(octet_autocast_exit());
    OK(octet_linear_backward(lin, &dy, saved, NULL, &dx));
    OK(octet_registry_finalize_backward(registry));
    y->deleter(y);
    dx->deleter(dx);
    octet_saved_destroy(saved);
    synchronize(device);
    if (i >= 0) {
      cpu[i] = now(CLOCK_THREAD_CPUTIME_ID) - c;
      wall[i] = now(CLOCK_MONOTONIC) - w;
    }
  }
  qsort(wall, (size_t)calls, sizeof(double), by_value);
  qsort(cpu, (size_t)calls, sizeof(double), by_value);
  printf("{\"us\": %.3f, \"cpu_us\": %.3f}\n", wall[calls / 2] * 1e6, cpu[calls / 2] * 1e6);
  free(wall);
  free(cpu);
  octet_registry_destroy(registry);
  octet_recipe_destroy(recipe);
  octet_linear_destroy(lin);
  return 0;
}
