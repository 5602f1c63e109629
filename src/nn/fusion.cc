#include "octet/nn/fusion.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "octet/core/error.h"

namespace octet::nn {
namespace {

constexpr std::array<std::string_view, kFusionCount> kNames = {
    "norm-cast",      "activation-cast",     "activation-grad-cast", "bias-grad",
    "optimizer-cast", "moe-activation-cast", "input-recast"};

std::string valid_names() {
  std::string out = "all, none";
  for (std::string_view n : kNames) out += ", " + std::string(n);
  return out;
}

/// The switches, read from OCTET_UNFUSE once, before the first read or write.
std::array<std::atomic<bool>, kFusionCount>& switches() {
  static std::array<std::atomic<bool>, kFusionCount> on;
  static std::once_flag once;
  std::call_once(once, [] {
    for (auto& s : on) s = true;
    const char* env = std::getenv("OCTET_UNFUSE");
    if (env == nullptr || *env == '\0') return;
    for (Fusion f : parse_fusions(env)) on[static_cast<int>(f)] = false;
  });
  return on;
}

}  // namespace

std::string_view fusion_name(Fusion fusion) { return kNames.at(static_cast<size_t>(fusion)); }

std::vector<Fusion> all_fusions() {
  std::vector<Fusion> out;
  for (int i = 0; i < kFusionCount; ++i) out.push_back(static_cast<Fusion>(i));
  return out;
}

std::vector<Fusion> parse_fusions(std::string_view list) {
  if (list == "all") return all_fusions();
  if (list == "none") return {};
  std::vector<Fusion> out;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(',', begin), list.size());
    const std::string_view name = list.substr(begin, end - begin);
    int found = -1;
    for (int i = 0; i < kFusionCount; ++i)
      if (kNames[static_cast<size_t>(i)] == name) found = i;
    OCTET_CHECK(found >= 0, "unknown fusion '", name, "' in '", list, "'; expected ",
                valid_names());
    out.push_back(static_cast<Fusion>(found));
    begin = end + 1;
  }
  return out;
}

bool fusion_enabled(Fusion fusion) { return switches()[static_cast<size_t>(fusion)]; }

void set_fusion_enabled(Fusion fusion, bool on) { switches()[static_cast<size_t>(fusion)] = on; }

std::string disabled_fusions() {
  std::string out;
  for (Fusion f : all_fusions()) {
    if (fusion_enabled(f)) continue;
    if (!out.empty()) out += ",";
    out += fusion_name(f);
  }
  return out.empty() ? "none" : out;
}

UnfusedScope::UnfusedScope(const std::vector<Fusion>& off) {
  for (Fusion f : all_fusions()) saved_[static_cast<int>(f)] = fusion_enabled(f);
  for (Fusion f : off) set_fusion_enabled(f, false);
}

UnfusedScope::~UnfusedScope() {
  for (Fusion f : all_fusions()) set_fusion_enabled(f, saved_[static_cast<int>(f)]);
}

}  // namespace octet::nn
