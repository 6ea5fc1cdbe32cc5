// Helpers shared by the unit tests (header-only; not part of any library).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <capnp/message.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/util.h"
#include "schemas/json.h"
#include "schemas/launch.capnp.h"
#include "schemas/run_layout.h"
#include "tests/unit/temp_dir.h"
#include "tools/forked_world/forked_world.h"

namespace megacpp::test_support {

// Runs the world's ranks, rank r running body(r) in a forked child (its return value is the
// child's exit status), bounded: ranks still running after `timeout` are SIGKILLed and the
// test fails (a hung rank must not hang the test). Returns each rank's wait status, in rank
// order. Needs megacpp::forked_world.
inline std::vector<int> run_ranks_within(const forked_world::ForkedWorld& world,
                                         const std::function<int(uint32_t rank)>& body,
                                         std::chrono::seconds timeout) {
  const forked_world::ReapResult r =
      world.run(body, forked_world::ReapOptions{.deadline = forked_world::Clock::now() + timeout});
  if (r.any_killed()) ADD_FAILURE() << "a child did not finish within " << timeout.count() << " s";
  return r.status;
}

// Distances between value vectors. A NaN or Inf operand (or a difference that overflows), or
// vectors of different sizes, make the distance NaN, so that every bound on it fails — `<=`,
// `<`, `>` and `>=` alike — whereas std::max(m, NaN) would keep m and pass it.
template <typename T>
double max_abs_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!std::isfinite(d)) return std::numeric_limits<double>::quiet_NaN();
    m = d > m ? d : m;
  }
  return m;
}
template <typename T>
double mean_abs_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.empty()) return std::numeric_limits<double>::quiet_NaN();
  const double m = max_abs_diff(a, b);
  if (std::isnan(m)) return m;
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i)
    sum += std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
  return sum / static_cast<double>(a.size());
}
template <typename T>
bool all_finite(const std::vector<T>& v) {
  for (const T& x : v)
    if (!std::isfinite(static_cast<double>(x))) return false;
  return true;
}

// Raw float32 files, how forked ranks hand vectors back to the test process.
inline bool write_floats(const std::filesystem::path& path, const std::vector<float>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()),
          static_cast<std::streamsize>(v.size() * sizeof(float)));
  return f.good();
}
inline std::vector<float> read_floats(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

// Writes RUN/launch.json with what a checkpointer launched on `run_dir` reads: run id, the
// control and checkpoint endpoints, the world, a 100 ms heartbeat and a recipe hash.
inline void write_test_launch(const std::filesystem::path& run_dir, const std::string& run_id,
                              const std::string& control, const std::string& checkpoint,
                              uint32_t world, const std::string& recipe_hash) {
  capnp::MallocMessageBuilder message;
  auto l = message.initRoot<schema::LaunchContract>();
  l.setSchemaVersion(schema::SCHEMA_VERSION);
  l.setRunId(run_id);
  l.setRunDir(run_dir.string());
  l.setControlEndpoint(control);
  l.setCheckpointEndpoint(checkpoint);
  l.setWorld(world);
  l.setHeartbeatIntervalMs(100);
  l.getRecipe().setHash(recipe_hash);
  write_file_atomic(layout::launch_path(run_dir), schemas::to_json(l.asReader()));
}

}  // namespace megacpp::test_support
