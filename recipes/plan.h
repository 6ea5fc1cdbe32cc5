// megacpp::recipe plan — what a recipe expands to under a mode and a world, computed without
// torch: every layer's block and parameter shapes, parameters per family, total and active
// parameters per token, an estimate of per-rank memory, and the gates (DESIGN.md "Hybrid
// recipes") that decide whether this build can run it. `megacpp plan` prints it; `megacpp run`
// refuses a plan with a failed gate and records the verdicts in the launch contract.
//
// The parameter shapes are the trainer's own (stages/trainer/model.h names them); a unit test
// builds the torch model and compares every name and shape.
//
// Memory model (bytes per rank; tp = the mode's tensor-parallel degree, dp = ranks / tp; c =
// the compute dtype's bytes, 4 for train.precision fp32 and 2 for bf16-mixed; r = the bytes of
// the dtype gradients are summed in, train.grad_reduce; the moments and masters are float32), as
// this build allocates it. A tensor-parallel rank holds its slices of the block matrices
// (stages/trainer/tensor_parallel.h weight shards) and every other parameter whole; DistMuon
// steps the matrices whole over the job's w = dp x tp ranks (w = dp without tensor
// parallelism), DistAdamW the other parameters over dp:
//   parameters and gradients  c B per element held: 1/tp of every block matrix (Mamba
//                             in_proj's B and C rows whole), every other parameter whole
//   master weights            bf16-mixed: 4 B per element the rank's optimizers own (a sharded
//                             DistAdamW parameter's rows, a replicated one whole, DistMuon's
//                             ceil(n / w) entries of each stack); tensor parallel in fp32:
//                             DistMuon's whole copies of its entries, 4 B each
//   DistMuon state            per stack of same-shape matrices in a group, ceil(n / w) owned
//                             entries x (rows x cols momentum + the factored second moment: rows
//                             when rows >= cols or the group is qkv-split, else cols) x 4 B
//   DistAdamW state           8 B per element (two moments), / dp when the tensor is sharded
//                             (numel >= adamw_crossover and shape[0] % dp == 0)
//   exchange buffers          kept from one step to the next (stages/trainer/optim.h): DistMuon's
//                             stacked gradients of its largest bucket, r B x P (P = every stack
//                             padded to ceil(n / w) x w entries, at most kMuonBucketNumel or one
//                             entry per rank), its gathered parameters c B x P when w > 1, the
//                             exchange's receive space r B x P (w - 1) / w (Gloo) or P / w
//                             (NCCL); on Gloo with float32 sums DistAdamW's gradient bucket 4 B x
//                             A (A = its elements), its receive space 4 B x A (dp - 1) and, when
//                             it rides in DistMuon's exchange (tp 1 and dp <= 2 or A <= 2^20),
//                             4 B x A x dp more there; under tensor parallelism the flat buffer
//                             summing over the group what every rank holds, c B per element;
//                             nothing at w 1 (no exchange)
//   activations               batch_size x seq_len tokens x (sum over layers of the block's
//                             activation_floats estimate x c B + the logits and the
//                             cross-entropy's log-probabilities, 8 B x vocab, and bf16-mixed's
//                             bfloat16 logits, 2 B x vocab), / tp (sequence parallelism shards
//                             what tensor parallelism does not)
//   optimizer working set     DistMuon's orthogonalization of a bucket's owned entries of its
//                             largest stack: (3 rows x cols + 3 min(rows, cols)^2) in the
//                             orthogonalization's dtype + 2 rows x cols float32 each
//   snapshot staging          the buffer a rank copies its snapshot share into,
//                             made at the first checkpoint and kept for the run: the parameters,
//                             masters and optimizer state above (the rank that writes the
//                             replicated state; the others' shares are smaller). Host memory:
//                             in the total on --device cpu; on cuda, device memory in the
//                             total when staged on the device (the default where it fits;
//                             PlanOptions::snapshot_staging), else host memory printed apart
// The activation figures are counted from each block's forward (the tensors autograd keeps for
// backward, plan.cpp activation_floats), not measured at plan time; blocks_test holds each
// family's count per layer within 5% of what the model keeps, one dimension changed at a time. They
// follow train.recompute (stages/trainer/model.h): none, everything autograd saves; selective,
// every matrix product's output and the inputs of the recomputed norms, not the element-wise tails
// between products; full, each block's input (d_model) per layer plus, once, the largest block's
// none figure: the working set of the one block whose forward runs again during backward.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "recipes/recipe.h"

namespace megacpp::recipe {

struct ParamShape {
  std::string name;  // relative to its layer ("attn.qkv.weight") or global ("embed.weight")
  std::vector<int64_t> shape;
  std::string optimizer;  // "muon" | "adamw"
  std::string group;      // DistMuon: "qkv" | "matrices"; DistAdamW: "embed" | "head" | "other"
  // Computed in slices across the tensor-parallel group (all but the MoE router); held in
  // slices when a block matrix (DistMuon's: tensor-parallel weight shards), else whole.
  bool tp_split = true;
  uint64_t numel() const;
};

struct LayerPlan {
  uint32_t index = 0;
  char symbol = 'A';  // the pattern's symbol
  char block = 'A';   // the block kind it became (recipes/recipe.h kBlock*)
  std::vector<ParamShape> params;
  uint64_t params_total = 0;
  uint64_t params_active = 0;      // per token: only top_k of the routed experts
  uint64_t activation_floats = 0;  // per token, estimate (see above)
};

// One check of the plan. Every refusal names its rule, the reason, and when the gate retires.
struct Gate {
  std::string rule;  // e.g. "tp-divides-heads"
  bool passed = true;
  bool checked = true;  // false: not applicable or not asked for (passed stays true)
  std::string detail;   // the figures checked, in the recipe's terms
  std::string reason;   // why the rule exists
  std::string retires;  // the condition under which the gate is removed
};

struct MemoryPlan {  // bytes per rank
  uint64_t parameters = 0;
  uint64_t gradients = 0;
  uint64_t master = 0;     // bf16-mixed: the float32 master weights
  uint64_t optimizer = 0;  // the moments
  uint64_t buffers = 0;    // the optimizers' exchange buffers
  uint64_t activations = 0;
  uint64_t working = 0;  // the optimizer step's largest transient (DistMuon's orthogonalization)
  uint64_t staging = 0;  // the snapshot staging buffer (host shared memory, or device memory)
  // On cuda: the staging is an exported device buffer (PlanOptions::snapshot_staging), so in
  // the device's total; the checkpointer then holds a page-locked host copy of the same size.
  bool staging_on_device = false;
  bool staging_counted = true;  // in the rank's total: --device cpu, or staged on the device
  // Everything at once: an upper bound (gradients grow in backward while activations are
  // released, and the optimizer's working set comes after both).
  uint64_t total() const {
    return parameters + gradients + master + optimizer + buffers + activations + working +
           (staging_counted ? staging : 0);
  }
};

struct PlanOptions {
  uint32_t ranks = 1;
  // Ranks on each node of a job across nodes; 0: all `ranks` on one node.
  uint32_t ranks_per_node = 0;
  double memory_budget_gib = 0;  // per rank; 0 = not checked
  // Where the budget comes from, for the gate's detail; empty: --memory-budget.
  std::string memory_budget_source = {};
  std::string device = "cpu";       // "cpu" | "cuda"
  bool cuda_trainer_built = false;  // this build has the CUDA trainer plugin
  // MEGACPP_SNAPSHOT_STAGING: auto | host | device | memfd. On cuda, auto stages on the device
  // when a CUDA driver can export the buffer (cuda_staging_available) and the total with it fits
  // the budget (or no budget is known), else in host memory; device always does (the memory
  // gate then judges it). Anything but device and auto stages in host memory.
  std::string snapshot_staging = "auto";
  bool cuda_staging_available = true;
};

struct Plan {
  std::string recipe;
  std::string hash;
  std::string pattern;
  std::string mode;
  uint32_t ranks = 1;
  uint32_t tp = 1;
  uint32_t dp = 1;
  bool sequence_parallel = false;
  std::vector<ParamShape> globals;  // embed.weight, head.weight
  std::vector<LayerPlan> layers;
  uint64_t params_total = 0;
  uint64_t params_active = 0;
  // Per block kind (block_name), in first-appearance order: parameters and layer count.
  struct Family {
    std::string name;
    uint32_t layers = 0;
    uint64_t params = 0;
  };
  std::vector<Family> families;
  MemoryPlan memory;
  std::string precision;  // the memory settings the figures assume, e.g. "fp32"
  std::vector<Gate> gates;
  double memory_budget_gib = 0;

  // The first failed gate, or nullptr.
  const Gate* refusal() const;
};

// The parameters of one layer's block, with the trainer's names and shapes; `qkv_split` is the
// recipe's optim.qkv_split (the attention's fused projection then forms DistMuon's qkv group).
std::vector<ParamShape> layer_params(const ModelConfig& model, char block, bool qkv_split);
// Estimate of the floats a block keeps for backward per token under train.recompute (see the
// memory model above); under full, the block's input only.
uint64_t activation_floats(const ModelConfig& model, char block,
                           Recompute recompute = Recompute::kNone);

// `recipe` as parsed (its mode and blocks already expanded). Throws Error{kInvalidArgument} for
// ranks == 0; a gate that fails is a verdict in the plan, not an exception.
Plan make_plan(const Recipe& recipe, const PlanOptions& options);
// What `megacpp plan` prints: every layer, the families, totals, memory, gates and the hash.
std::string format_plan(const Plan& plan);
// "rule: detail (reason; retires when ...)": the one-line refusal of a failed gate.
std::string refusal_line(const Gate& gate);

}  // namespace megacpp::recipe
