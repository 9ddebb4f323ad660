// lmtier — batched exact int8 GEMMs on cuBLAS, reached through dlopen/dlsym (see
// lmtier/int8_gemm.h). Compiled by the host compiler, CUDA builds only.
#include "lmtier/int8_gemm.h"

#include <dlfcn.h>
#include <library_types.h>  // cudaDataType (CUDA runtime headers; cuBLAS's own are not needed)

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "lmtier/common.h"

namespace lmtier {
namespace igemm {
namespace {

// The few cuBLAS declarations used, as cublas_api.h (CUDA 11+) gives them: a C ABI that cuBLAS
// keeps across versions (status 0 = success, CUBLAS_OP_N/T = 0/1, CUBLAS_COMPUTE_32I = 72,
// CUBLAS_GEMM_DEFAULT = -1; the handle functions' exported names carry the "_v2" suffix).
using Handle = void*;
using Status = int;
constexpr int kOpN = 0, kOpT = 1, kCompute32I = 72, kGemmDefault = -1;
using CreateFn = Status (*)(Handle*);
using SetStreamFn = Status (*)(Handle, cudaStream_t);
using SetWorkspaceFn = Status (*)(Handle, void*, size_t);
using GemmFn = Status (*)(Handle, int, int, int, int, int, const void*, const void*, cudaDataType,
                          int, long long, const void*, cudaDataType, int, long long, const void*,
                          void*, cudaDataType, int, long long, int, int, int);

struct Library {
  std::string name;  // the soname found, or "none: <why>"
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  GemmFn gemm = nullptr;
};

Library load() {
  Library lib;
  static const char* kNames[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so.11",
                                 "libcublas.so"};
  void* h = nullptr;
  // the copy the process already holds first (torch's), then any the loader can find
  for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const char* n : kNames) {
      if ((h = dlopen(n, flags)) != nullptr) {
        lib.name = n;
        break;
      }
    }
    if (h != nullptr) break;
  }
  if (h == nullptr) {
    lib.name = "none: no libcublas.so.13 / .12 / .11 / libcublas.so loaded or on the loader's path";
    return lib;
  }
  lib.create = reinterpret_cast<CreateFn>(dlsym(h, "cublasCreate_v2"));
  lib.set_stream = reinterpret_cast<SetStreamFn>(dlsym(h, "cublasSetStream_v2"));
  lib.set_workspace = reinterpret_cast<SetWorkspaceFn>(dlsym(h, "cublasSetWorkspace_v2"));
  lib.gemm = reinterpret_cast<GemmFn>(dlsym(h, "cublasGemmStridedBatchedEx"));
  if (!lib.create || !lib.set_stream || !lib.set_workspace || !lib.gemm) {
    lib.name = "none: " + lib.name + " lacks cublasCreate_v2 / cublasSetStream_v2 / " +
               "cublasSetWorkspace_v2 / cublasGemmStridedBatchedEx";
    lib.gemm = nullptr;
  }
  return lib;
}

const Library& library_once() {
  static const Library& lib = *new Library(load());  // never destroyed, as the handle table
  return lib;
}

// One handle per device, created at first use and kept for the process; used by one caller at a
// time (its mutex held across cublasSetStream, cublasSetWorkspace and the launch). cublasSetStream
// resets the workspace to cuBLAS's own pool, so every call then sets the caller's workspace: memory
// the caller allocated on that stream, so no two in-flight GEMMs share scratch.
struct Slot {
  std::mutex m;
  Handle h = nullptr;
};

Slot& slot(int device) {
  // never destroyed: an I/O thread may be inside bgemm_s8 (GIL released) while exit() runs the
  // static destructors
  static std::mutex& m = *new std::mutex;
  static auto& slots = *new std::vector<std::unique_ptr<Slot>>;
  std::lock_guard<std::mutex> g(m);
  if (static_cast<size_t>(device) >= slots.size()) slots.resize(device + 1);
  if (!slots[device]) slots[device] = std::make_unique<Slot>();
  return *slots[device];
}

}  // namespace

std::string library() { return library_once().name; }

void bgemm_s8(int32_t batch, int32_t m, int32_t k, int32_t p, const int8_t* a, const int8_t* bt,
              int32_t* out, void* workspace, size_t workspace_bytes, void* stream) {
  LMTIER_CHECK_ARG(batch >= 0 && m >= 0 && k > 0 && p > 0, "bgemm_s8: bad sizes batch ", batch,
                   ", m ", m, ", k ", k, ", p ", p);
  LMTIER_CHECK_ARG(k % 4 == 0 && p % 4 == 0, "bgemm_s8: k (", k, ") and p (", p,
                   ") must be multiples of 4");
  LMTIER_CHECK_ARG(workspace_bytes == 0 || workspace != nullptr, "bgemm_s8: a workspace of ",
                   workspace_bytes, " bytes at address 0");
  if (batch == 0 || m == 0) return;
  const Library& lib = library_once();
  LMTIER_CHECK(lib.gemm != nullptr, "bgemm_s8: cuBLAS not available (", lib.name, ")");
  int device = 0;
  LMTIER_CUDA_CHECK(cudaGetDevice(&device));
  Slot& s = slot(device);
  std::lock_guard<std::mutex> g(s.m);
  if (s.h == nullptr) {
    Handle h = nullptr;
    Status st = lib.create(&h);
    LMTIER_CHECK(st == 0, "bgemm_s8: cublasCreate failed (status ", st, ")");
    s.h = h;
  }
  Status st = lib.set_stream(s.h, static_cast<cudaStream_t>(stream));
  LMTIER_CHECK(st == 0, "bgemm_s8: cublasSetStream failed (status ", st, ")");
  st = lib.set_workspace(s.h, workspace, workspace_bytes);
  LMTIER_CHECK(st == 0, "bgemm_s8: cublasSetWorkspace failed (status ", st, ")");
  // Column-major view: out[b]^T [p x m] = bt[b] [p x k] (op T of the k x p column-major array)
  // times a[b]^T [k x m] (op N of the k x m column-major array): cuBLAS's "TN" int8 layout.
  const int32_t one = 1, zero = 0;
  st = lib.gemm(s.h, kOpT, kOpN, p, m, k, &one, bt, CUDA_R_8I, k, static_cast<long long>(p) * k, a,
                CUDA_R_8I, k, static_cast<long long>(m) * k, &zero, out, CUDA_R_32I, p,
                static_cast<long long>(m) * p, batch, kCompute32I, kGemmDefault);
  LMTIER_CHECK(st == 0, "bgemm_s8: cublasGemmStridedBatchedEx failed (status ", st, ", batch ",
               batch, ", m ", m, ", k ", k, ", p ", p, ")");
}

}  // namespace igemm
}  // namespace lmtier
