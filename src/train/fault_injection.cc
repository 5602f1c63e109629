#include "octet/train/fault_injection.h"

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <thread>

#include "octet/core/error.h"
#include "octet/nn/transformer.h"
#include "octet/ops/quantize.h"
#include "octet/train/guard.h"
#include "octet/train/model.h"

namespace octet::train {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

const char* const kGrammar =
    "expected KIND@STEPS[:MICROBATCH][/LAYER] with KIND nan-activation, inf-activation, "
    "nan-grad, inf-grad, nan-amax, inf-amax or spike-grad and STEPS N, N-M or N-";

/// A non-negative decimal integer that is all of `text`.
bool parse_int(std::string_view text, int64_t& out) {
  const auto r = std::from_chars(text.data(), text.data() + text.size(), out);
  return !text.empty() && r.ec == std::errc() && r.ptr == text.data() + text.size() && out >= 0;
}

Fault parse_fault(std::string_view spec) {
  const auto bad = [&](const char* what) {
    OCTET_ERROR("--inject '", spec, "': ", what, "; ", kGrammar);
  };
  Fault f;
  const size_t at = spec.find('@');
  if (at == std::string_view::npos) bad("no '@'");
  const std::string_view kind = spec.substr(0, at);
  if (kind == "nan-activation" || kind == "inf-activation")
    f.kind = Fault::Kind::activation;
  else if (kind == "nan-grad" || kind == "inf-grad")
    f.kind = Fault::Kind::gradient;
  else if (kind == "nan-amax" || kind == "inf-amax")
    f.kind = Fault::Kind::amax;
  else if (kind == "spike-grad")
    f.kind = Fault::Kind::spike;
  else if (kind == "exit")
    f.kind = Fault::Kind::exit;
  else if (kind == "hang")
    f.kind = Fault::Kind::hang;
  else
    bad("unknown kind");
  f.value = kind.starts_with("nan") ? kNaN : kind.starts_with("inf") ? kInf : kSpikeFactor;

  std::string_view rest = spec.substr(at + 1);
  const size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    if (!parse_int(rest.substr(slash + 1), f.layer)) bad("bad LAYER");
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.find(':');
  if (colon != std::string_view::npos) {
    if (!parse_int(rest.substr(colon + 1), f.microbatch)) bad("bad MICROBATCH");
    rest = rest.substr(0, colon);
  }
  const size_t dash = rest.find('-');
  if (!parse_int(rest.substr(0, dash), f.first_step) || f.first_step < 1) bad("bad STEPS");
  f.last_step = f.first_step;
  if (dash != std::string_view::npos) {
    const std::string_view last = rest.substr(dash + 1);
    if (last.empty())
      f.last_step = -1;
    else if (!parse_int(last, f.last_step) || f.last_step < f.first_step)
      bad("bad STEPS");
  }
  return f;
}

/// Multiplies every element of an f32 tensor (any device) by `factor`, through the host.
void scale_values(const Tensor& t, float factor) {
  Tensor host = t.to(Device::cpu());
  float* v = host.data<float>();
  for (int64_t i = 0; i < host.numel(); ++i) v[i] *= factor;
  Tensor(t).copy_from(host);
}

}  // namespace

std::vector<Fault> parse_faults(const std::string& spec) {
  std::vector<Fault> faults;
  std::string_view rest = spec;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    faults.push_back(parse_fault(rest.substr(0, comma)));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return faults;
}

void set_first_element(const Tensor& t, float value) {
  OCTET_CHECK(
      t.defined() && t.numel() >= 1 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16),
      "set_first_element: expected a non-empty f32 or bf16 tensor, got ", t.describe());
  Tensor one = Tensor::from_vector({value}, {1});
  if (t.dtype() != DType::f32) {
    Tensor converted = Tensor::empty({1}, t.dtype());
    ops::cast(one, converted);
    one = converted;
  }
  t.view({-1}).slice(0, 1).copy_from(one);
}

FaultInjector::FaultInjector(std::vector<Fault> faults, GPT& model)
    : faults_(std::move(faults)), model_(model) {
  const int64_t layers = model.config().layers;
  for (const Fault& f : faults_) {
    OCTET_CHECK(f.layer < layers, "--inject: layer ", f.layer, " does not exist (the model has ",
                layers, " blocks)");
    OCTET_CHECK(f.kind != Fault::Kind::amax || !model.fp8_modules().empty(),
                "--inject: an amax fault needs FP8 state, but the precision is ",
                model.precision().name());
  }
}

void FaultInjector::before_microbatch(int64_t step, int64_t micro) {
  std::vector<const Fault*> activations;
  for (const Fault& f : faults_) {
    if (!f.active(step, micro)) continue;
    if (f.kind == Fault::Kind::amax) {
      // The layer's first module (its qkv); the count per block differs in MoE models.
      const std::string qkv = "blocks." + std::to_string(f.layer) + ".attn.qkv";
      for (const Fp8Module& m : model_.fp8_modules())
        if (m.name == qkv) set_first_element(m.state->amax_slot(fp8::TensorRole::input), f.value);
    }
    if (f.kind == Fault::Kind::activation) activations.push_back(&f);
    if (f.kind == Fault::Kind::exit || f.kind == Fault::Kind::hang) {
      std::fprintf(stderr, "octet: injected fault: this process %s at step %lld, microbatch %lld\n",
                   f.kind == Fault::Kind::exit ? "exits" : "hangs", (long long)step,
                   (long long)micro);
      std::fflush(stderr);
      // No destructors, no MPI_Finalize: a rank that died, as far as the others can tell.
      if (f.kind == Fault::Kind::exit) std::_Exit(kInjectedExitStatus);
      while (true) std::this_thread::sleep_for(std::chrono::hours(1));
    }
  }
  if (activations.empty()) {
    model_.set_activation_hook(nullptr);
    return;
  }
  model_.set_activation_hook([activations](int64_t layer, const Tensor& x) {
    for (const Fault* f : activations)
      if (f->layer == layer) set_first_element(x, f->value);
  });
}

void FaultInjector::after_microbatch(int64_t step, int64_t micro,
                                     const std::vector<Parameter>& params) {
  for (const Fault& f : faults_) {
    if (!f.active(step, micro) || (f.kind != Fault::Kind::gradient && f.kind != Fault::Kind::spike))
      continue;
    const std::string group = "blocks." + std::to_string(f.layer);
    for (const Parameter& p : params) {
      if (layer_group(p.name) != group) continue;
      if (f.kind == Fault::Kind::gradient) {
        set_first_element(p.grad, f.value);
        break;
      }
      scale_values(p.grad, f.value);
    }
  }
}

}  // namespace octet::train
