// DeviceMesh: N-D rank layout, slicing by name, flattening, and per-dimension groups.
#include <dtensor/device_mesh.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "internal/check.h"
#include "mesh/process_group_state.h"

namespace dtensor {

namespace detail {

// Shared by every mesh derived from one init_device_mesh() call.
struct RootMesh {
  c10::DeviceType device = c10::DeviceType::CPU;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::vector<int> ranks; // row-major over shape
  std::vector<int64_t> my_coord; // this rank's coordinate in the root mesh
  std::mutex mutex;
  std::map<std::string, std::vector<int64_t>> flattened; // name -> root dims it merges
};

struct MeshState {
  std::shared_ptr<RootMesh> root;
  // For each dimension of this mesh, the root dimensions it spans (row-major); a plain
  // dimension spans one root dimension, a flattened one several.
  std::vector<std::vector<int64_t>> root_dims;
  std::vector<int64_t> shape;
  std::vector<std::string> names; // empty for unnamed meshes
  std::vector<int> ranks;
  std::vector<int64_t> coord; // this rank's coordinate
  std::vector<Group> groups;  // this rank's group per dimension
};

} // namespace detail

namespace {

using detail::MeshState;
using detail::RootMesh;

std::string nested_ranks(const std::vector<int>& ranks, const std::vector<int64_t>& shape,
                         size_t dim, size_t offset) {
  if (dim == shape.size()) {
    return std::to_string(ranks[offset]);
  }
  size_t stride = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) {
    stride *= static_cast<size_t>(shape[d]);
  }
  std::vector<std::string> parts;
  for (int64_t i = 0; i < shape[dim]; ++i) {
    parts.push_back(nested_ranks(ranks, shape, dim + 1, offset + static_cast<size_t>(i) * stride));
  }
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

std::string describe_mesh(const std::vector<int64_t>& shape, const std::vector<int>& ranks,
                     const std::vector<std::string>& names, c10::DeviceType device) {
  std::string s = fmt::format("DeviceMesh({}, {}", c10::DeviceTypeName(device, true),
                              nested_ranks(ranks, shape, 0, 0));
  if (!names.empty()) {
    s += fmt::format(", names=({})", fmt::join(names, ", "));
  }
  return s + ")";
}

// The ranks of the sub-mesh whose dimensions span `dims` (each a list of root dimensions,
// row-major), with all other root dimensions fixed at this rank's coordinate.
std::vector<int> slice_ranks(const RootMesh& root, const std::vector<std::vector<int64_t>>& dims) {
  std::vector<int64_t> order; // root dims from slowest to fastest varying
  for (const auto& d : dims) {
    order.insert(order.end(), d.begin(), d.end());
  }
  int64_t count = 1;
  for (int64_t d : order) {
    count *= root.shape[static_cast<size_t>(d)];
  }
  std::vector<int64_t> root_stride(root.shape.size(), 1);
  for (size_t d = root.shape.size(); d-- > 1;) {
    root_stride[d - 1] = root_stride[d] * root.shape[d];
  }
  std::vector<int> out;
  out.reserve(static_cast<size_t>(count));
  std::vector<int64_t> coord = root.my_coord;
  for (int64_t i = 0; i < count; ++i) {
    int64_t rest = i;
    for (size_t k = order.size(); k-- > 0;) {
      auto d = static_cast<size_t>(order[k]);
      coord[d] = rest % root.shape[d];
      rest /= root.shape[d];
    }
    int64_t flat = 0;
    for (size_t d = 0; d < coord.size(); ++d) {
      flat += coord[d] * root_stride[d];
    }
    out.push_back(root.ranks[static_cast<size_t>(flat)]);
  }
  return out;
}

std::shared_ptr<MeshState> make_mesh(std::shared_ptr<RootMesh> root,
                                     std::vector<std::vector<int64_t>> root_dims,
                                     std::vector<std::string> names) {
  auto m = std::make_shared<MeshState>();
  for (const auto& d : root_dims) {
    int64_t n = 1;
    for (int64_t r : d) {
      n *= root->shape[static_cast<size_t>(r)];
    }
    m->shape.push_back(n);
  }
  m->ranks = slice_ranks(*root, root_dims);
  // Coordinate of this rank: row-major index over each dimension's root dims.
  for (const auto& d : root_dims) {
    int64_t c = 0;
    for (int64_t r : d) {
      c = c * root->shape[static_cast<size_t>(r)] + root->my_coord[static_cast<size_t>(r)];
    }
    m->coord.push_back(c);
  }
  for (size_t i = 0; i < root_dims.size(); ++i) {
    std::string label = names.empty() ? fmt::format("dim{}", i) : names[i];
    m->groups.push_back(new_group(slice_ranks(*root, {root_dims[i]}), label));
  }
  m->root = std::move(root);
  m->root_dims = std::move(root_dims);
  m->names = std::move(names);
  return m;
}

} // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<detail::MeshState> state) : state_(std::move(state)) {}

#define DTENSOR_MESH_DEFINED(what)                                                       \
  DTENSOR_CHECK(state_ != nullptr, "DeviceMesh::{}: undefined mesh (default-constructed)", what)

c10::DeviceType DeviceMesh::device_type() const {
  DTENSOR_MESH_DEFINED("device_type");
  return state_->root->device;
}

const std::vector<int64_t>& DeviceMesh::shape() const {
  DTENSOR_MESH_DEFINED("shape");
  return state_->shape;
}

int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(shape().size()); }

int64_t DeviceMesh::size() const { return static_cast<int64_t>(ranks().size()); }

int64_t DeviceMesh::size(int64_t dim) const {
  DTENSOR_CHECK(dim >= -ndim() && dim < ndim(), "DeviceMesh::size: dim {} is out of range for {}",
                dim, to_string());
  return state_->shape[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)];
}

const std::vector<std::string>& DeviceMesh::dim_names() const {
  DTENSOR_MESH_DEFINED("dim_names");
  return state_->names;
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  DTENSOR_MESH_DEFINED("dim_index");
  DTENSOR_CHECK(!state_->names.empty(), "DeviceMesh: no dimension named '{}': {} has no dimension names",
                name, to_string());
  auto it = std::find(state_->names.begin(), state_->names.end(), name);
  DTENSOR_CHECK(it != state_->names.end(), "DeviceMesh: no dimension named '{}' in {}", name,
                to_string());
  return it - state_->names.begin();
}

int DeviceMesh::get_rank() const {
  DTENSOR_MESH_DEFINED("get_rank");
  return dtensor::get_rank();
}

std::optional<std::vector<int64_t>> DeviceMesh::get_coordinate() const {
  DTENSOR_MESH_DEFINED("get_coordinate");
  return state_->coord;
}

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  DTENSOR_CHECK(dim >= -ndim() && dim < ndim(),
                "DeviceMesh::get_local_rank: dim {} is out of range for {}", dim, to_string());
  return state_->coord[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)];
}

int64_t DeviceMesh::get_local_rank(const std::string& dim) const {
  return get_local_rank(dim_index(dim));
}

Group DeviceMesh::get_group(int64_t dim) const {
  DTENSOR_CHECK(dim >= -ndim() && dim < ndim(),
                "DeviceMesh::get_group: dim {} is out of range for {}", dim, to_string());
  return state_->groups[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)];
}

Group DeviceMesh::get_group(const std::string& dim) const { return get_group(dim_index(dim)); }

Group DeviceMesh::get_group() const {
  DTENSOR_CHECK(ndim() == 1,
                "DeviceMesh::get_group: {} has {} dimensions; name the dimension (get_group(dim))",
                to_string(), ndim());
  return get_group(0);
}

std::vector<Group> DeviceMesh::get_all_groups() const {
  DTENSOR_MESH_DEFINED("get_all_groups");
  return state_->groups;
}

const std::vector<int>& DeviceMesh::ranks() const {
  DTENSOR_MESH_DEFINED("ranks");
  return state_->ranks;
}

DeviceMesh DeviceMesh::root_mesh() const {
  DTENSOR_MESH_DEFINED("root_mesh");
  std::vector<std::vector<int64_t>> dims;
  for (size_t d = 0; d < state_->root->shape.size(); ++d) {
    dims.push_back({static_cast<int64_t>(d)});
  }
  return DeviceMesh(make_mesh(state_->root, std::move(dims), state_->root->names));
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return (*this)[std::vector<std::string>{name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  DTENSOR_MESH_DEFINED("operator[]");
  DTENSOR_CHECK(!names.empty(), "DeviceMesh: slicing {} needs at least one dimension name",
                to_string());
  DTENSOR_CHECK(!state_->names.empty(), "DeviceMesh: cannot slice {} by names ({}): it has no "
                                        "dimension names",
                to_string(), fmt::join(names, ", "));
  std::set<int64_t> mine; // root dims this mesh spans
  for (const auto& d : state_->root_dims) {
    mine.insert(d.begin(), d.end());
  }
  std::vector<std::vector<int64_t>> dims;
  std::set<int64_t> used;
  for (const auto& name : names) {
    std::vector<int64_t> root_dims;
    auto it = std::find(state_->names.begin(), state_->names.end(), name);
    if (it != state_->names.end()) {
      root_dims = state_->root_dims[static_cast<size_t>(it - state_->names.begin())];
    } else {
      std::lock_guard<std::mutex> lock(state_->root->mutex);
      auto f = state_->root->flattened.find(name);
      DTENSOR_CHECK(f != state_->root->flattened.end(),
                    "DeviceMesh: no dimension named '{}' in {} (slicing by ({}))", name,
                    to_string(), fmt::join(names, ", "));
      root_dims = f->second;
      for (int64_t d : root_dims) {
        DTENSOR_CHECK(mine.count(d) != 0,
                      "DeviceMesh: flattened dimension '{}' spans dimensions outside {}", name,
                      to_string());
      }
    }
    for (int64_t d : root_dims) {
      DTENSOR_CHECK(used.insert(d).second,
                    "DeviceMesh: dimension '{}' overlaps another selected dimension in ({}) of {}",
                    name, fmt::join(names, ", "), to_string());
    }
    dims.push_back(std::move(root_dims));
  }
  return DeviceMesh(make_mesh(state_->root, std::move(dims), names));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  DTENSOR_MESH_DEFINED("flatten");
  std::string flat_name = name;
  if (flat_name.empty()) {
    DTENSOR_CHECK(!state_->names.empty(),
                  "DeviceMesh::flatten: {} has no dimension names; pass a name", to_string());
    flat_name = fmt::format("{}", fmt::join(state_->names, "_"));
  }
  std::vector<int64_t> root_dims;
  for (const auto& d : state_->root_dims) {
    root_dims.insert(root_dims.end(), d.begin(), d.end());
  }
  {
    RootMesh& root = *state_->root;
    std::lock_guard<std::mutex> lock(root.mutex);
    DTENSOR_CHECK(std::find(root.names.begin(), root.names.end(), flat_name) == root.names.end(),
                  "DeviceMesh::flatten: name '{}' is already a dimension of the root mesh {}",
                  flat_name, describe_mesh(root.shape, root.ranks, root.names, root.device));
    auto it = root.flattened.find(flat_name);
    DTENSOR_CHECK(it == root.flattened.end() || it->second == root_dims,
                  "DeviceMesh::flatten: name '{}' already names a flattening of other "
                  "dimensions of the root mesh",
                  flat_name);
    root.flattened[flat_name] = root_dims;
  }
  return DeviceMesh(make_mesh(state_->root, {root_dims}, {flat_name}));
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  if (state_ == other.state_) {
    return true;
  }
  if (!state_ || !other.state_) {
    return false;
  }
  return device_type() == other.device_type() && state_->shape == other.state_->shape &&
         state_->ranks == other.state_->ranks && state_->names == other.state_->names;
}

size_t DeviceMesh::hash() const {
  if (!state_) {
    return 0;
  }
  size_t h = std::hash<int>()(static_cast<int>(device_type()));
  auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  for (int64_t s : state_->shape) {
    mix(std::hash<int64_t>()(s));
  }
  for (int r : state_->ranks) {
    mix(std::hash<int>()(r));
  }
  for (const auto& n : state_->names) {
    mix(std::hash<std::string>()(n));
  }
  return h;
}

std::string DeviceMesh::to_string() const {
  if (!state_) {
    return "DeviceMesh(undefined)";
  }
  return describe_mesh(state_->shape, state_->ranks, state_->names, state_->root->device);
}

DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  std::string what = fmt::format("init_device_mesh({}, shape={}, names=({}))",
                                 c10::DeviceTypeName(device_type, true), shape,
                                 fmt::join(dim_names, ", "));
  DTENSOR_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
                "{}: device type must be cpu or cuda", what);
  DTENSOR_CHECK(!shape.empty(), "{}: the mesh needs at least one dimension", what);
  int64_t n = 1;
  for (int64_t s : shape) {
    DTENSOR_CHECK(s > 0, "{}: dimension sizes must be positive", what);
    n *= s;
  }
  DTENSOR_CHECK(dim_names.empty() || dim_names.size() == shape.size(),
                "{}: {} names for {} dimensions", what, dim_names.size(), shape.size());
  std::set<std::string> seen;
  for (const auto& name : dim_names) {
    DTENSOR_CHECK(!name.empty(), "{}: dimension names must not be empty", what);
    DTENSOR_CHECK(seen.insert(name).second, "{}: dimension name '{}' appears twice", what, name);
  }
  if (!is_initialized()) {
    init_process_group();
  }
  int world = get_world_size();
  DTENSOR_CHECK(n == world, "{}: the mesh has {} ranks but the world has {}", what, n, world);
  BackendType backend = get_backend();
  c10::DeviceType backend_device =
      backend == BackendType::Nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  DTENSOR_CHECK(device_type == backend_device || backend == BackendType::Fake,
                "{}: device type {} does not match the process group's {} backend ({} tensors)",
                what, c10::DeviceTypeName(device_type, true), to_string(backend),
                c10::DeviceTypeName(backend_device, true));

  auto root = std::make_shared<RootMesh>();
  // A simulated world's meshes hold tensors of the simulated device, whichever device they
  // stand for ([Note: the simulated device]).
  root->device = backend == BackendType::Fake ? detail::kSimulatedDevice : device_type;
  root->shape = shape;
  root->names = dim_names;
  root->ranks.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    root->ranks[static_cast<size_t>(r)] = static_cast<int>(r);
  }
  int64_t rest = get_rank();
  root->my_coord.assign(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    root->my_coord[d] = rest % shape[d];
    rest /= shape[d];
  }
  std::vector<std::vector<int64_t>> dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    dims.push_back({static_cast<int64_t>(d)});
  }
  return DeviceMesh(make_mesh(root, std::move(dims), dim_names));
}

} // namespace dtensor
