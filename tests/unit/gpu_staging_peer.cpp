// The checkpointer's side of gpu_staging_test, in a process of its own (an IPC event cannot be
// opened by the process that made it, and a forked child of a CUDA process cannot use CUDA):
// binds the handle socket, and for each line "read <i>" on stdin reads rank 0's staged buffer of
// the given generation, as step i's snapshot, through StagingImports, writes what it got to
// <out>/read-<i>.bin and
// answers "status <i> <ok|no-buffer|gone|not-copied>". Exits 0 at the end of stdin.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "core/error.h"
#include "stages/checkpointer/staging_imports.h"

int main(int argc, char** argv) {
  using megacpp::checkpointer::StagingImports;
  if (argc != 5) {
    std::fprintf(stderr, "usage: gpu_staging_peer SOCKET GENERATION BYTES OUT_DIR\n");
    return 2;
  }
  try {
    StagingImports::Options o;
    o.buffer_wait = std::chrono::milliseconds(10000);
    o.copy_wait = std::chrono::milliseconds(10000);
    StagingImports imports(argv[1], o);
    const uint64_t generation = std::stoull(argv[2]);
    const uint64_t bytes = std::stoull(argv[3]);
    std::cout << "listening" << std::endl;
    std::string word, index;
    while (std::cin >> word >> index) {
      const auto got = imports.read(0, generation, bytes, std::stoull(index));
      const char* status = "ok";
      switch (got.status) {
        case StagingImports::Status::kOk: {
          std::ofstream f(std::string(argv[4]) + "/read-" + index + ".bin", std::ios::binary);
          f.write(reinterpret_cast<const char*>(got.bytes.data()),
                  static_cast<std::streamsize>(got.bytes.size()));
          break;
        }
        case StagingImports::Status::kNoBuffer:
          status = "no-buffer";
          break;
        case StagingImports::Status::kRankGone:
          status = "gone";
          break;
        case StagingImports::Status::kNotCopied:
          status = "not-copied";
          break;
        case StagingImports::Status::kRefused:
          status = "refused";
          std::cerr << "gpu_staging_peer: the import was refused: " << got.why << std::endl;
          break;
      }
      std::cout << "status " << index << " " << status << std::endl;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_staging_peer: %s\n", e.what());
    return 1;
  }
}
