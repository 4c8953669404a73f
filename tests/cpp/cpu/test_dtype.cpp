// Storage conversions: float16 and bfloat16 round to nearest even, with infinities, NaN and subnormals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cpu/dtype.h"

namespace kdakit::cpu {
namespace {

TEST(Dtype, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    ASSERT_EQ(float_to_half(f), h) << "half bits " << h;
  }
}

// Checks float -> half against the definition: the nearest representable half, ties to even mantissa.
TEST(Dtype, HalfRoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f) || std::fabs(f) > 65504.f || std::fabs(f) < 1e-9f) continue;
    const uint16_t h = float_to_half(f);
    const double got = half_to_float(h);
    // Neighbours of h in magnitude, same sign.
    const uint16_t sign = h & 0x8000u, mag = h & 0x7FFFu;
    const double err = std::fabs(got - f);
    if (mag > 0) ASSERT_LE(err, std::fabs(half_to_float(static_cast<uint16_t>(sign | (mag - 1))) - f)) << f;
    if (mag < 0x7C00u) ASSERT_LE(err, std::fabs(half_to_float(static_cast<uint16_t>(sign | (mag + 1))) - f)) << f;
  }
  EXPECT_EQ(float_to_half(65520.f), 0x7C00);  // halfway above the largest half rounds to infinity
  EXPECT_EQ(float_to_half(65504.f), 0x7BFF);
  EXPECT_EQ(float_to_half(-0.f), 0x8000);
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.f, -24));
}

TEST(Dtype, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  float tie;  // exactly between 0x3F80 and 0x3F81: rounds to the even 0x3F80
  uint32_t u = 0x3F808000u;
  std::memcpy(&tie, &u, 4);
  EXPECT_EQ(float_to_bf16(tie), 0x3F80);
  u = 0x3F818000u;  // between 0x3F81 and 0x3F82: rounds to 0x3F82
  std::memcpy(&tie, &u, 4);
  EXPECT_EQ(float_to_bf16(tie), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(INFINITY)), INFINITY);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int i = 0; i < 100000; ++i) {
    const float f = normal(rng) * 1000.f;
    const float r = bf16_to_float(float_to_bf16(f));
    ASSERT_LE(std::fabs(r - f), std::fabs(f) * (1.0f / 256.0f)) << f;
  }
}

}  // namespace
}  // namespace kdakit::cpu
