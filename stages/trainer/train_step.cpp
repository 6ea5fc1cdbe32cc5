// TrainStep (step, gradient all-reduce, AdamW), snapshot shares and the Gloo rendezvous.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/trainer.h"

namespace megacpp::trainer {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t align_up(uint64_t n) {
  return (n + kSnapshotAlignment - 1) / kSnapshotAlignment * kSnapshotAlignment;
}

}  // namespace

std::string safetensors_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("no safetensors dtype for {}", c10::toString(type)), __FILE__,
                  __LINE__);
  }
}

SnapshotLayout layout_of(const std::vector<NamedTensor>& tensors) {
  SnapshotLayout layout;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    SnapshotEntry e;
    e.name = name;
    e.dtype = safetensors_dtype(t.scalar_type());
    for (int64_t d : t.sizes()) e.shape.push_back(static_cast<uint64_t>(d));
    e.offset = offset;
    e.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    offset = align_up(offset + e.bytes);
    layout.entries.push_back(std::move(e));
  }
  layout.total_bytes = offset;
  return layout;
}

void fill_tensor_entries(const SnapshotLayout& layout,
                         capnp::List<schema::TensorEntry>::Builder out) {
  MEGACPP_CHECK(out.size() == layout.entries.size(), ErrorKind::kInternal,
                fmt::format("TensorEntry list has {} elements, layout {}", out.size(),
                            layout.entries.size()));
  for (uint32_t i = 0; i < out.size(); ++i) {
    const SnapshotEntry& e = layout.entries[i];
    auto b = out[i];
    b.setName(e.name);
    b.setDtype(e.dtype);
    auto shape = b.initShape(static_cast<uint32_t>(e.shape.size()));
    for (uint32_t d = 0; d < e.shape.size(); ++d) shape.set(d, e.shape[d]);
    b.setOffset(e.offset);
    b.setBytes(e.bytes);
  }
}

struct TrainStep::Impl {
  ModelConfig model_cfg;
  TrainConfig train_cfg;
  uint32_t total_steps;
  c10::intrusive_ptr<c10d::Backend> pg;
  uint32_t rank = 0;
  uint32_t world = 1;
  Transformer model;
  std::vector<NamedTensor> params;  // registration order; alias the live parameters
  std::unique_ptr<torch::optim::AdamW> optimizer;
  at::Tensor flat;  // all gradients (or parameters, for the broadcast), contiguous

  Impl(const ModelConfig& m, const TrainConfig& t, uint32_t steps,
       c10::intrusive_ptr<c10d::Backend> group)
      : model_cfg(m), train_cfg(t), total_steps(steps), pg(std::move(group)), model(m, t.seed) {
    MEGACPP_CHECK(t.batch_size > 0, ErrorKind::kInvalidArgument, "train: batchSize must be > 0");
    MEGACPP_CHECK(steps > 0, ErrorKind::kInvalidArgument, "total steps must be > 0");
    if (pg) {
      rank = static_cast<uint32_t>(pg->getRank());
      world = static_cast<uint32_t>(pg->getSize());
    }
    int64_t numel = 0;
    std::vector<at::Tensor> tensors;
    for (auto& item : model->named_parameters()) {
      params.emplace_back(item.key(), item.value());
      tensors.push_back(item.value());
      numel += item.value().numel();
    }
    flat = torch::empty({numel}, torch::kFloat32);
    optimizer = std::make_unique<torch::optim::AdamW>(
        tensors,
        torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).weight_decay(t.weight_decay));
    if (pg && world > 1) broadcast_parameters();
  }

  // Every rank initialised from the same seed already; the broadcast makes rank 0's
  // parameters authoritative regardless (e.g. a torch build whose RNG stream differs).
  void broadcast_parameters() {
    torch::NoGradGuard no_grad;
    pack([](const at::Tensor& p) { return p; });
    std::vector<at::Tensor> bufs{flat};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    pg->broadcast(bufs, opts)->wait();
    unpack([](const at::Tensor& p) { return p; });
  }

  // Copies source(p) of every parameter into `flat`, in order.
  template <typename F>
  void pack(F source) {
    int64_t off = 0;
    for (auto& [name, p] : params) {
      const int64_t n = p.numel();
      at::Tensor s = source(p);
      if (s.defined()) {
        flat.narrow(0, off, n).copy_(s.reshape({-1}));
      } else {
        flat.narrow(0, off, n).zero_();  // a rank without a gradient contributes zeros
      }
      off += n;
    }
  }

  // Copies `flat` back into target(p) of every parameter.
  template <typename F>
  void unpack(F target) {
    int64_t off = 0;
    for (auto& [name, p] : params) {
      const int64_t n = p.numel();
      at::Tensor t = target(p);
      t.view({-1}).copy_(flat.narrow(0, off, n));
      off += n;
    }
  }

  void allreduce_gradients() {
    for (auto& [name, p] : params) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
    pack([](const at::Tensor& p) { return p.grad(); });
    std::vector<at::Tensor> bufs{flat};
    pg->allreduce(bufs)->wait();  // SUM: Gloo has no AVG
    flat.div_(static_cast<double>(world));
    unpack([](const at::Tensor& p) { return p.grad(); });
  }

  double grad_norm_and_clip() {
    std::vector<at::Tensor> grads;
    for (auto& [name, p] : params) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (grads.empty()) return 0.0;
    const double norm = torch::stack(torch::_foreach_norm(grads)).norm().item<double>();
    if (train_cfg.grad_clip > 0 && norm > train_cfg.grad_clip) {
      torch::_foreach_mul_(grads, train_cfg.grad_clip / (norm + 1e-6));
    }
    return norm;
  }
};

TrainStep::TrainStep(const ModelConfig& model, const TrainConfig& train, uint32_t total_steps,
                     c10::intrusive_ptr<c10d::Backend> pg)
    : impl_(std::make_unique<Impl>(model, train, total_steps, std::move(pg))) {}

TrainStep::~TrainStep() = default;

uint32_t TrainStep::rank() const noexcept {
  return impl_->rank;
}
uint32_t TrainStep::world() const noexcept {
  return impl_->world;
}
uint32_t TrainStep::total_steps() const noexcept {
  return impl_->total_steps;
}
const ModelConfig& TrainStep::model_config() const noexcept {
  return impl_->model_cfg;
}
const TrainConfig& TrainStep::train_config() const noexcept {
  return impl_->train_cfg;
}
Transformer& TrainStep::model() noexcept {
  return impl_->model;
}
std::vector<NamedTensor> TrainStep::parameters() const {
  return impl_->params;
}

StepTiming TrainStep::step(const at::Tensor& tokens, uint32_t step_index, const StepHooks& hooks) {
  Impl& s = *impl_;
  MEGACPP_CHECK(
      tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.size(1) >= 2 &&
          tokens.size(1) - 1 <= s.model_cfg.seq_len,
      ErrorKind::kInvalidArgument,
      fmt::format("tokens must be int64 [B, T+1] with T <= {}, got {} {}", s.model_cfg.seq_len,
                  c10::toString(tokens.scalar_type()), c10::str(tokens.sizes())));
  auto phase = [&](schema::Phase p) {
    if (hooks.on_phase) hooks.on_phase(p);
  };
  StepTiming out;
  const int64_t T = tokens.size(1) - 1;

  phase(schema::Phase::FORWARD);
  auto t0 = Clock::now();
  s.optimizer->zero_grad(/*set_to_none=*/true);
  at::Tensor loss;
  {
    const auto logits = s.model->forward(tokens.narrow(1, 0, T));
    loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, static_cast<int64_t>(s.model_cfg.vocab_size)}),
        tokens.narrow(1, 1, T).reshape({-1}));
  }
  out.loss = loss.item<float>();
  out.forward_seconds = seconds_since(t0);

  phase(schema::Phase::BACKWARD);
  t0 = Clock::now();
  loss.backward();
  loss.reset();  // the graph (which saved the token indices) is gone after backward
  out.backward_seconds = seconds_since(t0);
  if (hooks.after_backward) hooks.after_backward();

  phase(schema::Phase::OPTIMIZER);
  t0 = Clock::now();
  if (s.pg && s.world > 1) {
    torch::NoGradGuard no_grad;
    const auto a0 = Clock::now();
    s.allreduce_gradients();
    out.allreduce_seconds = seconds_since(a0);
  }
  {
    torch::NoGradGuard no_grad;
    out.grad_norm = s.grad_norm_and_clip();
  }
  out.lr = lr_at(s.train_cfg, step_index, s.total_steps);
  for (auto& group : s.optimizer->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(out.lr);
  }
  s.optimizer->step();
  out.optimizer_seconds = seconds_since(t0);
  return out;
}

std::vector<NamedTensor> TrainStep::snapshot_share(uint32_t rank, uint32_t world) const {
  MEGACPP_CHECK(world > 0 && rank < world, ErrorKind::kInvalidArgument,
                fmt::format("snapshot share of rank {} in world {}", rank, world));
  const Impl& s = *impl_;
  std::vector<NamedTensor> share;
  if (rank == 0) {
    for (const auto& [name, p] : s.params) share.emplace_back("model." + name, p.detach());
  }
  const auto& state = s.optimizer->state();
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (i % world != rank) continue;
    const auto& [name, p] = s.params[i];
    const auto it = state.find(p.unsafeGetTensorImpl());
    const auto* st = it == state.end()
                         ? nullptr
                         : static_cast<const torch::optim::AdamWParamState*>(it->second.get());
    const std::string prefix = "optim." + name;
    share.emplace_back(prefix + ".exp_avg", st ? st->exp_avg() : torch::zeros_like(p));
    share.emplace_back(prefix + ".exp_avg_sq", st ? st->exp_avg_sq() : torch::zeros_like(p));
    share.emplace_back(prefix + ".step",
                       torch::scalar_tensor(st ? st->step() : int64_t{0}, torch::kInt64));
  }
  return share;
}

SnapshotLayout TrainStep::snapshot_layout(uint32_t rank, uint32_t world) const {
  return layout_of(snapshot_share(rank, world));
}

SnapshotLayout TrainStep::copy_snapshot(std::span<std::byte> region) const {
  const auto share = snapshot_share();
  SnapshotLayout layout = layout_of(share);
  MEGACPP_CHECK(region.size() >= layout.total_bytes, ErrorKind::kInvalidArgument,
                fmt::format("staging region of {} bytes cannot hold a {}-byte share", region.size(),
                            layout.total_bytes));
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < share.size(); ++i) {
    const at::Tensor& src = share[i].second;
    const SnapshotEntry& e = layout.entries[i];
    at::Tensor dst = torch::from_blob(region.data() + e.offset, src.sizes(),
                                      torch::TensorOptions().dtype(src.scalar_type()));
    dst.copy_(src);
  }
  return layout;
}

c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooOptions& o) {
  MEGACPP_CHECK(o.world > 0 && o.rank < o.world, ErrorKind::kInvalidArgument,
                fmt::format("rank {} outside world {}", o.rank, o.world));
  c10d::TCPStoreOptions so;
  so.port = o.store_port;
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = o.store_timeout;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(o.store_host, so);
  if (!o.store_prefix.empty())
    store = c10::make_intrusive<c10d::PrefixStore>(o.store_prefix, store);
  auto opts = c10d::ProcessGroupGloo::Options::create(o.collective_timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(o.device_hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(o.rank),
                                                     static_cast<int>(o.world), opts);
}

}  // namespace megacpp::trainer
