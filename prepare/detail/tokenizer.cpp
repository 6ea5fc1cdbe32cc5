#include "prepare/detail/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <string>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"

namespace megacpp::prepare::detail {

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  std::string kind() const override { return "byte"; }
  uint32_t vocab_size() const override { return kByteEos + 1; }
  uint32_t eos_id() const override { return kByteEos; }
  const std::string& model_bytes() const override { return none_; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    out.reserve(out.size() + text.size());
    for (char c : text) out.push_back(static_cast<unsigned char>(c));
  }

 private:
  std::string none_;
};

// ModelProto.trainer_spec (field 2) . model_type (field 3): 1 unigram, 2 bpe, 3 word, 4 char.
// Read from the wire format directly: the generated protobuf header is not installed with
// libsentencepiece-dev. Returns 0 when absent or unreadable.
int model_type_of(std::string_view proto) {
  auto varint = [](std::string_view& s, uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64 && !s.empty(); shift += 7) {
      const auto b = static_cast<unsigned char>(s.front());
      s.remove_prefix(1);
      v |= uint64_t{b & 0x7fu} << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  // Finds field `want` (wire type 0 or 2) in message `s`; returns its varint or its bytes.
  auto find = [&](std::string_view s, uint64_t want, uint64_t& value, std::string_view& bytes) {
    while (!s.empty()) {
      uint64_t key;
      if (!varint(s, key)) return false;
      const uint64_t field = key >> 3, wire = key & 7;
      uint64_t v = 0;
      switch (wire) {
        case 0:
          if (!varint(s, v)) return false;
          if (field == want) return value = v, true;
          break;
        case 1:
          if (s.size() < 8) return false;
          s.remove_prefix(8);
          break;
        case 2:
          if (!varint(s, v) || v > s.size()) return false;
          if (field == want) return bytes = s.substr(0, v), true;
          s.remove_prefix(v);
          break;
        case 5:
          if (s.size() < 4) return false;
          s.remove_prefix(4);
          break;
        default:
          return false;
      }
    }
    return false;
  };
  uint64_t v = 0;
  std::string_view spec;
  if (!find(proto, 2, v, spec)) return 0;
  std::string_view unused;
  uint64_t type = 1;  // the proto's default
  if (!find(spec, 3, type, unused)) type = 1;
  return static_cast<int>(type);
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string bytes, std::string_view what) : bytes_(std::move(bytes)) {
    auto status = sp_.LoadFromSerializedProto(bytes_);
    if (!status.ok()) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "{} is not a SentencePiece model ({}); pass a .model file written by "
                   "SentencePiece, or --vocab-size N to train one",
                   what, status.message());
    }
    switch (model_type_of(bytes_)) {
      case 1:
        kind_ = "sentencepiece-unigram";
        break;
      case 2:
        kind_ = "sentencepiece-bpe";
        break;
      default:
        MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                     "{} is a SentencePiece model of a type megacpp does not cut datasets with; "
                     "pass a BPE or unigram model",
                     what);
    }
    if (sp_.eos_id() < 0) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "{} has no EOS piece (eos_id < 0), which starts every document; train it with "
                   "eos_id >= 0",
                   what);
    }
  }
  std::string kind() const override { return kind_; }
  uint32_t vocab_size() const override { return static_cast<uint32_t>(sp_.GetPieceSize()); }
  uint32_t eos_id() const override { return static_cast<uint32_t>(sp_.eos_id()); }
  const std::string& model_bytes() const override { return bytes_; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    std::vector<int> ids;
    auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    MEGACPP_CHECK(status.ok(), ErrorKind::kInternal,
                  fmt::format("SentencePiece encode: {}", status.message()));
    out.reserve(out.size() + ids.size());
    for (int id : ids) out.push_back(static_cast<uint32_t>(id));
  }

 private:
  std::string bytes_;
  sentencepiece::SentencePieceProcessor sp_;
  std::string kind_;
};

// Lines of the accepted files, in order; empty lines are left out.
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<InputFile>& files) : files_(files) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    for (;;) {
      while (pos_ < text_.size()) {
        size_t end = text_.find('\n', pos_);
        if (end == std::string::npos) end = text_.size();
        const size_t begin = pos_;
        pos_ = end + 1;
        if (end > begin) {
          line_.assign(text_, begin, end - begin);
          return;
        }
      }
      if (next_file_ == files_.size()) {
        done_ = true;
        line_.clear();
        return;
      }
      text_ = read_file(files_[next_file_++].path);
      pos_ = 0;
      if (!rejection_reason(text_).empty()) text_.clear();
    }
  }

  const std::vector<InputFile>& files_;
  size_t next_file_ = 0;
  std::string text_;
  size_t pos_ = 0;
  std::string line_;
  bool done_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer() {
  return std::make_unique<ByteTokenizer>();
}

std::unique_ptr<Tokenizer> sentencepiece_tokenizer(std::string model_bytes, std::string_view what) {
  return std::make_unique<SentencePieceTokenizer>(std::move(model_bytes), what);
}

std::string train_sentencepiece(const std::vector<InputFile>& files, uint32_t vocab_size,
                                ModelType type) {
  // Determinism: sentences are taken in input order (no shuffling, the first
  // input_sentence_size lines) and the sampler's seed is fixed. SentencePiece's model depends on
  // its num_threads (1 and 2 give different bytes for BPE and unigram alike on 1.5 MB of
  // libstdc++ headers, each repeatable), so training always runs on one thread: the model never
  // depends on --threads.
  sentencepiece::SetRandomGeneratorSeed(1);
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", type == ModelType::kBpe ? "bpe" : "unigram"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},  // every byte has a piece: no token is <unk>
      {"character_coverage", "0.9995"},
      {"shuffle_input_sentence", "false"},
      {"input_sentence_size", "2000000"},
      {"max_sentence_length", "65536"},  // bytes; long code lines are kept
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},  // indentation
      {"remove_extra_whitespaces", "false"},     // text is kept as written
      {"add_dummy_prefix", "false"},
      {"normalization_rule_name", "identity"},
      {"num_threads", "1"},
      {"minloglevel", "2"},  // SentencePiece's own INFO/WARNING lines
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
  };
  LineIterator lines(files);
  std::string model;
  auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  if (!status.ok()) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "training a SentencePiece tokenizer (vocab {}) failed: {}; give it more text or "
                 "a smaller --vocab-size",
                 vocab_size, status.message());
  }
  return model;
}

}  // namespace megacpp::prepare::detail
