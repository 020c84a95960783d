#include "kernels/float16.h"
#include <gtest/gtest.h>
TEST(X, Y) { EXPECT_EQ(ampd::kernels::RoundToHalf(65519.0f), 65504.0f); }
