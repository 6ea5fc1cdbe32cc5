#include "core/knobs.h"

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/util.h"

namespace megacpp {

namespace {

const KnobSpec& typed(Knob k, KnobType type, bool computed) {
  const KnobSpec& s = knob_spec(k);
  MEGACPP_CHECK(s.type == type && s.computed == computed, ErrorKind::kInternal,
                fmt::format("knob {} read with the wrong accessor", s.name));
  return s;
}

}  // namespace

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
