// `megacpp prepare` throughput: MB/s of input text through the whole pipeline (read, UTF-8
// check, tokenize, write shards and manifest) on libstdc++'s header tree, byte-level and with a
// SentencePiece-1024 model, at 1 and 2 threads; prints per-thread MB/s and the 2-thread/1-thread
// scaling. The SentencePiece model is trained once first (its time is printed, not counted).
// Not a test: nothing is asserted.
#include <glob.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "core/error.h"
#include "prepare/prepare.h"

namespace fs = std::filesystem;
namespace pp = megacpp::prepare;

namespace {

fs::path newest_cxx_headers() {
  glob_t g{};
  fs::path out;
  if (::glob("/usr/include/c++/*", 0, nullptr, &g) == 0 && g.gl_pathc > 0) {
    out = g.gl_pathv[g.gl_pathc - 1];
  }
  ::globfree(&g);
  return out;
}

struct Scratch {
  Scratch() {
    std::string tmpl = (fs::temp_directory_path() / "megacpp-bench-prepare-XXXXXX").string();
    MEGACPP_CHECK(::mkdtemp(tmpl.data()) != nullptr, megacpp::ErrorKind::kSystem, "mkdtemp");
    path = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

// What 2 threads of pure compute get on this machine now, against 1 (a shared machine can give
// less than 2x): the ceiling for the scaling figures below.
double compute_scaling() {
  auto spin = [](unsigned threads) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([] {
        volatile uint64_t x = 0;
        for (uint64_t i = 0; i < 400'000'000; ++i) x = x + i;
      });
    }
    for (auto& t : pool) t.join();
    return threads / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const double one = spin(1);
  const double two = spin(2);
  return two / one;
}

pp::PrepareResult run(const pp::PrepareConfig& base, unsigned threads, const fs::path& out) {
  pp::PrepareConfig c = base;
  c.threads = threads;
  c.out_dir = out;
  return pp::prepare(c);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megacpp prepare throughput, byte-level and SentencePiece, 1 vs 2 threads"};
  fs::path input = newest_cxx_headers();
  uint32_t vocab = 1024;
  int repeat = 2;
  app.add_option("--input", input, "Text tree to prepare")->capture_default_str();
  app.add_option("--vocab-size", vocab, "SentencePiece vocabulary")->capture_default_str();
  app.add_option("--repeat", repeat, "Runs per point; the best is kept")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (input.empty() || !fs::is_directory(input)) {
    fmt::print(stderr, "bench_prepare: no input tree (pass --input DIR)\n");
    return 2;
  }
  fmt::print("machine: 2 threads of pure compute run {:.2f}x the work of 1 (the scaling ceiling)\n",
             compute_scaling());
  Scratch scratch;
  pp::PrepareConfig base;
  base.inputs = {input};
  base.progress = pp::ProgressMode::kNone;

  pp::PrepareConfig train = base;
  train.tokenizer = pp::TokenizerMode::kTrain;
  train.vocab_size = vocab;
  const auto t0 = std::chrono::steady_clock::now();
  auto trained = run(train, 2, scratch.path / "trained");
  const double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("input {}: {} documents, {:.1f} MB; SentencePiece BPE-{} trained + cut in {:.1f} s\n",
             input.string(), trained.manifest.documents, trained.input_bytes / 1e6, vocab, train_s);

  pp::PrepareConfig sp = base;
  sp.tokenizer = pp::TokenizerMode::kLoad;
  sp.tokenizer_model = scratch.path / "trained" / "tokenizer.model";
  struct Case {
    const char* name;
    const pp::PrepareConfig* config;
  };
  int n = 0;
  for (const Case& k : {Case{"byte-level", &base}, Case{"sentencepiece-1024", &sp}}) {
    double best[3] = {0, 0, 0};
    uint64_t tokens = 0;
    for (unsigned threads : {1u, 2u}) {
      for (int r = 0; r < repeat; ++r) {
        auto res = run(*k.config, threads, scratch.path / fmt::format("out{}", n++));
        best[threads] = std::max(best[threads], res.input_bytes / 1e6 / res.seconds);
        tokens = res.tokens;
      }
    }
    fmt::print(
        "{:<19} {:>10} tokens | 1 thread {:7.1f} MB/s | 2 threads {:7.1f} MB/s "
        "({:6.1f} MB/s per thread) | scaling 2/1 = {:.2f}x\n",
        k.name, tokens, best[1], best[2], best[2] / 2, best[2] / best[1]);
  }
  return 0;
}
