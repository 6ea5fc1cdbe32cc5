#include "prepare/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "data/shards.h"
#include "prepare/detail/inputs.h"
#include "prepare/detail/tokenizer.h"

namespace fs = std::filesystem;

namespace megacpp::prepare {

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kTokenizerFile = "tokenizer.model";

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double mb(uint64_t bytes) {
  return static_cast<double>(bytes) / 1e6;
}

// The out directory: refused unless missing or empty; created on first write; on destruction
// without commit() every file written through it is removed (and the directory, if this
// created it), so a failed prepare leaves the directory as it found it.
class OutDir {
 public:
  explicit OutDir(fs::path dir) : dir_(std::move(dir)) {
    std::error_code ec;
    auto st = fs::status(dir_, ec);
    if (!fs::exists(st)) return;
    if (!fs::is_directory(st)) {
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--out {} is not a directory; pass a new or empty one", dir_.string());
    }
    if (!fs::is_empty(dir_, ec) || ec) {
      const bool dataset = fs::exists(dir_ / data::kDatasetManifestName);
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "--out {} is not empty{}; pass a new or empty directory (or remove it first)",
                   dir_.string(), dataset ? " (it holds a prepared dataset)" : "");
    }
    existed_ = true;
  }
  OutDir(const OutDir&) = delete;
  OutDir& operator=(const OutDir&) = delete;
  ~OutDir() {
    if (committed_) return;
    std::error_code ec;
    for (const auto& f : written_) {
      fs::remove(f, ec);
      auto tmp = f;
      tmp += fmt::format(".tmp.{}", ::getpid());
      fs::remove(tmp, ec);
    }
    if (created_) fs::remove(dir_, ec);
  }
  // The path of `name` inside the directory, created if needed; recorded for removal.
  fs::path file(const std::string& name) {
    if (!existed_ && !created_) {
      std::error_code ec;
      fs::create_directories(dir_, ec);
      if (ec) {
        MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--out {} cannot be created ({})", dir_.string(),
                     ec.message());
      }
      created_ = true;
    }
    written_.push_back(dir_ / name);
    return dir_ / name;
  }
  void commit() { committed_ = true; }

 private:
  fs::path dir_;
  bool existed_ = false;
  bool created_ = false;
  bool committed_ = false;
  std::vector<fs::path> written_;
};

// Progress on stderr: a live line on a terminal, else a log line every few seconds.
class Progress {
 public:
  Progress(ProgressMode mode, size_t files, uint64_t bytes)
      : files_(files), bytes_(bytes), t0_(Clock::now()), last_(t0_) {
    if (mode == ProgressMode::kAuto) mode = ::isatty(2) ? ProgressMode::kTty : ProgressMode::kPlain;
    mode_ = mode;
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }
  void note(std::string_view text) {
    if (mode_ == ProgressMode::kNone) return;
    finish();
    log_info("{}", text);
  }
  void tick(size_t files_done, uint64_t bytes_done) {
    if (mode_ == ProgressMode::kNone) return;
    const auto now = Clock::now();
    const auto every = mode_ == ProgressMode::kTty ? std::chrono::milliseconds(200)
                                                   : std::chrono::milliseconds(5000);
    if (now - last_ < every && files_done != files_) return;
    last_ = now;
    const double s = std::max(seconds_since(t0_), 1e-9);
    const double pct = bytes_ ? 100.0 * static_cast<double>(bytes_done) / bytes_ : 100.0;
    const std::string text =
        fmt::format("tokenizing {}/{} files | {:.1f}/{:.1f} MB ({:.0f}%) | {:.1f} MB/s", files_done,
                    files_, mb(bytes_done), mb(bytes_), pct, mb(bytes_done) / s);
    if (mode_ == ProgressMode::kTty) {
      const int bar = static_cast<int>(pct / 5);
      fmt::print(stderr, "\r[{:<20}] {}\x1b[K", std::string(static_cast<size_t>(bar), '#'), text);
      std::fflush(stderr);
      live_ = true;
    } else {
      log_info("{}", text);
    }
  }

 private:
  void finish() {
    if (!live_) return;
    fmt::print(stderr, "\n");
    live_ = false;
  }
  ProgressMode mode_;
  size_t files_;
  uint64_t bytes_;
  Clock::time_point t0_, last_;
  bool live_ = false;
};

// One tokenized input: its manifest entry and (when accepted) [EOS] + tokens.
struct Document {
  data::DatasetInput input;
  std::vector<uint32_t> tokens;
  uint64_t text_bytes = 0;
};

Document tokenize_file(const detail::InputFile& f, const detail::Tokenizer& tok) {
  Document d;
  std::string text;
  try {
    text = read_file(f.path);
  } catch (const Error& e) {
    MEGACPP_FAIL_LIKE(e, "input {} cannot be read ({}); fix it or leave it out", f.path.string(),
                      std::strerror(e.sys_errno()));
  }
  d.input.path = f.display;
  d.input.bytes = text.size();
  d.input.xxh3 = xxh3_hex(text);
  d.input.skipped = detail::rejection_reason(text);
  if (!d.input.skipped.empty()) return d;
  d.input.documents = 1;
  d.text_bytes = text.size();
  d.tokens.push_back(tok.eos_id());
  tok.encode(text, d.tokens);
  return d;
}

// Tokenizes files on `threads` workers and hands the documents to `consume` in file order on
// the calling thread. At most `window` documents are in flight. A worker's exception stops the
// others and is rethrown here; so is consume's, after the workers have stopped.
template <typename Consume>
void tokenize_in_order(const std::vector<detail::InputFile>& files, const detail::Tokenizer& tok,
                       unsigned threads, Consume&& consume) {
  const size_t window = std::max<size_t>(4, size_t{threads} * 4);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::optional<Document>> slots(window);
  size_t next = 0, consumed = 0;
  bool stop = false;
  std::exception_ptr error;
  auto worker = [&] {
    for (;;) {
      size_t i;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || next >= files.size() || next < consumed + window; });
        if (stop || next >= files.size()) return;
        i = next++;
      }
      try {
        Document d = tokenize_file(files[i], tok);
        std::lock_guard lock(mu);
        slots[i % window] = std::move(d);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!error) error = std::current_exception();
        stop = true;
      }
      cv.notify_all();
    }
  };
  std::vector<std::jthread> pool;
  // Declared after the pool, so destroyed first: stops and wakes the workers before the joins.
  struct Stopper {
    std::mutex& mu;
    std::condition_variable& cv;
    bool& stop;
    ~Stopper() {
      {
        std::lock_guard lock(mu);
        stop = true;
      }
      cv.notify_all();
    }
  } stopper{mu, cv, stop};
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (size_t i = 0; i < files.size(); ++i) {
    Document d;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return error || slots[i % window].has_value(); });
      if (error) std::rethrow_exception(error);
      d = std::move(*slots[i % window]);
      slots[i % window].reset();
      consumed = i + 1;
    }
    cv.notify_all();
    consume(std::move(d));
  }
}

// Cuts one split's token stream into llm.c shards of `shard_tokens` tokens (the last shorter).
class ShardWriter {
 public:
  ShardWriter(OutDir& out, std::string split, uint64_t shard_tokens, data::TokenWidth width,
              std::vector<data::DatasetShard>& shards)
      : out_(out),
        split_(std::move(split)),
        shard_tokens_(shard_tokens),
        width_(width),
        shards_(shards) {}
  void add(const std::vector<uint32_t>& doc) {
    starts_.push_back(buf_.size());
    buf_.insert(buf_.end(), doc.begin(), doc.end());
    while (buf_.size() >= shard_tokens_) flush(shard_tokens_);
  }
  void finish() {
    if (!buf_.empty()) flush(buf_.size());
  }

 private:
  void flush(size_t n) {
    const std::string name = fmt::format("{}_{:06d}.bin", split_, index_++);
    const fs::path path = out_.file(name);
    data::write_llmc_shard(path, std::span<const uint32_t>(buf_.data(), n), width_);
    const auto docs =
        std::count_if(starts_.begin(), starts_.end(), [&](size_t s) { return s < n; });
    shards_.push_back({name, split_, static_cast<uint32_t>(n), static_cast<uint32_t>(docs),
                       data::llmc_file_bytes(n, width_), data::xxh3_file_hex(path)});
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(n));
    std::erase_if(starts_, [&](size_t s) { return s < n; });
    for (auto& s : starts_) s -= n;
  }

  OutDir& out_;
  std::string split_;
  uint64_t shard_tokens_;
  data::TokenWidth width_;
  std::vector<data::DatasetShard>& shards_;
  std::vector<uint32_t> buf_;
  std::vector<size_t> starts_;  // where documents start in buf_
  uint32_t index_ = 0;
};

}  // namespace

PrepareConfig validate(PrepareConfig c) {
  auto fail = [](std::string msg) {
    ::megacpp::detail::throw_fail(ErrorKind::kInvalidArgument, std::move(msg), __FILE__, __LINE__);
  };
  if (c.inputs.empty()) fail("no input given; pass files or folders of UTF-8 text");
  for (const auto& in : c.inputs) {
    if (in.empty()) fail("an input path is empty; pass files or folders of UTF-8 text");
  }
  if (c.out_dir.empty()) fail("--out is required: the directory the dataset is written to");
  if (c.tokenizer == TokenizerMode::kLoad && c.tokenizer_model.empty()) {
    fail("--tokenizer needs the path of a SentencePiece .model file");
  }
  if (c.tokenizer == TokenizerMode::kTrain &&
      (c.vocab_size < kMinTrainVocab || c.vocab_size > kMaxTrainVocab)) {
    fail(
        fmt::format("--vocab-size {} is out of range; pass {}..{} (256 byte pieces and the "
                    "specials come first)",
                    c.vocab_size, kMinTrainVocab, kMaxTrainVocab));
  }
  if (c.threads == 0) c.threads = std::max(1u, std::thread::hardware_concurrency());
  if (c.threads > 1024) fail(fmt::format("--threads {} is out of range; pass 1..1024", c.threads));
  if (c.shard_tokens < 1 || c.shard_tokens > INT32_MAX) {
    fail(fmt::format("--shard-tokens {} is out of range; pass 1..{} (llm.c's int32 count)",
                     c.shard_tokens, INT32_MAX));
  }
  if (c.val_every == 1) {
    fail("--val-every 1 would put every document in val; pass 0 (no val split) or K >= 2");
  }
  if (c.stage_to) {
    std::error_code ec;
    if (c.stage_to->empty() ||
        fs::weakly_canonical(*c.stage_to, ec) == fs::weakly_canonical(c.out_dir, ec)) {
      fail("--stage-to must name a directory other than --out");
    }
  }
  return c;
}

PrepareResult prepare(const PrepareConfig& config) {
  const PrepareConfig c = validate(config);
  const auto t0 = Clock::now();
  OutDir out(c.out_dir);
  const std::vector<detail::InputFile> files = detail::expand_inputs(c.inputs);
  uint64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += f.size;

  std::unique_ptr<detail::Tokenizer> tok;
  Progress progress(c.progress, files.size(), total_bytes);
  switch (c.tokenizer) {
    case TokenizerMode::kByte:
      tok = detail::byte_tokenizer();
      break;
    case TokenizerMode::kLoad: {
      std::string bytes;
      try {
        bytes = read_file(c.tokenizer_model);
      } catch (const Error& e) {
        MEGACPP_FAIL(ErrorKind::kInvalidArgument, "--tokenizer {} cannot be read ({})",
                     c.tokenizer_model.string(), std::strerror(e.sys_errno()));
      }
      tok = detail::sentencepiece_tokenizer(std::move(bytes),
                                            "--tokenizer " + c.tokenizer_model.string());
      break;
    }
    case TokenizerMode::kTrain: {
      progress.note(
          fmt::format("training a SentencePiece {} tokenizer (vocab {}) on {} files, "
                      "{:.1f} MB",
                      c.model_type == ModelType::kBpe ? "BPE" : "unigram", c.vocab_size,
                      files.size(), mb(total_bytes)));
      tok = detail::sentencepiece_tokenizer(
          detail::train_sentencepiece(files, c.vocab_size, c.model_type), "the trained tokenizer");
      progress.note(fmt::format("trained in {:.1f} s", seconds_since(t0)));
      break;
    }
  }

  data::DatasetManifest m;
  m.vocab_size = tok->vocab_size();
  m.eos_id = tok->eos_id();
  const data::TokenWidth width = data::width_for_vocab(m.vocab_size);
  m.token_width = static_cast<uint32_t>(data::bytes_of(width));
  m.tokenizer.kind = tok->kind();
  m.tokenizer.vocab_size = m.vocab_size;
  if (!tok->model_bytes().empty()) {
    m.tokenizer.file = kTokenizerFile;
    m.tokenizer.xxh3 = xxh3_hex(tok->model_bytes());
    write_file_atomic(out.file(kTokenizerFile), tok->model_bytes());
  }

  std::vector<data::DatasetShard> train_shards, val_shards;
  ShardWriter train(out, "train", c.shard_tokens, width, train_shards);
  ShardWriter val(out, "val", c.shard_tokens, width, val_shards);
  PrepareResult result;
  size_t files_done = 0;
  uint64_t bytes_done = 0;
  tokenize_in_order(files, *tok, c.threads, [&](Document d) {
    ++files_done;
    bytes_done += d.input.bytes;
    if (d.input.documents) {
      const bool to_val = c.val_every != 0 && (m.documents + 1) % c.val_every == 0;
      (to_val ? val : train).add(d.tokens);
      ++m.documents;
      result.tokens += d.tokens.size();
      result.input_bytes += d.text_bytes;
    } else {
      ++m.skipped_files;
    }
    m.inputs.push_back(std::move(d.input));
    progress.tick(files_done, bytes_done);
  });
  train.finish();
  val.finish();
  if (m.documents == 0) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "no input file is a document ({} files, all skipped: not UTF-8, a NUL byte or "
                 "empty); pass UTF-8 text",
                 files.size());
  }
  m.shards = std::move(train_shards);
  m.shards.insert(m.shards.end(), val_shards.begin(), val_shards.end());
  data::write_dataset_manifest(c.out_dir, m);  // the commit point
  out.file(std::string(data::kDatasetManifestName));
  out.commit();

  result.out_dir = c.out_dir;
  result.manifest = std::move(m);
  if (c.stage_to) {
    progress.note(fmt::format("staging to {}", c.stage_to->string()));
    result.staged = data::stage_dataset(c.out_dir, *c.stage_to);
    result.staged_to = c.stage_to;
  }
  result.seconds = seconds_since(t0);
  return result;
}

std::string summary_line(const PrepareResult& r) {
  const auto& m = r.manifest;
  size_t train = 0;
  for (const auto& s : m.shards) train += s.split == "train";
  std::string line = fmt::format(
      "prepared {} documents ({} skipped files), {} tokens in {} shards ({} train, {} val), "
      "vocab {} ({}), {:.1f} MB of text in {:.1f} s ({:.1f} MB/s) -> {}",
      m.documents, m.skipped_files, r.tokens, m.shards.size(), train, m.shards.size() - train,
      m.vocab_size, m.tokenizer.kind, mb(r.input_bytes), r.seconds,
      mb(r.input_bytes) / std::max(r.seconds, 1e-9),
      (r.out_dir / data::kDatasetManifestName).string());
  if (r.staged) {
    line += fmt::format("; staged to {}: {} copied, {} reused, {:.1f} MB", r.staged_to->string(),
                        r.staged->copied, r.staged->reused, mb(r.staged->bytes_copied));
  }
  return line;
}

}  // namespace megacpp::prepare
