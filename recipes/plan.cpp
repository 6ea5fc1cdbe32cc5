#include "recipes/plan.h"

#include <algorithm>
#include <map>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace megacpp::recipe {

namespace {

using Shape = std::vector<int64_t>;

ParamShape matrix(std::string name, int64_t rows, int64_t cols, std::string group = "matrices") {
  return ParamShape{.name = std::move(name),
                    .shape = {rows, cols},
                    .optimizer = "muon",
                    .group = std::move(group)};
}
ParamShape other(std::string name, Shape shape, bool tp_split = true) {
  return ParamShape{.name = std::move(name),
                    .shape = std::move(shape),
                    .optimizer = "adamw",
                    .group = "other",
                    .tp_split = tp_split};
}

uint64_t ceil_div(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

std::string gib(uint64_t bytes) {
  return fmt::format("{:.3f} GiB", static_cast<double>(bytes) / static_cast<double>(1ull << 30));
}

// 1234567 -> "1.23 M"
std::string count(uint64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.3f} B", static_cast<double>(n) / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.2f} M", static_cast<double>(n) / 1e6);
  if (n >= 1'000) return fmt::format("{:.1f} K", static_cast<double>(n) / 1e3);
  return fmt::format("{}", n);
}

}  // namespace

uint64_t ParamShape::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<ParamShape> layer_params(const ModelConfig& m, char block, bool qkv_split) {
  const int64_t D = m.d_model, F = m.ffn();
  std::vector<ParamShape> out;
  const auto mlp = [&](const std::string& prefix, int64_t hidden) {
    out.push_back(matrix(prefix + ".fc.weight", hidden, D));
    out.push_back(matrix(prefix + ".proj.weight", D, hidden));
  };
  switch (block) {
    case kBlockAttention: {
      const int64_t hd = m.head_dim(), H = m.n_heads, KV = m.kv_heads();
      out.push_back(
          matrix("attn.qkv.weight", (H + 2 * KV) * hd, D, qkv_split ? "qkv" : "matrices"));
      out.push_back(matrix("attn.proj.weight", D, H * hd));
      mlp("mlp", F);
      break;
    }
    case kBlockMlp:
      mlp("mlp", F);
      break;
    case kBlockMoe: {
      out.push_back(other("moe.router.weight", {int64_t{m.moe.n_experts}, D}, /*tp_split=*/false));
      for (uint32_t e = 0; e < m.moe.n_experts; ++e)
        mlp(fmt::format("moe.experts.{}", e), m.moe.expert_hidden);
      if (m.moe.shared_hidden > 0) mlp("moe.shared", m.moe.shared_hidden);
      break;
    }
    case kBlockMamba: {
      const int64_t I = int64_t{m.ssm.expand} * D, N = m.ssm.d_state, H = I / m.ssm.head_dim;
      const int64_t K = m.ssm.conv_kernel;
      out.push_back(matrix("mamba.in_proj.weight", 2 * I + 2 * N + H, D));
      out.push_back(other("mamba.conv.weight", {I + 2 * N, 1, K}));
      out.push_back(other("mamba.conv.bias", {I + 2 * N}));
      out.push_back(matrix("mamba.out_proj.weight", D, I));
      out.push_back(other("mamba.dt_bias", {H}));
      out.push_back(other("mamba.A_log", {H}));
      out.push_back(other("mamba.D", {H}));
      out.push_back(other("mamba.norm_weight", {I}));
      break;
    }
    case kBlockRecurrent: {
      const int64_t W = m.rnn_width(), K = m.rnn.conv_kernel;
      out.push_back(matrix("rnn.gate_proj.weight", W, D));
      out.push_back(matrix("rnn.in_proj.weight", W, D));
      out.push_back(other("rnn.conv.weight", {W, 1, K}));
      out.push_back(other("rnn.conv.bias", {W}));
      out.push_back(matrix("rnn.rec_gate.weight", W, W));
      out.push_back(other("rnn.rec_gate.bias", {W}));
      out.push_back(matrix("rnn.in_gate.weight", W, W));
      out.push_back(other("rnn.in_gate.bias", {W}));
      out.push_back(other("rnn.lambda", {W}));
      out.push_back(matrix("rnn.out_proj.weight", D, W));
      break;
    }
    default:
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "plan: unknown block kind '{}'", block);
  }
  return out;
}

uint64_t activation_floats(const ModelConfig& m, char block, Recompute recompute) {
  const uint64_t D = m.d_model, F = m.ffn();
  // full: the block's input; its working set in backward is make_plan's, once.
  if (recompute == Recompute::kFull) return D;
  const bool selective = recompute == Recompute::kSelective;
  switch (block) {
    case kBlockAttention: {
      // none: two norms' inputs and outputs and their 1 / rms; qkv; q and k after RoPE (RoPE's
      // products keep cos and sin, not the QK-norm's output) and the QK-norms' 1 / rms per head;
      // the attention's output, its [T, heads x hd] copy for the projection and its
      // log-sum-exp per head; the MLP's relu and square (relu's backward reads its own output,
      // the input of square: one tensor). selective: the two norms' inputs for their outputs, q
      // and k after RoPE, the attention's output, its copy and log-sum-exp, the fc output.
      const uint64_t hd = m.head_dim(), H = m.n_heads, KV = m.kv_heads();
      const uint64_t attention = (H + 2 * KV) * hd + (H + KV) * hd + 2 * H * hd + H;
      if (selective) return 2 * D + attention + F;
      return 4 * D + 2 + attention + (H + KV) + 2 * F;
    }
    case kBlockMlp:
      return selective ? D + F : 2 * D + 2 * F;
    case kBlockMoe: {
      // the norm's input and output, router probabilities (twice: softmax, the balancing
      // loss), per assignment the gathered token, the expert's relu and square, its output and
      // its weight (their product's operands) and the product (index_add keeps its source);
      // the shared expert's relu and square. selective: of each expert (and the shared one)
      // the fc output only, the rest as none.
      const uint64_t E = m.moe.n_experts, k = m.moe.top_k, h = m.moe.expert_hidden;
      const uint64_t s = m.moe.shared_hidden;
      if (selective) return 2 * D + 2 * E + k * (3 * D + h + 1) + s;
      return 2 * D + 2 * E + k * (3 * D + 2 * h + 1) + 2 * s;
    }
    case kBlockMamba: {
      // Per sequence of T positions, counted from what autograd keeps and checked against the
      // model per dimension (blocks_test Plan.ActivationsPerLayerFollowEachDimension). none: the
      // norm's and the residual's outputs (2D); in_proj's output (2I + 2N + H); the conv's
      // output over T + K - 1 positions and its SiLU (I + 2N each); softplus's input and output,
      // dt x A, the decay and cumulative-decay rows, the x-scaled input (about 10H + I); the
      // SSD scan's einsum operands made contiguous — C and B per head (5 H x N in all), the
      // chunk's decay matrix, C.B and their product (2.5 H x chunk: the last is sometimes
      // fused), x twice, the off-diagonal product (3I) — its chunk states, their copy and the
      // entering states (1.5 I x N per chunk boundary, C + 1 of them); the skip, the gate's
      // SiLU, the gated product, the inner norm's output (4I, with the ones above 12I).
      // selective: the norm's input for its output, and in_proj's output.
      const uint64_t I = uint64_t{m.ssm.expand} * D, N = m.ssm.d_state, H = I / m.ssm.head_dim;
      if (selective) return D + (2 * I + 2 * N + H);
      const uint64_t T = m.seq_len, Q = m.ssm.chunk, K = m.ssm.conv_kernel;
      const uint64_t boundaries = ceil_div(T, Q) + 1;
      const uint64_t twice_per_sequence =  // halves: 2.5 H x chunk and 1.5 I x N per boundary
          T * (2 * (2 * D + 12 * I + 10 * H + 5 * H * N + 4 * N) + 5 * H * Q) +
          3 * I * N * boundaries + 2 * (K - 1) * (I + 2 * N);
      return ceil_div(twice_per_sequence, 2 * T);
    }
    case kBlockRecurrent: {
      // Per sequence of T positions, counted as Mamba's. none: the norm's and the residual's
      // outputs (2D); gate_proj's output and its GeLU, in_proj's output, the conv's output over
      // T + K - 1 positions, the two gate projections and their sigmoids, log a and its parts,
      // the scale and the scan input, the scan's contiguous input and output, h and gate x h
      // (19W); the diagonal scan's decay matrix within a chunk (W x L, L =
      // recurrence_scan_chunk, not ssm.chunk) and across chunks (W x (C + 1)^2 per sequence, C
      // = T / L chunks) with three W x (C + 1) per sequence for the chunk states. selective:
      // the norm's input for its output; gate_proj's and in_proj's outputs, the conv's output,
      // the two gate projections, the conv output made contiguous for them and the product
      // out_proj reads (D + 7W, the conv over T + K - 1 positions).
      const uint64_t W = m.rnn_width(), T = m.seq_len, K = m.rnn.conv_kernel;
      if (selective) return ceil_div(T * (D + 7 * W) + (K - 1) * W, T);
      const auto L = static_cast<uint64_t>(
          recurrence_scan_chunk(static_cast<int64_t>(T), static_cast<int64_t>(m.ssm.chunk)));
      const uint64_t boundaries = ceil_div(T, L) + 1;
      return ceil_div(T * (2 * D + 19 * W + L * W) + W * boundaries * boundaries +
                          3 * W * boundaries + (K - 1) * W,
                      T);
    }
    default:
      return 0;
  }
}

const Gate* Plan::refusal() const {
  for (const Gate& g : gates)
    if (!g.passed) return &g;
  return nullptr;
}

Plan make_plan(const Recipe& r, const PlanOptions& o) {
  MEGACPP_CHECK(o.ranks >= 1, ErrorKind::kInvalidArgument, "plan: --ranks must be >= 1");
  const ModelConfig& m = r.model;
  Plan p;
  p.recipe = r.name;
  p.hash = r.hash;
  p.pattern = r.pattern;
  p.mode = m.mode;
  p.ranks = o.ranks;
  p.tp = m.tensor_parallel();
  p.sequence_parallel = p.tp > 1;
  p.dp = std::max<uint32_t>(1, o.ranks / p.tp);
  p.memory_budget_gib = o.memory_budget_gib;
  p.precision = r.train.bf16_mixed()
                    ? fmt::format("bf16-mixed, gradients summed in {}", r.train.grad_reduce)
                    : r.train.precision;
  if (r.train.recompute != "none") p.precision += ", recompute " + r.train.recompute;
  const bool qkv_split = r.train.optim.qkv_split;

  p.globals.push_back(ParamShape{.name = "embed.weight",
                                 .shape = {int64_t{m.vocab_size}, int64_t{m.d_model}},
                                 .optimizer = "adamw",
                                 .group = "embed"});
  p.globals.push_back(ParamShape{.name = "head.weight",
                                 .shape = {int64_t{m.vocab_size}, int64_t{m.d_model}},
                                 .optimizer = "adamw",
                                 .group = "head"});
  for (const ParamShape& g : p.globals) p.params_total += g.numel();
  p.params_active = p.params_total;

  uint64_t act_per_token = 0;  // floats per token of the blocks (the logits' bytes below)
  const Recompute recompute = recompute_mode(r.train.recompute);
  uint64_t working_set = 0;  // full: the largest block's unrecomputed figure, once
  for (uint32_t i = 0; i < m.n_layers; ++i) {
    LayerPlan l;
    l.index = i;
    l.symbol = r.layers.empty() ? 'A' : r.layers[i][0];
    l.block = m.block(i);
    l.params = layer_params(m, l.block, qkv_split);
    for (const ParamShape& s : l.params) l.params_total += s.numel();
    l.params_active = l.params_total;
    if (l.block == kBlockMoe) {
      const uint64_t per_expert = 2ull * m.moe.expert_hidden * m.d_model;
      l.params_active -= uint64_t{m.moe.n_experts - m.moe.top_k} * per_expert;
    }
    l.activation_floats = activation_floats(m, l.block, recompute);
    act_per_token += l.activation_floats;
    if (recompute == Recompute::kFull)
      working_set = std::max(working_set, activation_floats(m, l.block, Recompute::kNone));
    p.params_total += l.params_total;
    p.params_active += l.params_active;
    const std::string name(block_name(l.block));
    auto fam = std::find_if(p.families.begin(), p.families.end(),
                            [&](const Plan::Family& f) { return f.name == name; });
    if (fam == p.families.end()) fam = p.families.insert(p.families.end(), {.name = name});
    ++fam->layers;
    fam->params += l.params_total;
    p.layers.push_back(std::move(l));
  }

  act_per_token += working_set;

  // Memory per rank.
  const uint64_t tp = p.tp, dp = p.dp;
  std::vector<const ParamShape*> all;
  for (const ParamShape& g : p.globals) all.push_back(&g);
  for (const LayerPlan& l : p.layers)
    for (const ParamShape& s : l.params) all.push_back(&s);
  const bool mixed = r.train.bf16_mixed();
  const uint64_t c = mixed ? 2 : 4;                                    // compute dtype bytes
  const uint64_t rb = mixed && r.train.grad_reduce == "bf16" ? 2 : 4;  // reduction dtype bytes
  const bool gloo = o.device != "cuda";
  // Tensor-parallel weight shards (stages/trainer/tensor_parallel.h): a rank holds 1/tp of every
  // block matrix (a routed expert whole on one rank of tp; Mamba in_proj's B and C rows whole
  // on every rank) and every other parameter whole. DistMuon steps the matrices whole over
  // the job (dp x tp ranks) on whole copies of the entries it owns; DistAdamW the whole
  // parameters over data parallel.
  const uint64_t mw = dp * tp;  // DistMuon's world
  uint64_t held = 0, tp_reduced = 0;
  std::map<std::tuple<std::string, int64_t, int64_t>, uint64_t> stacks;  // -> entries
  uint64_t adam_bytes = 0, adam_owned = 0, adam_elements = 0;
  for (const ParamShape* s : all) {
    if (tp > 1 && s->optimizer == "muon") {
      const bool in_proj = s->name.ends_with("mamba.in_proj.weight");
      const uint64_t whole_rows = in_proj ? 2 * uint64_t{m.ssm.d_state} : 0;
      const uint64_t row = static_cast<uint64_t>(s->shape[1]);
      held += ceil_div(s->numel() - whole_rows * row, tp) + whole_rows * row;
      tp_reduced += whole_rows * row;
    } else {
      held += s->numel();
      if (tp > 1) tp_reduced += s->numel();
    }
    if (s->optimizer == "muon") {
      ++stacks[{s->group, s->shape[0], s->shape[1]}];
    } else {
      const bool sharded = dp > 1 && s->numel() >= r.train.optim.adamw_crossover &&
                           !s->shape.empty() && s->shape[0] % static_cast<int64_t>(dp) == 0;
      adam_bytes += ceil_div(8 * s->numel(), sharded ? dp : 1);
      adam_owned += ceil_div(s->numel(), sharded ? dp : 1);
      adam_elements += s->numel();
    }
  }
  uint64_t muon_bytes = 0, muon_owned = 0, muon_padded = 0, muon_entry = 0;
  for (const auto& [key, entries] : stacks) {
    const auto& [group, rows, cols] = key;
    const uint64_t second = (group == "qkv" || rows >= cols) ? rows : cols;
    const uint64_t numel = static_cast<uint64_t>(rows * cols);
    muon_bytes += ceil_div(entries, mw) * (numel + second) * 4;
    muon_owned += ceil_div(entries, mw) * numel;
    muon_padded += ceil_div(entries, mw) * mw * numel;
    muon_entry = std::max(muon_entry, numel);
  }
  // DistMuon's buffers hold its largest bucket: at most kMuonBucketNumel elements, or one
  // entry per rank when an entry is larger.
  const uint64_t bucket = std::min(
      muon_padded, std::max(static_cast<uint64_t>(kMuonBucketNumel) / mw * mw, muon_entry * mw));
  p.memory.parameters = c * held;
  p.memory.gradients = c * held;
  // Float32 masters (bf16-mixed); under tensor parallelism DistMuon's whole copies of its
  // entries in every precision (float32 either way).
  p.memory.master = (mixed ? 4 * adam_owned : 0) + (mixed || tp > 1 ? 4 * muon_owned : 0);
  p.memory.optimizer = muon_bytes + adam_bytes;
  uint64_t buffers = rb * bucket;  // DistMuon's stacked gradients
  if (mw > 1) {
    buffers += c * bucket;  // its gathered parameters
    buffers += gloo ? rb * bucket * (mw - 1) / mw : rb * bucket / mw;
  }
  if (dp > 1 && gloo && rb == 4) {
    // DistAdamW's bucket; without tensor parallelism it rides in every segment of DistMuon's
    // exchange (and so in its receive space) at dp <= 2 or up to 2^20 elements, else is
    // all-reduced on its own. Elsewhere DistAdamW reduces a parameter at a time (nothing kept).
    const bool rides = tp == 1 && (dp <= 2 || adam_elements <= (uint64_t{1} << 20));
    buffers +=
        4 * adam_elements + 4 * adam_elements * (dp - 1) + (rides ? 4 * adam_elements * dp : 0);
  }
  // The tensor-parallel sum of the gradients every rank of a group holds (one flat buffer
  // at the end of backward).
  buffers += c * tp_reduced;
  p.memory.buffers = buffers;
  // The logits and the cross-entropy's log-probabilities, float32; bf16-mixed also keeps the
  // bfloat16 logits the float32 copy is made from.
  const uint64_t logits_bytes = uint64_t{m.vocab_size} * (mixed ? 2 + 8 : 8);
  p.memory.activations =
      ceil_div(uint64_t{r.train.batch_size} * m.seq_len * (act_per_token * c + logits_bytes), tp);

  // The optimizer step's working set: DistMuon orthogonalizes a bucket's owned entries of one
  // shape together — the input, the iterate and its product (rows x cols each) and the
  // Gram matrix with its square and their sum (min(rows, cols)^2 each), in the orthogonalization's
  // dtype — and keeps float32 temporaries of the update's variance reduction (two rows x cols).
  const uint64_t ob = r.train.optim.muon_bf16 ? 2 : 4;
  const uint64_t seg_limit = std::max<uint64_t>(1, static_cast<uint64_t>(kMuonBucketNumel) / mw);
  for (const auto& [key, entries] : stacks) {
    const auto& [group, rows, cols] = key;
    const auto R = static_cast<uint64_t>(rows), C = static_cast<uint64_t>(cols);
    const uint64_t owned =
        std::min(ceil_div(entries, mw), std::max<uint64_t>(1, seg_limit / (R * C)));
    const uint64_t small = std::min(R, C);
    p.memory.working =
        std::max(p.memory.working, owned * ((3 * R * C + 3 * small * small) * ob + 2 * R * C * 4));
  }

  p.memory.staging = p.memory.parameters + p.memory.master + p.memory.optimizer;
  if (o.device == "cuda") {
    // Device staging costs the share's bytes of device memory: by default only where they fit.
    p.memory.staging_counted = false;
    const double with =
        static_cast<double>(p.memory.total() + p.memory.staging) / static_cast<double>(1ull << 30);
    p.memory.staging_on_device = o.snapshot_staging == "device" ||
                                 (o.snapshot_staging == "auto" && o.cuda_staging_available &&
                                  (o.memory_budget_gib <= 0 || with <= o.memory_budget_gib));
    p.memory.staging_counted = p.memory.staging_on_device;
  }

  // Gates.
  const auto gate = [&](std::string rule, bool passed, std::string detail, std::string reason,
                        std::string retires, bool checked = true) {
    p.gates.push_back(Gate{.rule = std::move(rule),
                           .passed = passed,
                           .checked = checked,
                           .detail = std::move(detail),
                           .reason = std::move(reason),
                           .retires = std::move(retires)});
  };
  const auto has = [&](char block) { return m.blocks.find(block) != std::string::npos; };
  gate("tp-divides-world", o.ranks % p.tp == 0,
       fmt::format("{} rank(s) into tensor-parallel groups of {} ({})", o.ranks, p.tp, p.mode),
       "every rank belongs to exactly one whole tensor-parallel group",
       "never: a partial tensor-parallel group cannot hold a layer");
  const uint32_t per_node = o.ranks_per_node > 0 ? o.ranks_per_node : o.ranks;
  gate("tp-within-node", per_node % p.tp == 0,
       fmt::format("{} rank(s) per node into tensor-parallel groups of {}", per_node, p.tp),
       "a tensor-parallel group's collectives run in every block, and a node's part of a "
       "checkpoint holds whole groups' weight shards: a group stays on one node",
       "never: give each node a multiple of the tensor-parallel degree");
  const bool attention = m.blocks.empty() || has(kBlockAttention);
  gate("tp-divides-heads", !attention || (m.n_heads % p.tp == 0 && m.kv_heads() % p.tp == 0),
       fmt::format("{} query and {} key/value heads over tensor parallel {}", m.n_heads,
                   m.kv_heads(), p.tp),
       "a column-parallel qkv projection gives each tensor-parallel rank whole heads",
       "never: a head is the unit attention cannot split", attention);
  if (has(kBlockMamba)) {
    const uint32_t heads = m.ssm.expand * m.d_model / m.ssm.head_dim;
    gate("tp-divides-ssm-heads", heads % p.tp == 0,
         fmt::format("{} Mamba heads over tensor parallel {}", heads, p.tp),
         "the Mamba mixer's projections are split by whole heads", "never: heads are the unit");
  }
  gate("sp-divides-seq", !p.sequence_parallel || m.seq_len % p.tp == 0,
       fmt::format("seq_len {} into {} sequence-parallel shard(s)", m.seq_len, p.tp),
       "sequence parallelism gives each tensor-parallel rank seq_len / tp positions of the norms "
       "and residuals",
       "when uneven sequence shards are implemented", p.sequence_parallel);
  if (has(kBlockMoe)) {
    gate("experts-divide-tp", m.moe.n_experts % p.tp == 0,
         fmt::format("{} routed experts over tensor parallel {} ({} per rank; replicated over "
                     "the {} data-parallel group(s))",
                     m.moe.n_experts, p.tp, m.moe.n_experts / std::max<uint32_t>(p.tp, 1), p.dp),
         "the routed experts are split whole across the tensor-parallel group",
         "when experts may be split inside their hidden dimension");
  }
  if (o.memory_budget_gib > 0) {
    const double need = static_cast<double>(p.memory.total()) / static_cast<double>(1ull << 30);
    gate("memory-budget", need <= o.memory_budget_gib,
         fmt::format("{:.3f} GiB per rank against a budget of {:.3f} GiB ({})", need,
                     o.memory_budget_gib,
                     o.memory_budget_source.empty() ? "--memory-budget" : o.memory_budget_source),
         "a rank over its memory fails in its first step, after the whole launch",
         "never: raise --memory-budget, add ranks or shrink the batch");
  } else {
    gate("memory-budget", true,
         o.device == "cuda" ? "--device cuda: no CUDA device visible here to read its memory, and "
                              "no --memory-budget given"
                            : "no --memory-budget given",
         "a rank over its memory fails in its first step, after the whole launch",
         "never: raise --memory-budget, add ranks or shrink the batch", false);
  }
  const bool cuda = o.device == "cuda";
  gate("feature-built", !cuda || o.cuda_trainer_built,
       !cuda ? fmt::format("--device cpu: {} over Gloo", p.tp > 1 ? "tensor-parallel groups and "
                                                                    "data parallelism"
                                                                  : "data parallelism")
       : o.cuda_trainer_built
           ? "--device cuda: this build has the CUDA trainer (NCCL)"
           : "--device cuda: this build has no CUDA trainer (libmegacpp_trainer_cuda.so is "
             "missing: torch without CUDA, or no CUDA/NCCL headers at configure time)",
       "a layout or device this build cannot run would fail in every rank after the whole launch",
       "when megacpp is built against torch with CUDA; meanwhile use --device cpu");
  return p;
}

std::string refusal_line(const Gate& g) {
  return fmt::format("{}: {} ({}; retires {})", g.rule, g.detail, g.reason, g.retires);
}

std::string format_plan(const Plan& p) {
  std::string out = fmt::format(
      "plan {} (hash {})\n  pattern {} over {} layers, mode {}: tensor parallel {}{}, data "
      "parallel {} ({} rank(s))\n\n",
      p.recipe, p.hash, p.pattern, p.layers.size(), p.mode, p.tp,
      p.sequence_parallel ? " + sequence parallel" : "", p.dp, p.ranks);
  out += fmt::format("  {:>5}  {:<3} {:<10} {:>12} {:>12} {:>14}\n", "layer", "sym", "block",
                     "params", "active", "act floats/tok");
  for (const LayerPlan& l : p.layers) {
    out += fmt::format("  {:>5}  {:<3} {:<10} {:>12} {:>12} {:>14}\n", l.index,
                       std::string(1, l.symbol), block_name(l.block), l.params_total,
                       l.params_active, l.activation_floats);
  }
  out += "\n  shapes per block kind (first layer of each):\n";
  std::string seen;
  for (const LayerPlan& l : p.layers) {
    if (seen.find(l.block) != std::string::npos) continue;
    seen.push_back(l.block);
    std::string shapes;
    size_t experts = 0;
    for (const ParamShape& s : l.params) {
      if (s.name.starts_with("moe.experts.") && !s.name.starts_with("moe.experts.0.")) {
        ++experts;
        continue;
      }
      shapes += fmt::format(" {}[{}]", s.name, fmt::join(s.shape, "x"));
    }
    out += fmt::format(
        "    {:<10}{}{}\n", block_name(l.block), shapes,
        experts ? fmt::format(" (and {} more expert matrices of the same shapes)", experts) : "");
  }
  out += "\n  parameters per family:\n";
  for (const Plan::Family& f : p.families)
    out += fmt::format("    {:<10} {:>3} layer(s) {:>16} ({})\n", f.name, f.layers, f.params,
                       count(f.params));
  uint64_t globals = 0;
  for (const ParamShape& g : p.globals) globals += g.numel();
  out += fmt::format("    {:<10} {:>13} {:>16} ({})\n", "embed+head", "", globals, count(globals));
  out += fmt::format("  total {} ({}), active per token {} ({})\n\n", p.params_total,
                     count(p.params_total), p.params_active, count(p.params_active));
  out += fmt::format(
      "  memory per rank ({}; estimate): parameters {}, gradients {}, master weights {}, "
      "optimizer state {}, exchange buffers {}, activations {}, optimizer working set {}{}: "
      "{}{}\n\n",
      p.precision, gib(p.memory.parameters), gib(p.memory.gradients), gib(p.memory.master),
      gib(p.memory.optimizer), gib(p.memory.buffers), gib(p.memory.activations),
      gib(p.memory.working),
      !p.memory.staging_counted    ? ""
      : p.memory.staging_on_device ? ", snapshot staging on the device " + gib(p.memory.staging)
                                   : ", snapshot staging " + gib(p.memory.staging),
      gib(p.memory.total()),
      p.memory.staging_on_device
          ? "; and in host memory, the checkpointer's page-locked copy of the staging " +
                gib(p.memory.staging)
      : p.memory.staging_counted
          ? ""
          : "; and in host memory, snapshot staging " + gib(p.memory.staging));
  out += "  gates:\n";
  for (const Gate& g : p.gates) {
    out += fmt::format("    {:<8} {:<22} {}\n",
                       !g.checked ? "n/a" : (g.passed ? "pass" : "REFUSED"), g.rule, g.detail);
    if (!g.passed) out += fmt::format("             reason: {}; retires {}\n", g.reason, g.retires);
  }
  const Gate* refused = p.refusal();
  out += refused ? fmt::format("\n  verdict: refused by {}\n", refused->rule)
                 : std::string("\n  verdict: runnable by this build\n");
  return out;
}

}  // namespace megacpp::recipe
