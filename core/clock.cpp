#include "core/clock.h"

#include <time.h>

#include <fmt/format.h>

namespace megacpp {

namespace {
int64_t clock_ns(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}
}  // namespace

int64_t mono_ns() {
  return clock_ns(CLOCK_MONOTONIC);
}
int64_t wall_ns() {
  return clock_ns(CLOCK_REALTIME);
}

std::string rfc3339(int64_t ns) {
  time_t secs = ns / 1'000'000'000;
  int ms = static_cast<int>((ns / 1'000'000) % 1000);
  tm t{};
  gmtime_r(&secs, &t);
  char buf[40];
  strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &t);
  return fmt::format("{}.{:03d}Z", buf, ms);
}

}  // namespace megacpp
