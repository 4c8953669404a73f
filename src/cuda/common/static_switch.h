// Run-time values to compile-time constants: f(std::integral_constant<...>) for the value at hand. Plain C++, so
// host planners and kernel launchers dispatch the same way.
#pragma once

#include <type_traits>

namespace kdakit::cuda {

// f(KP) for a padded head dimension: 64, 128, else 256.
template <typename F>
void with_kp(int KP, F&& f) {
  switch (KP) {
    case 64: f(std::integral_constant<int, 64>()); break;
    case 128: f(std::integral_constant<int, 128>()); break;
    default: f(std::integral_constant<int, 256>()); break;
  }
}

// f(BV) for the recurrence's V tile: 16, 32, 128 (bf16 operands with KP <= 128 only), else 64 where KP <= 128 and 32
// at KP = 256.
template <int ELEM_BYTES, int KP, typename F>
void with_bv(int BV, F&& f) {
  switch (BV) {
    case 16: f(std::integral_constant<int, 16>()); break;
    case 32: f(std::integral_constant<int, 32>()); break;
    case 128:
      if constexpr (KP <= 128 && ELEM_BYTES == 2) {
        f(std::integral_constant<int, 128>());
        break;
      }
      [[fallthrough]];
    default:
      if constexpr (KP <= 128) f(std::integral_constant<int, 64>());
      else f(std::integral_constant<int, 32>());
  }
}

// f(true_type) or f(false_type).
template <typename F>
void with_bool(bool b, F&& f) {
  if (b) f(std::true_type());
  else f(std::false_type());
}

}  // namespace kdakit::cuda
