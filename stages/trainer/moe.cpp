#include "stages/trainer/moe.h"

#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/model_internal.h"
#include "stages/trainer/recompute.h"

namespace megacpp::trainer {

namespace {

using detail::linear;

struct Routing {
  at::Tensor probs;    // [N, E]
  at::Tensor weights;  // [N, k], each row summing to 1
  at::Tensor experts;  // int64 [N, k]
};

Routing route(MoeImpl& moe, const at::Tensor& flat) {
  Routing r;
  r.probs = at::softmax(moe.router(flat), -1);
  auto [top_w, top_e] = r.probs.topk(moe.config().top_k, -1);
  r.weights = top_w / top_w.sum(-1, /*keepdim=*/true);
  r.experts = top_e;
  return r;
}

}  // namespace

MlpImpl::MlpImpl(int64_t d_model, int64_t hidden) {
  fc = register_module("fc", linear(d_model, hidden));
  proj = register_module("proj", linear(hidden, d_model));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return from_fc(fc(x));
}

at::Tensor MlpImpl::from_fc(const at::Tensor& f) {
  if (selective_) return detail::relu2_linear(f, proj->weight, true);
  return proj(torch::relu(f).square());
}

MoeImpl::MoeImpl(int64_t d_model, const recipe::MoeConfig& c) : config_(c) {
  MEGACPP_CHECK(c.n_experts >= 1 && c.top_k >= 1 && c.top_k <= c.n_experts && c.expert_hidden >= 1,
                ErrorKind::kInvalidArgument,
                fmt::format("moe: needs n_experts >= 1, top_k in [1, n_experts] and "
                            "expert_hidden >= 1 (got {}, {}, {})",
                            c.n_experts, c.top_k, c.expert_hidden));
  router = register_module("router", linear(d_model, c.n_experts));
  experts = register_module("experts", torch::nn::ModuleList());
  for (uint32_t e = 0; e < c.n_experts; ++e) experts->push_back(Mlp(d_model, c.expert_hidden));
  if (c.shared_hidden > 0) shared = register_module("shared", Mlp(d_model, c.shared_hidden));
}

void MoeImpl::set_selective(bool on) {
  for (const auto& e : *experts) e->as<Mlp>()->set_selective(on);
  if (shared) shared->set_selective(on);
}

at::Tensor MoeImpl::forward(const at::Tensor& x) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  at::Tensor y = combine(dispatch(flat), flat, 0, config_.n_experts);
  if (shared) y = y + shared(flat);
  return y.view(x.sizes());
}

MoeImpl::Dispatch MoeImpl::dispatch(const at::Tensor& flat) {
  const Routing r = route(*this, flat);
  const at::Tensor assigned = r.experts.reshape({-1});  // [N * k]
  // A scatter-add, not bincount: bincount's device path reads the input's maximum to size its
  // output, a second wait of the host for the device beside the counts' own read below.
  const at::Tensor counts = at::zeros({config_.n_experts}, assigned.options())
                                .scatter_add_(0, assigned, at::ones_like(assigned));
  Dispatch d;
  d.order = std::get<1>(assigned.sort(std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  d.weights = r.weights.reshape({-1});
  const at::Tensor counts_host = counts.to(at::kCPU);
  d.count.assign(counts_host.data_ptr<int64_t>(),
                 counts_host.data_ptr<int64_t>() + counts_host.numel());
  record_routing(r.probs, counts);
  return d;
}

at::Tensor MoeImpl::combine(const Dispatch& d, const at::Tensor& flat, int64_t first,
                            int64_t last) {
  int64_t begin = 0, assignments = 0;
  for (int64_t e = 0; e < first; ++e) begin += d.count[static_cast<size_t>(e)];
  for (int64_t e = first; e < last; ++e) assignments += d.count[static_cast<size_t>(e)];
  at::Tensor y = at::zeros_like(flat);
  if (assignments == 0) return y;
  const at::Tensor mine = d.order.narrow(0, begin, assignments);
  const at::Tensor token_of = at::floor_divide(mine, int64_t{config_.top_k});
  const at::Tensor routed_in = flat.index_select(0, token_of);
  std::vector<at::Tensor> outs;
  outs.reserve(static_cast<size_t>(last - first));
  int64_t offset = 0;
  for (int64_t e = first; e < last; ++e) {
    const int64_t n = d.count[static_cast<size_t>(e)];
    if (n == 0) continue;
    outs.push_back(experts[e]->as<Mlp>()->forward(routed_in.narrow(0, offset, n)));
    offset += n;
  }
  const at::Tensor routed = at::cat(outs, 0) * d.weights.index_select(0, mine).unsqueeze(1);
  return y.index_add(0, token_of, routed);
}

void MoeImpl::record_routing(const at::Tensor& probs, const at::Tensor& counts) {
  const int64_t assignments = probs.size(0) * config_.top_k;
  const at::Tensor share = counts.to(probs.scalar_type()) / static_cast<double>(assignments);
  aux_loss_ = static_cast<double>(config_.n_experts) * (share * probs.mean(0)).sum();
  tokens_per_expert_ = counts;
}

at::Tensor moe_reference(MoeImpl& moe, const at::Tensor& x) {
  const int64_t D = x.size(-1), E = moe.config().n_experts;
  const at::Tensor flat = x.reshape({-1, D});
  const Routing r = route(moe, flat);
  const at::Tensor dense_w =
      at::zeros({flat.size(0), E}, flat.options()).scatter(1, r.experts, r.weights);
  at::Tensor y = at::zeros_like(flat);
  for (int64_t e = 0; e < E; ++e)
    y = y + moe.experts[e]->as<Mlp>()->forward(flat) * dense_w.select(1, e).unsqueeze(1);
  if (moe.shared) y = y + moe.shared(flat);
  return y.view(x.sizes());
}

}  // namespace megacpp::trainer
