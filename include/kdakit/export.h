// KDAKIT_API marks the public API. The library is compiled with hidden symbols by default, so the shared library
// exports what carries this mark and nothing else (docs/cpp-api.md). Public types carry it too: a template
// instantiated on a type (PlannedCall<ForwardParams>) is no more visible than the type.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define KDAKIT_API __attribute__((visibility("default")))
#else
#define KDAKIT_API
#endif
