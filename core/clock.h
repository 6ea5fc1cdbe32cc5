// Clocks: the lowest file of core/ (it includes no other megacpp header), so that Error can
// stamp when it was raised without a cycle through the utilities that throw Errors.
#pragma once

#include <cstdint>
#include <string>

namespace megacpp {

// CLOCK_MONOTONIC nanoseconds: comparable across processes on one host (first-failure order).
int64_t mono_ns();
// CLOCK_REALTIME nanoseconds since the epoch.
int64_t wall_ns();
// RFC 3339 UTC text with milliseconds for a wall_ns() value.
std::string rfc3339(int64_t wall_ns);

}  // namespace megacpp
