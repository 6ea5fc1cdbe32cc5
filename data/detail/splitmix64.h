// megacpp::data::detail::splitmix64 — the one 64-bit mixer behind the built-in corpus's text
// and the sampler's per-epoch permutation. Changing it changes the corpus bytes and the window
// order (the golden losses pin both).
#pragma once

#include <cstdint>

namespace megacpp::data::detail {

// Advances `s` and returns the next value of the SplitMix64 sequence.
inline uint64_t splitmix64(uint64_t& s) noexcept {
  uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace megacpp::data::detail
