#include "data/shards.h"

#include <array>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::data {

const char* format_name(ShardFormat f) noexcept {
  switch (f) {
    case ShardFormat::kLlmc:
      return "llmc";
    case ShardFormat::kMegatron:
      return "megatron";
  }
  return "?";
}

void write_llmc_shard(const std::filesystem::path& path, std::span<const uint32_t> tokens,
                      TokenWidth width) {
  MEGACPP_CHECK(tokens.size() <= INT32_MAX, ErrorKind::kInvalidArgument,
                fmt::format("{}: {} tokens exceed the llm.c header's int32 count", path.string(),
                            tokens.size()));
  std::array<int32_t, kLlmcHeaderInts> header{};
  const bool narrow = width == TokenWidth::kU16;
  header[0] = narrow ? kLlmcMagic16 : kLlmcMagic32;
  header[1] = narrow ? kLlmcVersion16 : kLlmcVersion32;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(llmc_file_bytes(tokens.size(), width), '\0');
  std::memcpy(bytes.data(), header.data(), sizeof header);
  char* out = bytes.data() + sizeof header;
  if (narrow) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      MEGACPP_CHECK(tokens[i] <= UINT16_MAX, ErrorKind::kInvalidArgument,
                    fmt::format("{}: token {} at index {} does not fit a uint16 shard",
                                path.string(), tokens[i], i));
      const auto t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(out + i * 2, &t, 2);
    }
  } else {
    std::memcpy(out, tokens.data(), tokens.size_bytes());
  }
  write_file_atomic(path, bytes);
}

}  // namespace megacpp::data
