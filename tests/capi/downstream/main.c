/* Links the installed liboctet_c: y = x W^T + b of a CPU Linear against a naive loop. */
#include <math.h>
#include <octet/octet.h>
#include <stdio.h>

int main(void) {
  enum { ROWS = 4, IN = 8, OUT = 3 };
  float x[ROWS * IN];
  for (int i = 0; i < ROWS * IN; ++i) x[i] = (float)(i % 7) - 3.0f;
  DLDevice cpu = {kDLCPU, 0};
  octet_linear* lin = NULL;
  if (octet_linear_create(IN, OUT, 1, cpu, 42, OCTET_F32, &lin) != OCTET_OK) {
    fprintf(stderr, "downstream: %s\n", octet_last_error());
    return 1;
  }
  int64_t shape[2] = {ROWS, IN};
  DLManagedTensor in = {{x, cpu, 2, {kDLFloat, 32, 1}, shape, NULL, 0}, NULL, NULL};
  DLManagedTensor *y = NULL, *w = NULL, *b = NULL;
  octet_saved* saved = NULL;
  if (octet_linear_forward(lin, &in, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved) != OCTET_OK ||
      octet_linear_tensor_view(lin, OCTET_LINEAR_WEIGHT, NULL, &w) != OCTET_OK ||
      octet_linear_tensor_view(lin, OCTET_LINEAR_BIAS, NULL, &b) != OCTET_OK) {
    fprintf(stderr, "downstream: %s\n", octet_last_error());
    return 1;
  }
  const float *yv = y->dl_tensor.data, *wv = w->dl_tensor.data, *bv = b->dl_tensor.data;
  int bad = 0;
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < OUT; ++o) {
      float ref = bv[o];
      for (int i = 0; i < IN; ++i) ref += x[r * IN + i] * wv[o * IN + i];
      bad += fabsf(yv[r * OUT + o] - ref) > 1e-5f * (1.0f + fabsf(ref));
    }
  y->deleter(y);
  w->deleter(w);
  b->deleter(b);
  octet_saved_destroy(saved);
  octet_linear_destroy(lin);
  printf("downstream: %s (%d of %d outputs off)\n", bad ? "FAILED" : "ok", bad, ROWS * OUT);
  return bad != 0;
}
