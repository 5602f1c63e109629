#include "octet/nn/linear_stack.h"

namespace octet::nn {
namespace {
/// t on `device` (t itself when it is there already).
Tensor on_device(const Tensor& t, const Device& device) {
  return t.device() == device ? t : t.to(device);
}
}  // namespace

Tensor LinearStack::forward(const Tensor& x, Saved& saved) {
  OCTET_CHECK(!layers_.empty(), "LinearStack::forward: the stack has no layers");
  OCTET_CHECK(x.defined(), "LinearStack::forward: the input is an undefined tensor");
  Saved out;
  out.input_device = x.device();
  Tensor h = on_device(x, layers_.front().device());
  out.input = h;
  for (Linear& layer : layers_) {
    Linear::Saved layer_saved;
    h = layer.forward(on_device(h, layer.device()), layer_saved);
    if (recompute_) {
      out.snapshots.push_back(std::move(layer_saved.snapshot));  // the activations are dropped
    } else {
      out.layers.push_back(std::move(layer_saved));
    }
  }
  saved = std::move(out);
  return h;
}

Tensor LinearStack::backward(const Tensor& dy, Saved& saved) {
  OCTET_CHECK(saved.input.defined(),
              "LinearStack::backward needs the Saved of a forward, got an "
              "empty one");
  if (recompute_ && saved.layers.empty()) {
    OCTET_CHECK(saved.snapshots.size() == layers_.size(),
                "LinearStack::backward: ", saved.snapshots.size(), " snapshots for ",
                layers_.size(), " layers");
    Tensor h = saved.input;
    for (size_t i = 0; i < layers_.size(); ++i) {
      Linear::Saved layer_saved = Linear::Saved::from_snapshot(std::move(saved.snapshots[i]));
      h = layers_[i].forward(on_device(h, layers_[i].device()), layer_saved,
                             ForwardMode::recompute);
      saved.layers.push_back(std::move(layer_saved));
    }
    saved.snapshots.clear();
  }
  OCTET_CHECK(saved.layers.size() == layers_.size(), "LinearStack::backward: ", saved.layers.size(),
              " saved records for ", layers_.size(), " layers");
  Tensor g = dy;
  for (size_t i = layers_.size(); i-- > 0;) {
    g = layers_[i].backward(on_device(g, layers_[i].device()), saved.layers[i]);
    saved.layers[i] = Linear::Saved();  // free the activations as soon as they are used
  }
  Tensor dx = on_device(g, saved.input_device);
  saved = Saved();
  return dx;
}

void LinearStack::zero_grad() {
  for (Linear& layer : layers_) layer.zero_grad();
}

void LinearStack::on_weights_updated() {
  for (Linear& layer : layers_) layer.on_weights_updated();
}

}  // namespace octet::nn
