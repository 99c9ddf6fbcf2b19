// fully_shard's all-gather extension (all_gather_extension.h, include/dtensor/fsdp_extension.h).
#include "parallel/fsdp/all_gather_extension.h"

#include <algorithm>
#include <mutex>
#include <typeinfo>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp_param_group.h"
#include "parallel/fsdp/fsdp_state.h"
#include "parallel/fsdp/memory.h"
#include "tensor/dispatch/op_args.h"

namespace dtensor::detail {

// [Note: the all-gather extension] FSDP2 lets a parameter's tensor subclass decide what its
// unit's all-gather sends (fsdp_pre_all_gather) and how the unsharded parameter is rebuilt
// (fsdp_post_all_gather); torchao's float8 all-gather is such a subclass. LibTorch has no
// tensor subclasses, so the extension is an object registered on the parameter before
// fully_shard (as module hooks are registered on a module: kept while it lives, a new tensor
// at a freed one's address inherits nothing), which the unit takes with the parameter. A unit
// with extensions still issues one all-gather: each parameter's tensors (its extension's, or
// its segment of the flat shard in the parameter dtype) are bytes in one buffer, each piece
// 16-byte aligned so that it can be viewed as its dtype. Every rank computes the same layout
// on its own: an extension's tensors depend only on the padded shard's shape, which every
// rank shares. The extension rebuilds every rank's padded rows; the unit keeps each rank's
// own rows, cast to the parameter dtype, in the ordinary unsharded parameter: autograd, the
// gradient's reduce-scatter and the optimizer never see the format. Or, as FSDP2's unsharded
// parameter may be a subclass over the all-gather outputs (torchao's float8 weight is its
// gathered bytes), the extension keeps what was gathered (keeps_gathered): the unit keeps
// every rank's rows of each sent tensor whole, has no place for the parameter in its unsharded
// buffer, and frees the kept tensors' storage when it reshards as it frees the buffer's (the
// tensors stay, so that what holds them sees the next unshard's values). The extension's
// consumer reads them (gathered_unsharded) in an autograd function that takes the parameter
// itself, whose gradient reaches the unit's accumulator as any op's does; every other op of
// forward and backward runs on the extension's value made from them, for that op (the
// fallback's interceptor asks FSDPParamGroup::unsharded_value). Before the parameters'
// pre_all_gather, each type of extension is given all of the unit's parameters it serves
// once (prepare), so that one collective can serve them (float8's amaxes: one all-reduce per
// unit, as before the protocol existed); at the end of each backward each extension learns
// that its shard may change. fully_shard knows no format: float8's extension lives in
// lib/parallel/float8/, and the tests plug in an int8 one of their own.

namespace {

struct Registration {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  std::shared_ptr<AllGatherExtension> extension;
};

std::mutex& registrations_mutex() {
  static std::mutex m;
  return m;
}

std::vector<Registration>& registrations() {
  static std::vector<Registration> r;
  return r;
}

std::vector<Registration>::iterator find_registration(std::vector<Registration>& r,
                                                      const at::Tensor& param) {
  std::erase_if(r, [](const Registration& k) { return k.param.expired(); });
  return std::find_if(r.begin(), r.end(), [&](const Registration& k) {
    return k.param.lock().get() == param.unsafeGetTensorImpl();
  });
}

constexpr int64_t kPieceAlign = 16;

int64_t piece_aligned(int64_t bytes) {
  return (bytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
}

// This rank's rows padded with zero rows to the chunk along the shard dim. The flat shard
// holds them so (its padding is zero) where the rows lead (dim 0) or fill the chunk.
at::Tensor padded_shard(const FSDPParamGroup& group, const FSDPParam& fp, const at::Tensor& local) {
  if (fp.shard_dim == 0 || fp.local_rows == fp.chunk) {
    return group.flat_shard.narrow(0, fp.offset, fp.segment_numel())
        .view(fp.chunk_shape(fp.chunk))
        .to(group.device);
  }
  at::Tensor padded = at::zeros(fp.chunk_shape(fp.chunk), local.options());
  padded.narrow(fp.shard_dim, 0, fp.local_rows).copy_(local);
  return padded;
}

AllGatherParam describe_gather(const FSDPParamGroup& group, const FSDPParam& fp) {
  AllGatherParam d;
  d.name = fp.fqn;
  d.local = fp.local_rows_of(group.flat_shard).to(group.device);
  d.padded = padded_shard(group, fp, d.local);
  d.shard_dim = fp.shard_dim;
  d.shard_size = group.shard_size;
  d.unsharded_shape = fp.shape;
  d.param_dtype = group.param_dtype;
  d.shard_group = group.shard_group;
  return d;
}

// Each type of extension prepared once, with every parameter of the unit it serves.
void prepare(const FSDPParamGroup& group, const ExtensionGather& gather) {
  std::vector<bool> done(group.params.size(), false);
  for (size_t i = 0; i < group.params.size(); ++i) {
    const auto& first = group.params[i].extension;
    if (!first || done[i]) {
      continue;
    }
    std::vector<std::pair<AllGatherExtension*, AllGatherParam>> same_type;
    for (size_t j = i; j < group.params.size(); ++j) {
      const auto& e = group.params[j].extension;
      if (e && !done[j] && typeid(*e) == typeid(*first)) {
        done[j] = true;
        same_type.emplace_back(e.get(), gather.described[j]);
      }
    }
    first->prepare(same_type);
  }
}

void add_piece(ExtensionGather& gather, size_t param, const at::Tensor& t) {
  ExtensionGather::Piece piece;
  piece.param = param;
  piece.dtype = t.scalar_type();
  piece.shape = t.sizes().vec();
  piece.offset = gather.stride;
  piece.bytes = t.numel() * static_cast<int64_t>(t.element_size());
  gather.stride += piece_aligned(piece.bytes);
  gather.pieces.push_back(std::move(piece));
}

// Rank r's piece, viewed as what was sent, for every rank: [shard size, *shape].
at::Tensor gathered_piece(const at::Tensor& gathered, const ExtensionGather& gather,
                          const ExtensionGather::Piece& piece, int64_t shard_size) {
  std::vector<int64_t> shape{shard_size};
  shape.insert(shape.end(), piece.shape.begin(), piece.shape.end());
  if (piece.bytes == 0) {
    return at::empty(shape, gathered.options().dtype(piece.dtype));
  }
  return gathered.view({shard_size, gather.stride})
      .narrow(1, piece.offset, piece.bytes)
      .view(piece.dtype)
      .view(shape);
}

void check_inputs(const FSDPParamGroup& group, const FSDPParam& fp, const AllGatherInputs& in) {
  const auto dim = static_cast<size_t>(fp.shard_dim);
  for (const at::Tensor& t : in.tensors) {
    DTENSOR_CHECK(t.defined(),
                  "fully_shard unit '{}': all-gather extension '{}' of '{}' gave an undefined "
                  "tensor to send",
                  group.name, fp.extension->name(), fp.fqn);
    DTENSOR_CHECK(!fp.keeps_gathered || (t.dim() == static_cast<int64_t>(fp.shape.size()) &&
                                         t.size(fp.shard_dim) == fp.chunk),
                  "fully_shard unit '{}': all-gather extension '{}' of '{}' keeps what is "
                  "gathered, so each tensor it sends must be {}-D with the padded shard's {} rows "
                  "along dim {}, got {}",
                  group.name, fp.extension->name(), fp.fqn, fp.shape.size(), fp.chunk, dim,
                  c10::str(t.sizes()));
  }
}

// A parameter kept as gathered: every rank's own rows of each gathered piece ([shard size,
// *padded]) into the kept tensors, made on the first unshard and refilled on later ones.
void copy_out_kept(FSDPParam& fp, const std::vector<at::Tensor>& pieces, int64_t shards) {
  if (fp.kept.size() != pieces.size()) {
    fp.kept.clear();
    for (const at::Tensor& p : pieces) {
      fp.kept.push_back(at::empty({0}, p.options()));
    }
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    at::Tensor& k = fp.kept[i];
    std::vector<int64_t> shape = pieces[i].sizes().slice(1).vec();
    shape[static_cast<size_t>(fp.shard_dim)] = fp.shape[static_cast<size_t>(fp.shard_dim)];
    if (k.sizes().vec() != shape) {
      k.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    }
    allocate_storage(k);
    for (int64_t r = 0; r < shards; ++r) {
      const int64_t rows = fp.rows_on(r, shards);
      if (rows > 0) {
        k.narrow(fp.shard_dim, r * fp.chunk, rows)
            .copy_(pieces[i][r].narrow(fp.shard_dim, 0, rows));
      }
    }
  }
}

} // namespace

std::shared_ptr<AllGatherExtension> take_all_gather_extension(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(registrations_mutex());
  std::vector<Registration>& r = registrations();
  const auto it = find_registration(r, param);
  if (it == r.end()) {
    return nullptr;
  }
  std::shared_ptr<AllGatherExtension> e = std::move(it->extension);
  r.erase(it);
  return e;
}

bool has_all_gather_extension(const FSDPParamGroup& group) {
  return std::any_of(group.params.begin(), group.params.end(),
                     [](const FSDPParam& fp) { return fp.extension != nullptr; });
}

at::Tensor extension_all_gather_input(FSDPParamGroup& group, ExtensionGather& gather) {
  at::NoGradGuard no_grad;
  const size_t n = group.params.size();
  gather.described.assign(n, AllGatherParam());
  gather.sent.assign(n, AllGatherInputs());
  for (size_t i = 0; i < n; ++i) {
    if (group.params[i].extension) {
      gather.described[i] = describe_gather(group, group.params[i]);
    }
  }
  prepare(group, gather);
  std::vector<at::Tensor> wire;
  for (size_t i = 0; i < n; ++i) {
    const FSDPParam& fp = group.params[i];
    if (!fp.extension) {
      wire.push_back(group.flat_shard.narrow(0, fp.offset, fp.segment_numel())
                         .to(group.device, group.param_dtype));
      add_piece(gather, i, wire.back());
      continue;
    }
    gather.sent[i] = fp.extension->pre_all_gather(gather.described[i]);
    check_inputs(group, fp, gather.sent[i]);
    for (const at::Tensor& t : gather.sent[i].tensors) {
      wire.push_back(t.to(group.device).contiguous());
      add_piece(gather, i, wire.back());
    }
  }
  at::Tensor bytes = at::zeros({gather.stride}, at::TensorOptions(at::kByte).device(group.device));
  for (size_t k = 0; k < wire.size(); ++k) {
    const ExtensionGather::Piece& piece = gather.pieces[k];
    if (piece.bytes > 0) {
      bytes.narrow(0, piece.offset, piece.bytes).copy_(wire[k].reshape({-1}).view(at::kByte));
    }
  }
  return bytes;
}

void extension_copy_out(FSDPParamGroup& group, const ExtensionGather& gather,
                        const at::Tensor& gathered) {
  at::NoGradGuard no_grad;
  const int64_t shards = group.shard_size;
  size_t k = 0;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const FSDPParam& fp = group.params[i];
    std::vector<at::Tensor> pieces;
    for (; k < gather.pieces.size() && gather.pieces[k].param == i; ++k) {
      pieces.push_back(gathered_piece(gathered, gather, gather.pieces[k], shards));
    }
    if (fp.keeps_gathered) {
      copy_out_kept(group.params[i], pieces, shards);
      continue;
    }
    at::Tensor rebuilt;
    if (fp.extension) {
      rebuilt = fp.extension->post_all_gather(pieces, gather.sent[i], gather.described[i]);
      std::vector<int64_t> want{shards};
      const auto chunk = fp.chunk_shape(fp.chunk);
      want.insert(want.end(), chunk.begin(), chunk.end());
      DTENSOR_CHECK(rebuilt.defined() && rebuilt.sizes().vec() == want &&
                        at::isFloatingType(rebuilt.scalar_type()),
                    "fully_shard unit '{}': all-gather extension '{}' of '{}' must rebuild every "
                    "rank's padded shard as a floating tensor of shape {}, got {}",
                    group.name, fp.extension->name(), fp.fqn, c10::str(c10::IntArrayRef(want)),
                    rebuilt.defined() ? c10::str(rebuilt.sizes()) : std::string("none"));
    } else {
      rebuilt = pieces.at(0); // [shards, chunk x row_numel] in the parameter dtype
    }
    for (int64_t r = 0; r < shards; ++r) {
      const int64_t rows = fp.rows_on(r, shards);
      if (rows == 0) {
        continue;
      }
      const at::Tensor src =
          fp.extension ? rebuilt[r].narrow(fp.shard_dim, 0, rows)
                       : rebuilt[r].narrow(0, 0, rows * fp.row_numel).view(fp.chunk_shape(rows));
      fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, rows).copy_(src);
    }
  }
}

at::Tensor kept_unsharded_value(const FSDPParamGroup& group, const FSDPParam& fp) {
  DTENSOR_CHECK(group.state == ShardState::Unsharded && !fp.kept.empty(),
                "fully_shard unit '{}': '{}' is used unsharded while its unit is not", group.name,
                fp.fqn);
  at::Tensor v = fp.extension->unsharded_value(fp.kept, describe_gather(group, fp));
  DTENSOR_CHECK(v.defined() && v.sizes().vec() == fp.shape && v.scalar_type() == group.param_dtype,
                "fully_shard unit '{}': all-gather extension '{}' of '{}' must make its value as a "
                "{} tensor of shape {}, got {}",
                group.name, fp.extension->name(), fp.fqn, c10::toString(group.param_dtype),
                c10::str(c10::IntArrayRef(fp.shape)),
                v.defined()
                    ? fmt::format("{} {}", c10::toString(v.scalar_type()), c10::str(v.sizes()))
                    : std::string("none"));
  return v;
}

void free_kept(FSDPParamGroup& group) {
  for (FSDPParam& fp : group.params) {
    for (const at::Tensor& k : fp.kept) {
      free_storage(k);
    }
  }
}

void extensions_after_backward(FSDPParamGroup& group) {
  for (FSDPParam& fp : group.params) {
    if (fp.extension) {
      fp.extension->after_backward();
    }
  }
}

} // namespace dtensor::detail

namespace dtensor {

at::Tensor AllGatherExtension::unsharded_value(const std::vector<at::Tensor>& kept,
                                               const AllGatherParam& param) {
  (void)kept;
  DTENSOR_FAIL("all-gather extension '{}' keeps what is gathered for '{}' but makes no value of "
               "it in the parameter dtype (AllGatherExtension::unsharded_value), which an op "
               "other than its own consumer needs",
               name(), param.name);
}

std::vector<at::Tensor> gathered_unsharded(const at::Tensor& param) {
  const auto tag = param.defined() ? detail::fsdp_tag(param) : nullptr;
  const std::shared_ptr<detail::FSDPParamGroup> group = tag ? tag->group.lock() : nullptr;
  if (!group || tag->is_view() || !group->params.at(tag->index).keeps_gathered) {
    return {};
  }
  group->fsdp_state().ready_for_use(detail::in_backward());
  return group->params.at(tag->index).kept;
}

void set_all_gather_extension(const at::Tensor& param,
                              std::shared_ptr<AllGatherExtension> extension) {
  DTENSOR_CHECK(param.defined(), "set_all_gather_extension: the parameter is undefined");
  const std::shared_ptr<const detail::FsdpTag> tag = detail::fsdp_tag(param);
  const std::shared_ptr<detail::FSDPParamGroup> group = tag ? tag->group.lock() : nullptr;
  DTENSOR_CHECK(group == nullptr,
                "set_all_gather_extension: the parameter is fully_shard's already (unit '{}'); "
                "register its extension before fully_shard takes it",
                group ? group->name : std::string());
  std::lock_guard<std::mutex> lock(detail::registrations_mutex());
  std::vector<detail::Registration>& r = detail::registrations();
  const auto it = detail::find_registration(r, param);
  if (it != r.end()) {
    r.erase(it);
  }
  if (extension) {
    r.push_back(
        {c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(extension)});
  }
}

std::shared_ptr<AllGatherExtension> all_gather_extension(const at::Tensor& param) {
  if (!param.defined()) {
    return nullptr;
  }
  if (const auto tag = detail::fsdp_tag(param)) {
    const std::shared_ptr<detail::FSDPParamGroup> group = tag->group.lock();
    return group && !tag->is_view() ? group->params.at(tag->index).extension : nullptr;
  }
  std::lock_guard<std::mutex> lock(detail::registrations_mutex());
  std::vector<detail::Registration>& r = detail::registrations();
  const auto it = detail::find_registration(r, param);
  return it == r.end() ? nullptr : it->extension;
}

std::vector<std::pair<std::shared_ptr<AllGatherExtension>, AllGatherParam>>
all_gather_params(torch::nn::Module& module) {
  std::vector<std::pair<std::shared_ptr<AllGatherExtension>, AllGatherParam>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : module.parameters()) {
    const auto tag = detail::fsdp_tag(p);
    const std::shared_ptr<detail::FSDPParamGroup> group = tag ? tag->group.lock() : nullptr;
    if (!group || tag->is_view() || !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    const detail::FSDPParam& fp = group->params.at(tag->index);
    if (fp.extension) {
      out.emplace_back(fp.extension, detail::describe_gather(*group, fp));
    }
  }
  return out;
}

} // namespace dtensor
