#include "supervisor/rendezvous.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "supervisor/process.h"

namespace megacpp::supervisor {

// The plugin (store_plugin.cpp) and the store it made; both released in reverse order.
struct StoreServer::Impl {
  using Create = void* (*)(const char*, uint16_t, uint32_t, int*, char*, size_t);
  using Port = uint16_t (*)(const void*);
  using Destroy = void (*)(void*);
  void* library = nullptr;
  void* store = nullptr;
  Port port = nullptr;
  Destroy destroy = nullptr;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (store != nullptr) destroy(store);
    if (library != nullptr) ::dlclose(library);
  }
};

namespace {

// The client functions' results (store_plugin.cpp).
constexpr int kOk = 0;
constexpr int kAbsent = 1;

void* open_store_plugin() {
  const auto path = detail::self_exe_dir() / "libmegacpp_store.so";
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();
    MEGACPP_FAIL(ErrorKind::kInvalidArgument,
                 "this megacpp cannot host the ranks' rendezvous: {} does not load ({}); "
                 "rebuild or reinstall megacpp with its libraries",
                 path.string(), why != nullptr ? why : "unknown dlopen error");
  }
  return library;
}

// `name` of the plugin `library` (opened from `path`), or an Error{kInternal} naming both.
void* plugin_symbol(void* library, const char* name) {
  void* s = ::dlsym(library, name);
  MEGACPP_CHECK(s != nullptr, ErrorKind::kInternal,
                fmt::format("{} lacks {}: a library of another megacpp build",
                            (detail::self_exe_dir() / "libmegacpp_store.so").string(), name));
  return s;
}

}  // namespace

void check_store_plugin() {
  ::dlclose(open_store_plugin());
}

StoreServer::StoreServer(const std::string& host, uint16_t port, uint32_t world)
    : impl_(std::make_unique<Impl>()) {
  impl_->library = open_store_plugin();
  const auto create =
      reinterpret_cast<Impl::Create>(plugin_symbol(impl_->library, "megacpp_store_create"));
  impl_->port = reinterpret_cast<Impl::Port>(plugin_symbol(impl_->library, "megacpp_store_port"));
  impl_->destroy =
      reinterpret_cast<Impl::Destroy>(plugin_symbol(impl_->library, "megacpp_store_destroy"));
  char error[512] = {};
  int code = 0;
  impl_->store = create(host.c_str(), port, world, &code, error, sizeof error);
  if (impl_->store == nullptr) {
    MEGACPP_FAIL(code == 2 ? ErrorKind::kInvalidArgument : ErrorKind::kSystem, "{}", error);
  }
}

StoreServer::~StoreServer() = default;

uint16_t StoreServer::port() const {
  return impl_->port(impl_->store);
}

// The plugin and the client it made; both released in reverse order.
struct StoreClient::Impl {
  using Connect = void* (*)(const char*, uint16_t, uint32_t, int*, char*, size_t);
  using Set = int (*)(void*, const char*, const char*, size_t, char*, size_t);
  using Sink = void (*)(void*, const char*, size_t);
  using Get = int (*)(void*, const char*, uint32_t, Sink, void*, char*, size_t);
  using Add = int (*)(void*, const char*, int64_t, int64_t*, char*, size_t);
  using Destroy = void (*)(void*);
  void* library = nullptr;
  void* client = nullptr;
  Set set = nullptr;
  Get get = nullptr;
  Add add = nullptr;
  Destroy destroy = nullptr;
  std::string where;  // host:port, for messages

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (client != nullptr) destroy(client);
    if (library != nullptr) ::dlclose(library);
  }
};

namespace {
uint32_t clamp_ms(std::chrono::milliseconds t) {
  return static_cast<uint32_t>(std::clamp<int64_t>(t.count(), 0, UINT32_MAX));
}
}  // namespace

StoreClient::StoreClient(const std::string& host, uint16_t port, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->where = fmt::format("{}:{}", host, port);
  impl_->library = open_store_plugin();
  const auto connect =
      reinterpret_cast<Impl::Connect>(plugin_symbol(impl_->library, "megacpp_store_connect"));
  impl_->set = reinterpret_cast<Impl::Set>(plugin_symbol(impl_->library, "megacpp_store_set"));
  impl_->get = reinterpret_cast<Impl::Get>(plugin_symbol(impl_->library, "megacpp_store_get"));
  impl_->add = reinterpret_cast<Impl::Add>(plugin_symbol(impl_->library, "megacpp_store_add"));
  impl_->destroy = reinterpret_cast<Impl::Destroy>(
      plugin_symbol(impl_->library, "megacpp_store_client_destroy"));
  char error[512] = {};
  int code = 0;
  impl_->client = connect(host.c_str(), port, clamp_ms(timeout), &code, error, sizeof error);
  if (impl_->client == nullptr) {
    MEGACPP_FAIL(code == 2 ? ErrorKind::kTimeout : ErrorKind::kSystem, "{}", error);
  }
}

StoreClient::~StoreClient() = default;

void StoreClient::set(const std::string& key, std::string_view value) {
  char error[512] = {};
  if (impl_->set(impl_->client, key.c_str(), value.data(), value.size(), error, sizeof error) !=
      kOk) {
    MEGACPP_FAIL(ErrorKind::kSystem, "the store at {}: {}", impl_->where, error);
  }
}

std::optional<std::string> StoreClient::get(const std::string& key,
                                            std::chrono::milliseconds timeout) {
  char error[512] = {};
  std::string value;
  bool fits = true;
  const auto sink = [](void* context, const char* bytes, size_t len) {
    auto* out = static_cast<std::pair<std::string*, bool*>*>(context);
    try {
      out->first->assign(bytes, len);
    } catch (...) {  // nothing may unwind through the plugin's frames
      *out->second = false;
    }
  };
  std::pair<std::string*, bool*> context{&value, &fits};
  const int rc = impl_->get(impl_->client, key.c_str(), clamp_ms(timeout), sink, &context, error,
                            sizeof error);
  if (rc == kAbsent) return std::nullopt;
  if (rc != kOk) MEGACPP_FAIL(ErrorKind::kSystem, "the store at {}: {}", impl_->where, error);
  MEGACPP_CHECK(fits, ErrorKind::kSystem, "no memory for a value of the store");
  return value;
}

namespace {

std::string sealed_text(const std::string& key, std::string_view value) {
  std::string text = key;
  text += '\n';
  text += value;
  return text;
}

}  // namespace

bool seal_matches(const SealedRecords::Seal& seal, std::string_view text, std::string_view given) {
  const std::string want = seal(text);
  if (want.size() != given.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < want.size(); ++i)
    diff |= static_cast<unsigned char>(want[i]) ^ static_cast<unsigned char>(given[i]);
  return diff == 0;
}

void SealedRecords::set(const std::string& key, std::string_view value) {
  if (!seal_) {
    store_.set(key, value);
    return;
  }
  std::string record(value);
  record += ' ';
  record += seal_(sealed_text(key, value));
  store_.set(key, record);
}

std::optional<std::string> SealedRecords::get(const std::string& key,
                                              std::chrono::milliseconds timeout) {
  auto record = store_.get(key, timeout);
  if (!record || !seal_) return record;
  const auto space = record->rfind(' ');
  if (space != std::string::npos) {
    const std::string_view value = std::string_view(*record).substr(0, space);
    if (seal_matches(seal_, sealed_text(key, value), std::string_view(*record).substr(space + 1)))
      return std::string(value);
  }
  ++forged_;
  return std::nullopt;
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  char error[512] = {};
  int64_t result = 0;
  if (impl_->add(impl_->client, key.c_str(), delta, &result, error, sizeof error) != kOk) {
    MEGACPP_FAIL(ErrorKind::kSystem, "the store at {}: {}", impl_->where, error);
  }
  return result;
}

std::string torch_version() {
  return MEGACPP_TORCH_VERSION;
}

}  // namespace megacpp::supervisor
