// megacpp::recipe — named, hashed training declarations (DESIGN §6), parsed from TOML.
//
// Parsing is strict: an unknown key, a wrong type or a value outside its rule is an
// Error{kInvalidArgument} naming the file, the key and the rule. The hash is XXH3-64 of the
// canonical expanded declaration (every value, pattern expanded to layers; not the path),
// so two files that declare the same thing hash the same.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "schemas/launch.capnp.h"

namespace megacpp::recipe {

struct ModelConfig {
  uint32_t vocab_size = 256;
  uint32_t seq_len = 64;
  uint32_t d_model = 128;
  uint32_t n_layers = 2;
  uint32_t n_heads = 4;
  uint32_t mlp_mult = 4;
};

struct TrainConfig {
  uint32_t batch_size = 16;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  uint32_t warmup_steps = 5;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;
  uint32_t seed = 1234;
  uint32_t checkpoint_every = 20;
};

struct DataConfig {
  std::string corpus = "builtin";
  uint32_t shard_tokens = 1 << 20;
  uint32_t shards = 2;
};

struct Recipe {
  std::string name;
  std::filesystem::path path;
  std::string pattern = "A";
  std::vector<std::string> layers;  // pattern expanded to n_layers block families
  ModelConfig model;
  TrainConfig train;
  DataConfig data;
  std::string hash;

  // Throws Error{kInvalidArgument} naming the violated rule.
  void validate() const;
};

// `name_or_path`: a path to a .toml file, or the name of a recipe in `recipe_dir`.
std::filesystem::path resolve(const std::string& name_or_path,
                              const std::filesystem::path& recipe_dir);
Recipe load(const std::filesystem::path& path);
Recipe parse(const std::string& toml_text, const std::filesystem::path& origin);

void to_spec(const Recipe& r, schema::RecipeSpec::Builder spec);
// A human-readable expansion (what `megacpp plan` prints).
std::string describe(const Recipe& r);

}  // namespace megacpp::recipe
