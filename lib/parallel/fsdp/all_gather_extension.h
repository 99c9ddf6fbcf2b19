#pragma once

// fully_shard's side of the all-gather extension (include/dtensor/fsdp_extension.h): a unit
// whose parameters have extensions gathers bytes laid out here ([Note: the all-gather
// extension] in all_gather_extension.cpp).
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/fsdp_extension.h>

namespace dtensor::detail {

struct FSDPParam;
struct FSDPParamGroup;

// fully_shard: the extension registered on `param` (the registration is used up); null
// when none.
std::shared_ptr<AllGatherExtension> take_all_gather_extension(const at::Tensor& param);
bool has_all_gather_extension(const FSDPParamGroup& group);

// One all-gather of a unit with extensions: what each parameter's extension was told and
// sent, and where each piece sits in a rank's bytes.
struct ExtensionGather {
  struct Piece {
    size_t param = 0;
    c10::ScalarType dtype = at::kByte;
    std::vector<int64_t> shape;
    int64_t offset = 0; // in a rank's bytes, 16-byte aligned
    int64_t bytes = 0;
  };
  std::vector<AllGatherParam> described; // per parameter (only those with an extension set)
  std::vector<AllGatherInputs> sent;     // per parameter
  std::vector<Piece> pieces;             // in order; a parameter without one is a single piece
  int64_t stride = 0;                    // bytes per rank
};

// The unit's all-gather input: every parameter's pieces as bytes (the extensions prepared and
// asked), with their layout in `gather`.
at::Tensor extension_all_gather_input(FSDPParamGroup& group, ExtensionGather& gather);
// Every rank's bytes (one after another) rebuilt into the unsharded parameters.
void extension_copy_out(FSDPParamGroup& group, const ExtensionGather& gather,
                        const at::Tensor& gathered);
// The unit's backward ended: each extension told once.
void extensions_after_backward(FSDPParamGroup& group);
// A parameter kept as gathered (FSDPParam::keeps_gathered): its value in the parameter dtype,
// made by its extension from the kept tensors, for an op other than the extension's consumer.
at::Tensor kept_unsharded_value(const FSDPParamGroup& group, const FSDPParam& fp);
// Reshard: the kept tensors' storage goes (the tensors stay, refilled by the next unshard).
void free_kept(FSDPParamGroup& group);

} // namespace dtensor::detail
