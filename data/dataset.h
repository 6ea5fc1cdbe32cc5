// megacpp::data::resolve_dataset — the pre-flight of a run's data: which files a recipe's
// [data] names under --data-dir, each opened and validated completely (format, size, every
// token below the vocabulary) with its XXH3, and the window rule checked at the run's batch
// geometry. The supervisor runs it before it creates the run directory, so a bad shard or an
// empty data folder ends the command with one line and nothing written.
//
// Blocking: reads every byte of every file once (threads across files), except files whose
// name, size, mtime, ctime and inode match a line of the check cache beside them
// (kCheckCacheName, written after a pre-flight that passed; skipped on a read-only volume) and
// for which no dataset.json records an XXH3 (those are hashed on every pre-flight).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "data/shards.h"
#include "recipes/recipe.h"
#include "schemas/launch.capnp.h"

namespace megacpp::data {

// The check cache beside the files (dataset.cpp): a file whose name, size, mtime, ctime and
// inode are unchanged since it last passed is not rescanned, unless dataset.json records its
// XXH3 (the cache never stands in for a recorded hash).
inline constexpr const char* kCheckCacheName = ".megacpp-shard-checks";

struct DatasetFile {
  std::filesystem::path path;  // absolute; the token file
  uint64_t tokens = 0;
  uint64_t bytes = 0;
  uint64_t documents = 0;
  uint32_t max_token = 0;
  std::string xxh3;
};

struct ResolvedDataset {
  ShardFormat format = ShardFormat::kLlmc;
  TokenWidth width = TokenWidth::kU16;  // of the files
  uint32_t slot_token_bytes = 2;        // of the batch slots
  uint64_t windows = 0;
  uint64_t documents_without_window = 0;
  int64_t eos_id = -1;         // the recipe's, else the dataset manifest's; -1 = none
  std::string manifest;        // the dataset.json beside the files (`megacpp prepare`), if any
  std::string manifest_xxh3;   // XXH3 of its bytes (receipts/runtime_provenance.json)
  std::string tokenizer;       // its tokenizer kind
  std::string staged_from;     // --stage-data: the directory the files were copied from
  uint64_t files_scanned = 0;  // files read in full this time (the others: the check cache)
  std::vector<DatasetFile> files;
};

// When the files' directory holds a dataset.json (data/dataset_manifest.h), it is read and
// held to: the recipe's vocab_size must cover the tokenizer's, every listed file must have
// the size and XXH3 the manifest records, and its EOS id is used when the recipe sets none.
// Throws Error{kInvalidArgument} (no files, mixed token widths, the window rule, a vocabulary
// smaller than the data's) or Error{kCorruption} (a bad file), one line each.
// `batch` is the attempt's geometry (recipes/recipe.h resolve_batch): its rows per rank, seq_len,
// slot token width and world are what the window rule is checked at.
ResolvedDataset resolve_dataset(const recipe::Recipe& recipe, const recipe::BatchGeometry& batch,
                                const std::filesystem::path& data_dir, unsigned threads);

// The val split a run evaluates on (README.md "Validation loss"), resolved with the same checks
// as the training files: for the built-in corpus its generated val shard, else the files of
// [data] path with split "val". When the recipe evaluates (train.eval_every > 0) but cannot —
// it trains on the val split, the data has none, the path cannot tell the splits apart, the split
// holds no window — `off` says so in one line for the console and the launch contract, and
// `dataset` is empty. Throws as resolve_dataset for a bad val file.
struct ResolvedValidation {
  std::optional<ResolvedDataset> dataset;
  std::string off;     // "evaluation is off: ..." when the recipe asks and the run cannot
  std::string notice;  // one line when the split holds fewer windows than eval_tokens asks
  uint64_t split_windows = 0;
  uint64_t windows = 0;  // per evaluation: eval_tokens / seq_len, at most split_windows
  std::string digest;    // XXH3 of the files' XXH3s, token counts and the windows read
};
ResolvedValidation resolve_validation(const recipe::Recipe& recipe,
                                      const recipe::BatchGeometry& batch,
                                      const ResolvedDataset& train,
                                      const std::filesystem::path& data_dir, unsigned threads);
void to_spec(const ResolvedValidation& validation, uint32_t every, uint32_t ring_slots,
             schema::Validation::Builder out);

// The launch contract's form of a resolved dataset, and back.
void to_spec(const ResolvedDataset& dataset, schema::Dataset::Builder out);
ResolvedDataset from_spec(schema::Dataset::Reader in);

// Opens the files of a resolved dataset again (the data loader: structure checked, tokens not
// rescanned) and checks each still has the token count the pre-flight saw. For pack = false
// llm.c files, splits them into documents at the dataset's eos_id.
std::vector<std::unique_ptr<Shard>> open_dataset(const ResolvedDataset& dataset, bool pack);

}  // namespace megacpp::data
