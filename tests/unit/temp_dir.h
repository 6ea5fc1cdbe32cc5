// megacpp::test_support::TempDir — torch-free, so the sanitizer build's unit tests share it
// with the torch tests (test_support.h includes it).
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "core/error.h"

namespace megacpp::test_support {

// A private temporary directory (mkdtemp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "megacpp-test-XXXXXX").string();
    MEGACPP_CHECK(::mkdtemp(tmpl.data()) != nullptr, ErrorKind::kSystem, "mkdtemp");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace megacpp::test_support
