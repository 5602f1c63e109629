#include "octet/core/tensor.h"

#include <gtest/gtest.h>

namespace octet {
namespace {

TEST(Tensor, ViewSharesStorage) {
  Tensor t = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor v = t.view({3, -1});
  EXPECT_EQ(v.shape(), (Shape{3, 2}));
  v.data<float>()[0] = 42;
  EXPECT_EQ(t.data<float>()[0], 42);
}

}  // namespace
}  // namespace octet
