// Exceptions thrown by kdakit. Every message names the argument, what was expected and what was received.
#pragma once

#include <stdexcept>
#include <string>

#include "kdakit/export.h"

namespace kdakit {

// Every class here is exported and has its virtual destructor defined in the library (src/core/error.cpp), so its
// vtable and type information exist once, in the library: a program catches them by type across the shared library.
class KDAKIT_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  ~Error() override;
};

// A caller-supplied argument is invalid. `argument()` is the parameter's public name (e.g. "cu_seqlens").
class KDAKIT_API InvalidArgument : public Error {
 public:
  InvalidArgument(std::string argument, const std::string& message)
      : Error(argument + ": " + message), argument_(std::move(argument)) {}
  ~InvalidArgument() override;
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// The request needs a backend this build does not contain (e.g. CUDA tensors without the CUDA kernels).
class KDAKIT_API NotBuilt : public Error {
 public:
  using Error::Error;
  ~NotBuilt() override;
};

// A CUDA runtime call failed.
class KDAKIT_API CudaError : public Error {
 public:
  using Error::Error;
  ~CudaError() override;
};

}  // namespace kdakit
