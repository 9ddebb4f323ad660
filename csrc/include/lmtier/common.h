// lmtier — error macros and small helpers shared by every translation unit.
// Framework-free: no torch, no pybind11 here (house rule 1: kernels never see a framework).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace lmtier {

// Thrown for bad arguments; the binding layer maps it to Python's ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

template <typename... Args>
[[noreturn]] inline void throw_invalid(const char* file, int line, Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  throw InvalidArgument(os.str());
}

template <typename... Args>
[[noreturn]] inline void throw_runtime(const char* file, int line, Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  throw std::runtime_error(os.str());
}

}  // namespace lmtier

// The message is only built when the check fails.
#define LMTIER_CHECK_ARG(cond, ...)                                                    \
  do {                                                                                 \
    if (!(cond)) ::lmtier::throw_invalid(__FILE__, __LINE__, "lmtier: ", __VA_ARGS__); \
  } while (0)

#define LMTIER_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) ::lmtier::throw_runtime(__FILE__, __LINE__, "lmtier: ", __VA_ARGS__); \
  } while (0)

#ifdef LMTIER_WITH_CUDA
#include <cuda_runtime_api.h>
#define LMTIER_CUDA_CHECK(call)                                                       \
  do {                                                                                \
    cudaError_t lmtier_err_ = (call);                                                 \
    if (lmtier_err_ != cudaSuccess)                                                   \
      ::lmtier::throw_runtime(__FILE__, __LINE__, "lmtier: CUDA error ", #call, ": ", \
                              cudaGetErrorName(lmtier_err_), ": ",                    \
                              cudaGetErrorString(lmtier_err_));                       \
  } while (0)
// After every kernel launch.
#define LMTIER_CUDA_CHECK_LAUNCH() LMTIER_CUDA_CHECK(cudaGetLastError())
#endif
