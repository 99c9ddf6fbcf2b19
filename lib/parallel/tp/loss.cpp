// Loss parallelism (LossParallel, include/dtensor/tensor_parallel.h): cross-entropy on
// class-sharded logits without gathering them. An interceptor runs the four ops that
// cross_entropy is made of -- _log_softmax, nll_loss_forward and their backwards -- on the
// local shards with small all-reduces over the mesh dim that shards the classes.
#include <atomic>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/core/Reduction.h>
#include <fmt/ranges.h>

#include <dtensor/collectives.h>
#include <dtensor/tensor_parallel.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "tensor/dispatch/interceptors.h"
#include "tensor/dtensor_impl.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor {

namespace {
std::atomic<int> loss_parallel_scopes{0};
} // namespace

LossParallel::LossParallel() {
  ++loss_parallel_scopes;
}
LossParallel::~LossParallel() {
  --loss_parallel_scopes;
}
bool loss_parallel_enabled() {
  return loss_parallel_scopes.load() > 0;
}

} // namespace dtensor

namespace dtensor::detail {

namespace {

// [Note: loss parallelism]
// log_softmax over a class dim sharded on mesh dim m: the row max and the row sum of
// exponentials are all-reduced over m (N elements each), the rest is local. nll_loss picks
// each row's target log-probability on the one rank of m whose class range holds it (zero
// elsewhere) and sums over the rows first, so one scalar is all-reduced (N values for
// reduction none). Backward needs no collective: nll_loss_backward gives the gradient with
// respect to the log-probabilities, -w_t g at each row's target, and tags it with its row
// sums over all classes (-w_t g, known locally); _log_softmax_backward_data then computes
// grad - exp(out) * rowsum from the tag. PyTorch's handler instead returns the logits'
// gradient from nll_loss_backward and passes it through log_softmax's backward, which is
// wrong when the log-probabilities also feed another op (the gradients are summed before
// log_softmax's backward); here such a sum carries no tag, and its row sums are all-reduced.
struct NllGradRowSums {
  at::Tensor row_sums; // the gradient's sum over all classes, keepdim on `dim`
  int64_t dim = 0;
};

// A rank's range of the class dim and the group that shards it.
struct ClassShard {
  int64_t mesh_dim = -1; // -1: the class dim is not sharded (not loss parallelism's)
  int64_t offset = 0;
  int64_t length = 0;
};

ClassShard class_shard(const char* op, const DTensorSpec& spec, int64_t dim) {
  ClassShard c;
  for (int64_t i = 0; i < spec.mesh.ndim(); ++i) {
    const Placement& p = spec.placements[static_cast<size_t>(i)];
    if (!p.is_shard(dim)) {
      continue;
    }
    DTENSOR_CHECK(c.mesh_dim < 0,
                  "{} under LossParallel: the class dim {} of {} is sharded on mesh dims {} and "
                  "{} of {}; loss parallelism needs it sharded on exactly one",
                  op, dim, to_string(spec.placements), c.mesh_dim, i, spec.mesh.to_string());
    c.mesh_dim = i;
  }
  if (c.mesh_dim < 0) {
    return c;
  }
  for (int64_t i = 0; i < spec.mesh.ndim(); ++i) {
    DTENSOR_CHECK(!spec.placements[static_cast<size_t>(i)].is_partial(),
                  "{} under LossParallel: the input {} is Partial on mesh dim {} of {}; "
                  "redistribute it to Replicate or Shard first",
                  op, to_string(spec.placements), i, spec.mesh.to_string());
  }
  const int64_t n = spec.shape[static_cast<size_t>(dim)];
  const int64_t k = spec.mesh.size(c.mesh_dim);
  const int64_t at = spec.mesh.get_coordinate().value()[static_cast<size_t>(c.mesh_dim)];
  c.offset = chunk_offset(n, k, at);
  c.length = chunk_size(n, k, at);
  return c;
}

// The layout of a per-row tensor (target, per-row loss): the logits' placements with the
// class dim removed (Replicate on the class mesh dim, later shard dims shifted down).
Placements row_placements(const DTensorSpec& logits, int64_t class_dim, int64_t mesh_dim) {
  Placements out;
  for (size_t i = 0; i < logits.placements.size(); ++i) {
    const Placement& p = logits.placements[i];
    if (static_cast<int64_t>(i) == mesh_dim || !p.is_shard()) {
      out.push_back(Placement::replicate());
    } else {
      out.push_back(p.dim() > class_dim ? Placement::shard(p.dim() - 1) : p);
    }
  }
  return out;
}

bool all_replicate(const Placements& ps) {
  for (const Placement& p : ps) {
    if (!p.is_replicate()) {
      return false;
    }
  }
  return true;
}

// This rank's piece of `t` in `placements` on `mesh`: a DTensor is redistributed there, a
// plain tensor is taken as whole, which only a replicated layout allows.
at::Tensor local_in(const char* op, const char* what, const at::Tensor& t, const DeviceMesh& mesh,
                    const Placements& placements) {
  if (const DTensorMeta* m = dtensor_meta(t)) {
    DTENSOR_CHECK(m->spec.mesh == mesh,
                  "{} under LossParallel: {} is a DTensor on {}, the logits on {}", op, what,
                  m->spec.mesh.to_string(), mesh.to_string());
    return m->spec.placements == placements ? m->local
                                            : redistribute_local(m->local, m->spec, placements);
  }
  DTENSOR_CHECK(all_replicate(placements),
                "{} under LossParallel: {} is a plain tensor, but the logits' layout gives it {} "
                "on {}; pass it as a DTensor with those placements",
                op, what, to_string(placements), mesh.to_string());
  return t;
}

at::Tensor wrap(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                std::vector<int64_t> shape) {
  return make_dtensor(local.contiguous(),
                      make_spec(mesh, placements, std::move(shape), local.scalar_type()));
}

// All-reduce over the class group; a group of one rank has nothing to add.
void reduce_over(at::Tensor& t, ReduceOp op, const Group& group) {
  if (group.size() > 1) {
    dtensor::all_reduce_(t, op, group, detail::known_sizes());
  }
}

// Reduced-precision logits are computed in float, as PyTorch's decomposition does.
at::Tensor compute_dtype(const at::Tensor& t) {
  return at::isReducedFloatingType(t.scalar_type()) ? t.to(at::kFloat) : t;
}

// _log_softmax(self, dim, half_to_float)
bool log_softmax(torch::jit::Stack* stack) {
  const char* op = "aten::_log_softmax";
  auto args = torch::jit::last(*stack, 3);
  const DTensorMeta* m = dtensor_meta(args[0].toTensor());
  if (m == nullptr) {
    return false;
  }
  const int64_t dim = c10::maybe_wrap_dim(args[1].toInt(), m->spec.ndim());
  const ClassShard c = class_shard(op, m->spec, dim);
  if (c.mesh_dim < 0) {
    return false;
  }
  const at::ScalarType out_dtype = args[2].toBool() ? at::kFloat : m->local.scalar_type();
  const Group group = m->spec.mesh.get_group(c.mesh_dim);
  at::Tensor x = compute_dtype(m->local);
  at::Tensor row_max = c.length > 0 ? at::amax(x, dim, /*keepdim=*/true)
                                    : at::full_like(x.sum(dim, true), -INFINITY);
  reduce_over(row_max, ReduceOp::Max, group);
  at::Tensor shifted = x - row_max;
  at::Tensor sum_exp = at::exp(shifted).sum(dim, /*keepdim=*/true);
  reduce_over(sum_exp, ReduceOp::Sum, group);
  at::Tensor out = (shifted - at::log(sum_exp)).to(out_dtype);
  at::Tensor result = wrap(out, m->spec.mesh, m->spec.placements, m->spec.shape);
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, result);
  return true;
}

// _log_softmax_backward_data(grad_output, output, dim, input_dtype)
bool log_softmax_backward(torch::jit::Stack* stack) {
  const char* op = "aten::_log_softmax_backward_data";
  auto args = torch::jit::last(*stack, 4);
  const DTensorMeta* out = dtensor_meta(args[1].toTensor());
  if (out == nullptr) {
    return false;
  }
  const int64_t dim = c10::maybe_wrap_dim(args[2].toInt(), out->spec.ndim());
  const ClassShard c = class_shard(op, out->spec, dim);
  if (c.mesh_dim < 0) {
    return false;
  }
  const at::Tensor& grad_arg = args[0].toTensor();
  at::Tensor grad =
      compute_dtype(local_in(op, "grad_output", grad_arg, out->spec.mesh, out->spec.placements));
  at::Tensor row_sums;
  const DTensorMeta* g = dtensor_meta(grad_arg);
  auto tag = g != nullptr ? g->extension<NllGradRowSums>() : nullptr;
  if (tag && tag->dim == dim && g->spec.placements == out->spec.placements) {
    row_sums = tag->row_sums; // nll_loss's gradient: no collective ([Note: loss parallelism])
  } else {
    row_sums = grad.sum(dim, /*keepdim=*/true);
    reduce_over(row_sums, ReduceOp::Sum, out->spec.mesh.get_group(c.mesh_dim));
  }
  at::Tensor result = grad - at::exp(compute_dtype(out->local)) * row_sums;
  result = result.to(args[3].toScalarType());
  at::Tensor wrapped = wrap(result, out->spec.mesh, out->spec.placements, out->spec.shape);
  torch::jit::drop(*stack, 4);
  torch::jit::push(*stack, wrapped);
  return true;
}

// What nll_loss's forward and backward share: the log-probabilities, and for each row
// where its target lies and its weight.
struct Rows {
  const DTensorMeta* x = nullptr; // the log-probabilities
  int64_t ch = 0;                 // their class dim
  ClassShard c;
  at::Tensor lp;       // x's local tensor in the computation dtype
  at::Tensor valid;    // target != ignore_index
  at::Tensor in_range; // the target class lies on this rank (and the row is valid)
  at::Tensor local;    // the target's local class index (0 where not in range)
  at::Tensor weight;   // w[target] where valid, 0 elsewhere (dtype of the computation)
};

// nullopt when `self` is not a class-sharded DTensor (not loss parallelism's).
std::optional<Rows> rows_of(const char* op, const c10::IValue& self, const c10::IValue& target,
                            const c10::IValue& weight, int64_t ignore_index) {
  Rows r;
  r.x = dtensor_meta(self.toTensor());
  if (r.x == nullptr) {
    return std::nullopt;
  }
  r.ch = r.x->spec.ndim() >= 2 ? 1 : 0;
  r.c = class_shard(op, r.x->spec, r.ch);
  if (r.c.mesh_dim < 0) {
    return std::nullopt;
  }
  const DeviceMesh& mesh = r.x->spec.mesh;
  r.lp = compute_dtype(r.x->local);
  at::Tensor t = local_in(op, "target", target.toTensor(), mesh,
                          row_placements(r.x->spec, r.ch, r.c.mesh_dim));
  r.valid = t != ignore_index;
  at::Tensor safe = at::where(r.valid, t, 0);
  r.in_range = r.valid & (safe >= r.c.offset) & (safe < r.c.offset + r.c.length);
  r.local = at::where(r.in_range, safe - r.c.offset, 0);
  r.weight = r.valid.to(r.lp.scalar_type());
  if (weight.isTensor() && weight.toTensor().defined()) {
    const Placements whole(static_cast<size_t>(mesh.ndim()), Placement::replicate());
    at::Tensor full = local_in(op, "weight", weight.toTensor(), mesh, whole).to(r.lp.scalar_type());
    r.weight = r.weight * full.index_select(0, safe.flatten()).view(safe.sizes());
  }
  return r;
}

// nll_loss_forward(self, target, weight, reduction, ignore_index) -> (output, total_weight)
bool nll_loss_forward(torch::jit::Stack* stack) {
  const char* op = "aten::nll_loss_forward";
  auto args = torch::jit::last(*stack, 5);
  const std::optional<Rows> rows_or = rows_of(op, args[0], args[1], args[2], args[4].toInt());
  if (!rows_or) {
    return false;
  }
  const Rows& r = *rows_or;
  const DTensorMeta* x = r.x;
  const int64_t ch = r.ch;
  const ClassShard& c = r.c;
  const at::Tensor& lp = r.lp;
  const int64_t reduction = args[3].toInt();
  at::Tensor picked = c.length > 0 ? lp.gather(ch, r.local.unsqueeze(ch)).squeeze(ch)
                                   : at::zeros(r.local.sizes(), lp.options());
  at::Tensor loss = -at::where(r.in_range, picked, 0) * r.weight;
  const DeviceMesh& mesh = x->spec.mesh;
  const Group group = mesh.get_group(c.mesh_dim);
  const Placements rows = row_placements(x->spec, ch, c.mesh_dim);
  std::vector<int64_t> row_shape = x->spec.shape;
  row_shape.erase(row_shape.begin() + ch);
  const auto out_dtype = x->local.scalar_type();
  at::Tensor output;
  at::Tensor total = r.weight.sum();
  Placements scalar(rows.size(), Placement::replicate());
  if (reduction == at::Reduction::None) {
    reduce_over(loss, ReduceOp::Sum, group);
    output = wrap(loss.to(out_dtype), mesh, rows, row_shape);
    total = at::zeros({}, lp.options());
  } else {
    at::Tensor loss_sum = loss.sum();
    reduce_over(loss_sum, ReduceOp::Sum, group); // the weights' total is the same over it
    at::Tensor sums = at::stack({loss_sum, total});
    for (size_t i = 0; i < rows.size(); ++i) {
      if (!rows[i].is_shard()) {
        continue;
      }
      if (reduction == at::Reduction::Mean) { // the global mean: one scalar pair per dim
        reduce_over(sums, ReduceOp::Sum, mesh.get_group(static_cast<int64_t>(i)));
      } else {
        scalar[i] = Placement::partial(ReduceOp::Sum);
      }
    }
    at::Tensor value = reduction == at::Reduction::Mean ? sums[0] / sums[1] : sums[0];
    output = wrap(value.to(out_dtype), mesh, scalar, {});
    total = sums[1];
  }
  at::Tensor total_weight = wrap(total.to(out_dtype), mesh, scalar, {});
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, output, total_weight);
  return true;
}

// nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)
bool nll_loss_backward(torch::jit::Stack* stack) {
  const char* op = "aten::nll_loss_backward";
  auto args = torch::jit::last(*stack, 7);
  const std::optional<Rows> rows_or = rows_of(op, args[1], args[2], args[3], args[5].toInt());
  if (!rows_or) {
    return false;
  }
  const Rows& r = *rows_or;
  const DTensorMeta* x = r.x;
  const int64_t ch = r.ch;
  const ClassShard& c = r.c;
  const at::Tensor& lp = r.lp;
  const int64_t reduction = args[4].toInt();
  const DeviceMesh& mesh = x->spec.mesh;
  const Placements whole(static_cast<size_t>(mesh.ndim()), Placement::replicate());
  const Placements rows =
      reduction == at::Reduction::None ? row_placements(x->spec, ch, c.mesh_dim) : whole;
  at::Tensor g = local_in(op, "grad_output", args[0].toTensor(), mesh, rows).to(lp.scalar_type());
  if (reduction == at::Reduction::Mean) {
    g = g / local_in(op, "total_weight", args[6].toTensor(), mesh, whole).to(lp.scalar_type());
  }
  at::Tensor coeff = r.weight * g; // d loss / d logprob at each row's target, negated
  at::Tensor grad = at::zeros_like(lp);
  if (c.length > 0) {
    grad.scatter_(ch, r.local.unsqueeze(ch), (-coeff * r.in_range).unsqueeze(ch));
  }
  at::Tensor out = wrap(grad.to(x->local.scalar_type()), mesh, x->spec.placements, x->spec.shape);
  auto tag = std::make_shared<NllGradRowSums>();
  tag->row_sums = (-coeff).unsqueeze(ch);
  tag->dim = ch;
  mutable_dtensor_meta(out)->set_extension<NllGradRowSums>(std::move(tag));
  torch::jit::drop(*stack, 7);
  torch::jit::push(*stack, out);
  return true;
}

bool loss_parallel_run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!loss_parallel_enabled()) {
    return false;
  }
  const c10::OperatorName& name = op.operator_name();
  if (!name.overload_name.empty()) {
    return false;
  }
  if (name.name == "aten::_log_softmax") {
    return log_softmax(stack);
  }
  if (name.name == "aten::_log_softmax_backward_data") {
    return log_softmax_backward(stack);
  }
  if (name.name == "aten::nll_loss_forward") {
    return nll_loss_forward(stack);
  }
  if (name.name == "aten::nll_loss_backward") {
    return nll_loss_backward(stack);
  }
  if (name.name == "aten::nll_loss2d_forward" || name.name == "aten::nll_loss2d_backward") {
    const DTensorMeta* x =
        dtensor_meta(torch::jit::peek(*stack, name.name == "aten::nll_loss2d_forward" ? 0 : 1,
                                      op.schema().arguments().size())
                         .toTensor());
    DTENSOR_CHECK(x == nullptr || class_shard(name.name.c_str(), x->spec, 1).mesh_dim < 0,
                  "{} under LossParallel: logits {} with the class dim sharded {}; flatten them "
                  "to [N, C] (and the target to [N]) first",
                  name.name, fmt::join(x->spec.shape, "x"), to_string(x->spec.placements));
  }
  return false;
}

[[maybe_unused]] const bool loss_parallel_registered =
    register_interceptor({"loss parallelism", /*order=*/5, loss_parallel_run, nullptr});

} // namespace

} // namespace dtensor::detail
