// fully_shard's float8 all-gather (float8_all_gather.h), and
// precompute_float8_dynamic_scale_for_fsdp (include/dtensor/float8.h).
#include "parallel/fsdp/float8_all_gather.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/float8.h>

#include "internal/check.h"
#include "mesh/collectives_internal.h"
#include "parallel/float8/float8_cast.h"
#include "parallel/fsdp/fsdp_param_group.h"

namespace dtensor::detail {

// [Note: float8 all-gather] torchao's float8 all-gather for FSDP2, on fully_shard's flat
// buffers. A marked weight's shard is cast to e4m3 with one scale for the whole weight
// (max(e4m3) / the amax of every rank's shard: a MAX all-reduce over the shard group, or
// precompute_float8_dynamic_scale_for_fsdp's) and gathered as bytes: one byte an element where
// bf16 takes two. The unit still issues one all-gather: every parameter's segment is bytes in
// one buffer (the others in the parameter dtype), each segment 16-byte aligned so that it can
// be viewed as its dtype. The gathered float8 values are dequantized into the unsharded buffer
// (x8 / scale), and the float8 linear casts the weight again with the same scale: x8 / scale *
// scale is within an fp32 (or bf16) rounding of x8, which e4m3's 3 mantissa bits round back to
// x8, so the products see exactly the gathered bits while autograd, the gradient's
// reduce-scatter and everything else keep the ordinary unsharded parameter. As in torchao the
// cast is from the sharded (master) values; unlike torchao#3982, uneven and empty shards
// (an empty shard's amax is 0) are ordinary. Scales stay valid from their computation until
// the unit's backward ends: forward and backward gather the same bits.

namespace {

struct Mark {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  std::string name;
};

std::mutex& marks_mutex() {
  static std::mutex m;
  return m;
}

std::vector<Mark>& marks() {
  static std::vector<Mark> m;
  return m;
}

constexpr int64_t kAlign = 16;

int64_t aligned(int64_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

c10::ScalarType wire_dtype(const FSDPParamGroup& group, const FSDPParam& fp) {
  return fp.float8 ? at::kFloat8_e4m3fn : group.param_dtype;
}

int64_t segment_bytes(const FSDPParamGroup& group, const FSDPParam& fp) {
  return aligned(fp.segment_numel() *
                 static_cast<int64_t>(c10::elementSize(wire_dtype(group, fp))));
}

int64_t shard_bytes(const FSDPParamGroup& group) {
  int64_t total = 0;
  for (const FSDPParam& fp : group.params) {
    total += segment_bytes(group, fp);
  }
  return total;
}

// Every float8 parameter's scale from one MAX all-reduce of the shards' amaxes over
// `shard_group` (their shard group); an empty shard contributes 0.
void compute_scales(const std::vector<std::pair<FSDPParamGroup*, size_t>>& params,
                    const Group& shard_group) {
  if (params.empty()) {
    return;
  }
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> amax;
  for (const auto& [group, i] : params) {
    const at::Tensor local = group->params[i].local_rows_of(group->flat_shard);
    amax.push_back(local.numel() > 0 ? local.abs().max().to(at::kFloat)
                                     : at::zeros({}, local.options().dtype(at::kFloat)));
  }
  at::Tensor all = at::stack(amax).to(params.front().first->device);
  detail::all_reduce_(all, ReduceOp::Max, shard_group);
  for (size_t k = 0; k < params.size(); ++k) {
    auto& [group, i] = params[k];
    group->params[i].float8_scale =
        float8_amax_to_scale(all[static_cast<int64_t>(k)], at::kFloat8_e4m3fn, false);
  }
}

void ensure_scales(FSDPParamGroup& group) {
  if (group.float8_scales_valid) {
    return;
  }
  std::vector<std::pair<FSDPParamGroup*, size_t>> params;
  for (size_t i = 0; i < group.params.size(); ++i) {
    if (group.params[i].float8) {
      params.emplace_back(&group, i);
    }
  }
  compute_scales(params, group.shard_group);
  group.float8_scales_valid = true;
}

} // namespace

void mark_float8_all_gather(const at::Tensor& weight, const std::string& name) {
  DTENSOR_CHECK(!is_dtensor(weight),
                "convert_to_float8_training: Linear '{}': its weight is a DTensor already; with "
                "enable_fsdp_float8_all_gather convert before fully_shard (and without tensor "
                "parallelism)",
                name);
  std::lock_guard<std::mutex> lock(marks_mutex());
  std::vector<Mark>& m = marks();
  std::erase_if(m, [](const Mark& k) { return k.weight.expired(); });
  m.push_back({c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), name});
}

bool take_float8_all_gather_mark(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(marks_mutex());
  std::vector<Mark>& m = marks();
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it->weight.lock().get() == param.unsafeGetTensorImpl()) {
      m.erase(it);
      return true;
    }
  }
  return false;
}

bool gathers_float8(const FSDPParamGroup& group) {
  for (const FSDPParam& fp : group.params) {
    if (fp.float8) {
      return true;
    }
  }
  return false;
}

at::Tensor float8_all_gather_input(FSDPParamGroup& group) {
  ensure_scales(group);
  at::NoGradGuard no_grad;
  at::Tensor bytes =
      at::zeros({shard_bytes(group)}, at::TensorOptions(at::kByte).device(group.device));
  int64_t pos = 0;
  for (const FSDPParam& fp : group.params) {
    const at::Tensor segment =
        group.flat_shard.narrow(0, fp.offset, fp.segment_numel()).to(group.device);
    const at::Tensor wire = fp.float8 ? float8_cast(segment, fp.float8_scale, at::kFloat8_e4m3fn)
                                      : segment.to(group.param_dtype);
    const at::Tensor raw = wire.contiguous().view(at::kByte);
    bytes.narrow(0, pos, raw.numel()).copy_(raw);
    pos += segment_bytes(group, fp);
  }
  return bytes;
}

void float8_copy_out(FSDPParamGroup& group, const at::Tensor& gathered) {
  at::NoGradGuard no_grad;
  const int64_t stride = shard_bytes(group);
  int64_t pos = 0;
  for (const FSDPParam& fp : group.params) {
    const c10::ScalarType dtype = wire_dtype(group, fp);
    const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t r = 0; r < group.shard_size; ++r) {
      const int64_t rows = fp.rows_on(r, group.shard_size);
      if (rows == 0) {
        continue;
      }
      at::Tensor src = gathered.narrow(0, r * stride + pos, rows * fp.row_numel * elem)
                           .view(dtype)
                           .view(fp.chunk_shape(rows));
      if (fp.float8) {
        src = src.to(at::kFloat) / fp.float8_scale;
      }
      fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, rows).copy_(src);
    }
    pos += segment_bytes(group, fp);
  }
}

at::Tensor fsdp_float8_scale(const at::Tensor& param) {
  const std::shared_ptr<const FsdpTag> tag = fsdp_tag(param);
  if (!tag || tag->is_view()) {
    return {};
  }
  const std::shared_ptr<FSDPParamGroup> group = tag->group.lock();
  if (!group || !group->params.at(tag->index).float8) {
    return {};
  }
  return group->params[tag->index].float8_scale;
}

} // namespace dtensor::detail

namespace dtensor {

void precompute_float8_dynamic_scale_for_fsdp(torch::nn::Module& module) {
  // The units under `module` with float8 weights, by shard group (one all-reduce each).
  std::vector<std::shared_ptr<detail::FSDPParamGroup>> groups;
  for (const at::Tensor& p : module.parameters()) {
    const auto tag = detail::fsdp_tag(p);
    std::shared_ptr<detail::FSDPParamGroup> group = tag ? tag->group.lock() : nullptr;
    if (group && detail::gathers_float8(*group) &&
        std::find(groups.begin(), groups.end(), group) == groups.end()) {
      groups.push_back(group);
    }
  }
  std::vector<bool> done(groups.size(), false);
  for (size_t g = 0; g < groups.size(); ++g) {
    if (done[g]) {
      continue;
    }
    std::vector<std::pair<detail::FSDPParamGroup*, size_t>> params;
    for (size_t h = g; h < groups.size(); ++h) {
      if (!done[h] && groups[h]->shard_group == groups[g]->shard_group) {
        done[h] = true;
        for (size_t i = 0; i < groups[h]->params.size(); ++i) {
          if (groups[h]->params[i].float8) {
            params.emplace_back(groups[h].get(), i);
          }
        }
      }
    }
    detail::compute_scales(params, groups[g]->shard_group);
  }
  for (const auto& group : groups) {
    group->float8_scales_valid = true;
  }
}

} // namespace dtensor
