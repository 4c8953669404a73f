// Exceptions thrown by kdakit. Every message names the argument, what was expected and what was received.
#pragma once

#include <stdexcept>
#include <string>

namespace kdakit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller-supplied argument is invalid. `argument()` is the parameter's public name (e.g. "cu_seqlens").
class InvalidArgument : public Error {
 public:
  InvalidArgument(std::string argument, const std::string& message)
      : Error(argument + ": " + message), argument_(std::move(argument)) {}
  const std::string& argument() const { return argument_; }

 private:
  std::string argument_;
};

// The request needs a backend this build does not contain (e.g. CUDA tensors without the CUDA kernels).
class NotBuilt : public Error {
 public:
  using Error::Error;
};

// A CUDA runtime call failed.
class CudaError : public Error {
 public:
  using Error::Error;
};

}  // namespace kdakit
