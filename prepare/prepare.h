// megacpp::prepare — `megacpp prepare`: turns folders of UTF-8 text into an llm.c token
// dataset (train_NNNNNN.bin, val_NNNNNN.bin, tokenizer.model, dataset.json; see
// data/dataset_manifest.h) that a recipe's [data] section can name.
//
// Contract: every input file is one document, written as [EOS] + its tokens (llm.c's
// convention: the end-of-text id starts each document), in the order of the sorted input
// paths, so the output is byte-identical for any thread count. A file that is not valid UTF-8
// or holds a NUL byte is skipped and recorded in the manifest, never fatal. dataset.json is
// written last and atomically: it is the commit point. Bad options or inputs throw
// Error{kInvalidArgument} before anything is written; any failure after that removes what
// this call wrote, leaving the out directory as it found it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset_manifest.h"

namespace megacpp::prepare {

enum class TokenizerMode : uint8_t {
  kByte,   // ids 0..255 are the bytes, EOS = 256, vocabulary 257
  kLoad,   // a SentencePiece model file (`tokenizer_model`); EOS = its eos_id
  kTrain,  // train SentencePiece (`vocab_size`, `model_type`) on the accepted inputs
};
enum class ModelType : uint8_t { kBpe, kUnigram };
// Where progress goes (stderr): kAuto = a live line on a terminal, else log lines.
enum class ProgressMode : uint8_t { kAuto, kTty, kPlain, kNone };

inline constexpr uint64_t kDefaultShardTokens = 100'000'000;  // llm.c's fineweb shards
inline constexpr uint32_t kMinTrainVocab = 512;
inline constexpr uint32_t kMaxTrainVocab = 1u << 20;

struct PrepareConfig {
  std::vector<std::filesystem::path> inputs;  // files or folders (recursed)
  std::filesystem::path out_dir;              // created; must be missing or empty
  TokenizerMode tokenizer = TokenizerMode::kByte;
  std::filesystem::path tokenizer_model;   // kLoad
  uint32_t vocab_size = 0;                 // kTrain
  ModelType model_type = ModelType::kBpe;  // kTrain
  unsigned threads = 0;                    // tokenizing threads; 0 = hardware threads
  uint64_t shard_tokens = kDefaultShardTokens;
  uint32_t val_every = 100;  // every K-th document goes to val; 0 = no val split
  std::optional<std::filesystem::path> stage_to;  // stage_dataset(out_dir, *stage_to) after
  ProgressMode progress = ProgressMode::kAuto;
};

// The one place options are checked. Throws Error{kInvalidArgument}, one line naming the
// option and the accepted values. Returns the config with defaults resolved (threads).
PrepareConfig validate(PrepareConfig config);

struct PrepareResult {
  std::filesystem::path out_dir;
  data::DatasetManifest manifest;
  uint64_t tokens = 0;
  uint64_t input_bytes = 0;  // bytes of the accepted documents
  double seconds = 0;        // wall time, training included
  std::optional<data::StageReport> staged;
  std::optional<std::filesystem::path> staged_to;
};

// Runs the whole pipeline (blocking; uses config.threads threads). See the contract above.
PrepareResult prepare(const PrepareConfig& config);

// "prepared N documents (S skipped files), T tokens in K shards (a train, b val), ..." — one
// line for the CLI's last word.
std::string summary_line(const PrepareResult& result);

}  // namespace megacpp::prepare
