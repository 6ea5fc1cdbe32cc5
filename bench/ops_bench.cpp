// ops bench: RMSNorm forward against its physical peer, a plain copy of the same bytes, in one
// invocation. Both move rows*cols*4 bytes in and as many out (w is cols floats, negligible), so
// effective GB/s = 2 * bytes / time and the ratio rmsnorm / peer says how close the op runs to
// the memory system's copy bandwidth (1.0 = as fast as a copy).
//   CPU:  rmsnorm_cpu vs std::memcpy, wall clock.
//   CUDA: rmsnorm_cuda vs cudaMemcpy device-to-device, cudaEvent timing on one stream.
// Without a CUDA build or device the CUDA half prints why and the exit status stays 0.
// Then stream_copy (the snapshot copy): --copy-mb of data copied as --copy-pieces separate
// copies, with stream_copy and with memcpy per piece, against one memcpy of the whole (the
// bound: a copy that large gets glibc's streaming stores); ratios to that bound.
// Then the optimizer's fused loops (optim_kernels.h) over --optim-mb of float32 and of
// bfloat16: each reads two arrays and writes one, against a memcpy of the same array (one
// read, one write); the ratio is the loop's GB/s over memcpy's (1.0 = as fast as a copy).
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/error.h"
#include "ops/ops.h"
#include "ops/optim_kernels.h"

#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "ops/cuda_check.h"
#endif

namespace ops = megacpp::ops;

namespace {

struct Config {
  size_t copy_mb = 256;
  size_t copy_pieces = 58;  // a TrainStep share's tensor count (bench_checkpoint's default)
  int64_t rows = 4096;
  int64_t cols = 4096;
  int iters = 20;
  int warmup = 3;
  float eps = 1e-6f;
  size_t optim_mb = 64;
  size_t adamw_mb = 256;  // per array: 64 M float32 elements, above gpu-small's embedding table
  // Muon's tail: gpu-small's MLP input matrices (12 of 4096 x 1024, one statistic per row).
  int64_t muon_count = 12, muon_rows = 4096, muon_cols = 1024;
};

double gbps(double bytes, double ms) {
  return bytes / (ms * 1e-3) / 1e9;
}

void report(const char* side, const char* op, double op_ms, const char* peer, double peer_ms,
            double bytes) {
  fmt::print(
      "{:<4}  {:<12} {:9.4f} ms {:8.2f} GB/s | {:<18} {:9.4f} ms {:8.2f} GB/s | ratio {:.3f}\n",
      side, op, op_ms, gbps(bytes, op_ms), peer, peer_ms, gbps(bytes, peer_ms), peer_ms / op_ms);
}

template <typename F>
double cpu_ms_per_iter(const Config& cfg, F&& f) {
  for (int i = 0; i < cfg.warmup; ++i) f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < cfg.iters; ++i) f();
  const std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / cfg.iters;
}

void bench_cpu(const Config& cfg, const std::vector<float>& x, const std::vector<float>& w,
               std::vector<float>& y) {
  const auto n = static_cast<size_t>(cfg.rows * cfg.cols);
  const double bytes = 2.0 * double(n) * sizeof(float);
  std::vector<float> copy(n);
  const double op_ms = cpu_ms_per_iter(
      cfg, [&] { ops::rmsnorm_cpu(x.data(), w.data(), y.data(), cfg.rows, cfg.cols, cfg.eps); });
  const double peer_ms =
      cpu_ms_per_iter(cfg, [&] { std::memcpy(copy.data(), x.data(), n * sizeof(float)); });
  if (copy[n - 1] != x[n - 1]) throw std::runtime_error("memcpy peer produced wrong data");
  report("cpu", "rmsnorm_cpu", op_ms, "memcpy", peer_ms, bytes);
}

#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&p_, bytes)); }
  ~DeviceBuffer() { (void)cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  float* get() const { return static_cast<float*>(p_); }

 private:
  void* p_ = nullptr;
};

class Event {
 public:
  Event() { CUDA_CHECK(cudaEventCreate(&e_)); }
  ~Event() { (void)cudaEventDestroy(e_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&&) = delete;
  Event& operator=(Event&&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&&) = delete;
  Stream& operator=(Stream&&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// The largest |got - want| / |want| over the elements; an exact zero wanted must be got exactly
// (else infinity).
double max_relative_difference(const std::vector<float>& got, const std::vector<float>& want) {
  double max_rel = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (want[i] != 0.f) {
      max_rel = std::max(max_rel, std::abs(double(got[i]) - want[i]) / std::abs(double(want[i])));
    } else if (got[i] != 0.f) {
      max_rel = INFINITY;
    }
  }
  return max_rel;
}

template <typename F>
double gpu_ms_per_iter(const Config& cfg, const Stream& stream, F&& f) {
  for (int i = 0; i < cfg.warmup; ++i) f();
  Event start, stop;
  CUDA_CHECK(cudaEventRecord(start.get(), stream.get()));
  for (int i = 0; i < cfg.iters; ++i) f();
  CUDA_CHECK(cudaEventRecord(stop.get(), stream.get()));
  CUDA_CHECK(cudaEventSynchronize(stop.get()));
  float ms = 0.f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return double(ms) / cfg.iters;
}

void bench_cuda(const Config& cfg, const std::vector<float>& x, const std::vector<float>& w,
                const std::vector<float>& y_cpu) {
  const auto n = static_cast<size_t>(cfg.rows * cfg.cols);
  const size_t bytes = n * sizeof(float);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  fmt::print("cuda: device 0: {}\n", prop.name);

  DeviceBuffer dx(bytes), dy(bytes), dcopy(bytes), dw(w.size() * sizeof(float));
  CUDA_CHECK(cudaMemcpy(dx.get(), x.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dw.get(), w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice));
  Stream stream;
  const double op_ms = gpu_ms_per_iter(cfg, stream, [&] {
    ops::rmsnorm_cuda(dx.get(), dw.get(), dy.get(), cfg.rows, cfg.cols, cfg.eps, stream.get());
  });
  const double peer_ms = gpu_ms_per_iter(cfg, stream, [&] {
    CUDA_CHECK(
        cudaMemcpyAsync(dcopy.get(), dx.get(), bytes, cudaMemcpyDeviceToDevice, stream.get()));
  });
  report("cuda", "rmsnorm_cuda", op_ms, "cudaMemcpy D2D", peer_ms, 2.0 * double(bytes));

  // A bench that is fast but wrong is worthless: compare with the CPU reference once.
  std::vector<float> y(n);
  CUDA_CHECK(cudaMemcpy(y.data(), dy.get(), bytes, cudaMemcpyDeviceToHost));
  const double max_rel = max_relative_difference(y, y_cpu);
  fmt::print("cuda: max relative difference to rmsnorm_cpu: {:.3g}{}\n", max_rel,
             max_rel <= 1e-5 ? "" : "  (ABOVE 1e-5)");
}
#endif

void bench_stream_copy(const Config& cfg) {
  const size_t bytes = cfg.copy_mb << 20;
  const size_t piece = (bytes / cfg.copy_pieces) & ~size_t{63};
  std::vector<unsigned char> src(bytes, 0x5a), dst(bytes, 0);
  auto pieces = [&](auto&& copy) {
    for (size_t at = 0; at < bytes; at += piece)
      copy(dst.data() + at, src.data() + at, std::min(piece, bytes - at));
  };
  Config c = cfg;
  c.iters = std::max(3, cfg.iters / 4);
  const double whole_ms = cpu_ms_per_iter(c, [&] { std::memcpy(dst.data(), src.data(), bytes); });
  const double memcpy_ms = cpu_ms_per_iter(
      c, [&] { pieces([](void* d, const void* s, size_t n) { std::memcpy(d, s, n); }); });
  std::fill(dst.begin(), dst.end(), 0);
  const double stream_ms = cpu_ms_per_iter(c, [&] { pieces(ops::stream_copy); });
  if (std::memcmp(dst.data(), src.data(), bytes) != 0)
    throw std::runtime_error("stream_copy produced wrong data");
  fmt::print("\nops_bench stream_copy {} MB in {} pieces of {:.1f} MB (streaming stores: {})\n",
             cfg.copy_mb, cfg.copy_pieces, piece / 1e6, ops::stream_copy_streams() ? "yes" : "no");
  const double b = static_cast<double>(bytes);
  fmt::print("cpu   one memcpy of the whole    {:9.4f} ms {:8.2f} GB/s   (the bound)\n", whole_ms,
             gbps(b, whole_ms));
  fmt::print("cpu   memcpy per piece           {:9.4f} ms {:8.2f} GB/s   {:.2f}x the bound\n",
             memcpy_ms, gbps(b, memcpy_ms), memcpy_ms / whole_ms);
  fmt::print("cpu   stream_copy per piece      {:9.4f} ms {:8.2f} GB/s   {:.2f}x the bound\n",
             stream_ms, gbps(b, stream_ms), stream_ms / whole_ms);
}

// GB/s counts the bytes each side moves: the loop reads x and y and writes x (3 arrays), the
// memcpy reads one and writes one (2). Coefficients below 1 keep the in-place iterations
// bounded and away from subnormals (which would time the FPU's slow path, not the loop).
template <typename T, typename F>
void bench_optim_loop(const Config& cfg, const char* op, const char* dtype, F&& f) {
  const size_t n = (cfg.optim_mb << 20) / sizeof(T);
  std::vector<T> x(n), y(n), copy(n);
  std::mt19937 gen(2);
  std::uniform_int_distribution<uint32_t> bits(0x3E000000u, 0x3F800000u);  // [0.125, 1)
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = bits(gen), b = bits(gen);
    if constexpr (sizeof(T) == 4) {
      x[i] = std::bit_cast<T>(a);
      y[i] = std::bit_cast<T>(b);
    } else {
      x[i] = static_cast<T>(a >> 16);
      y[i] = static_cast<T>(b >> 16);
    }
  }
  const double op_ms = cpu_ms_per_iter(cfg, [&] { f(x.data(), y.data(), n); });
  const double peer_ms =
      cpu_ms_per_iter(cfg, [&] { std::memcpy(copy.data(), y.data(), n * sizeof(T)); });
  const double b = static_cast<double>(n * sizeof(T));
  const double op_gbps = gbps(3 * b, op_ms), peer_gbps = gbps(2 * b, peer_ms);
  fmt::print(
      "cpu   {:<15} {:<8} {:9.4f} ms {:8.2f} GB/s | memcpy {:9.4f} ms {:8.2f} GB/s | ratio "
      "{:.3f}\n",
      op, dtype, op_ms, op_gbps, peer_ms, peer_gbps, op_gbps / peer_gbps);
}

// The fused AdamW step: 4 arrays read and 3 written per element, against one copy of the same
// bytes (the bound an element-wise pass cannot beat): on the CPU the double-precision reference
// against memcpy, on a GPU the kernel against cudaMemcpy device-to-device; and the kernel's
// largest relative difference to the reference over the first 1 M elements.
void bench_adamw(const Config& cfg) {
  const size_t n = (cfg.adamw_mb << 20) / sizeof(float);
  const double moved = 7.0 * static_cast<double>(n) * sizeof(float);
  fmt::print(
      "\nops_bench adamw_step {} MB per array ({:.0f} MB moved per call: p, g, m, v in; p, "
      "m, v out)\n",
      cfg.adamw_mb, moved / 1e6);
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> p(n), g(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = dist(gen);
    g[i] = dist(gen);
    m[i] = 0.1f * dist(gen);
    v[i] = 0.01f * std::abs(dist(gen));
  }
  const std::vector<float> scalars{3e-3f, 0.8f, 0.95f, 1e-10f, 0.0f, 5.f, 1.f};
  const auto scalars_at = [](const float* b) {
    return ops::AdamWStepScalars{b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6};
  };
  {
    Config c = cfg;
    c.iters = std::max(2, cfg.iters / 8);
    c.warmup = 1;
    std::vector<float> pc = p, mc = m, vc = v;
    const double op_ms = cpu_ms_per_iter(c, [&] {
      ops::adamw_step_cpu(pc.data(), g.data(), mc.data(), vc.data(), static_cast<int64_t>(n),
                          scalars_at(scalars.data()), false);
    });
    std::vector<unsigned char> src(static_cast<size_t>(moved / 2)), dst(src.size());
    const double peer_ms =
        cpu_ms_per_iter(c, [&] { std::memcpy(dst.data(), src.data(), src.size()); });
    report("cpu", "adamw_step", op_ms, "memcpy (same bytes)", peer_ms, moved);
  }
#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
  if (ops::cuda_device_count() == 0) {
    fmt::print("cuda: skipped: no CUDA device (cuda_device_count()==0)\n");
    return;
  }
  const size_t bytes = n * sizeof(float);
  DeviceBuffer dp(bytes), dg(bytes), dm(bytes), dv(bytes), ds(scalars.size() * sizeof(float));
  DeviceBuffer dcopy(static_cast<size_t>(moved / 2)), dcopy2(static_cast<size_t>(moved / 2));
  for (auto [dev, host] : {std::pair{&dp, &p}, {&dg, &g}, {&dm, &m}, {&dv, &v}})
    CUDA_CHECK(cudaMemcpy(dev->get(), host->data(), bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(ds.get(), scalars.data(), scalars.size() * sizeof(float), cudaMemcpyHostToDevice));
  Stream stream;
  const auto f = [](DeviceBuffer& b) { return static_cast<float*>(b.get()); };
  // One step checked against the reference first (a fast wrong kernel is worthless).
  ops::adamw_step_cuda(f(dp), f(dg), f(dm), f(dv), static_cast<int64_t>(n), scalars_at(f(ds)),
                       false, stream.get());
  CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  const size_t k = std::min<size_t>(n, size_t{1} << 20);
  std::vector<float> pr(p.begin(), p.begin() + k), mr(m.begin(), m.begin() + k),
      vr(v.begin(), v.begin() + k), got(k);
  ops::adamw_step_cpu(pr.data(), g.data(), mr.data(), vr.data(), static_cast<int64_t>(k),
                      scalars_at(scalars.data()), false);
  CUDA_CHECK(cudaMemcpy(got.data(), dp.get(), k * sizeof(float), cudaMemcpyDeviceToHost));
  const double max_rel = max_relative_difference(got, pr);
  const double op_ms = gpu_ms_per_iter(cfg, stream, [&] {
    ops::adamw_step_cuda(f(dp), f(dg), f(dm), f(dv), static_cast<int64_t>(n), scalars_at(f(ds)),
                         false, stream.get());
  });
  const double peer_ms = gpu_ms_per_iter(cfg, stream, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dcopy2.get(), dcopy.get(), static_cast<size_t>(moved / 2),
                               cudaMemcpyDeviceToDevice, stream.get()));
  });
  report("cuda", "adamw_step", op_ms, "cudaMemcpy D2D", peer_ms, moved);
  fmt::print("cuda: max relative difference of p to adamw_step_cpu (first {} elements): {:.3g}{}\n",
             k, max_rel, max_rel <= 1e-5 ? "" : "  (ABOVE 1e-5)");
#endif
}

// Muon's fused tail over a stack of matrices: u read twice, p read, the new p written, against
// one copy of those bytes: on the CPU the double-precision reference against memcpy, on a GPU the
// kernels against cudaMemcpy device-to-device; and the kernels' largest relative difference to
// the reference (the new p, every element).
void bench_muon_tail(const Config& cfg) {
  const int64_t count = cfg.muon_count, rows = cfg.muon_rows, cols = cfg.muon_cols;
  const auto n = static_cast<size_t>(count * rows * cols);
  const bool reduce_cols = rows >= cols;
  const auto n_stats =
      static_cast<size_t>(ops::muon_tail_workspace(count, rows, cols, reduce_cols));
  const double moved = 4.0 * static_cast<double>(n) * sizeof(float);
  fmt::print(
      "\nops_bench muon_tail {} x {} x {} ({:.0f} MB moved per call: u twice, p in, p out)\n",
      count, rows, cols, moved / 1e6);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> u(n), p(n), sec(n_stats);
  for (size_t i = 0; i < n; ++i) {
    u[i] = dist(gen);
    p[i] = dist(gen);
  }
  for (auto& s : sec) s = 0.01f * std::abs(dist(gen));
  const std::vector<float> scalars{0.02f, 0.95f}, gate(static_cast<size_t>(count), 1.f);
  const auto args = [&](const float* u_, float* p_, float* sec_, const float* s, const float* g,
                        float* ws) {
    return ops::MuonTailArgs{.u = u_,
                             .p = p_,
                             .out = p_,
                             .sec = sec_,
                             .count = count,
                             .rows = rows,
                             .cols = cols,
                             .reduce_cols = reduce_cols,
                             .lr = s,
                             .beta2 = s + 1,
                             .gate = g,
                             .aspect = 2.f,
                             .workspace = ws};
  };
  {
    Config c = cfg;
    c.iters = std::max(2, cfg.iters / 8);
    c.warmup = 1;
    std::vector<float> pc = p, sc = sec;
    const double op_ms = cpu_ms_per_iter(c, [&] {
      ops::muon_tail_cpu(
          args(u.data(), pc.data(), sc.data(), scalars.data(), gate.data(), nullptr));
    });
    std::vector<unsigned char> src(static_cast<size_t>(moved / 2)), dst(src.size());
    const double peer_ms =
        cpu_ms_per_iter(c, [&] { std::memcpy(dst.data(), src.data(), src.size()); });
    report("cpu", "muon_tail", op_ms, "memcpy (same bytes)", peer_ms, moved);
  }
#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
  if (ops::cuda_device_count() == 0) {
    fmt::print("cuda: skipped: no CUDA device (cuda_device_count()==0)\n");
    return;
  }
  const size_t bytes = n * sizeof(float);
  DeviceBuffer du(bytes), dp(bytes), dsec(n_stats * sizeof(float)), dws(n_stats * sizeof(float)),
      ds(scalars.size() * sizeof(float)), dg(gate.size() * sizeof(float));
  DeviceBuffer dcopy(static_cast<size_t>(moved / 2)), dcopy2(static_cast<size_t>(moved / 2));
  CUDA_CHECK(cudaMemcpy(du.get(), u.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dp.get(), p.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dsec.get(), sec.data(), n_stats * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(ds.get(), scalars.data(), scalars.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(
      cudaMemcpy(dg.get(), gate.data(), gate.size() * sizeof(float), cudaMemcpyHostToDevice));
  Stream stream;
  const auto f = [](DeviceBuffer& b) { return static_cast<float*>(b.get()); };
  // One call checked against the reference first (a fast wrong kernel is worthless).
  ops::muon_tail_cuda(args(f(du), f(dp), f(dsec), f(ds), f(dg), f(dws)), stream.get());
  CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  std::vector<float> want = p, want_sec = sec, got(n);
  ops::muon_tail_cpu(
      args(u.data(), want.data(), want_sec.data(), scalars.data(), gate.data(), nullptr));
  CUDA_CHECK(cudaMemcpy(got.data(), dp.get(), bytes, cudaMemcpyDeviceToHost));
  const double max_rel = max_relative_difference(got, want);
  const double op_ms = gpu_ms_per_iter(cfg, stream, [&] {
    ops::muon_tail_cuda(args(f(du), f(dp), f(dsec), f(ds), f(dg), f(dws)), stream.get());
  });
  const double peer_ms = gpu_ms_per_iter(cfg, stream, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dcopy2.get(), dcopy.get(), static_cast<size_t>(moved / 2),
                               cudaMemcpyDeviceToDevice, stream.get()));
  });
  report("cuda", "muon_tail", op_ms, "cudaMemcpy D2D", peer_ms, moved);
  fmt::print("cuda: max relative difference of p to muon_tail_cpu: {:.3g}{}\n", max_rel,
             max_rel <= 1e-5 ? "" : "  (ABOVE 1e-5)");
#endif
}

void bench_optim(const Config& cfg) {
  fmt::print("\nops_bench optim_kernels {} MB per array\n", cfg.optim_mb);
  bench_optim_loop<float>(cfg, "scaled_sum", "float32", [](float* x, const float* y, size_t n) {
    ops::scaled_sum(x, y, 0.5f, 0.25f, n);
  });
  bench_optim_loop<uint16_t>(
      cfg, "scaled_sum", "bfloat16",
      [](uint16_t* x, const uint16_t* y, size_t n) { ops::scaled_sum(x, y, 0.5f, 0.25f, n); });
  bench_optim_loop<float>(cfg, "scale_add", "float32", [](float* x, const float* y, size_t n) {
    ops::scale_add(x, y, 0.5f, n);
  });
  bench_optim_loop<uint16_t>(
      cfg, "scale_add", "bfloat16",
      [](uint16_t* x, const uint16_t* y, size_t n) { ops::scale_add(x, y, 0.5f, n); });
  bench_optim_loop<float>(cfg, "sum_and_divide", "float32", [](float* x, const float* y, size_t n) {
    ops::sum_and_divide(x, y, 2.0f, n);
  });
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{
      "ops kernels vs their physical peer: RMSNorm vs a copy of the same bytes (CPU: memcpy, "
      "GPU: cudaMemcpy D2D), stream_copy vs memcpy, the optimizer loops vs memcpy"};
  app.add_option("--rows", cfg.rows, "rows")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  app.add_option("--cols", cfg.cols, "columns")->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  app.add_option("--iters", cfg.iters, "timed iterations per side")->check(CLI::Range(1, 1 << 20));
  app.add_option("--warmup", cfg.warmup, "untimed iterations first")->check(CLI::Range(0, 1 << 20));
  app.add_option("--copy-mb", cfg.copy_mb, "stream_copy: MB copied per call")
      ->check(CLI::Range(size_t{1}, size_t{1} << 16));
  app.add_option("--copy-pieces", cfg.copy_pieces, "stream_copy: separate copies per call")
      ->check(CLI::Range(size_t{1}, size_t{1} << 16));
  app.add_option("--adamw-mb", cfg.adamw_mb, "fused AdamW step: MB per array")
      ->check(CLI::Range(size_t{1}, size_t{1} << 16));
  app.add_option("--optim-mb", cfg.optim_mb, "optimizer loops: MB per array")
      ->check(CLI::Range(size_t{1}, size_t{1} << 16));
  app.add_option("--muon-count", cfg.muon_count, "Muon's tail: matrices per call")
      ->check(CLI::Range(int64_t{1}, int64_t{65535}));
  app.add_option("--muon-rows", cfg.muon_rows, "Muon's tail: rows of each matrix")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--muon-cols", cfg.muon_cols, "Muon's tail: columns of each matrix")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  CLI11_PARSE(app, argc, argv);

  try {
    const auto n = static_cast<size_t>(cfg.rows * cfg.cols);
    fmt::print(
        "ops_bench rmsnorm rows={} cols={} iters={} ({:.1f} MB moved per call: x in, y out)\n",
        cfg.rows, cfg.cols, cfg.iters, 2.0 * double(n) * sizeof(float) / 1e6);
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> dist(-3.f, 3.f);
    std::vector<float> x(n), w(static_cast<size_t>(cfg.cols)), y(n);
    for (auto& v : x) v = dist(gen);
    for (auto& v : w) v = dist(gen);
    bench_cpu(cfg, x, w, y);
#if defined(MEGACPP_HAVE_CUDA) && MEGACPP_HAVE_CUDA
    if (ops::cuda_device_count() == 0) {
      fmt::print("cuda: skipped: no CUDA device (cuda_device_count()==0)\n");
    } else {
      bench_cuda(cfg, x, w, y);
    }
#else
    fmt::print("cuda: skipped: built without CUDA\n");
#endif
    bench_stream_copy(cfg);
    bench_optim(cfg);
    bench_adamw(cfg);
    bench_muon_tail(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ops_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
