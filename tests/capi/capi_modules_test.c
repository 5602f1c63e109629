/* The C API's modules from C11: Linear forward/backward against naive loops, recompute bitwise,
 * FP8 state checkpoints, the normed Linear and the MLP against the same math in double, and every
 * error path (a status plus octet's message). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi_check.h"

/* Forward/backward of a Linear against naive loops: y = x W^T + b, dx = dy W, dW = dy^T x,
 * db = sum_rows dy. `rel` scales the tolerance by sum_k |a_k b_k| (the size of the terms). */
typedef struct {
  float *x, *w, *b, *dy;
  int64_t rows, in, out;
} Problem;

static int compare_matmul(const float* got, const float* a, const float* b, const float* add,
                          int64_t m, int64_t n, int64_t k, int64_t as_m, int64_t as_k, int64_t bs_n,
                          int64_t bs_k, float rel) {
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = add ? add[j] : 0.0, mag = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double t = (double)a[i * as_m + p * as_k] * b[j * bs_n + p * bs_k];
        acc += t;
        mag += fabs(t);
      }
      if (fabs(got[i * n + j] - acc) > rel * mag + 1e-6) {
        if (bad < 3)
          fprintf(stderr, "  [%lld, %lld]: %g vs %g\n", (long long)i, (long long)j, got[i * n + j],
                  acc);
        ++bad;
      }
    }
  return bad;
}

static void check_linear_against_naive(octet_linear* lin, const Problem* p, float rel_fwd,
                                       float rel_bwd, octet_registry* reg,
                                       const octet_recipe* recipe) {
  int64_t xs[3] = {2, p->rows / 2, p->in}, ys[3] = {2, p->rows / 2, p->out};
  DLManagedTensor xm = managed(dl_f32(p->x, 3, xs));
  DLManagedTensor *y = NULL, *dx = NULL, *w = NULL, *gw = NULL, *gb = NULL;
  octet_saved* saved = NULL;
  OK(octet_linear_zero_grad(lin, 0, NULL));
  if (recipe) OK(octet_autocast_enter(recipe, reg));
  const int calls = deleter_calls;
  OK(octet_linear_forward(lin, &xm, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved));
  if (recipe) OK(octet_autocast_exit());
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_WEIGHT, NULL, &w));
  if (!y || !w) return;
  CHECK(y->dl_tensor.ndim == 3 && y->dl_tensor.shape[2] == p->out &&
            y->dl_tensor.shape[1] == p->rows / 2,
        "y has %d dims", y->dl_tensor.ndim);
  const float* wv = (const float*)w->dl_tensor.data;
  int bad = compare_matmul((float*)y->dl_tensor.data, p->x, wv, p->b, p->rows, p->out, p->in, p->in,
                           1, p->in, 1, rel_fwd);
  CHECK(bad == 0, "%d forward outputs outside %g x sum|x w|", bad, rel_fwd);

  DLTensor dyt = dl_f32(p->dy, 3, ys);
  OK(octet_linear_backward(lin, &dyt, saved, NULL, &dx));
  if (reg && recipe) OK(octet_registry_finalize_backward(reg));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_WEIGHT, NULL, &gw));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_BIAS, NULL, &gb));
  if (!dx || !gw || !gb) return;
  /* dx [rows, in] = dy [rows, out] W [out, in]. */
  bad = compare_matmul((float*)dx->dl_tensor.data, p->dy, wv, NULL, p->rows, p->in, p->out, p->out,
                       1, 1, p->in, rel_bwd);
  CHECK(bad == 0, "%d dx values outside %g x sum|dy w|", bad, rel_bwd);
  /* dW [out, in] = dy^T [out, rows] x [rows, in]. */
  bad = compare_matmul((float*)gw->dl_tensor.data, p->dy, p->x, NULL, p->out, p->in, p->rows, 1,
                       p->out, 1, p->in, rel_bwd);
  CHECK(bad == 0, "%d weight-gradient values outside %g x sum|dy x|", bad, rel_bwd);
  int bias_bad = 0;
  for (int64_t j = 0; j < p->out; ++j) {
    double acc = 0, mag = 0;
    for (int64_t r = 0; r < p->rows; ++r)
      acc += p->dy[r * p->out + j], mag += fabs(p->dy[r * p->out + j]);
    bias_bad += fabs(((float*)gb->dl_tensor.data)[j] - acc) > 1e-5 * mag + 1e-6;
  }
  CHECK(bias_bad == 0, "%d bias-gradient values differ from the row sums", bias_bad);
  release(y);
  release(dx);
  release(w);
  release(gw);
  release(gb);
  octet_saved_destroy(saved);
  CHECK(deleter_calls == calls + 1, "the input's deleter ran %d times", deleter_calls - calls);
}

void test_linear(void) {
  enum { ROWS = 48, IN = 64, OUT = 32 };
  static float x[ROWS * IN], dy[ROWS * OUT];
  fill(x, ROWS * IN, -1.0f, 1.0f);
  fill(dy, ROWS * OUT, -0.01f, 0.01f);
  DLDevice cpu = {kDLCPU, 0};
  octet_linear* lin = NULL;
  OK(octet_linear_create(IN, OUT, 1, cpu, 1234, OCTET_F32, &lin));
  if (!lin) return;
  DLManagedTensor* bias = NULL;
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_BIAS, NULL, &bias));
  if (!bias) return;
  Problem p = {x, NULL, (float*)bias->dl_tensor.data, dy, ROWS, IN, OUT};
  /* f32 outside autocast: only the summation order differs from the naive loops. */
  check_linear_against_naive(lin, &p, 1e-5f, 1e-5f, NULL, NULL);

  /* FP8 under each recipe. E4M3 keeps 2^-4 relative per operand, E5M2 (gradients) 2^-3: a product
   * of two rounded operands is within (1 + 2^-4)(1 + 2^-3) - 1 < 0.2 of its magnitude. */
  octet_recipe* recipes[4] = {NULL, NULL, NULL, NULL};
  OK(octet_recipe_delayed(0, 4, OCTET_AMAX_MAX, OCTET_FORMAT_HYBRID, &recipes[0]));
  OK(octet_recipe_current(0, OCTET_FORMAT_HYBRID, &recipes[1]));
  OK(octet_recipe_block(&recipes[2]));
  OK(octet_recipe_mxfp8(&recipes[3]));
  octet_registry* reg = NULL;
  OK(octet_registry_create(&reg));
  for (int i = 0; i < 4; ++i) check_linear_against_naive(lin, &p, 0.13f, 0.2f, reg, recipes[i]);
  int64_t fwd = 0, bwd = 0;
  OK(octet_registry_update_counts(reg, &fwd, &bwd));
  CHECK(fwd == 4 && bwd == 4, "registry updates: %lld forward, %lld backward", (long long)fwd,
        (long long)bwd);

  /* Recompute: a record whose activations were released, rebuilt, gives bitwise the same dx and
   * gradients, and updates no FP8 state (DESIGN.md rule 1). */
  int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
  DLTensor dyt = dl_f32(dy, 2, ys);
  DLManagedTensor xm = managed(dl_f32(x, 2, xs)), xm2 = managed(dl_f32(x, 2, xs));
  DLManagedTensor *y = NULL, *y2 = NULL, *dx = NULL, *dx2 = NULL, *gw = NULL, *gw2 = NULL;
  octet_saved *saved = NULL, *again = NULL;
  OK(octet_autocast_enter(recipes[0], reg));
  OK(octet_linear_forward(lin, &xm, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved));
  OK(octet_autocast_exit());
  OK(octet_linear_zero_grad(lin, 1, NULL));
  OK(octet_linear_backward(lin, &dyt, saved, NULL, &dx));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_WEIGHT, NULL, &gw));
  DLManagedTensor* gw_copy = NULL;
  OK(octet_linear_fp8_update_counts(lin, &fwd, &bwd));
  OK(octet_saved_release_activations(saved));
  FAILS(octet_linear_backward(lin, &dyt, saved, NULL, &dx2), OCTET_ERROR_INVALID_ARGUMENT,
        "released");
  OK(octet_linear_forward(lin, &xm2, OCTET_FORWARD_RECOMPUTE, saved, NULL, &y2, &again));
  static float gw_before[OUT * IN];
  if (gw) memcpy(gw_before, gw->dl_tensor.data, sizeof gw_before);
  OK(octet_linear_zero_grad(lin, 1, NULL));
  OK(octet_linear_backward(lin, &dyt, again, NULL, &dx2));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_WEIGHT, NULL, &gw2));
  int64_t fwd2 = 0, bwd2 = 0;
  OK(octet_linear_fp8_update_counts(lin, &fwd2, &bwd2));
  if (y && y2 && dx && dx2 && gw2) {
    CHECK(same_bytes(y, y2), "the recomputed forward differs");
    CHECK(same_bytes(dx, dx2), "dx after recompute differs");
    CHECK(memcmp(gw_before, gw2->dl_tensor.data, sizeof gw_before) == 0,
          "dW after recompute differs");
    CHECK(fwd2 == fwd && bwd2 == bwd, "recompute updated the FP8 state");
  }
  (void)gw_copy;
  release(y), release(y2), release(dx), release(dx2), release(gw), release(gw2);
  octet_saved_destroy(again);

  /* Checkpoint: the FP8 state of one layer, set into a fresh one, reads back the same. */
  octet_linear* fresh = NULL;
  int count = 0;
  OK(octet_linear_create(IN, OUT, 1, cpu, 1234, OCTET_F32, &fresh));
  OK(octet_linear_fp8_state_count(lin, recipes[0], &count));
  CHECK(count == 6, "%d state tensors", count);
  for (int i = 0; fresh && i < count; ++i) {
    DLManagedTensor *v = NULL, *back = NULL;
    const char* name = NULL;
    OK(octet_linear_fp8_state_name(i, &name));
    OK(octet_linear_fp8_state_get(lin, recipes[0], i, NULL, &v));
    if (!v) continue;
    OK(octet_linear_fp8_state_set(fresh, recipes[0], i, &v->dl_tensor, NULL));
    OK(octet_linear_fp8_state_get(fresh, recipes[0], i, NULL, &back));
    CHECK(back && same_bytes(v, back), "state %s does not round-trip", name);
    if (i == 0) CHECK(((float*)v->dl_tensor.data)[0] != 1.0f, "the input scale was never updated");
    release(v), release(back);
  }
  FAILS(octet_linear_fp8_state_get(lin, recipes[0], 6, NULL, &y), OCTET_ERROR_INVALID_ARGUMENT,
        "out of range");
  float wrong[3] = {1, 2, 3};
  int64_t three = 3;
  DLTensor wt = dl_f32(wrong, 1, &three);
  FAILS(octet_linear_fp8_state_set(fresh, recipes[0], 0, &wt, NULL), OCTET_ERROR_INVALID_ARGUMENT,
        "f32[2]");

  /* Bad input to a Linear. */
  DLManagedTensor* out = NULL;
  octet_saved* s = NULL;
  const int calls = deleter_calls;
  DLManagedTensor bad_in = managed(dl_f32(x, 2, (int64_t[]){ROWS * 2, IN / 2}));
  FAILS(octet_linear_forward(lin, &bad_in, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s),
        OCTET_ERROR_RUNTIME, "64");
  static int32_t ints[ROWS * IN];
  DLManagedTensor int_in = managed(dl(ints, 2, xs, kDLInt, 32));
  FAILS(octet_linear_forward(lin, &int_in, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s),
        OCTET_ERROR_RUNTIME, "i32");
  DLManagedTensor strided = managed(dl_f32(x, 2, xs));
  strided.dl_tensor.strides = (int64_t[]){1, ROWS};
  FAILS(octet_linear_forward(lin, &strided, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s),
        OCTET_ERROR_INVALID_ARGUMENT, "contiguous");
  DLManagedTensor orphan = managed(dl_f32(x, 2, xs));
  FAILS(octet_linear_forward(NULL, &orphan, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s),
        OCTET_ERROR_INVALID_ARGUMENT, "linear must not be NULL");
  DLManagedTensor nosnap = managed(dl_f32(x, 2, xs));
  FAILS(octet_linear_forward(lin, &nosnap, OCTET_FORWARD_RECOMPUTE, NULL, NULL, &out, &s),
        OCTET_ERROR_INVALID_ARGUMENT, "original");
  CHECK(deleter_calls == calls + 5, "consumed inputs released %d times, expected 5",
        deleter_calls - calls);
  FAILS(octet_linear_backward(lin, &dyt, NULL, NULL, &out), OCTET_ERROR_INVALID_ARGUMENT,
        "record of a forward");
  DLManagedTensor inf_in = managed(dl_f32(x, 2, xs));
  OK(octet_linear_forward(lin, &inf_in, OCTET_FORWARD_INFERENCE, NULL, NULL, &out, &s));
  release(out);
  FAILS(octet_linear_backward(lin, &dyt, s, NULL, &out), OCTET_ERROR_INVALID_ARGUMENT, "inference");
  FAILS(octet_linear_backward(fresh, &dyt, s, NULL, &out), OCTET_ERROR_INVALID_ARGUMENT,
        "another Linear");
  octet_saved_destroy(s);
  DLManagedTensor ok_in = managed(dl_f32(x, 2, xs));
  OK(octet_linear_forward(lin, &ok_in, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s));
  release(out);
  DLTensor dy_wrong = dl_f32(dy, 2, (int64_t[]){ROWS / 2, OUT * 2});
  FAILS(octet_linear_backward(lin, &dy_wrong, s, NULL, &out), OCTET_ERROR_RUNTIME, "grad_output");
  octet_saved_destroy(s);
  octet_linear* nobias = NULL;
  OK(octet_linear_create(IN, OUT, 0, cpu, 1, OCTET_BF16, &nobias));
  FAILS(octet_linear_tensor_view(nobias, OCTET_LINEAR_BIAS, NULL, &out),
        OCTET_ERROR_INVALID_ARGUMENT, "no bias");
  FAILS(octet_linear_create(IN, OUT, 1, cpu, 1, OCTET_E4M3, &lin), OCTET_ERROR_INVALID_ARGUMENT,
        "compute_dtype");
  FAILS(octet_linear_create(0, OUT, 1, cpu, 1, OCTET_F32, &lin), OCTET_ERROR_INVALID_ARGUMENT,
        "positive");
  FAILS(octet_autocast_exit(), OCTET_ERROR_INVALID_ARGUMENT, "without an open scope");
  OK(octet_autocast_enter(recipes[0], reg));
  FAILS(octet_registry_destroy(reg), OCTET_ERROR_INVALID_ARGUMENT, "open autocast");
  CHECK(octet_autocast_depth() == 1, "depth %d", octet_autocast_depth());
  OK(octet_autocast_exit());

  /* A GPU module rejects CPU input (the CUDA cases need a GPU). */
  int with_cuda = 0, gpus = 0;
  OK(octet_cuda_info(&with_cuda, &gpus));
  DLDevice gpu = {kDLCUDA, 0};
  octet_linear* glin = NULL;
  if (gpus > 0) {
    OK(octet_linear_create(IN, OUT, 1, gpu, 1, OCTET_F32, &glin));
    DLManagedTensor cpu_in = managed(dl_f32(x, 2, xs));
    FAILS(octet_linear_forward(glin, &cpu_in, OCTET_FORWARD_TRAINING, NULL, NULL, &out, &s),
          OCTET_ERROR_RUNTIME, "cpu");
    gpu.device_id = gpus;
    FAILS(octet_linear_create(IN, OUT, 1, gpu, 1, OCTET_F32, &glin), OCTET_ERROR_RUNTIME, "cuda:");
    octet_linear_destroy(glin);
  } else {
    FAILS(octet_linear_create(IN, OUT, 1, gpu, 1, OCTET_F32, &glin), OCTET_ERROR_RUNTIME, "cuda:0");
    printf("skipped: the CUDA cases (no GPU)\n");
    ++skipped;
  }

  octet_linear_destroy(nobias);
  octet_linear_destroy(fresh);
  octet_linear_destroy(lin);
  OK(octet_registry_destroy(reg));
  for (int i = 0; i < 4; ++i) octet_recipe_destroy(recipes[i]);
  release(bias);
}

/* A Linear with a LayerNorm in front: y = norm(x) W^T + b and every gradient (x, W's through
 * the plain Linear's path, gamma, beta) against the norm computed here in double. */
void test_normed_linear(void) {
  enum { ROWS = 32, IN = 64, OUT = 16 };
  static float x[ROWS * IN], dy[ROWS * OUT], h[ROWS * IN];
  static double xhat[ROWS * IN], rstd[ROWS], dh[ROWS * IN];
  fill(x, ROWS * IN, -2.0f, 2.0f);
  fill(dy, ROWS * OUT, -1.0f, 1.0f);
  const float eps = 1e-5f;
  DLDevice cpu = {kDLCPU, 0};
  octet_linear* lin = NULL;
  OK(octet_linear_create_normed(IN, OUT, 1, OCTET_NORM_LAYERNORM, eps, cpu, 7, OCTET_F32, &lin));
  if (!lin) return;
  octet_norm kind = OCTET_NORM_NONE;
  float got_eps = 0.0f;
  OK(octet_linear_norm_info(lin, &kind, &got_eps));
  CHECK(kind == OCTET_NORM_LAYERNORM && got_eps == eps, "norm %d, eps %g", (int)kind, got_eps);
  DLManagedTensor *gamma = NULL, *beta = NULL, *w = NULL, *b = NULL;
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_NORM_WEIGHT, NULL, &gamma));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_NORM_BIAS, NULL, &beta));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_WEIGHT, NULL, &w));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_BIAS, NULL, &b));
  if (!gamma || !beta || !w || !b) return;
  float *g = (float*)gamma->dl_tensor.data, *be = (float*)beta->dl_tensor.data;
  const float* wv = (const float*)w->dl_tensor.data;
  fill(g, IN, 0.5f, 1.5f); /* written through the views: the next forward reads them */
  fill(be, IN, -0.5f, 0.5f);
  for (int r = 0; r < ROWS; ++r) {
    double mean = 0.0, var = 0.0;
    for (int k = 0; k < IN; ++k) mean += x[r * IN + k];
    mean /= IN;
    for (int k = 0; k < IN; ++k) var += (x[r * IN + k] - mean) * (x[r * IN + k] - mean);
    rstd[r] = 1.0 / sqrt(var / IN + eps);
    for (int k = 0; k < IN; ++k) {
      xhat[r * IN + k] = (x[r * IN + k] - mean) * rstd[r];
      h[r * IN + k] = (float)(xhat[r * IN + k] * g[k] + be[k]);
    }
  }
  int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
  DLManagedTensor xm = managed(dl_f32(x, 2, xs));
  DLManagedTensor *y = NULL, *dx = NULL, *gg = NULL, *gbe = NULL;
  octet_saved* saved = NULL;
  OK(octet_linear_zero_grad(lin, 0, NULL));
  OK(octet_linear_forward(lin, &xm, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved));
  if (!y) return;
  int bad = compare_matmul((float*)y->dl_tensor.data, h, wv, (const float*)b->dl_tensor.data, ROWS,
                           OUT, IN, IN, 1, IN, 1, 1e-5f);
  CHECK(bad == 0, "%d outputs of the normed Linear outside 1e-5 x sum|h w|", bad);
  DLTensor dyt = dl_f32(dy, 2, ys);
  OK(octet_linear_backward(lin, &dyt, saved, NULL, &dx));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_NORM_WEIGHT, NULL, &gg));
  OK(octet_linear_tensor_view(lin, OCTET_LINEAR_GRAD_NORM_BIAS, NULL, &gbe));
  if (!dx || !gg || !gbe) return;
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < IN; ++k) {
      double acc = 0.0;
      for (int j = 0; j < OUT; ++j) acc += (double)dy[r * OUT + j] * wv[j * IN + k];
      dh[r * IN + k] = acc;
    }
  int dx_bad = 0, norm_bad = 0;
  for (int r = 0; r < ROWS; ++r) {
    double mean_d = 0.0, mean_dx = 0.0, scale = 0.0;
    for (int k = 0; k < IN; ++k) {
      const double d = dh[r * IN + k] * g[k];
      mean_d += d / IN;
      mean_dx += d * xhat[r * IN + k] / IN;
      scale += fabs(d);
    }
    for (int k = 0; k < IN; ++k) {
      const double ref = rstd[r] * (dh[r * IN + k] * g[k] - mean_d - xhat[r * IN + k] * mean_dx);
      dx_bad += fabs(((float*)dx->dl_tensor.data)[r * IN + k] - ref) > 1e-5 * rstd[r] * scale;
    }
  }
  for (int k = 0; k < IN; ++k) {
    double dgamma = 0.0, dbeta = 0.0, mag = 0.0;
    for (int r = 0; r < ROWS; ++r) {
      dgamma += dh[r * IN + k] * xhat[r * IN + k];
      dbeta += dh[r * IN + k];
      mag += fabs(dh[r * IN + k]) * (1.0 + fabs(xhat[r * IN + k]));
    }
    norm_bad += fabs(((float*)gg->dl_tensor.data)[k] - dgamma) > 1e-5 * mag;
    norm_bad += fabs(((float*)gbe->dl_tensor.data)[k] - dbeta) > 1e-5 * mag;
  }
  CHECK(dx_bad == 0, "%d dx values of the normed Linear off the norm's gradient", dx_bad);
  CHECK(norm_bad == 0, "%d gamma/beta gradient values off", norm_bad);

  octet_linear *plain = NULL, *rms = NULL, *bad_lin = NULL;
  DLManagedTensor* out = NULL;
  FAILS(octet_linear_create_normed(IN, OUT, 1, (octet_norm)7, eps, cpu, 1, OCTET_F32, &bad_lin),
        OCTET_ERROR_INVALID_ARGUMENT, "norm");
  FAILS(
      octet_linear_create_normed(IN, OUT, 1, OCTET_NORM_RMSNORM, 0.0f, cpu, 1, OCTET_F32, &bad_lin),
      OCTET_ERROR_INVALID_ARGUMENT, "epsilon must be positive");
  OK(octet_linear_create_normed(IN, OUT, 1, OCTET_NORM_RMSNORM, eps, cpu, 1, OCTET_F32, &rms));
  FAILS(octet_linear_tensor_view(rms, OCTET_LINEAR_NORM_BIAS, NULL, &out),
        OCTET_ERROR_INVALID_ARGUMENT, "RMSNorm has no beta");
  OK(octet_linear_create(IN, OUT, 1, cpu, 1, OCTET_F32, &plain));
  FAILS(octet_linear_tensor_view(plain, OCTET_LINEAR_NORM_WEIGHT, NULL, &out),
        OCTET_ERROR_INVALID_ARGUMENT, "no norm");
  OK(octet_linear_norm_info(plain, &kind, &got_eps));
  CHECK(kind == OCTET_NORM_NONE && got_eps == 0.0f, "a plain Linear reports norm %d", (int)kind);
  release(y);
  release(dx);
  release(gg);
  release(gbe);
  release(gamma);
  release(beta);
  release(w);
  release(b);
  octet_saved_destroy(saved);
  octet_linear_destroy(plain);
  octet_linear_destroy(rms);
  octet_linear_destroy(lin);
}

/* An MLP with RMSNorm and SwiGLU against the same math in double, forward and backward; its
 * layers' handles; recompute; the refusals. */
static double silu(double v) { return v / (1.0 + exp(-v)); }
void test_mlp(void) {
  enum { ROWS = 16, H = 32, F = 24 };
  static float x[ROWS * H], dy[ROWS * H];
  static double hn[ROWS * H], xhat[ROWS * H], rstd[ROWS], a[ROWS * 2 * F], act[ROWS * F];
  static double da[ROWS * 2 * F], dh[ROWS * H];
  fill(x, ROWS * H, -2.0f, 2.0f);
  fill(dy, ROWS * H, -1.0f, 1.0f);
  const float eps = 1e-6f;
  DLDevice cpu = {kDLCPU, 0};
  octet_mlp* mlp = NULL;
  OK(octet_mlp_create(H, F, 1, OCTET_ACTIVATION_SWIGLU, OCTET_NORM_RMSNORM, eps, cpu, 11, OCTET_F32,
                      &mlp));
  if (!mlp) return;
  int64_t hidden = 0, ffn = 0;
  octet_activation kind = OCTET_ACTIVATION_GELU;
  OK(octet_mlp_info(mlp, &hidden, &ffn, &kind));
  CHECK(hidden == H && ffn == F && kind == OCTET_ACTIVATION_SWIGLU, "info %lld %lld %d",
        (long long)hidden, (long long)ffn, (int)kind);
  octet_linear *fc1 = NULL, *fc2 = NULL, *none = NULL;
  OK(octet_mlp_linear(mlp, 0, &fc1));
  OK(octet_mlp_linear(mlp, 1, &fc2));
  FAILS(octet_mlp_linear(mlp, 2, &none), OCTET_ERROR_INVALID_ARGUMENT, "index");
  if (!fc1 || !fc2) return;
  int64_t in1 = 0, out1 = 0, in2 = 0, out2 = 0;
  OK(octet_linear_info(fc1, &in1, &out1, NULL, NULL));
  OK(octet_linear_info(fc2, &in2, &out2, NULL, NULL));
  CHECK(in1 == H && out1 == 2 * F && in2 == F && out2 == H, "fc1 %lldx%lld, fc2 %lldx%lld",
        (long long)in1, (long long)out1, (long long)in2, (long long)out2);
  octet_norm norm = OCTET_NORM_NONE;
  OK(octet_linear_norm_info(fc1, &norm, NULL));
  CHECK(norm == OCTET_NORM_RMSNORM, "fc1 carries the norm, got %d", (int)norm);
  octet_linear_destroy(fc1); /* ignored: the layer belongs to the MLP */
  DLManagedTensor *gamma = NULL, *w1 = NULL, *b1 = NULL, *w2 = NULL, *b2 = NULL;
  OK(octet_linear_tensor_view(fc1, OCTET_LINEAR_NORM_WEIGHT, NULL, &gamma));
  OK(octet_linear_tensor_view(fc1, OCTET_LINEAR_WEIGHT, NULL, &w1));
  OK(octet_linear_tensor_view(fc1, OCTET_LINEAR_BIAS, NULL, &b1));
  OK(octet_linear_tensor_view(fc2, OCTET_LINEAR_WEIGHT, NULL, &w2));
  OK(octet_linear_tensor_view(fc2, OCTET_LINEAR_BIAS, NULL, &b2));
  if (!gamma || !w1 || !b1 || !w2 || !b2) return;
  float* g = (float*)gamma->dl_tensor.data;
  const float *W1 = (const float*)w1->dl_tensor.data, *B1 = (const float*)b1->dl_tensor.data;
  const float *W2 = (const float*)w2->dl_tensor.data, *B2 = (const float*)b2->dl_tensor.data;
  fill(g, H, 0.5f, 1.5f);
  /* The forward in double: RMSNorm, fc1, silu(gate) * up, fc2. */
  for (int r = 0; r < ROWS; ++r) {
    double ms = 0.0;
    for (int k = 0; k < H; ++k) ms += (double)x[r * H + k] * x[r * H + k] / H;
    rstd[r] = 1.0 / sqrt(ms + eps);
    for (int k = 0; k < H; ++k) {
      xhat[r * H + k] = x[r * H + k] * rstd[r];
      hn[r * H + k] = xhat[r * H + k] * g[k];
    }
    for (int j = 0; j < 2 * F; ++j) {
      double acc = B1[j];
      for (int k = 0; k < H; ++k) acc += hn[r * H + k] * W1[j * H + k];
      a[r * 2 * F + j] = acc;
    }
    for (int j = 0; j < F; ++j) act[r * F + j] = silu(a[r * 2 * F + j]) * a[r * 2 * F + F + j];
  }
  int64_t xs[2] = {ROWS, H};
  DLManagedTensor xm = managed(dl_f32(x, 2, xs));
  DLManagedTensor *y = NULL, *y2 = NULL, *dx = NULL, *dx2 = NULL, *gg = NULL;
  octet_saved *saved = NULL, *again = NULL;
  OK(octet_linear_zero_grad(fc1, 0, NULL));
  OK(octet_linear_zero_grad(fc2, 0, NULL));
  const int before = deleter_calls;
  OK(octet_mlp_forward(mlp, &xm, OCTET_FORWARD_TRAINING, NULL, NULL, &y, &saved));
  if (!y) return;
  const float* yv = (const float*)y->dl_tensor.data;
  int bad = 0;
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < H; ++k) {
      double ref = B2[k], mag = fabs(B2[k]);
      for (int j = 0; j < F; ++j) {
        ref += act[r * F + j] * W2[k * F + j];
        mag += fabs(act[r * F + j] * W2[k * F + j]);
      }
      bad += fabs(yv[r * H + k] - ref) > 1e-5 * (mag + 1.0);
    }
  CHECK(bad == 0, "%d MLP outputs off the double reference by more than 1e-5 x (sum|terms| + 1)",
        bad);
  /* A recompute from the record: bitwise the same output. */
  DLManagedTensor xm2 = managed(dl_f32(x, 2, xs));
  OK(octet_mlp_forward(mlp, &xm2, OCTET_FORWARD_RECOMPUTE, saved, NULL, &y2, &again));
  CHECK(y2 && same_bytes(y, y2), "the recomputed MLP output differs from the original");
  DLTensor dyt = dl_f32(dy, 2, xs);
  OK(octet_mlp_backward(mlp, &dyt, again, NULL, &dx));
  FAILS(octet_mlp_backward(mlp, &dyt, again, NULL, &dx2), OCTET_ERROR_INVALID_ARGUMENT,
        "recompute it");
  OK(octet_linear_tensor_view(fc1, OCTET_LINEAR_GRAD_NORM_WEIGHT, NULL, &gg));
  if (!dx || !gg) return;
  /* The backward in double: dact = dy W2, SwiGLU's gradient, dh = da W1, RMSNorm's gradient. */
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < F; ++j) {
      double dact = 0.0;
      for (int k = 0; k < H; ++k) dact += (double)dy[r * H + k] * W2[k * F + j];
      const double gate = a[r * 2 * F + j], up = a[r * 2 * F + F + j];
      const double sig = 1.0 / (1.0 + exp(-gate));
      da[r * 2 * F + j] = dact * up * sig * (1.0 + gate * (1.0 - sig));
      da[r * 2 * F + F + j] = dact * silu(gate);
    }
    for (int k = 0; k < H; ++k) {
      double acc = 0.0;
      for (int j = 0; j < 2 * F; ++j) acc += da[r * 2 * F + j] * W1[j * H + k];
      dh[r * H + k] = acc;
    }
  }
  int dx_bad = 0, dg_bad = 0;
  const float* dxv = (const float*)dx->dl_tensor.data;
  for (int r = 0; r < ROWS; ++r) {
    double mean_dx = 0.0, scale = 0.0;
    for (int k = 0; k < H; ++k) {
      mean_dx += dh[r * H + k] * g[k] * xhat[r * H + k] / H;
      scale += fabs(dh[r * H + k] * g[k]);
    }
    for (int k = 0; k < H; ++k) {
      const double ref = rstd[r] * (dh[r * H + k] * g[k] - xhat[r * H + k] * mean_dx);
      dx_bad += fabs(dxv[r * H + k] - ref) > 1e-4 * rstd[r] * (scale + 1.0);
    }
  }
  for (int k = 0; k < H; ++k) {
    double dgamma = 0.0, mag = 0.0;
    for (int r = 0; r < ROWS; ++r) {
      dgamma += dh[r * H + k] * xhat[r * H + k];
      mag += fabs(dh[r * H + k] * xhat[r * H + k]);
    }
    dg_bad += fabs(((float*)gg->dl_tensor.data)[k] - dgamma) > 1e-4 * (mag + 1.0);
  }
  CHECK(dx_bad == 0, "%d MLP dx values off the double reference", dx_bad);
  CHECK(dg_bad == 0, "%d RMSNorm gamma gradients of the MLP off the double reference", dg_bad);

  /* Refusals: another module's record, a wrong width, a bad activation; a refused input is still
   * consumed. */
  octet_linear* lin = NULL;
  octet_saved* lin_saved = NULL;
  DLManagedTensor *ly = NULL, *bad_y = NULL;
  OK(octet_linear_create(H, H, 0, cpu, 3, OCTET_F32, &lin));
  DLManagedTensor xl = managed(dl_f32(x, 2, xs));
  OK(octet_linear_forward(lin, &xl, OCTET_FORWARD_TRAINING, NULL, NULL, &ly, &lin_saved));
  FAILS(octet_mlp_backward(mlp, &dyt, lin_saved, NULL, &dx2), OCTET_ERROR_INVALID_ARGUMENT,
        "another MLP");
  int64_t narrow[2] = {ROWS * 2, H / 2};
  DLManagedTensor xn = managed(dl_f32(x, 2, narrow));
  octet_saved* bad_saved = NULL;
  const int before_bad = deleter_calls;
  FAILS(octet_mlp_forward(mlp, &xn, OCTET_FORWARD_TRAINING, NULL, NULL, &bad_y, &bad_saved),
        OCTET_ERROR_INVALID_ARGUMENT, "expects [..., 32]");
  CHECK(deleter_calls == before_bad + 1, "a refused MLP input was not released exactly once");
  octet_mlp* bad_mlp = NULL;
  FAILS(octet_mlp_create(H, F, 1, (octet_activation)9, OCTET_NORM_NONE, 0.0f, cpu, 1, OCTET_F32,
                         &bad_mlp),
        OCTET_ERROR_INVALID_ARGUMENT, "activation");
  FAILS(octet_mlp_create(H, 0, 1, OCTET_ACTIVATION_GELU, OCTET_NORM_NONE, 0.0f, cpu, 1, OCTET_F32,
                         &bad_mlp),
        OCTET_ERROR_INVALID_ARGUMENT, "must be positive");
  release(y);
  release(y2);
  release(dx);
  release(gg);
  release(ly);
  release(gamma);
  release(w1);
  release(b1);
  release(w2);
  release(b2);
  octet_saved_destroy(saved);
  octet_saved_destroy(again);
  octet_saved_destroy(lin_saved);
  octet_linear_destroy(lin);
  CHECK(deleter_calls == before + 4, "%d inputs released, expected 4", deleter_calls - before);
  octet_mlp_destroy(mlp);
}
