// Small process-wide utilities: durable file writes, checksums, host facts, logging. The top
// file of core/: it re-exports the lower ones (clock.h, fd.h, knobs.h) for its callers, and
// none of them includes it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/clock.h"
#include "core/fd.h"
#include "core/knobs.h"

namespace megacpp {

// Durable writes. write_file_atomic: write `path.tmp.<pid>`, fsync, rename over `path`,
// fsync the parent directory. A crash leaves either the old file or the new one.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);
void fsync_path(const std::filesystem::path& path);  // file or directory
std::string read_file(const std::filesystem::path& path);

// Hex text of XXH3-64 over bytes (checksums in manifests).
std::string xxh3_hex(std::string_view bytes);

// This host, for receipts: /proc/cpuinfo's first "model name" ("" when there is none) and
// uname's "sysname release version machine".
std::string cpu_model();
std::string kernel_description();
// The bfloat16 matrix units this CPU has and the kernel lets processes use, from
// /proc/cpuinfo's flags: "amx_bf16" and/or "avx512_bf16", space-separated in that order; ""
// when it has none (bfloat16 matmuls then run emulated, several times slower than float32).
std::string cpu_bf16_units();
// This process's resident memory now and its peak so far (VmRSS, VmHWM of /proc/self/status), in
// bytes; zeros when unreadable. Resident shared memory (mapped rings and staging) counts.
// `file`: of the resident memory now, the pages of mapped files (RssFile: the libraries' code,
// paged in as it first runs; shared with every process mapping them, and reclaimable).
struct ProcessMemory {
  uint64_t resident = 0;
  uint64_t peak = 0;
  uint64_t file = 0;
};
ProcessMemory process_memory();
// A statfs f_type's filesystem name ("ext4", "xfs", "tmpfs", "overlay", "btrfs", "nfs", "zfs",
// "fuse"), else its magic number in hex; and the filesystem `path` lies on ("?" when statfs
// fails), for receipts and the benchmarks' figures.
std::string filesystem_type_name(long f_type);
std::string filesystem_type(const std::filesystem::path& path);

// Log lines go to stderr (a stage's stderr is its log file) with a prefix naming the
// process, e.g. "[trainer-1] ...". set_log_prefix is called once in main.
void set_log_prefix(std::string prefix);
void log_line(std::string_view level, std::string_view text);
template <typename... A>
void log_info(fmt::format_string<A...> f, A&&... a) {
  log_line("info", fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void log_warn(fmt::format_string<A...> f, A&&... a) {
  log_line("warn", fmt::format(f, std::forward<A>(a)...));
}
template <typename... A>
void log_error(fmt::format_string<A...> f, A&&... a) {
  log_line("error", fmt::format(f, std::forward<A>(a)...));
}

}  // namespace megacpp
