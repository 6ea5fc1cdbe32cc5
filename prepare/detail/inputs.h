// Internal to megacpp::prepare: finding the input files and deciding which are documents.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::prepare::detail {

struct InputFile {
  std::filesystem::path path;  // as opened (the argument joined with the path below it)
  std::string display;         // relative to the input root, led by the root's own name
  uint64_t size = 0;           // at expansion (progress only; the bytes read are recorded)
};

// Files under `inputs`: a file stands for itself, a folder for every regular file below it
// (recursed; symlinks to files followed, symlinks to folders not), sorted by `display`
// (byte order), a file reached twice (same device and inode) kept once. Throws
// Error{kInvalidArgument}, one line, for an input that does not exist, is neither a file nor
// a folder, or is a folder without files.
std::vector<InputFile> expand_inputs(const std::vector<std::filesystem::path>& inputs);

// Empty when `text` is a document (valid UTF-8: no overlong forms, surrogates or code points
// above U+10FFFF; no NUL byte; not empty); else why it is skipped, e.g.
// "not UTF-8: invalid byte 0xff at offset 12".
std::string rejection_reason(std::string_view text);

}  // namespace megacpp::prepare::detail
