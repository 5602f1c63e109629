// The octet command. Subcommands arrive with their issues (train, eval, generate, bench, inspect).
#include <CLI/CLI.hpp>

#include <iostream>

#include "octet/core/device.h"

int main(int argc, char** argv) {
  CLI::App app{"octet: FP8 training engine"};
  app.require_subcommand(1);
  auto* info = app.add_subcommand("info", "print the build and the visible GPUs");
  info->callback([] {
    std::cout << "octet 0.1.0, CUDA backend " << (octet::built_with_cuda() ? "on" : "off")
              << ", " << octet::cuda_device_count() << " GPU(s) visible\n";
  });
  CLI11_PARSE(app, argc, argv);
  return 0;
}
