// Ops along dimensions: scans (cumsum), sorting (sort, topk), reductions without a Partial
// form (var, std, prod, logsumexp, argmax / argmin, any / all), indexing (index_select,
// gather), repeat and dot. Each needs some dims whole on every rank: a shard on such a dim
// is gathered; shards on other dims stay and the outputs keep them.
#include <algorithm>

#include <c10/util/accumulate.h>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

// The dims of input 0 named by the "dim" argument (int, int[] or none: all of them), and
// whether the op keeps them ("keepdim").
struct DimArgs {
  std::vector<bool> named;
  bool keepdim = false;
  bool all = false; // no dim given: every dim, reduced to a scalar unless keepdim
};

DimArgs dim_args(const OpInfo& info, int64_t ndim) {
  DimArgs d;
  d.named.assign(static_cast<size_t>(ndim), false);
  bool given = false;
  const auto& args = info.op->schema().arguments();
  for (size_t a = 0; a < args.size() && a < info.num_args(); ++a) {
    const c10::IValue& v = info.arg(a);
    if (args[a].name() == "dim") {
      if (v.isInt()) {
        d.named[static_cast<size_t>(wrap_dim(v.toInt(), ndim))] = true;
        given = true;
      } else if (v.isIntList()) {
        for (int64_t x : v.toIntVector()) {
          d.named[static_cast<size_t>(wrap_dim(x, ndim))] = true;
          given = true;
        }
      }
    } else if (args[a].name() == "keepdim" && v.isBool()) {
      d.keepdim = v.toBool();
    }
  }
  if (!given) {
    d.all = true;
    d.named.assign(static_cast<size_t>(ndim), true);
  }
  return d;
}

// Output placements of input placements `want` when input dim d becomes output dim to[d]
// (-1: gone).
Placements mapped(const Placements& want, const std::vector<int64_t>& to) {
  Placements out = want;
  for (auto& p : out) {
    if (p.is_shard()) {
      const int64_t od = to[static_cast<size_t>(p.dim())];
      p = od < 0 ? Placement::replicate() : Placement::shard(od);
    }
  }
  return out;
}

size_t num_tensor_returns(const OpInfo& info) {
  return info.op->schema().returns().size();
}

// cumsum / cumprod / sort / topk / _log_softmax-like scans: the named dim whole, shape kept.
OpSharding along_dim_rule(const OpInfo& info) {
  // Their dim arguments have defaults (-1), which the dispatcher fills in: always given.
  const DTensorSpec& in = *info.specs[0];
  const DimArgs d = dim_args(info, in.ndim());
  const Placements want = keep_other_shards(in, d.named);
  OpSharding s = single_input(info, want, want, num_tensor_returns(info));
  if (info.name.rfind("aten::cummax", 0) == 0 || info.name.rfind("aten::cummin", 0) == 0) {
    s.output_shapes.assign(s.outputs.size(), in.shape); // no meta kernel (_cummax_helper)
  }
  return s;
}

// var / std / prod / logsumexp / argmax / any ...: the named dims whole; they leave the
// output unless keepdim.
OpSharding reduce_whole_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  const DimArgs d = dim_args(info, in.ndim());
  const Placements want = keep_other_shards(in, d.named);
  std::vector<int64_t> to(static_cast<size_t>(in.ndim()));
  int64_t next = 0;
  for (int64_t i = 0; i < in.ndim(); ++i) {
    const bool gone = d.named[static_cast<size_t>(i)] && !d.keepdim;
    to[static_cast<size_t>(i)] = gone ? -1 : next++;
  }
  OpSharding s = single_input(info, want, mapped(want, to), num_tensor_returns(info));
  // The global shape, given here: some of these ops have no C++ meta kernel (var).
  std::vector<int64_t> shape;
  for (int64_t i = 0; i < in.ndim(); ++i) {
    if (!d.named[static_cast<size_t>(i)]) {
      shape.push_back(in.shape[static_cast<size_t>(i)]);
    } else if (d.keepdim) {
      shape.push_back(1);
    }
  }
  s.output_shapes.assign(s.outputs.size(), shape);
  return s;
}

// index_select(self, dim, index): self whole on dim, index Replicate.
OpSharding index_select_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  std::vector<bool> whole(static_cast<size_t>(in.ndim()), false);
  whole[static_cast<size_t>(wrap_dim(info.arg(1).toInt(), in.ndim()))] = true;
  const Placements want = keep_other_shards(in, whole);
  OpSharding s = single_input(info, want, want, 1);
  std::vector<int64_t> shape = in.shape; // no C++ meta kernel: the shape is given here
  shape[static_cast<size_t>(wrap_dim(info.arg(1).toInt(), in.ndim()))] =
      info.specs[2] ? c10::multiply_integers(info.specs[2]->shape) : info.arg(2).toTensor().numel();
  s.output_shapes.push_back(shape);
  return s;
}

// gather(self, dim, index): the output has index's shape and placements. self is whole,
// except on a dim other than `dim` that both shard alike over equal sizes; an index cut on
// another dim is gathered (its rows must meet self's rows).
OpSharding gather_rule(const OpInfo& info) {
  const DTensorSpec& self = *info.specs[0];
  const DTensorSpec& index = *info.specs[2];
  const int64_t dim = wrap_dim(info.arg(1).toInt(), self.ndim());
  Placements want_self = replicate_all(info.mesh_ndim());
  Placements want_index = index.placements;
  for (size_t i = 0; i < want_index.size(); ++i) {
    const Placement& p = index.placements[i];
    const Placement& q = self.placements[i];
    if (p.is_replicate() && q.is_shard() && q.dim() != dim &&
        self.shape[static_cast<size_t>(q.dim())] == index.shape[static_cast<size_t>(q.dim())]) {
      want_self[i] = q; // a Replicate index is cut like self, locally
      want_index[i] = q;
    } else if (p.is_partial()) {
      want_index[i] = Placement::replicate();
    } else if (p.is_shard() && p.dim() != dim) {
      // Row r of the output reads row r of self: both cut alike, or the index whole.
      const auto d = static_cast<size_t>(p.dim());
      if (self.placements[i] == p && self.shape[d] == index.shape[d]) {
        want_self[i] = p;
      } else {
        want_index[i] = Placement::replicate();
      }
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want_self;
  s.inputs[2] = want_index;
  s.outputs.push_back(want_index);
  return s;
}

// repeat(self, repeats): dims repeated more than once whole; new leading dims shift the rest.
OpSharding repeat_rule(const OpInfo& info) {
  const DTensorSpec& in = *info.specs[0];
  const std::vector<int64_t> reps = info.arg(1).toIntVector();
  const int64_t off = static_cast<int64_t>(reps.size()) - in.ndim();
  std::vector<bool> whole(static_cast<size_t>(in.ndim()), false);
  std::vector<int64_t> to(static_cast<size_t>(in.ndim()));
  for (int64_t d = 0; d < in.ndim(); ++d) {
    whole[static_cast<size_t>(d)] = reps[static_cast<size_t>(d + off)] != 1;
    to[static_cast<size_t>(d)] = d + off;
  }
  const Placements want = keep_other_shards(in, whole);
  OpSharding s = single_input(info, want, mapped(want, to), 1);
  return s; // repeats are counts, not sizes: the local call keeps them
}

// dot(a, b): both sharded alike -> a Partial(sum) scalar; otherwise both whole.
OpSharding dot_rule(const OpInfo& info) {
  const DTensorSpec& a = *info.specs[0];
  const DTensorSpec& b = *info.specs[1];
  const size_t n = static_cast<size_t>(info.mesh_ndim());
  Placements want(n, Placement::replicate());
  Placements out(n, Placement::replicate());
  for (size_t i = 0; i < n; ++i) {
    if (a.placements[i].is_shard() || b.placements[i].is_shard()) {
      want[i] = Placement::shard(0); // a Replicate operand is cut locally
      out[i] = Placement::partial(ReduceOp::Sum);
    }
  }
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = want;
  s.inputs[1] = want;
  s.outputs.push_back(out);
  return s;
}

} // namespace

void register_dim_ops() {
  for (const char* name : {"aten::cumsum", "aten::cumprod", "aten::sort", "aten::topk",
                           "aten::cummax", "aten::cummin", "aten::argsort"}) {
    register_rule(name, along_dim_rule);
  }
  for (const char* name : {"aten::var", "aten::std", "aten::var_mean", "aten::std_mean",
                           "aten::prod", "aten::logsumexp", "aten::argmax", "aten::argmin",
                           "aten::any", "aten::all", "aten::median", "aten::mode"}) {
    register_rule(name, reduce_whole_rule);
  }
  register_rule("aten::index_select", index_select_rule);
  register_rule("aten::gather", gather_rule);
  register_rule("aten::repeat", repeat_rule);
  register_rule("aten::dot", dot_rule);
}

} // namespace dtensor::detail
