#include "stages/trainer/tensor_parallel.h"

#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "stages/trainer/collective.h"
#include "stages/trainer/model_internal.h"
#include "stages/trainer/recompute.h"
#include "stages/trainer/ssd.h"

namespace megacpp::trainer {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through the autograd context as an address: TensorParallel's contract
// makes it outlive every graph built with it.
int64_t address(const TensorParallel& tp) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&tp));
}
const TensorParallel& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<const TensorParallel*>(
      static_cast<intptr_t>(ctx->saved_data["tp"].toInt()));
}

at::Tensor all_reduce(const TensorParallel& tp, at::Tensor x) {
  x = x.contiguous();
  std::vector<at::Tensor> v{x};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  run_collective("tensor-parallel all_reduce", tp.group, [&] { return tp.group->allreduce(v, o); });
  return v[0];
}

at::Tensor gather_dim1(const TensorParallel& tp, const at::Tensor& x) {
  // Gathered along dim 0 of [t, B, ...], then back to [B, T, ...].
  at::Tensor in = x.transpose(0, 1).contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= tp.size;
  at::Tensor out = at::empty(shape, in.options());
  run_collective("tensor-parallel all_gather", tp.group,
                 [&] { return tp.group->_allgather_base(out, in); });
  return out.transpose(0, 1);
}

at::Tensor shard_dim1(const TensorParallel& tp, const at::Tensor& x) {
  const int64_t t = x.size(1) / tp.size;
  return x.narrow(1, tp.rank * t, t);
}

struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return gather_dim1(group_of(ctx), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const TensorParallel& tp = group_of(ctx);
    return {shard_dim1(tp, all_reduce(tp, grad[0])).contiguous(), at::Tensor()};
  }
};

struct ReduceScatterSequence : public torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    const TensorParallel& g = group_of(ctx);
    return shard_dim1(g, all_reduce(g, x.clone())).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_dim1(group_of(ctx), grad[0]).contiguous(), at::Tensor()};
  }
};

struct AllReduceSum : public torch::autograd::Function<AllReduceSum> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return all_reduce(group_of(ctx), x.clone());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduce(group_of(ctx), grad[0].clone()), at::Tensor()};
  }
};

void require(bool ok, const std::string& what) {
  MEGACPP_CHECK(ok, ErrorKind::kInvalidArgument, "tensor parallel: " + what);
}

// Rows [first, first + count) of a weight.
at::Tensor rows(const at::Tensor& w, int64_t first, int64_t count) {
  return w.narrow(0, first, count);
}

using detail::rms_norm;
using detail::rope;

// hf: the gathered normed input [B, T, D]; returns the partial output [B, T, D].
at::Tensor attention(const AttentionImpl& attn, const ModelConfig& c, const at::Tensor& hf,
                     const at::Tensor& cos, const at::Tensor& sin, const TensorParallel& tp) {
  const int64_t H = c.n_heads, KV = c.kv_heads(), hd = c.head_dim();
  require(H % tp.size == 0 && KV % tp.size == 0,
          fmt::format("{} query and {} key/value heads over {} ranks", H, KV, tp.size));
  const int64_t hq = H / tp.size, hk = KV / tp.size, B = hf.size(0), T = hf.size(1);
  // This rank's q, k and v rows (shard_model).
  const at::Tensor& w_local = attn.qkv->weight;
  require(w_local.size(0) == (hq + 2 * hk) * hd, "the model is not sharded (shard_model)");
  const auto parts = at::linear(hf, w_local).split_with_sizes({hq * hd, hk * hd, hk * hd}, -1);
  const auto [q, k] = detail::qk_norm_rope(parts[0].view({B, T, hq, hd}).transpose(1, 2),
                                           parts[1].view({B, T, hk, hd}).transpose(1, 2), cos, sin,
                                           attn.selective());
  const at::Tensor v = parts[2].view({B, T, hk, hd}).transpose(1, 2);
  const at::Tensor y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, {},
                                                        /*enable_gqa=*/hq != hk);
  return at::linear(y.transpose(1, 2).reshape({B, T, hq * hd}), attn.proj->weight);
}

// This rank's hidden units (shard_model cut fc's rows and proj's columns).
at::Tensor mlp(const MlpImpl& m, const at::Tensor& hf) {
  if (m.selective())
    return detail::relu2_linear(at::linear(hf, m.fc->weight), m.proj->weight, true);
  return at::linear(at::relu(at::linear(hf, m.fc->weight)).square(), m.proj->weight);
}

// Routing on every rank (the router is whole), this rank's experts, a slice of the shared one.
at::Tensor moe(MoeImpl& moe, const at::Tensor& hf, const TensorParallel& tp) {
  const int64_t E = moe.config().n_experts;
  require(E % tp.size == 0, fmt::format("{} routed experts over {} ranks", E, tp.size));
  const at::Tensor flat = hf.reshape({-1, hf.size(-1)});
  const int64_t per_rank = E / tp.size;
  at::Tensor y =
      moe.combine(moe.dispatch(flat), flat, tp.rank * per_rank, (tp.rank + 1) * per_rank);
  if (moe.shared) y = y + mlp(*moe.shared, flat);
  return y.view(hf.sizes());
}

// Whole heads of the Mamba-2 mixer; B and C (one group shared by every head) on every rank.
// The gated norm's all-reduce splits it in two regions: in_proj's output (selective; full: the
// gathered input) to the gated product g and its sum of squares, and g with the mean of squares
// through the norm to out_proj (kept: g and the mean).
at::Tensor mamba(const MambaImpl& m, const at::Tensor& hf, const TensorParallel& tp,
                 recipe::Recompute mode) {
  const MambaConfig& c = m.config();
  const int64_t H = c.n_heads(), P = c.head_dim, N = c.d_state, I = c.d_inner();
  require(H % tp.size == 0, fmt::format("{} Mamba heads over {} ranks", H, tp.size));
  const int64_t hl = H / tp.size, il = hl * P, B = hf.size(0), T = hf.size(1);
  const int64_t r = tp.rank;
  // This rank's in_proj rows (shard_model): z [il], x [il], B [N], C [N], dt [hl].
  const at::Tensor& w_local = m.in_proj->weight;
  require(w_local.size(0) == 2 * il + 2 * N + hl, "the model is not sharded (shard_model)");
  const at::Tensor& cw = m.conv->weight;  // channels: x [I], B [N], C [N]
  const at::Tensor conv_w = at::cat({rows(cw, r * il, il), rows(cw, I, 2 * N)});
  const at::Tensor conv_b = at::cat({rows(m.conv->bias, r * il, il), rows(m.conv->bias, I, 2 * N)});
  const at::Tensor dt_bias = m.dt_bias.narrow(0, r * hl, hl);
  const at::Tensor A_log = m.A_log.narrow(0, r * hl, hl);
  const at::Tensor D = m.D.narrow(0, r * hl, hl);
  // in: the in_proj output, conv weight and bias, dt_bias, A_log, D (this rank's slices).
  const auto gated = [=](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    const auto parts = in[0].split_with_sizes({il, il + 2 * N, hl}, -1);
    const at::Tensor xbc = at::silu(
        at::conv1d(parts[1].transpose(1, 2), in[1], in[2], 1, c.conv_kernel - 1, 1, il + 2 * N)
            .narrow(2, 0, T)
            .transpose(1, 2));
    const auto xbc_parts = xbc.split_with_sizes({il, N, N}, -1);
    const at::Tensor u = xbc_parts[0].reshape({B, T, hl, P});
    const at::Tensor dt = at::softplus(parts[2] + in[3]);
    const at::Tensor A = -in[4].exp();
    const at::Tensor b = xbc_parts[1].unsqueeze(2).expand({B, T, hl, N});
    const at::Tensor cc = xbc_parts[2].unsqueeze(2).expand({B, T, hl, N});
    const SsdResult s = ssd_chunked(u * dt.unsqueeze(-1), dt * A, b, cc, c.chunk);
    const at::Tensor y = (s.y + u * in[5].view({1, 1, hl, 1})).reshape({B, T, il});
    at::Tensor g = y * at::silu(parts[0]);
    at::Tensor sum_sq = g.square().sum(-1, true);
    return {std::move(g), std::move(sum_sq)};
  };
  std::vector<at::Tensor> g;
  switch (mode) {
    case recipe::Recompute::kNone:
      g = gated({at::linear(hf, w_local), conv_w, conv_b, dt_bias, A_log, D});
      break;
    case recipe::Recompute::kSelective:
      g = detail::recompute(gated, {at::linear(hf, w_local), conv_w, conv_b, dt_bias, A_log, D});
      break;
    case recipe::Recompute::kFull:
      g = detail::recompute(
          [gated](const std::vector<at::Tensor>& in) {
            return gated({at::linear(in[0], in[1]), in[2], in[3], in[4], in[5], in[6]});
          },
          {hf, w_local, conv_w, conv_b, dt_bias, A_log, D});
      break;
  }
  // RMSNorm over all I channels: the mean of squares is summed across the group.
  const at::Tensor mean_sq = AllReduceSum::apply(g[1], address(tp)) / static_cast<double>(I);
  const at::Tensor norm_w = m.norm_weight.narrow(0, r * il, il);
  const at::Tensor& out_w = m.out_proj->weight;  // this rank's columns
  const auto normed = [](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
    return {in[0] * at::rsqrt(in[1] + 1e-6) * in[2]};
  };
  if (mode == recipe::Recompute::kNone)
    return at::linear(normed({g[0], mean_sq, norm_w})[0], out_w);
  return detail::recompute_into_linear(normed, {g[0], mean_sq, norm_w}, {out_w})[0];
}

// "full": a branch's local compute between its gather and its reduce-scatter is one region
// (model_internal.h recompute_block), its inputs the gathered input and the block's parameters;
// the collectives stay outside it (recompute.h). `body` must capture by value what it reads.
at::Tensor full_branch(BlockImpl& block, const at::Tensor& hf,
                       std::function<at::Tensor(const at::Tensor&)> body) {
  return detail::recompute_block(
      block, {hf},
      [body = std::move(body)](const std::vector<at::Tensor>& in) { return body(in[0]); });
}

}  // namespace

at::Tensor gather_sequence(const at::Tensor& x, const TensorParallel& tp) {
  return GatherSequence::apply(x, address(tp));
}
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const TensorParallel& tp) {
  return ReduceScatterSequence::apply(x, address(tp));
}
at::Tensor all_reduce_sum(const at::Tensor& x, const TensorParallel& tp) {
  return AllReduceSum::apply(x, address(tp));
}

at::Tensor forward_tensor_parallel(TransformerImpl& model, const at::Tensor& tokens,
                                   const TensorParallel& tp) {
  const ModelConfig& c = model.config();
  const int64_t T = tokens.size(1);
  require(tp.group && tp.size > 1 && tp.rank < tp.size, "needs a group of 2 or more ranks");
  require(T % tp.size == 0, fmt::format("sequence {} over {} ranks", T, tp.size));
  const int64_t t = T / tp.size;
  const auto tables = model.rope(T);
  const at::Tensor cos = tables.first, sin = tables.second;
  at::Tensor x = rms_norm(model.embed(tokens.narrow(1, tp.rank * t, t)));
  const bool full = model.recompute() == recipe::Recompute::kFull;
  for (const auto& item : *model.blocks) {
    BlockImpl& block = *item->as<Block>();
    const auto branch = [&](std::function<at::Tensor(const at::Tensor&)> body) {
      const at::Tensor hf = gather_sequence(rms_norm(x), tp);
      return reduce_scatter_sequence(full ? full_branch(block, hf, std::move(body)) : body(hf), tp);
    };
    // The bodies capture by value (a "full" region runs its body again in backward); the
    // model, its blocks and `tp` outlive the graph.
    const TensorParallel* g = &tp;
    const ModelConfig* mc = &c;
    BlockImpl* bp = &block;
    switch (block.kind()) {
      case recipe::kBlockAttention:
        x = x + branch([=](const at::Tensor& hf) {
              return attention(*bp->attn, *mc, hf, cos, sin, *g);
            });
        x = x + branch([=](const at::Tensor& hf) { return mlp(*bp->mlp, hf); });
        break;
      case recipe::kBlockMlp:
        x = x + branch([=](const at::Tensor& hf) { return mlp(*bp->mlp, hf); });
        break;
      case recipe::kBlockMoe:
        x = x + branch([=](const at::Tensor& hf) { return moe(*bp->moe, hf, *g); });
        break;
      case recipe::kBlockMamba: {
        // Its all-reduce splits it: mamba() places its own regions.
        const at::Tensor hf = gather_sequence(rms_norm(x), tp);
        x = x + reduce_scatter_sequence(mamba(*block.mamba, hf, tp, model.recompute()), tp);
        break;
      }
      default:
        require(false,
                "the recurrence block (R) has no tensor-parallel form; nemo_native runs R "
                "on the Mamba block");
    }
  }
  return model.head(rms_norm(x));
}

void reduce_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& blocks,
                      const TensorParallel& tp) {
  if (!tp.group || tp.size <= 1 || (params.empty() && blocks.empty())) return;
  int64_t numel = 0;
  for (const at::Tensor& p : params) numel += p.numel();
  int64_t block_numel = 0;
  for (const at::Tensor& b : blocks) block_numel += b.numel();
  const int64_t n = static_cast<int64_t>(params.size());
  const at::Tensor& any = params.empty() ? blocks.front() : params.front();
  at::Tensor flat = at::zeros({numel + n + block_numel}, any.options().requires_grad(false));
  int64_t at_ = numel + n;
  for (const at::Tensor& b : blocks) {
    flat.narrow(0, at_, b.numel()).copy_(b.reshape({-1}));
    at_ += b.numel();
  }
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[static_cast<size_t>(i)];
    if (p.grad().defined()) {
      flat.narrow(0, off, p.numel()).copy_(p.grad().reshape({-1}));
      flat[numel + i].fill_(1.0);
    }
    off += p.numel();
  }
  flat = all_reduce(tp, flat);
  at_ = numel + n;
  for (const at::Tensor& b : blocks) {
    at::Tensor(b).copy_(flat.narrow(0, at_, b.numel()).view(b.sizes()));
    at_ += b.numel();
  }
  const at::Tensor has = flat.narrow(0, numel, n).gt(0).to(at::kCPU);
  const auto* has_grad = has.data_ptr<bool>();
  off = 0;
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor p = params[static_cast<size_t>(i)];
    if (has_grad[i]) {
      p.mutable_grad() = flat.narrow(0, off, p.numel()).view(p.sizes()).clone();
    } else {
      p.mutable_grad() = at::Tensor();
    }
    off += p.numel();
  }
}

}  // namespace megacpp::trainer

namespace megacpp::trainer {

std::map<std::string, MatrixPart> shard_model(TransformerImpl& model, const TensorParallel& tp) {
  require(tp.size > 1 && tp.rank < tp.size, "shard_model needs a group of 2 or more ranks");
  torch::NoGradGuard no_grad;
  const ModelConfig& c = model.config();
  const int64_t n = tp.size, r = tp.rank;
  std::map<std::string, MatrixPart> parts;
  // A run of `size` indices along the cut dimension from `offset`: split (this rank holds
  // size / n of them) or whole on every rank.
  struct Run {
    int64_t offset, size;
    bool split = true;
  };
  const auto cut = [&](const std::string& name, at::Tensor& p, int64_t dim,
                       const std::vector<Run>& runs) {
    MatrixPart part{.full_shape = p.sizes().vec(), .dim = dim, .blocks = {}};
    std::vector<at::Tensor> pieces;
    int64_t local = 0;
    for (const Run& run : runs) {
      require(!run.split || run.size % n == 0,
              fmt::format("{}: {} rows or columns over {} ranks", name, run.size, n));
      const int64_t size = run.split ? run.size / n : run.size;
      const int64_t offset = run.split ? run.offset + r * size : run.offset;
      pieces.push_back(p.narrow(dim, offset, size));
      part.blocks.push_back({.full_offset = offset,
                             .local_offset = local,
                             .size = size,
                             .contributes = run.split || r == 0,
                             .replicated = !run.split});
      local += size;
    }
    p.set_data(pieces.size() == 1 ? pieces.front().contiguous() : at::cat(pieces, dim));
    parts.emplace(name, std::move(part));
  };
  const auto cut_mlp = [&](const std::string& prefix, MlpImpl& m) {
    cut(prefix + ".fc.weight", m.fc->weight, 0, {{0, m.fc->weight.size(0)}});
    cut(prefix + ".proj.weight", m.proj->weight, 1, {{0, m.proj->weight.size(1)}});
  };
  for (size_t i = 0; i < model.blocks->size(); ++i) {
    BlockImpl& block = *model.blocks[i]->as<Block>();
    const std::string prefix = fmt::format("blocks.{}", i);
    switch (block.kind()) {
      case recipe::kBlockAttention: {
        const int64_t hd = c.head_dim(), q = int64_t{c.n_heads} * hd, kv = c.kv_heads() * hd;
        require(c.n_heads % n == 0 && c.kv_heads() % n == 0,
                fmt::format("{} query and {} key/value heads over {} ranks", c.n_heads,
                            c.kv_heads(), n));
        cut(prefix + ".attn.qkv.weight", block.attn->qkv->weight, 0,
            {{0, q}, {q, kv}, {q + kv, kv}});
        cut(prefix + ".attn.proj.weight", block.attn->proj->weight, 1, {{0, q}});
        cut_mlp(prefix + ".mlp", *block.mlp);
        break;
      }
      case recipe::kBlockMlp:
        cut_mlp(prefix + ".mlp", *block.mlp);
        break;
      case recipe::kBlockMoe: {
        MoeImpl& moe = *block.moe;
        const int64_t E = moe.config().n_experts;
        require(E % n == 0, fmt::format("{} routed experts over {} ranks", E, n));
        for (int64_t e = 0; e < E; ++e) {
          auto& expert = *moe.experts[static_cast<size_t>(e)]->as<Mlp>();
          const bool mine = e / (E / n) == r;
          for (const char* which : {"fc", "proj"}) {
            at::Tensor& w =
                std::string_view(which) == "fc" ? expert.fc->weight : expert.proj->weight;
            MatrixPart part{.full_shape = w.sizes().vec(), .dim = 0, .blocks = {}};
            if (mine) {
              part.blocks.push_back({.full_offset = 0, .local_offset = 0, .size = w.size(0)});
            } else {
              w.set_data(at::empty({0, w.size(1)}, w.options()));
            }
            parts.emplace(fmt::format("{}.moe.experts.{}.{}.weight", prefix, e, which),
                          std::move(part));
          }
        }
        if (moe.shared) cut_mlp(prefix + ".moe.shared", *moe.shared);
        break;
      }
      case recipe::kBlockMamba: {
        MambaImpl& m = *block.mamba;
        const MambaConfig& mc = m.config();
        const int64_t I = mc.d_inner(), N = mc.d_state, H = mc.n_heads();
        require(H % n == 0, fmt::format("{} Mamba heads over {} ranks", H, n));
        // in_proj rows: z [I], x [I], B [N], C [N] (whole: every head reads them), dt [H].
        cut(prefix + ".mamba.in_proj.weight", m.in_proj->weight, 0,
            {{0, I}, {I, I}, {2 * I, 2 * N, false}, {2 * I + 2 * N, H}});
        cut(prefix + ".mamba.out_proj.weight", m.out_proj->weight, 1, {{0, I}});
        break;
      }
      default:
        require(false,
                "the recurrence block (R) has no tensor-parallel form; nemo_native runs R "
                "on the Mamba block");
    }
  }
  return parts;
}

}  // namespace megacpp::trainer
