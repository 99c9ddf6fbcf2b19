// Attention kernels: the ones scaled_dot_product_attention picks on CPU (flash for CPU) and
// on CUDA (flash, memory-efficient, cuDNN, and the overrideable one), forward and backward,
// and _fused_sdp_choice. One table describes them all.
//
// [Note: attention layouts] As PyTorch's strategies (batch parallel, head parallel): on
// each mesh dim, a query sharded on batch (dim 0) or heads (dim 1) keeps that shard and
// every [batch, heads, ...] argument follows it; anything else is gathered (sequence and
// head_dim shards, Partial). Heads shard only where every such argument has the query's
// head count (grouped-query kernels with fewer key/value heads gather them). An attention
// bias or mask follows where its dim has the query's size, and is replicated where it
// broadcasts; its gradient is then a sum over the sharded dim: Partial. Outputs of shape
// [batch, heads, ...] follow the query; the rest (random-state tensors, sequence offsets,
// unused placeholders) are Replicate. The CUDA kernels have no C++ meta kernel, so output
// shapes come from the local results with the sharded leading dims' global sizes
// (`leading_dims_from_input`); test_attention_kernels checks them against PyTorch's meta
// kernels and runs each kernel's CPU analogue through dtensor.
#include <algorithm>
#include <array>

#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

enum class Out : uint8_t {
  kSharded,    // [batch, heads, ...]: follows the query
  kReplicated, // scalars, offsets, placeholders (and SymInt returns)
  kIfFlag,     // kSharded when the op's bool flag argument is true, else kReplicated
  kGradBias,   // the bias gradient: the bias's layout, Partial where the bias broadcasts
};

struct AttentionOp {
  const char* name;
  size_t query;                // the query, or the output gradient in backward kernels
  std::vector<size_t> sharded; // arguments laid out as the query
  int bias;                    // attention bias / mask argument (-1: none)
  int flag;                    // the bool argument kIfFlag outputs follow (-1: none)
  std::vector<Out> outputs;    // per return, in schema order
};

using O = Out;
const std::array<AttentionOp, 11>& attention_ops() {
  static const std::array<AttentionOp, 11> ops = {{
      {"aten::_fused_sdp_choice", 0, {0, 1, 2}, 3, -1, {O::kReplicated}},
      {"aten::_scaled_dot_product_flash_attention_for_cpu",
       0,
       {0, 1, 2},
       5,
       -1,
       {O::kSharded, O::kSharded}},
      {"aten::_scaled_dot_product_flash_attention_for_cpu_backward",
       0,
       {0, 1, 2, 3, 4, 5},
       8,
       -1,
       {O::kSharded, O::kSharded, O::kSharded}},
      // (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug)
      {"aten::_scaled_dot_product_flash_attention",
       0,
       {0, 1, 2},
       -1,
       5,
       {O::kSharded, O::kSharded, O::kReplicated, O::kReplicated, O::kReplicated, O::kReplicated,
        O::kReplicated, O::kReplicated, O::kIfFlag}},
      {"aten::_scaled_dot_product_flash_attention_backward",
       0,
       {0, 1, 2, 3, 4, 5},
       -1,
       -1,
       {O::kSharded, O::kSharded, O::kSharded}},
      // (output, log_sumexp [B, H, 0] when not computed, philox_seed, philox_offset)
      {"aten::_scaled_dot_product_efficient_attention",
       0,
       {0, 1, 2},
       3,
       -1,
       {O::kSharded, O::kSharded, O::kReplicated, O::kReplicated}},
      {"aten::_scaled_dot_product_efficient_attention_backward",
       0,
       {0, 1, 2, 3, 5, 6},
       4,
       -1,
       {O::kSharded, O::kSharded, O::kSharded, O::kGradBias}},
      // cuDNN's debug_attn_mask is always an empty placeholder.
      {"aten::_scaled_dot_product_cudnn_attention",
       0,
       {0, 1, 2},
       3,
       -1,
       {O::kSharded, O::kSharded, O::kReplicated, O::kReplicated, O::kReplicated, O::kReplicated,
        O::kReplicated, O::kReplicated, O::kReplicated}},
      {"aten::_scaled_dot_product_cudnn_attention_backward",
       0,
       {0, 1, 2, 3, 4, 5},
       8,
       -1,
       {O::kSharded, O::kSharded, O::kSharded}},
      {"aten::_scaled_dot_product_fused_attention_overrideable",
       0,
       {0, 1, 2},
       3,
       6,
       {O::kSharded, O::kSharded, O::kReplicated, O::kReplicated, O::kReplicated, O::kReplicated,
        O::kReplicated, O::kReplicated, O::kIfFlag}},
      {"aten::_scaled_dot_product_fused_attention_overrideable_backward",
       0,
       {0, 1, 2, 3, 5, 6},
       4,
       -1,
       {O::kSharded, O::kSharded, O::kSharded, O::kGradBias}},
  }};
  return ops;
}

const AttentionOp& attention_op(const OpInfo& info) {
  const std::string_view name = info.name.substr(0, info.name.find('.'));
  for (const auto& op : attention_ops()) {
    if (name == op.name) {
      return op;
    }
  }
  DTENSOR_FAIL("{}: not an attention kernel", info.name);
}

// Per mesh dim: the query's batch or head shard where every laid-out argument agrees on
// that dim's size, else Replicate.
Placements attention_placements(const OpInfo& info, const AttentionOp& op) {
  const DTensorSpec& q = *info.specs[op.query];
  Placements p;
  for (const auto& x : q.placements) {
    bool keep = x.is_shard() && (x.dim() == 0 || x.dim() == 1);
    for (size_t a : op.sharded) {
      const auto& s = info.specs[a];
      keep = keep && (!s || (s->ndim() > x.dim() && s->shape[x.dim()] == q.shape[x.dim()]));
    }
    p.push_back(keep ? x : Placement::replicate());
  }
  return p;
}

// The bias follows `p` on the dims where it has the query's size.
Placements bias_placements(const DTensorSpec& q, const DTensorSpec& bias, const Placements& p) {
  Placements out;
  for (const auto& x : p) {
    bool follow =
        x.is_shard() && bias.ndim() == q.ndim() && bias.shape[x.dim()] == q.shape[x.dim()];
    out.push_back(follow ? x : Placement::replicate());
  }
  return out;
}

OpSharding attention_rule(const OpInfo& info) {
  const AttentionOp& op = attention_op(info);
  DTENSOR_CHECK(info.specs[op.query], "{}: expected a DTensor query, got {}", info.name,
                describe_args(info));
  const DTensorSpec& q = *info.specs[op.query];
  const Placements p = attention_placements(info, op);
  const Placements r = replicate_all(info.mesh_ndim());
  OpSharding s;
  s.inputs.resize(info.num_args());
  for (size_t a = 0; a < info.num_args(); ++a) {
    if (info.specs[a]) {
      s.inputs[a] = r; // random state, sequence offsets
    }
  }
  for (size_t a : op.sharded) {
    if (a < info.num_args() && info.specs[a]) {
      s.inputs[a] = p;
    }
  }
  const bool has_bias = op.bias >= 0 && static_cast<size_t>(op.bias) < info.num_args() &&
                        info.specs[op.bias].has_value();
  Placements bias = r;
  if (has_bias) {
    bias = bias_placements(q, *info.specs[op.bias], p);
    s.inputs[op.bias] = bias;
  }
  const bool flag = op.flag >= 0 && static_cast<size_t>(op.flag) < info.num_args() &&
                    info.arg(op.flag).isBool() && info.arg(op.flag).toBool();
  for (Out o : op.outputs) {
    switch (o) {
    case Out::kSharded:
      s.outputs.push_back(p);
      break;
    case Out::kReplicated:
      s.outputs.push_back(r);
      break;
    case Out::kIfFlag:
      s.outputs.push_back(flag ? p : r);
      break;
    case Out::kGradBias: {
      Placements g = bias;
      for (size_t i = 0; i < g.size(); ++i) {
        if (!g[i].is_shard() && p[i].is_shard()) {
          g[i] = Placement::partial(ReduceOp::Sum);
        }
      }
      s.outputs.push_back(g);
      break;
    }
    }
  }
  s.leading_dims_from_input = 2; // batch and heads: the only dims an output is sharded on
  return s;
}

} // namespace

void register_attention_ops() {
  for (const auto& op : attention_ops()) {
    register_rule(op.name, attention_rule);
  }
}

} // namespace dtensor::detail
