#include "stages/trainer/recompute.h"

#include <cstddef>
#include <utility>

#include "stages/trainer/model_internal.h"

namespace megacpp::trainer::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a region's node keeps besides its inputs: the function, and how many of the trailing
// inputs are the weights of the closing products (0: a plain region).
struct Region : torch::CustomClassHolder {
  RegionFn fn;
  size_t weights = 0;
};

// The gradients of at::linear(s, w) without a bias for the incoming `grad`, as autograd computes
// them: linear is matmul(s, w.t()), which folds s of more than 2 dimensions to [n, K] (a view:
// s is contiguous) and takes mm with w.t(); MmBackward0 then runs mm_mat1_backward and
// mm_mat2_backward (declared in the wheel's autograd FunctionsManual header, not
// exported), whose branches are repeated here, and the transpose and the fold are undone.
std::pair<at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad, const at::Tensor& s,
                                                  const at::Tensor& w, bool need_s, bool need_w) {
  const at::Tensor s2 = s.dim() == 2 ? s : s.reshape({-1, s.size(-1)});
  const at::Tensor g2 = grad.dim() == 2 ? grad : grad.reshape({-1, grad.size(-1)});
  const at::Tensor wt = w.t();
  at::Tensor gs, gw;
  if (need_s) {
    // mm_mat1_backward: a column-major mat1 gets its gradient column-major.
    gs = (s2.stride(0) == 1 && s2.stride(1) == s2.size(0)) ? wt.mm(g2.t()).t() : g2.mm(wt.t());
    if (s.dim() != 2) gs = gs.reshape(s.sizes());
  }
  if (need_w) {
    // mm_mat2_backward for mat2 = w.t(), then TBackward0.
    const at::Tensor gwt =
        (wt.stride(0) == 1 && wt.stride(1) == wt.size(0)) ? g2.t().mm(s2).t() : s2.t().mm(g2);
    gw = gwt.t();
  }
  return {gs, gw};
}

struct RegionFunction : public torch::autograd::Function<RegionFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Region> region,
                               at::TensorList all) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(all.vec());
    const size_t n_in = all.size() - region->weights;
    const std::vector<at::Tensor> inputs(all.begin(), all.begin() + static_cast<ptrdiff_t>(n_in));
    variable_list out = region->fn(inputs);
    if (region->weights > 0) {
      // [products of s..., the function's other outputs...]
      TORCH_INTERNAL_ASSERT(out.at(0).is_contiguous(), "a region's tail must be contiguous");
      variable_list products;
      for (size_t j = n_in; j < all.size(); ++j) products.push_back(at::linear(out[0], all[j]));
      products.insert(products.end(), out.begin() + 1, out.end());
      out = std::move(products);
    }
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto region =
        c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    const size_t n_in = saved.size() - region->weights;
    std::vector<at::Tensor> inputs(n_in), targets;
    std::vector<size_t> target_index;
    for (size_t i = 0; i < n_in; ++i) {
      const at::Tensor& t = saved[i];
      if (!t.defined() || !t.requires_grad()) {
        inputs[i] = t;
        continue;
      }
      inputs[i] = t.is_leaf() ? t : t.detach().requires_grad_(true);
      targets.push_back(inputs[i]);
      target_index.push_back(i);
    }
    variable_list result(1 + saved.size());  // [0]: the region (not a tensor)
    at::AutoGradMode grad_mode(true);
    const variable_list out = region->fn(inputs);
    variable_list outs, grad_outs;
    if (region->weights == 0) {
      for (size_t k = 0; k < out.size(); ++k) {
        if (grads[k].defined() && out[k].requires_grad()) {
          outs.push_back(out[k]);
          grad_outs.push_back(grads[k]);
        }
      }
    } else {
      const at::Tensor& s = out.at(0);
      at::Tensor grad_s;
      for (size_t j = 0; j < region->weights; ++j) {
        if (!grads[j].defined()) continue;
        const at::Tensor w = saved[n_in + j];
        auto [gs, gw] =
            linear_backward(grads[j], s.detach(), w.detach(), s.requires_grad(), w.requires_grad());
        result[1 + n_in + j] = gw;
        if (gs.defined()) grad_s = grad_s.defined() ? grad_s + gs : gs;
      }
      if (grad_s.defined()) {
        outs.push_back(s);
        grad_outs.push_back(grad_s);
      }
      for (size_t k = 1; k < out.size(); ++k) {
        const at::Tensor& g = grads[region->weights + k - 1];
        if (g.defined() && out[k].requires_grad()) {
          outs.push_back(out[k]);
          grad_outs.push_back(g);
        }
      }
    }
    if (!outs.empty() && !targets.empty()) {
      const variable_list g = torch::autograd::grad(outs, targets, grad_outs,
                                                    /*retain_graph=*/false,
                                                    /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t t = 0; t < g.size(); ++t) result[1 + target_index[t]] = g[t];
    }
    return result;
  }
};

std::vector<at::Tensor> apply(RegionFn fn, std::vector<at::Tensor> inputs,
                              std::vector<at::Tensor> weights) {
  auto region = c10::make_intrusive<Region>();
  region->fn = std::move(fn);
  region->weights = weights.size();
  for (at::Tensor& w : weights) inputs.push_back(std::move(w));
  return RegionFunction::apply(std::move(region), at::TensorList(inputs));
}

}  // namespace

std::vector<at::Tensor> recompute(RegionFn fn, std::vector<at::Tensor> inputs) {
  return apply(std::move(fn), std::move(inputs), {});
}

std::vector<at::Tensor> recompute_into_linear(RegionFn fn, std::vector<at::Tensor> inputs,
                                              std::vector<at::Tensor> weights) {
  return apply(std::move(fn), std::move(inputs), std::move(weights));
}

std::vector<at::Tensor> norm_linear(const at::Tensor& x, std::vector<at::Tensor> weights) {
  // The pass-through (a view of x) is created after the norm, as the residual add is without
  // recomputation, so x's gradient adds the residual's term first, then the norm's terms in the
  // order autograd runs them (the float32 norm reads x twice: three terms whose sum depends on
  // their order).
  return recompute_into_linear(
      [](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        at::Tensor s = rms_norm(in[0]);
        return {std::move(s), in[0].view_as(in[0])};
      },
      {x}, std::move(weights));
}

at::Tensor relu2_linear(const at::Tensor& f, const at::Tensor& w, bool selective) {
  if (!selective) return at::linear(at::relu(f).square(), w);
  return recompute_into_linear(
      [](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        return {at::relu(in[0]).square()};
      },
      {f}, {w})[0];
}

std::pair<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin,
                                               bool selective) {
  if (!selective) return {rope(rms_norm(q), cos, sin), rope(rms_norm(k), cos, sin)};
  const auto out = recompute(
      [](const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
        return {rope(rms_norm(in[0]), in[2], in[3]), rope(rms_norm(in[1]), in[2], in[3])};
      },
      {q, k, cos, sin});
  return {out[0], out[1]};
}

}  // namespace megacpp::trainer::detail
