// lmtier — error macros and small helpers shared by every translation unit.
// Framework-free: no torch, no pybind11 here (house rule 1: kernels never see a framework).
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace lmtier {

// Thrown for bad arguments; the binding layer maps it to Python's ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

// Error messages are built without iostreams: a module whose libstdc++ is linked statically (the
// device machine's toolchain does that) crashed formatting a number with std::ostringstream while
// Python's process also holds the shared libstdc++ (RESULTS §4.1m). std::to_string / snprintf use
// the C library only.
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }

template <typename T>
void append(std::string& s, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, char*> || std::is_same_v<U, const char*>) {
    append(s, static_cast<const char*>(v));
  } else if constexpr (std::is_enum_v<U>) {
    s += std::to_string(static_cast<std::underlying_type_t<U>>(v));
  } else if constexpr (std::is_integral_v<U>) {
    s += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<U>) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", static_cast<double>(v));
    s += b;
  } else if constexpr (std::is_pointer_v<U>) {
    char b[32];
    std::snprintf(b, sizeof b, "%p", static_cast<const void*>(v));
    s += b;
  } else {
    static_assert(!sizeof(U), "lmtier error messages take strings, numbers, enums and pointers");
  }
}

template <typename... Args>
std::string message(const char* file, int line, const Args&... args) {
  std::string s;
  (append(s, args), ...);
  s += " [";
  append(s, file);
  s += ':';
  append(s, line);
  s += ']';
  return s;
}

}  // namespace detail

template <typename... Args>
[[noreturn]] inline void throw_invalid(const char* file, int line, const Args&... args) {
  throw InvalidArgument(detail::message(file, line, args...));
}

template <typename... Args>
[[noreturn]] inline void throw_runtime(const char* file, int line, const Args&... args) {
  throw std::runtime_error(detail::message(file, line, args...));
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
