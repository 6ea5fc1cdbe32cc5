// Internal to megacpp::prepare: the tokenizers a dataset can be cut with.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "prepare/detail/inputs.h"
#include "prepare/prepare.h"

namespace megacpp::prepare::detail {

// Immutable once built; encode() is const and safe to call from many threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string kind() const = 0;  // the manifest's tokenizer.kind
  virtual uint32_t vocab_size() const = 0;
  virtual uint32_t eos_id() const = 0;
  // The model file's bytes (empty for byte-level).
  virtual const std::string& model_bytes() const = 0;
  // Appends the ids of `text` to `out`.
  virtual void encode(std::string_view text, std::vector<uint32_t>& out) const = 0;
};

inline constexpr uint32_t kByteEos = 256;
std::unique_ptr<Tokenizer> byte_tokenizer();

// A SentencePiece model from its serialized bytes; `what` names it in errors. Throws
// Error{kInvalidArgument}, one line, when the bytes are not a BPE or unigram model or it has no
// EOS piece.
std::unique_ptr<Tokenizer> sentencepiece_tokenizer(std::string model_bytes, std::string_view what);

// Trains a SentencePiece model on the lines of the accepted `files` (those rejection_reason
// passes), read in order, and returns its serialized bytes. Deterministic: the same files and
// options give the same bytes, whatever --threads is. Blocking; runs on one thread.
std::string train_sentencepiece(const std::vector<InputFile>& files, uint32_t vocab_size,
                                ModelType type);

}  // namespace megacpp::prepare::detail
