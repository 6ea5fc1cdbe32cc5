#include "prepare/detail/inputs.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"

namespace fs = std::filesystem;

namespace megacpp::prepare::detail {

namespace {

struct Found {
  InputFile file;
  std::pair<dev_t, ino_t> id;
};

// stat() following symlinks; false when it cannot be read (a dangling link).
bool stat_follow(const fs::path& p, struct stat& st) {
  return ::stat(p.c_str(), &st) == 0;
}

}  // namespace

std::vector<InputFile> expand_inputs(const std::vector<fs::path>& inputs) {
  std::vector<Found> found;
  for (const auto& input : inputs) {
    struct stat st {};
    if (!stat_follow(input, st)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "input {} cannot be read ({}); pass files or folders of UTF-8 text",
                   input.string(), std::strerror(errno));
    }
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(input, ec);
    if (ec) canonical = input;
    const std::string root = canonical.filename().string();
    if (S_ISREG(st.st_mode)) {
      found.push_back({{input, root, static_cast<uint64_t>(st.st_size)}, {st.st_dev, st.st_ino}});
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "input {} is neither a file nor a folder; pass files or folders of UTF-8 text",
                   input.string());
    }
    size_t before = found.size();
    fs::recursive_directory_iterator it(input, fs::directory_options::none, ec);
    if (ec) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "input folder {} cannot be listed ({})",
                   input.string(), ec.message());
    }
    for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) {
        MEGACPP_FAIL(ErrorKind::kInvalidArgument, "input folder {} cannot be listed ({})",
                     input.string(), ec.message());
      }
      const fs::path& p = it->path();
      struct stat fst {};
      if (!stat_follow(p, fst) || !S_ISREG(fst.st_mode)) continue;
      std::string display = (fs::path(root) / p.lexically_relative(input)).string();
      found.push_back(
          {{p, std::move(display), static_cast<uint64_t>(fst.st_size)}, {fst.st_dev, fst.st_ino}});
    }
    if (found.size() == before) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "input folder {} holds no files; pass folders of UTF-8 text", input.string());
    }
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const Found& a, const Found& b) { return a.file.display < b.file.display; });
  std::set<std::pair<dev_t, ino_t>> seen;
  std::vector<InputFile> out;
  out.reserve(found.size());
  for (auto& f : found) {
    if (seen.insert(f.id).second) out.push_back(std::move(f.file));
  }
  return out;
}

std::string rejection_reason(std::string_view text) {
  if (text.empty()) return "empty file";
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  auto bad = [&](size_t at) {
    return fmt::format("not UTF-8: invalid byte 0x{:02x} at offset {}", s[at], at);
  };
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      if (c == 0) return fmt::format("holds a NUL byte at offset {}", i);
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return bad(i);  // a continuation byte, an overlong lead (0xc0, 0xc1) or 0xf5..0xff
    }
    if (i + len > n) {
      return fmt::format("not UTF-8: truncated sequence at offset {}", i);
    }
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return bad(i + k);
      cp = (cp << 6) | (s[i + k] & 0x3f);
    }
    const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
    if (overlong || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return bad(i);
    i += len;
  }
  return {};
}

}  // namespace megacpp::prepare::detail
