#include "core/knobs.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace megacpp {

namespace {

const KnobSpec& typed(Knob k, KnobType type, bool computed) {
  const KnobSpec& s = knob_spec(k);
  MEGACPP_CHECK(s.type == type && s.computed == computed, ErrorKind::kInternal,
                fmt::format("knob {} read with the wrong accessor", s.name));
  return s;
}

}  // namespace

std::optional<std::string> env_knob(std::string_view name) {
  MEGACPP_CHECK(find_knob(name) != nullptr, ErrorKind::kInternal,
                fmt::format("environment knob {} is not declared in core/knobs.h", name));
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t env_knob_int(std::string_view name, int64_t fallback) {
  auto v = env_knob(name);
  if (!v) return fallback;
  try {
    return std::stoll(*v);
  } catch (const std::exception&) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}={} is not an integer", name, *v);
  }
}

double env_knob_double(std::string_view name, double fallback) {
  auto v = env_knob(name);
  if (!v) return fallback;
  try {
    return std::stod(*v);
  } catch (const std::exception&) {
    MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{}={} is not a number", name, *v);
  }
}

std::optional<std::string> foreign_env(std::string_view name) {
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

const KnobSpec* find_knob(std::string_view name) {
  for (const auto& s : kKnobs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::optional<std::string> knob_value(Knob k) {
  return env_knob(knob_spec(k).name);
}

std::string knob_string(Knob k) {
  const KnobSpec& s = typed(k, KnobType::kString, false);
  if (auto v = env_knob(s.name)) return *v;
  return s.default_text == "—" ? std::string() : std::string(s.default_text);
}

int64_t knob_int(Knob k) {
  const KnobSpec& s = typed(k, KnobType::kInt, false);
  return env_knob_int(s.name, std::stoll(std::string(s.default_text)));
}

double knob_seconds(Knob k) {
  const KnobSpec& s = typed(k, KnobType::kSeconds, false);
  return env_knob_double(s.name, std::stod(std::string(s.default_text)));
}

double knob_seconds(Knob k, double fallback) {
  const KnobSpec& s = typed(k, KnobType::kSeconds, true);
  return env_knob_double(s.name, fallback);
}

}  // namespace megacpp
