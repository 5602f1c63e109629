// LinearStack: a sequence of Linear layers with optional activation recompute.
#pragma once

#include <vector>

#include "octet/nn/linear.h"

namespace octet::nn {

/// y = L_{n-1}(... L_1(L_0(x))). Layers may live on different devices: activations move to each
/// layer's device on the way forward and gradients move back on the way backward.
///
/// Without recompute, forward keeps every layer's Saved. With recompute it keeps only the stack
/// input and each layer's Snapshot (the scales in use and the weight cast), and backward first
/// re-runs every layer's forward with ForwardMode::recompute, which rebuilds the same Saved bytes
/// without touching the FP8 state, then runs the backward.
class LinearStack {
 public:
  struct Saved {
    Tensor input;                             ///< on layer 0's device
    Device input_device;                      ///< where the caller's input was
    std::vector<Linear::Saved> layers;        ///< without recompute, or once recomputed
    std::vector<Linear::Snapshot> snapshots;  ///< with recompute
  };

  explicit LinearStack(bool recompute = false) : recompute_(recompute) {}

  /// Appends a layer.
  void add(Linear layer) { layers_.push_back(std::move(layer)); }
  size_t size() const { return layers_.size(); }
  Linear& layer(size_t i) { return layers_.at(i); }
  const Linear& layer(size_t i) const { return layers_.at(i); }
  bool recompute() const { return recompute_; }

  /// Runs every layer in order (under whatever fp8_autocast is active) and fills `saved`.
  Tensor forward(const Tensor& x, Saved& saved);
  /// dx (on the input's device) from dy; accumulates every layer's gradients and releases the
  /// Saved records as it goes.
  Tensor backward(const Tensor& dy, Saved& saved);

  void zero_grad();
  void on_weights_updated();

 private:
  bool recompute_;
  std::vector<Linear> layers_;
};

}  // namespace octet::nn
