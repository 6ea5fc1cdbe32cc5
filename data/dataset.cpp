#include "data/dataset.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "data/dataset_manifest.h"
#include "data/sampler.h"

namespace megacpp::data {

namespace {

ShardFormat format_of(const std::string& source) {
  return source == "megatron" ? ShardFormat::kMegatron : ShardFormat::kLlmc;
}

// The check cache: one line per file that passed a full scan, "<identity> <xxh3> <max token>",
// where the identity is the file's name, size, mtime (ns), ctime (ns) and inode. A file whose
// identity is unchanged is not rescanned: its largest token is taken from the line. What the
// cache trusts is exactly that identity: any write to the file, and any utimensat that puts
// its mtime back, moves the ctime, which no user-space call sets back. It does not see changes
// below the file system (a raw device edit, media corruption), so it never stands in for a
// hash someone recorded: a file that dataset.json records an XXH3 for is read in full on every
// pre-flight. The loader still checks each file's structure and token count, and
// `--stage-data` copies are verified by XXH3.
std::string identity_of(const std::filesystem::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return {};
  return fmt::format("{}/{}/{}/{}/{}", p.filename().string(), st.st_size,
                     int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec,
                     int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec, st.st_ino);
}

struct CachedCheck {
  std::string xxh3;
  uint32_t max_token = 0;
};

std::map<std::string, CachedCheck> read_check_cache(const std::filesystem::path& dir) {
  std::map<std::string, CachedCheck> out;
  std::ifstream in(dir / kCheckCacheName);
  std::string id, hash;
  uint32_t max = 0;
  while (in >> id >> hash >> max) {
    if (hash.size() == 16) out[id] = {hash, max};
  }
  return out;
}

// Best effort: a read-only data volume keeps no cache.
void write_check_cache(const std::filesystem::path& dir, const std::string& text,
                       const std::string& before) {
  if (text == before) return;
  try {
    write_file_atomic(dir / kCheckCacheName, text);
  } catch (const Error& e) {
    log_info("no shard check cache in {}: {}", dir.string(), e.what());
  }
}

// The pre-flight of `paths`: every file opened and validated (the check cache), the dataset
// manifest held to. `batch` set: the window rule at that geometry; unset (the val split): the
// windows are counted, with no rule (ValidationSampler's own).
ResolvedDataset resolve_files(const recipe::Recipe& recipe, const recipe::BatchGeometry& geometry,
                              const recipe::BatchGeometry* batch,
                              std::vector<std::filesystem::path> paths, unsigned threads) {
  const auto& d = recipe.data;
  ResolvedDataset out;
  out.format = format_of(d.source);
  out.slot_token_bytes = geometry.slot.token_bytes;
  out.eos_id = d.eos_id;
  std::optional<DatasetManifest> manifest;
  const auto dir = paths.front().parent_path();
  if (d.source == "llmc" && std::filesystem::exists(dir / kDatasetManifestName)) {
    manifest = read_dataset_manifest(dir);
    out.manifest = (dir / kDatasetManifestName).string();
    out.manifest_xxh3 = xxh3_hex(read_file(dir / kDatasetManifestName));
    out.tokenizer = manifest->tokenizer.kind;
    if (manifest->vocab_size > recipe.model.vocab_size)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "recipe {} has model.vocab_size {} but the dataset's tokenizer ({}) has {} ids "
                   "({}): raise vocab_size to at least {}",
                   recipe.name, recipe.model.vocab_size, manifest->tokenizer.kind,
                   manifest->vocab_size, out.manifest, manifest->vocab_size);
    if (out.eos_id < 0) out.eos_id = manifest->eos_id;
  }
  if (!d.pack && out.eos_id < 0 && out.format == ShardFormat::kLlmc)
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "data.eos_id: pack = false on llm.c shards needs the end-of-text id that starts "
                 "each document");

  // Every file is opened and scanned once, in parallel; the first error in path order wins so
  // the message does not depend on thread timing.
  std::vector<std::unique_ptr<Shard>> shards(paths.size());
  std::vector<std::exception_ptr> errors(paths.size());
  std::vector<CachedCheck> checks(paths.size());
  std::vector<std::string> ids(paths.size());
  // The files dataset.json records an XXH3 for: always hashed (the cache vouches for none).
  std::set<std::string> recorded;
  if (manifest)
    for (const auto& entry : manifest->shards)
      if (!entry.xxh3.empty()) recorded.insert(entry.file);
  const auto cache = read_check_cache(dir);
  std::string cache_before;
  for (const auto& [id, c] : cache)
    cache_before += fmt::format("{} {} {}\n", id, c.xxh3, c.max_token);
  std::atomic<size_t> next{0}, scanned{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < paths.size();) {
      try {
        // Megatron's tokens are in the .bin; its identity covers the .idx too (both names).
        auto token_file = paths[i];
        if (out.format == ShardFormat::kMegatron) token_file.replace_extension(".bin");
        ids[i] = identity_of(token_file);
        if (out.format == ShardFormat::kMegatron) ids[i] += "+" + identity_of(paths[i]);
        auto hit = cache.find(ids[i]);
        if (hit != cache.end() && hit->second.max_token < recipe.model.vocab_size &&
            !recorded.contains(paths[i].filename().string())) {
          shards[i] = std::make_unique<Shard>(paths[i], out.format);
          checks[i] = hit->second;
        } else {
          shards[i] = std::make_unique<Shard>(
              paths[i], out.format,
              ShardCheck{.vocab_size = recipe.model.vocab_size, .checksum = true});
          checks[i] = {shards[i]->xxh3(), shards[i]->max_token()};
          scanned.fetch_add(1);
        }
        if (!d.pack && out.eos_id >= 0)
          shards[i]->find_documents(static_cast<uint32_t>(out.eos_id));
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  const unsigned n = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(paths.size())));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  if (manifest) {
    for (const auto& s : shards) {
      const auto name = s->path().filename().string();
      for (const auto& entry : manifest->shards) {
        if (entry.file != name) continue;
        const auto& hash = checks[static_cast<size_t>(&s - shards.data())].xxh3;
        if (entry.bytes != s->file_bytes() || entry.xxh3 != hash)
          MEGACPP_FAIL(ErrorKind::kCorruption,
                       "shard {} does not match {} ({} bytes, XXH3 {}; the manifest records {} "
                       "bytes, XXH3 {}): it changed after `megacpp prepare`; prepare it again",
                       s->path().string(), out.manifest, s->file_bytes(), hash, entry.bytes,
                       entry.xxh3);
      }
    }
  }

  out.width = shards.front()->width();
  std::vector<const Shard*> views;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    if (s->width() != out.width)
      MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                   "{} holds {}-byte tokens but {} holds {}-byte tokens: one dataset has one "
                   "token width",
                   s->path().string(), bytes_of(s->width()), shards.front()->path().string(),
                   bytes_of(out.width));
    views.push_back(s.get());
    out.files.push_back({.path = std::filesystem::absolute(s->path()).lexically_normal(),
                         .tokens = s->tokens(),
                         .bytes = s->file_bytes(),
                         .documents = s->document_starts().size(),
                         .max_token = checks[i].max_token,
                         .xxh3 = checks[i].xxh3});
  }
  // The window rule at every rank of the world (not only the data ranks: a tensor-parallel
  // group's ranks each count here, as they always have).
  Sampler sampler(views, SamplerConfig{.seq_len = geometry.slot.seq_len,
                                       .batch = batch ? batch->slot.batch : 1,
                                       .world = batch ? batch->world : 1,
                                       .token_bytes = out.slot_token_bytes,
                                       .seed = recipe.train.seed,
                                       .pack = d.pack,
                                       .windows_rule = batch != nullptr});
  out.windows = sampler.windows();
  out.documents_without_window = sampler.documents_without_window();
  out.files_scanned = scanned.load();
  // Written only now, when every rule has passed: a refused run leaves the data untouched.
  if (d.source != "builtin") {
    auto merged = cache;
    for (size_t i = 0; i < ids.size(); ++i)
      if (!ids[i].empty()) merged[ids[i]] = checks[i];
    std::string text;
    for (const auto& [id, c] : merged) text += fmt::format("{} {} {}\n", id, c.xxh3, c.max_token);
    write_check_cache(dir, text, cache_before);
  }
  return out;
}

// Whether found shard files and a resolved dataset share a file. A resolved file is the token
// file: a Megatron dataset's .bin, found by its .idx.
bool overlap(const std::vector<std::filesystem::path>& found, const std::vector<DatasetFile>& b) {
  for (auto p : found) {
    if (p.extension() == ".idx") p.replace_extension(".bin");
    for (const auto& f : b)
      if (std::filesystem::absolute(p).lexically_normal() == f.path) return true;
  }
  return false;
}

}  // namespace

ResolvedDataset resolve_dataset(const recipe::Recipe& recipe, const recipe::BatchGeometry& batch,
                                const std::filesystem::path& data_dir, unsigned threads) {
  const auto& d = recipe.data;
  std::vector<std::filesystem::path> paths =
      d.source == "builtin" ? ensure_builtin_corpus(data_dir, d.shards, d.shard_tokens)
                            : find_shards(data_dir, format_of(d.source), d.path, d.split);
  return resolve_files(recipe, batch, &batch, std::move(paths), threads);
}

ResolvedValidation resolve_validation(const recipe::Recipe& recipe,
                                      const recipe::BatchGeometry& batch,
                                      const ResolvedDataset& train,
                                      const std::filesystem::path& data_dir, unsigned threads) {
  ResolvedValidation out;
  const auto& d = recipe.data;
  if (recipe.train.eval_every == 0) return out;
  const auto off = [&](std::string why) {
    out.off = fmt::format("evaluation is off: {}", why);
    return out;
  };
  // (The built-in corpus trains on its training shards whatever data.split says.)
  if (d.split == "val" && d.source != "builtin")
    return off(
        "the run trains on the val split (data.split = \"val\"), so no held-out data is left");
  std::vector<std::filesystem::path> paths;
  if (d.source == "builtin") {
    paths.push_back(ensure_builtin_validation(data_dir, d.shard_tokens));
  } else {
    try {
      paths = find_shards(data_dir, format_of(d.source), d.path, "val");
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kInvalidArgument) throw;
      return off(fmt::format(
          "the data has no val split (no {} files named *val* at [data] path \"{}\" under {}); "
          "`megacpp prepare --val-every K` writes one, or set train.eval_every = 0",
          d.source, d.path, data_dir.string()));
    }
    if (overlap(paths, train.files))
      return off(fmt::format(
          "[data] path \"{}\" names the same files for the train and val splits; put \"{{split}}\" "
          "where the split's name goes (e.g. \"fw_{{split}}_*.bin\"), or set train.eval_every = 0",
          d.path));
  }
  ResolvedDataset val = resolve_files(recipe, batch, nullptr, std::move(paths), threads);
  out.split_windows = val.windows;
  if (val.windows == 0)
    return off(fmt::format("the val split ({}) holds no window of {} tokens{}",
                           val.files.front().path.parent_path().string(), batch.slot.seq_len + 1,
                           d.pack ? "" : " inside a document"));
  const uint64_t asked = recipe.train.eval_tokens / batch.slot.seq_len;
  out.windows = std::min(asked, val.windows);
  if (out.windows < asked)
    out.notice = fmt::format(
        "the val split holds {} windows of {} tokens, fewer than train.eval_tokens asks ({}): "
        "every evaluation reads all of them",
        val.windows, batch.slot.seq_len + 1, asked);
  std::string text;
  for (const auto& f : val.files) text += fmt::format("{}:{};", f.xxh3, f.tokens);
  text += fmt::format("windows={};seq_len={};pack={}", out.windows, batch.slot.seq_len, d.pack);
  out.digest = xxh3_hex(text);
  out.dataset = std::move(val);
  return out;
}

void to_spec(const ResolvedValidation& v, uint32_t every, uint32_t ring_slots,
             schema::Validation::Builder out) {
  out.setEvery(every);
  out.setWindows(v.windows);
  out.setSplitWindows(v.split_windows);
  out.setOff(v.off);
  if (v.dataset) {
    to_spec(*v.dataset, out.initDataset());
    out.setRingSlots(ring_slots);
    out.setDigest(v.digest);
  }
}

void to_spec(const ResolvedDataset& d, schema::Dataset::Builder out) {
  out.setFormat(format_name(d.format));
  out.setTokenBytes(static_cast<uint32_t>(bytes_of(d.width)));
  out.setSlotTokenBytes(d.slot_token_bytes);
  out.setWindows(static_cast<double>(d.windows));
  out.setDocumentsWithoutWindow(static_cast<double>(d.documents_without_window));
  out.setEosId(d.eos_id);
  out.setManifest(d.manifest);
  out.setTokenizer(d.tokenizer);
  if (!d.manifest_xxh3.empty()) out.setManifestXxh3(d.manifest_xxh3);
  out.setStagedFrom(d.staged_from);
  auto files = out.initFiles(static_cast<unsigned>(d.files.size()));
  for (unsigned i = 0; i < files.size(); ++i) {
    const auto& f = d.files[i];
    files[i].setPath(f.path.string());
    files[i].setTokens(static_cast<double>(f.tokens));
    files[i].setBytes(static_cast<double>(f.bytes));
    files[i].setDocuments(static_cast<double>(f.documents));
    files[i].setMaxToken(f.max_token);
    files[i].setXxh3(f.xxh3);
  }
}

ResolvedDataset from_spec(schema::Dataset::Reader in) {
  ResolvedDataset d;
  d.format = std::string_view(in.getFormat().cStr()) == "megatron" ? ShardFormat::kMegatron
                                                                   : ShardFormat::kLlmc;
  d.width = in.getTokenBytes() == 4 ? TokenWidth::kU32 : TokenWidth::kU16;
  d.slot_token_bytes = in.getSlotTokenBytes();
  d.windows = static_cast<uint64_t>(in.getWindows());
  d.documents_without_window = static_cast<uint64_t>(in.getDocumentsWithoutWindow());
  d.eos_id = in.getEosId();
  d.manifest = in.getManifest().cStr();
  d.tokenizer = in.getTokenizer().cStr();
  d.manifest_xxh3 = in.getManifestXxh3().cStr();
  d.staged_from = in.getStagedFrom().cStr();
  for (auto f : in.getFiles()) {
    d.files.push_back({.path = f.getPath().cStr(),
                       .tokens = static_cast<uint64_t>(f.getTokens()),
                       .bytes = static_cast<uint64_t>(f.getBytes()),
                       .documents = static_cast<uint64_t>(f.getDocuments()),
                       .max_token = f.getMaxToken(),
                       .xxh3 = f.getXxh3().cStr()});
  }
  return d;
}

std::vector<std::unique_ptr<Shard>> open_dataset(const ResolvedDataset& dataset, bool pack) {
  std::vector<std::unique_ptr<Shard>> out;
  for (const auto& f : dataset.files) {
    out.push_back(std::make_unique<Shard>(f.path, dataset.format));
    if (out.back()->tokens() != f.tokens)
      MEGACPP_FAIL(ErrorKind::kCorruption,
                   "shard {} changed since the run started: {} tokens, the launch contract "
                   "recorded {}",
                   f.path.string(), out.back()->tokens(), f.tokens);
    if (!pack && dataset.eos_id >= 0)
      out.back()->find_documents(static_cast<uint32_t>(dataset.eos_id));
  }
  return out;
}

}  // namespace megacpp::data
