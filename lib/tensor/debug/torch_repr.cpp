// PyTorch's spellings of placements, meshes and sizes (lib/tensor/debug/torch_repr.h).
#include "tensor/debug/torch_repr.h"

#include <vector>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

std::string placement_repr(const Placement& p) {
  switch (p.kind()) {
  case Placement::Kind::Shard:
    return fmt::format("Shard(dim={})", p.dim());
  case Placement::Kind::Replicate:
    return "Replicate()";
  case Placement::Kind::Partial:
    return p.is_norm_partial() ? fmt::format("_NormPartial(norm_type={})", p.norm_p())
                               : fmt::format("Partial({})", to_string(p.reduce_op()));
  }
  return "?";
}

// A Python tuple: "(a,)" for one element, "(a, b)" otherwise.
std::string py_tuple(const std::vector<std::string>& items) {
  return items.size() == 1 ? fmt::format("({},)", items[0])
                           : fmt::format("({})", fmt::join(items, ", "));
}

} // namespace

std::string torch_repr(const Placements& placements) {
  std::vector<std::string> items;
  for (const auto& p : placements) {
    items.push_back(placement_repr(p));
  }
  return py_tuple(items);
}

// PyTorch prints a mesh's dimension sizes (with names) and the stride of each dimension in
// global ranks. dtensor's meshes lay their ranks out row-major, so a dimension's stride is
// the rank distance of one step along it (a dimension of size 1: the product of the sizes
// after it, as in a row-major layout).
std::string torch_repr(const DeviceMesh& mesh) {
  const auto& shape = mesh.shape();
  const auto& names = mesh.dim_names();
  const auto& ranks = mesh.ranks();
  std::vector<std::string> sizes, strides;
  int64_t inner = 1; // elements after dimension d in this mesh's row-major order
  std::vector<int64_t> after(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 0;) {
    after[d] = inner;
    inner *= shape[d];
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    sizes.push_back(names.empty() ? std::to_string(shape[d])
                                  : fmt::format("{}={}", names[d], shape[d]));
    const int64_t stride =
        shape[d] > 1 ? ranks[static_cast<size_t>(after[d])] - ranks[0] : after[d];
    strides.push_back(std::to_string(stride));
  }
  const std::string dims = names.empty() ? py_tuple(sizes) : fmt::format("({})", fmt::join(sizes, ", "));
  return fmt::format("DeviceMesh({}, '{}', stride={})", dims,
                     c10::DeviceTypeName(mesh.device_type(), /*lower_case=*/true), py_tuple(strides));
}

std::string torch_size_repr(c10::IntArrayRef shape) {
  return fmt::format("torch.Size([{}])", fmt::join(shape, ", "));
}

} // namespace dtensor::detail
