// Convolution (every dimensionality, transposed, grouped) and its backward kernel.
//
// [Note: convolution layouts] On each mesh dim, either
// - batch parallel: the input sharded on the batch dim (0) stays so, the weight and bias are
//   gathered; the output is sharded on the batch, the weight and bias gradients are sums over
//   it (Partial);
// - output-channel parallel (plain convolution, one group): the weight sharded on its output
//   channels (dim 0) stays so, with the bias; the input is gathered; the output is sharded on
//   its channel dim (1); the input gradient is a sum over the output channels (Partial);
// - otherwise everything is gathered.
// Output shapes follow the convolution arithmetic (no meta kernel run).
#include "internal/check.h"
#include "tensor/ops/registry.h"

namespace dtensor::detail {

namespace {

enum class ConvMode : uint8_t { kReplicate, kBatch, kOutChannels };

struct ConvArgs {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
};

// A per-spatial-dim argument (given once for every dim or per dim).
int64_t at_dim(const std::vector<int64_t>& v, size_t j, int64_t fallback) {
  if (v.empty()) {
    return fallback;
  }
  return v.size() == 1 ? v[0] : v.at(j);
}

ConvArgs conv_args(const OpInfo& info, size_t first) {
  ConvArgs c;
  c.stride = info.arg(first).toIntVector();
  c.padding = info.arg(first + 1).toIntVector();
  c.dilation = info.arg(first + 2).toIntVector();
  c.transposed = info.arg(first + 3).toBool();
  c.output_padding = info.arg(first + 4).toIntVector();
  c.groups = info.arg(first + 5).toInt();
  return c;
}

std::vector<int64_t> conv_output_shape(const std::vector<int64_t>& in,
                                       const std::vector<int64_t>& w, const ConvArgs& c) {
  const bool batched = in.size() == w.size();
  const size_t lead = batched ? 2 : 1;
  std::vector<int64_t> out;
  if (batched) {
    out.push_back(in[0]);
  }
  out.push_back(c.transposed ? w[1] * c.groups : w[0]);
  for (size_t j = 0; j + lead < in.size(); ++j) {
    const int64_t size = in[j + lead];
    const int64_t k = w[j + 2];
    const int64_t s = at_dim(c.stride, j, 1);
    const int64_t p = at_dim(c.padding, j, 0);
    const int64_t d = at_dim(c.dilation, j, 1);
    out.push_back(c.transposed
                      ? (size - 1) * s - 2 * p + d * (k - 1) + at_dim(c.output_padding, j, 0) + 1
                      : (size + 2 * p - d * (k - 1) - 1) / s + 1);
  }
  return out;
}

// The mode of each mesh dim, from the input's (or output gradient's) batch shard and the
// weight's output-channel shard.
std::vector<ConvMode> conv_modes(const DTensorSpec* data, const DTensorSpec* channels_from,
                                 int64_t channel_dim, const DTensorSpec* weight, const ConvArgs& c,
                                 bool batched, int64_t mesh_ndim) {
  std::vector<ConvMode> modes(static_cast<size_t>(mesh_ndim), ConvMode::kReplicate);
  const bool channels_ok = !c.transposed && c.groups == 1;
  for (size_t i = 0; i < modes.size(); ++i) {
    if (batched && data != nullptr && data->placements[i].is_shard(0)) {
      modes[i] = ConvMode::kBatch;
    } else if (channels_ok &&
               ((weight != nullptr && weight->placements[i].is_shard(0)) ||
                (channels_from != nullptr && channels_from->placements[i].is_shard(channel_dim)))) {
      modes[i] = ConvMode::kOutChannels;
    }
  }
  return modes;
}

// Placements over the modes: `batch` in batch mode, `channels` in channel mode.
Placements by_mode(const std::vector<ConvMode>& modes, const Placement& batch,
                   const Placement& channels) {
  Placements p;
  for (ConvMode m : modes) {
    p.push_back(m == ConvMode::kBatch         ? batch
                : m == ConvMode::kOutChannels ? channels
                                              : Placement::replicate());
  }
  return p;
}

const DTensorSpec* spec_or_null(const OpInfo& info, size_t a) {
  return a < info.num_args() && info.specs[a] ? &*info.specs[a] : nullptr;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding,
// groups)
OpSharding convolution_rule(const OpInfo& info) {
  const DTensorSpec* in = spec_or_null(info, 0);
  const DTensorSpec* w = spec_or_null(info, 1);
  DTENSOR_CHECK(in != nullptr && w != nullptr, "{}: expected DTensor input and weight, got {}",
                info.name, describe_args(info));
  const ConvArgs c = conv_args(info, 3);
  const bool batched = in->ndim() == w->ndim();
  const auto modes = conv_modes(in, nullptr, 0, w, c, batched, info.mesh_ndim());
  const Placement r = Placement::replicate();
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = by_mode(modes, Placement::shard(0), r);
  s.inputs[1] = by_mode(modes, r, Placement::shard(0));
  if (spec_or_null(info, 2) != nullptr) {
    s.inputs[2] = by_mode(modes, r, Placement::shard(0));
  }
  s.outputs.push_back(by_mode(modes, Placement::shard(0), Placement::shard(batched ? 1 : 0)));
  s.output_shapes.push_back(conv_output_shape(in->shape, w->shape, c));
  return s;
}

// convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation,
// transposed, output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
OpSharding convolution_backward_rule(const OpInfo& info) {
  const DTensorSpec* g = spec_or_null(info, 0);
  const DTensorSpec* in = spec_or_null(info, 1);
  const DTensorSpec* w = spec_or_null(info, 2);
  DTENSOR_CHECK(g != nullptr && in != nullptr && w != nullptr,
                "{}: expected DTensor grad_output, input and weight, got {}", info.name,
                describe_args(info));
  const ConvArgs c = conv_args(info, 4);
  const bool batched = in->ndim() == w->ndim();
  const int64_t channel_dim = batched ? 1 : 0;
  auto modes = conv_modes(in, g, channel_dim, w, c, batched, info.mesh_ndim());
  for (size_t i = 0; i < modes.size(); ++i) { // a batch-sharded output gradient counts too
    if (modes[i] == ConvMode::kReplicate && batched && g->placements[i].is_shard(0)) {
      modes[i] = ConvMode::kBatch;
    }
  }
  const Placement r = Placement::replicate();
  const Placement sum = Placement::partial(ReduceOp::Sum);
  OpSharding s;
  s.inputs.resize(info.num_args());
  s.inputs[0] = by_mode(modes, Placement::shard(0), Placement::shard(channel_dim));
  s.inputs[1] = by_mode(modes, Placement::shard(0), r);
  s.inputs[2] = by_mode(modes, r, Placement::shard(0));
  s.outputs = {by_mode(modes, Placement::shard(0), sum), by_mode(modes, sum, Placement::shard(0)),
               by_mode(modes, sum, Placement::shard(0))};
  const int64_t out_channels = c.transposed ? w->shape[1] * c.groups : w->shape[0];
  s.output_shapes = {in->shape, w->shape, {out_channels}};
  // The bias size the local kernel sees is this rank's piece of the output channels.
  if (info.arg(3).isIntList()) {
    s.local_args.resize(info.num_args());
    s.local_args[3] = c10::IValue(local_shape_of(*info.mesh, s.outputs[2], {out_channels}));
  }
  return s;
}

} // namespace

void register_conv_ops() {
  register_rule("aten::convolution", convolution_rule);
  register_rule("aten::convolution_backward", convolution_backward_rule);
}

} // namespace dtensor::detail
