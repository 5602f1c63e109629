#include "octet/train/schedule.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace octet::train {
namespace {

struct WidthLr {
  double width, lr;
};
// GPT-3 table 2.1 (model width -> peak lr; the 13B row's width is printed as 5140 there, 5120 is
// the width such a model has), preceded by octet's tiny model, whose 2e-3 was chosen on the CPU
// main job (README: the loss falls 74% in 300 steps).
constexpr std::array<WidthLr, 9> kLrTable{{
    {128, 2.0e-3},
    {768, 6.0e-4},
    {1024, 3.0e-4},
    {1536, 2.5e-4},
    {2048, 2.0e-4},
    {2560, 1.6e-4},
    {4096, 1.2e-4},
    {5120, 1.0e-4},
    {12288, 0.6e-4},
}};

struct WidthWarmup {
  double width, warmup;
};
// octet's tiny CPU model keeps the 20 steps its main job was tuned with. At GPT-2 124M (lr 6e-4,
// 16 x 512 tokens a step) 20 steps ended in a loss spike within the warmup in every precision,
// which delayed scaling recovered from worst; 200 steps trained without one and better in every
// precision (docs/CONVERGENCE.md).
constexpr std::array<WidthWarmup, 2> kWarmupTable{{{128, 20}, {768, 200}}};

/// `table` (rows sorted by width, with a `width` and one value) at `width`: linear in log(value)
/// over log(width) between rows, held constant beyond the first and last.
template <typename Row, size_t N, typename Value>
double log_interpolate(const std::array<Row, N>& table, double width, Value Row::*value) {
  if (width <= table.front().width) return table.front().*value;
  if (width >= table.back().width) return table.back().*value;
  const auto upper = std::find_if(table.begin(), table.end(),
                                  [&](const Row& row) { return row.width >= width; });
  const Row& hi = *upper;
  const Row& lo = *(upper - 1);
  if (hi.width == width) return hi.*value;
  const double t = std::log(width / lo.width) / std::log(hi.width / lo.width);
  return std::exp(std::log(lo.*value) + t * (std::log(hi.*value) - std::log(lo.*value)));
}

}  // namespace

double learning_rate(double peak, int64_t warmup, int64_t step) {
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  return peak * std::sqrt(static_cast<double>(std::max<int64_t>(warmup, 1)) / step);
}

double default_learning_rate(int64_t dim) {
  return log_interpolate(kLrTable, static_cast<double>(dim), &WidthLr::lr);
}

int64_t default_warmup(int64_t dim) {
  return std::llround(log_interpolate(kWarmupTable, static_cast<double>(dim), &WidthWarmup::warmup));
}

}  // namespace octet::train
