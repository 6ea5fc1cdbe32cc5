// megacpp::checkpoint export — `megacpp export`: a committed checkpoint as one consolidated
// safetensors file.
#pragma once

#include <cstdint>
#include <filesystem>

#include "checkpoint/reader.h"

namespace megacpp::checkpoint {

namespace fs = std::filesystem;

struct ExportReport {
  uint32_t tensors = 0;
  uint64_t bytes = 0;  // of the file written
};
// One consolidated safetensors file of the model's parameters under the names the equivalent
// PyTorch module uses ("embed.weight", "blocks.0.attn.qkv.weight", ...: the checkpoint's
// "model." names without the prefix), every shard reassembled. With `optimizer`, the optimizer
// state too, per parameter: "optim.adamw.<param>.{exp_avg,exp_avg_sq,step}",
// "optim.muon.<param>.{momentum,second_momentum}" (a row of its stack), and the groups'
// scalars "optim.{adamw,muon}.<group>.<field>". Metadata: run_id, step, recipe_hash, world.
// Written to a temporary name, fsynced and renamed. The checkpoint must verify first.
ExportReport export_checkpoint(const CheckpointReader& ckpt, const fs::path& out, bool optimizer);

}  // namespace megacpp::checkpoint
