// NVTX range around every op entry point (a no-op without CUDA).
#pragma once

#if OCTET_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace octet {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#if OCTET_WITH_CUDA
    nvtxRangePushA(name);
#endif
  }
  ~NvtxRange() {
#if OCTET_WITH_CUDA
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace octet
