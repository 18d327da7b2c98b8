// XLA FFI handler that launches a compiled Triton/Gluon kernel (PTX) on XLA's stream.
//
// pallas_kernels/w4_gluon.py builds this file with the system C++ compiler on first use and
// registers it as the custom-call target "qerl_gluon_launch". Unlike jax-triton's legacy custom
// call, the handler is marked command-buffer compatible, so XLA can capture its launches in the
// CUDA graph of a decode step (docs/benchmarks.md, session 7). It needs no CUDA headers: the
// driver entry points it uses are looked up in libcuda.so.1 at run time.
//
// Kernel parameters, in order: every operand's and result's device pointer, then the two null
// scratch pointers that Triton 3.6 appends (global and profile scratch; the kernels here use none).
// zero_results is a bitmask: bit i zeroes result i on the stream first (one memset node each in a CUDA
// graph; byte counts must be multiples of 4), for kernels that add into it (1: a single result, the
// decode GEMV's; 2: the large-M GEMM's split-K tail, its second result). out_offset (bytes) is
// added to every result's pointer: the kernel writes a region of a larger (aliased) buffer, such as
// a decode step's float32 accumulator that one memset zeroed for several kernels.
// tma = [count, then 6 ints per descriptor: operand, rows, columns, box rows, box columns, L2 promotion]: the
// kernel takes that many TMA descriptors (Triton's host tensor descriptors) before the pointers, each 2-D over an
// operand of one-byte elements, row-major and contiguous, unswizzled: the CUtensorMap (128 bytes, encoded here by
// cuTensorMapEncodeTiled at each launch, so a CUDA graph records the operand's current address), then the shape
// as two int32 and the strides as two int64 (elements), as Triton 3.6's launcher passes them. [0]: none.
// tma = [-count, then 8 ints per descriptor: the same six, element bytes (1: uint8, 2: bfloat16), swizzle
// (CUtensorMapSwizzle: 0 none, 2 64 bytes, 3 128 bytes)]: the same with two-byte elements or a swizzled box.
// Modules are loaded once per (CUDA context, key) pair, where the key is a short digest of the PTX and
// kernel name computed once in Python, so that a launch looks up a few dozen bytes instead of copying
// and comparing the whole PTX: qerl_gluon_preload loads them outside any stream capture (called from
// Python when a call is built); the handler loads on a miss.
// A kernel's "PTX" may instead be "cubin:" and the base64 of a cubin, which the driver loads as it is (lab, session 64:
// kernels built elsewhere, experiments/lab/time_append.py's APPEND_CUBINS).

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

typedef struct CUstream_st* cudaStream_t;
typedef int CUresult;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef int CUdevice;
struct alignas(64) CUtensorMap {
  uint64_t opaque[16];
};
// cuLaunchKernelEx's configuration (CUDA 12 driver API, cuda.h), for programmatic dependent launch (the chain).
struct CUlaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    int programmatic_stream_serialization_allowed;
  } value;
};
struct CUlaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  cudaStream_t stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

namespace {

struct Driver {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            cudaStream_t, void**, void**) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, int, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*memset_d32_async)(unsigned long long, unsigned, size_t, cudaStream_t) = nullptr;
  // (map, data type, rank, address, dims, strides, box, element strides, interleave, swizzle, L2 promotion,
  // out-of-bounds fill); optional (only the TMA builds need it)
  CUresult (*tensor_map_encode_tiled)(CUtensorMap*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                                      const unsigned*, const unsigned*, int, int, int, int) = nullptr;
  CUresult (*launch_kernel_ex)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;  // optional (the chain)
  bool ok = false;
};

const Driver& GetDriver() {
  static Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return d;
    d.ctx_get_current = reinterpret_cast<decltype(d.ctx_get_current)>(dlsym(lib, "cuCtxGetCurrent"));
    d.module_load_data = reinterpret_cast<decltype(d.module_load_data)>(dlsym(lib, "cuModuleLoadData"));
    d.module_get_function = reinterpret_cast<decltype(d.module_get_function)>(dlsym(lib, "cuModuleGetFunction"));
    d.launch_kernel = reinterpret_cast<decltype(d.launch_kernel)>(dlsym(lib, "cuLaunchKernel"));
    d.func_set_attribute = reinterpret_cast<decltype(d.func_set_attribute)>(dlsym(lib, "cuFuncSetAttribute"));
    d.primary_ctx_retain = reinterpret_cast<decltype(d.primary_ctx_retain)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    d.ctx_push = reinterpret_cast<decltype(d.ctx_push)>(dlsym(lib, "cuCtxPushCurrent_v2"));
    d.ctx_pop = reinterpret_cast<decltype(d.ctx_pop)>(dlsym(lib, "cuCtxPopCurrent_v2"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(dlsym(lib, "cuDeviceGet"));
    d.memset_d32_async = reinterpret_cast<decltype(d.memset_d32_async)>(dlsym(lib, "cuMemsetD32Async"));
    d.tensor_map_encode_tiled =
        reinterpret_cast<decltype(d.tensor_map_encode_tiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
    d.launch_kernel_ex = reinterpret_cast<decltype(d.launch_kernel_ex)>(dlsym(lib, "cuLaunchKernelEx"));
    d.ok = d.ctx_get_current && d.module_load_data && d.module_get_function && d.launch_kernel &&
           d.func_set_attribute && d.primary_ctx_retain && d.ctx_push && d.ctx_pop && d.device_get &&
           d.memset_d32_async;
    return d;
  }();
  return d;
}

std::mutex cache_mutex;
std::map<std::pair<CUcontext, std::string>, CUfunction> cache;

constexpr int kMaxDynamicSharedSizeBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

// The bytes of the base64 text `text` (RFC 4648 alphabet, '=' padding); stops at the first other character.
std::string Base64Decode(std::string_view text) {
  std::string out;
  out.reserve(text.size() / 4 * 3);
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    int v;
    if (c >= 'A' && c <= 'Z') v = c - 'A';
    else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
    else if (c >= '0' && c <= '9') v = c - '0' + 52;
    else if (c == '+') v = 62;
    else if (c == '/') v = 63;
    else break;
    bits = (bits << 6) | static_cast<uint32_t>(v);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out.push_back(static_cast<char>((bits >> count) & 0xff));
    }
  }
  return out;
}

constexpr std::string_view kCubinPrefix = "cubin:";

// The kernel `name` of `ptx` (digest `key`) in the current context; loads the module on a miss, allowing it `shared`
// bytes of dynamic shared memory (above 48 KiB by the opt-in attribute). 0 on success.
CUresult Function(const Driver& d, std::string_view key, std::string_view ptx, std::string_view name, int64_t shared,
                  CUfunction* fn) {
  CUcontext ctx = nullptr;
  CUresult r = d.ctx_get_current(&ctx);
  if (r != 0) return r;
  auto cache_key = std::make_pair(ctx, std::string(key));
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find(cache_key);
  if (it != cache.end()) {
    *fn = it->second;
    return 0;
  }
  CUmodule module = nullptr;
  const std::string image = ptx.substr(0, kCubinPrefix.size()) == kCubinPrefix
                                ? Base64Decode(ptx.substr(kCubinPrefix.size()))
                                : std::string(ptx);
  r = d.module_load_data(&module, image.c_str());
  if (r != 0) return r;
  r = d.module_get_function(fn, module, std::string(name).c_str());
  if (r != 0) return r;
  if (shared > 48 * 1024) {
    r = d.func_set_attribute(*fn, kMaxDynamicSharedSizeBytes, static_cast<int>(shared));
    if (r != 0) return r;
  }
  cache.emplace(cache_key, *fn);
  return 0;
}

// Launches `fn` on `stream` with `params` (pointers to each parameter), by cuLaunchKernelEx with programmatic stream
// serialization when `pdl` (and the driver has it), else by cuLaunchKernel. 0 on success.
CUresult LaunchOne(const Driver& d, CUfunction fn, const int64_t grid[3], int64_t threads, int64_t shared,
                   cudaStream_t stream, void** params, bool pdl) {
  if (pdl && d.launch_kernel_ex) {
    CUlaunchAttribute attr = {};
    attr.id = kProgrammaticStreamSerialization;
    attr.value.programmatic_stream_serialization_allowed = 1;
    CUlaunchConfig config = {static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
                             static_cast<unsigned>(grid[2]), static_cast<unsigned>(threads), 1, 1,
                             static_cast<unsigned>(shared), stream, &attr, 1};
    return d.launch_kernel_ex(&config, fn, params, nullptr);
  }
  return d.launch_kernel(fn, static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
                         static_cast<unsigned>(grid[2]), static_cast<unsigned>(threads), 1, 1,
                         static_cast<unsigned>(shared), stream, params, nullptr);
}

// Zeroes `bytes` (a multiple of 4) at `data` on `stream` (a memset node in a CUDA graph); `who` names the caller in
// the error.
ffi::Error ZeroResult(const Driver& d, void* data, size_t bytes, cudaStream_t stream, const char* who) {
  CUresult r = d.memset_d32_async(reinterpret_cast<unsigned long long>(data), 0, bytes / 4, stream);
  if (r != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(who) + ": cuMemsetD32Async failed, CUresult " +
                                                     std::to_string(r));
  }
  return ffi::Error::Success();
}

ffi::Error Launch(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view key,
                  std::string_view ptx, std::string_view name, int64_t grid_x, int64_t grid_y, int64_t grid_z,
                  int64_t threads, int64_t shared, int64_t zero_results, int64_t out_offset,
                  ffi::Span<const int64_t> tma) {
  const Driver& d = GetDriver();
  if (!d.ok) return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_launch: libcuda.so.1 not loadable");
  CUfunction fn = nullptr;
  CUresult r = Function(d, key, ptx, name, shared, &fn);
  if (r != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "qerl_gluon_launch: loading kernel " + std::string(name) + " failed, CUresult " + std::to_string(r));
  }
  const size_t width = (tma.size() >= 1 && tma[0] < 0) ? 8 : 6;  // ints a descriptor
  if (tma.size() < 1 || tma.size() != 1 + width * static_cast<size_t>(tma[0] < 0 ? -tma[0] : tma[0])) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_launch: tma attribute of " +
                                                            std::to_string(tma.size()) + " values is malformed");
  }
  const size_t descriptors = static_cast<size_t>(tma[0] < 0 ? -tma[0] : tma[0]);
  std::vector<CUtensorMap> maps(descriptors);
  std::vector<int32_t> shapes(2 * descriptors);
  std::vector<int64_t> strides(2 * descriptors);
  for (size_t t = 0; t < descriptors; ++t) {
    const int64_t* spec = tma.begin() + 1 + width * t;
    const int64_t element_bytes = width == 8 ? spec[6] : 1;
    const int64_t swizzle = width == 8 ? spec[7] : 0;
    if ((element_bytes != 1 && element_bytes != 2) || (swizzle != 0 && swizzle != 2 && swizzle != 3)) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_launch: tma element bytes " +
                                                              std::to_string(element_bytes) + " or swizzle " +
                                                              std::to_string(swizzle) + " not supported");
    }
    if (spec[0] < 0 || static_cast<size_t>(spec[0]) >= args.size()) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_launch: tma operand out of range");
    }
    if (!d.tensor_map_encode_tiled) {
      return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_launch: cuTensorMapEncodeTiled not in libcuda.so.1");
    }
    auto buffer = args.get<ffi::AnyBuffer>(static_cast<size_t>(spec[0]));
    if (buffer.has_error()) return buffer.error();
    const uint64_t dims[2] = {static_cast<uint64_t>(spec[2]), static_cast<uint64_t>(spec[1])};  // innermost first
    const uint64_t row_bytes[1] = {static_cast<uint64_t>(spec[2] * element_bytes)};
    const unsigned box[2] = {static_cast<unsigned>(spec[4]), static_cast<unsigned>(spec[3])};
    const unsigned element_strides[2] = {1, 1};
    if (buffer->size_bytes() != static_cast<size_t>(spec[1] * spec[2] * element_bytes)) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_launch: tma operand of " +
                                                              std::to_string(buffer->size_bytes()) +
                                                              " bytes is not rows x columns");
    }
    // CU_TENSOR_MAP_DATA_TYPE_UINT8 (0) or _BFLOAT16 (9), no interleave, the swizzle, zeros out of bounds
    r = d.tensor_map_encode_tiled(&maps[t], element_bytes == 2 ? 9 : 0, 2, buffer->untyped_data(), dims, row_bytes,
                                  box, element_strides, 0, static_cast<int>(swizzle), static_cast<int>(spec[5]), 0);
    if (r != 0) {
      return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_launch: cuTensorMapEncodeTiled failed, CUresult " +
                                                       std::to_string(r));
    }
    shapes[2 * t] = static_cast<int32_t>(spec[1]);
    shapes[2 * t + 1] = static_cast<int32_t>(spec[2]);
    strides[2 * t] = spec[2];
    strides[2 * t + 1] = 1;
  }
  std::vector<void*> pointers;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    pointers.push_back(buffer->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    void* data = (*buffer)->untyped_data();
    size_t bytes = (*buffer)->size_bytes();
    if (i < 63 && ((zero_results >> i) & 1) && bytes > 0) {  // the kernel adds into it (split-K by atomics)
      ffi::Error e = ZeroResult(d, data, bytes, stream, "qerl_gluon_launch");
      if (e.failure()) return e;
    }
    if (out_offset < 0 || static_cast<size_t>(out_offset) > bytes) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_launch: out_offset " +
                                                              std::to_string(out_offset) + " outside a result of " +
                                                              std::to_string(bytes) + " bytes");
    }
    pointers.push_back(static_cast<char*>(data) + out_offset);
  }
  pointers.push_back(nullptr);  // global scratch
  pointers.push_back(nullptr);  // profile scratch
  std::vector<void*> params;
  for (size_t t = 0; t < descriptors; ++t) {  // the descriptors' parameters come first (the kernel's signature)
    params.push_back(&maps[t]);
    params.push_back(&shapes[2 * t]);
    params.push_back(&shapes[2 * t + 1]);
    params.push_back(&strides[2 * t]);
    params.push_back(&strides[2 * t + 1]);
  }
  for (void*& p : pointers) params.push_back(&p);
  const int64_t grid[3] = {grid_x, grid_y, grid_z};
  r = LaunchOne(d, fn, grid, threads, shared, stream, params.data(), false);
  if (r != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "qerl_gluon_launch: cuLaunchKernel(" + std::string(name) + ") failed, CUresult " + std::to_string(r));
  }
  return ffi::Error::Success();
}

// The i-th of `text`'s fields separated by '\x1e' (ASCII record separator), or an empty view past the last.
std::string_view Field(std::string_view text, size_t i) {
  size_t start = 0;
  for (size_t k = 0; k < i; ++k) {
    size_t at = text.find('\x1e', start);
    if (at == std::string_view::npos) return {};
    start = at + 1;
  }
  size_t end = text.find('\x1e', start);
  return text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
}

// Several kernels launched in order on XLA's stream by one FFI call (lab; w4_gluon.chain_call), so that a CUDA graph
// holds them in one captured node, where programmatic dependent launch can join them: XLA records every FFI call
// as its own child graph node, and a programmatic edge does not cross nodes (docs/kernels.md, "Programmatic
// dependent launch"). keys / ptxs / names: one field per kernel, '\x1e'-separated. launch: 6 ints a kernel (grid x,
// y, z, threads, shared bytes, pdl: 1 launches it with programmatic stream serialization, so it may start before
// the kernel before it ends and must wait with griddepcontrol.wait before reading what that one writes). params: per
// kernel its pointer count, then (buffer, byte offset) pairs, buffer i an operand for i < operands, else result
// i - operands; Triton's two null scratch pointers follow. zero_results: a bitmask over the results, zeroed first.
ffi::Error Chain(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view keys,
                 std::string_view ptxs, std::string_view names, ffi::Span<const int64_t> launch,
                 ffi::Span<const int64_t> params, int64_t zero_results) {
  const Driver& d = GetDriver();
  if (!d.ok) return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_chain: libcuda.so.1 not loadable");
  if (launch.size() % 6 != 0 || launch.size() == 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_chain: launch attribute of " +
                                                            std::to_string(launch.size()) + " values is malformed");
  }
  const size_t kernels = launch.size() / 6;
  std::vector<void*> bases;
  std::vector<size_t> sizes;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    bases.push_back(buffer->untyped_data());
    sizes.push_back(buffer->size_bytes());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    bases.push_back((*buffer)->untyped_data());
    sizes.push_back((*buffer)->size_bytes());
    if (i < 63 && ((zero_results >> i) & 1) && sizes.back() > 0) {
      ffi::Error e = ZeroResult(d, bases.back(), sizes.back(), stream, "qerl_gluon_chain");
      if (e.failure()) return e;
    }
  }
  size_t at = 0;  // position in params
  for (size_t k = 0; k < kernels; ++k) {
    const int64_t* l = launch.begin() + 6 * k;
    std::string_view key = Field(keys, k), ptx = Field(ptxs, k), name = Field(names, k);
    if (key.empty() || ptx.empty() || name.empty()) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "qerl_gluon_chain: no key, PTX or name for kernel " + std::to_string(k));
    }
    CUfunction fn = nullptr;
    CUresult r = Function(d, key, ptx, name, l[4], &fn);
    if (r != 0) {
      return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_chain: loading kernel " + std::string(name) +
                                                       " failed, CUresult " + std::to_string(r));
    }
    if (at >= params.size() || params[at] < 0 || at + 1 + 2 * static_cast<size_t>(params[at]) > params.size()) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "qerl_gluon_chain: params attribute malformed at kernel " + std::to_string(k));
    }
    const size_t count = static_cast<size_t>(params[at]);
    std::vector<void*> pointers;
    for (size_t j = 0; j < count; ++j) {
      const int64_t buffer = params[at + 1 + 2 * j], offset = params[at + 2 + 2 * j];
      if (buffer < 0 || static_cast<size_t>(buffer) >= bases.size() || offset < 0 ||
          static_cast<size_t>(offset) > sizes[buffer]) {
        return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_chain: kernel " + std::to_string(k) +
                                                                " parameter " + std::to_string(j) + " out of range");
      }
      pointers.push_back(static_cast<char*>(bases[buffer]) + offset);
    }
    at += 1 + 2 * count;
    pointers.push_back(nullptr);  // global scratch
    pointers.push_back(nullptr);  // profile scratch
    std::vector<void*> kernel_params;
    for (void*& p : pointers) kernel_params.push_back(&p);
    r = LaunchOne(d, fn, l, l[3], l[4], stream, kernel_params.data(), l[5] && k > 0);
    if (r != 0) {
      return ffi::Error(ffi::ErrorCode::kInternal, "qerl_gluon_chain: launching " + std::string(name) +
                                                       " failed, CUresult " + std::to_string(r));
    }
  }
  if (at != params.size()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "qerl_gluon_chain: params attribute has values past the last "
                                                        "kernel's");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QerlGluonChain, Chain,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("keys")
                                  .Attr<std::string_view>("ptxs")
                                  .Attr<std::string_view>("names")
                                  .Attr<ffi::Span<const int64_t>>("launch")
                                  .Attr<ffi::Span<const int64_t>>("params")
                                  .Attr<int64_t>("zero_results"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QerlGluonLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("key")
                                  .Attr<std::string_view>("ptx")
                                  .Attr<std::string_view>("name")
                                  .Attr<int64_t>("grid_x")
                                  .Attr<int64_t>("grid_y")
                                  .Attr<int64_t>("grid_z")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("shared")
                                  .Attr<int64_t>("zero_results")
                                  .Attr<int64_t>("out_offset")
                                  .Attr<ffi::Span<const int64_t>>("tma"),
                              {ffi::Traits::kCmdBufferCompatible});

// Loads `name` of `ptx` (digest `key`, as the handler's attribute) into device `device`'s primary context
// (outside any stream capture). Returns 0 on success, else the CUresult (-1: libcuda not found).
extern "C" int qerl_gluon_preload(const char* key, const char* ptx, const char* name, int device, long long shared) {
  const Driver& d = GetDriver();
  if (!d.ok) return -1;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUresult r = d.device_get(&dev, device);
  if (r == 0) r = d.primary_ctx_retain(&ctx, dev);
  if (r != 0) return r;
  r = d.ctx_push(ctx);
  if (r != 0) return r;
  CUfunction fn = nullptr;
  r = Function(d, key, ptx, name, shared, &fn);
  CUcontext popped = nullptr;
  d.ctx_pop(&popped);
  return r;
}

// The "cubin:" image decoder, exported for a CPU test: writes the bytes of the base64 text `text` to `out` (at most
// `capacity`) and returns their count, or -1 where they do not fit.
extern "C" long long qerl_gluon_base64_decode(const char* text, unsigned char* out, long long capacity) {
  const std::string bytes = Base64Decode(text);
  if (static_cast<long long>(bytes.size()) > capacity) return -1;
  for (size_t i = 0; i < bytes.size(); ++i) out[i] = static_cast<unsigned char>(bytes[i]);
  return static_cast<long long>(bytes.size());
}
