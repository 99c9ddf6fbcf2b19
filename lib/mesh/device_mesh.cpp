// DeviceMesh: N-D rank layout, slicing by name, flattening, and per-dimension groups.
#include <dtensor/device_mesh.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <numeric>
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
  std::vector<int> ranks;        // row-major over shape
  std::vector<int64_t> my_coord; // this rank's coordinate in the root mesh
  std::mutex mutex;
  std::map<std::string, std::vector<int64_t>> flattened; // name -> root dims it merges
  // Per root dimension: its backend and timeout ([Note: per-group backends]), and, for meshes
  // made by from_group, this rank's group (empty otherwise).
  std::vector<GroupOptions> dim_options;
  GroupOptions flat_options; // of groups spanning several root dimensions
  std::vector<Group> given;
};

} // namespace detail

struct DeviceMesh::State {
  std::shared_ptr<detail::RootMesh> root;
  // For each dimension of this mesh, the root dimensions it spans (row-major); a plain
  // dimension spans one root dimension, a flattened one several.
  std::vector<std::vector<int64_t>> root_dims;
  std::vector<int64_t> shape;
  std::vector<std::string> names; // empty for unnamed meshes
  std::vector<int> ranks;
  std::vector<int64_t> coord; // this rank's coordinate
  std::vector<Group> groups;  // this rank's group per dimension
  // [Note: the mesh's hash, once] Every DTensor op's decision key holds its meshes' hashes
  // (lib/tensor/dispatch/decision.cpp), and hashing walks every rank: computed on first use
  // and kept, as nothing above changes once the mesh is made (0: not yet computed).
  mutable std::atomic<size_t> hash{0};
};

namespace {

using MeshState = DeviceMesh::State;
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
    if (root_dims[i].size() == 1 && !root->given.empty()) {
      // An unnamed mesh keeps the labels the program gave its groups.
      const Group& g = root->given[static_cast<size_t>(root_dims[i][0])];
      m->groups.push_back(names.empty() ? g : g.with_label(label));
      continue;
    }
    const GroupOptions& options = root_dims[i].size() == 1
                                      ? root->dim_options[static_cast<size_t>(root_dims[i][0])]
                                      : root->flat_options;
    m->groups.push_back(new_group(slice_ranks(*root, {root_dims[i]}), label, options));
  }
  m->root = std::move(root);
  m->root_dims = std::move(root_dims);
  m->names = std::move(names);
  return m;
}

} // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<State> state) : state_(std::move(state)) {}

#define DTENSOR_MESH_DEFINED(what)                                                                 \
  DTENSOR_CHECK(state_ != nullptr, "DeviceMesh::{}: undefined mesh (default-constructed)", what)

c10::DeviceType DeviceMesh::device_type() const {
  DTENSOR_MESH_DEFINED("device_type");
  return state_->root->device;
}

const std::vector<int64_t>& DeviceMesh::shape() const {
  DTENSOR_MESH_DEFINED("shape");
  return state_->shape;
}

int64_t DeviceMesh::ndim() const {
  return static_cast<int64_t>(shape().size());
}

int64_t DeviceMesh::size() const {
  return static_cast<int64_t>(ranks().size());
}

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
  DTENSOR_CHECK(!state_->names.empty(),
                "DeviceMesh: no dimension named '{}': {} has no dimension names", name,
                to_string());
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

Group DeviceMesh::get_group(const std::string& dim) const {
  return get_group(dim_index(dim));
}

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
  DTENSOR_CHECK(!state_->names.empty(),
                "DeviceMesh: cannot slice {} by names ({}): it has no "
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
  if (size_t known = state_->hash.load(std::memory_order_relaxed); known != 0) {
    return known;
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
  state_->hash.store(h, std::memory_order_relaxed); // [Note: the mesh's hash, once]
  return h;
}

std::string DeviceMesh::to_string() const {
  if (!state_) {
    return "DeviceMesh(undefined)";
  }
  return describe_mesh(state_->shape, state_->ranks, state_->names, state_->root->device);
}

namespace {

// The checks every mesh's layout passes: its device type, shape and names.
void check_layout(const std::string& what, c10::DeviceType device_type,
                  const std::vector<int64_t>& shape, const std::vector<std::string>& dim_names) {
  // A simulated world's meshes are on its device; a mesh made from one (another mesh's
  // device_type(), as expert parallelism's sparse mesh) names it.
  DTENSOR_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA ||
                    (device_type == detail::kSimulatedDevice && is_simulated()),
                "{}: device type must be cpu or cuda", what);
  DTENSOR_CHECK(!shape.empty(), "{}: the mesh needs at least one dimension", what);
  for (int64_t s : shape) {
    DTENSOR_CHECK(s > 0, "{}: dimension sizes must be positive", what);
  }
  DTENSOR_CHECK(dim_names.empty() || dim_names.size() == shape.size(),
                "{}: {} names for {} dimensions", what, dim_names.size(), shape.size());
  std::set<std::string> seen;
  for (const auto& name : dim_names) {
    DTENSOR_CHECK(!name.empty(), "{}: dimension names must not be empty", what);
    DTENSOR_CHECK(seen.insert(name).second, "{}: dimension name '{}' appears twice", what, name);
  }
}

// This rank's coordinate in a row-major layout of `ranks` over `shape`; nullopt outside.
std::optional<std::vector<int64_t>> coordinate_of(int rank, const std::vector<int64_t>& shape,
                                                  const std::vector<int>& ranks) {
  auto it = std::find(ranks.begin(), ranks.end(), rank);
  if (it == ranks.end()) {
    return std::nullopt;
  }
  int64_t rest = it - ranks.begin();
  std::vector<int64_t> coord(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    coord[d] = rest % shape[d];
    rest /= shape[d];
  }
  return coord;
}

std::shared_ptr<MeshState> make_root(c10::DeviceType device, std::vector<int64_t> shape,
                                     std::vector<int> ranks, std::vector<std::string> names,
                                     std::vector<GroupOptions> options, GroupOptions flat,
                                     std::vector<Group> given) {
  auto root = std::make_shared<RootMesh>();
  root->device = device;
  root->my_coord = *coordinate_of(get_rank(), shape, ranks);
  root->shape = std::move(shape);
  root->ranks = std::move(ranks);
  root->names = names;
  root->dim_options = std::move(options);
  root->flat_options = flat;
  root->given = std::move(given);
  std::vector<std::vector<int64_t>> dims;
  for (size_t d = 0; d < root->shape.size(); ++d) {
    dims.push_back({static_cast<int64_t>(d)});
  }
  return make_mesh(root, std::move(dims), std::move(names));
}

// The backend a mesh dimension gets when the caller does not name one: the world's where it
// serves the mesh's device type, Gloo for a CPU mesh in an NCCL world.
BackendType default_backend(const std::string& what, c10::DeviceType device_type) {
  BackendType backend = get_backend();
  if (backend == BackendType::Fake || (backend == BackendType::Gloo && device_type == c10::kCPU) ||
      (backend == BackendType::Nccl && device_type == c10::kCUDA)) {
    return backend;
  }
  if (backend == BackendType::Nccl && device_type == c10::kCPU) {
    return BackendType::Gloo; // PyTorch's "cpu:gloo,cuda:nccl"
  }
  // A CUDA mesh in a Gloo world: NCCL only when asked for (backend_override).
  DTENSOR_FAIL("{}: device type {} does not match the process group's {} backend ({} tensors); "
               "name nccl for its dimensions in DeviceMeshOptions::backend_override",
               what, c10::DeviceTypeName(device_type, true), to_string(backend),
               c10::DeviceTypeName(c10::kCPU, true));
}

// Each dimension's GroupOptions from backend_override (keys by name or index, each dimension
// at most once), backends checked against the device type.
std::vector<GroupOptions> dim_options(const std::string& what, c10::DeviceType device_type,
                                      const std::vector<int64_t>& shape,
                                      const std::vector<std::string>& names,
                                      const BackendOverride& overrides) {
  const auto ndim = static_cast<int64_t>(shape.size());
  std::vector<std::optional<GroupOptions>> given(shape.size());
  for (const auto& [key, opts] : overrides) {
    int64_t d = -1;
    if (const auto* index = std::get_if<int64_t>(&key)) {
      d = *index < 0 ? *index + ndim : *index;
      DTENSOR_CHECK(d >= 0 && d < ndim, "{}: backend_override names dimension {}, out of range",
                    what, *index);
    } else {
      const auto& name = std::get<std::string>(key);
      auto it = std::find(names.begin(), names.end(), name);
      DTENSOR_CHECK(it != names.end(), "{}: backend_override names dimension '{}', not one of ({})",
                    what, name, fmt::join(names, ", "));
      d = it - names.begin();
    }
    DTENSOR_CHECK(!given[static_cast<size_t>(d)].has_value(),
                  "{}: backend_override names dimension {} twice (by index and by name)", what, d);
    given[static_cast<size_t>(d)] = opts;
  }
  const bool simulated = is_simulated();
  std::vector<GroupOptions> out;
  for (size_t d = 0; d < shape.size(); ++d) {
    GroupOptions o = given[d].value_or(GroupOptions());
    const std::string dim = names.empty() ? fmt::format("{}", d) : fmt::format("'{}'", names[d]);
    if (simulated) { // every group of a simulated world is fake; timeouts still apply
      o.backend(BackendType::Fake);
    } else if (o.backend() == BackendType::Auto) {
      o.backend(default_backend(what, device_type));
    } else {
      const BackendType b = o.backend();
      DTENSOR_CHECK(b != BackendType::Fake,
                    "{}: dimension {}: backend fake outside a simulated "
                    "world",
                    what, dim);
      DTENSOR_CHECK((b == BackendType::Nccl) == (device_type == c10::kCUDA),
                    "{}: dimension {}: backend {} does not serve {} tensors", what, dim,
                    to_string(b), c10::DeviceTypeName(device_type, true));
    }
    out.push_back(o);
  }
  return out;
}

} // namespace

DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  return init_device_mesh(device_type, shape, dim_names, DeviceMeshOptions());
}

DeviceMesh init_device_mesh(c10::DeviceType device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names,
                            const DeviceMeshOptions& options) {
  std::string what =
      fmt::format("init_device_mesh({}, shape={}, names=({}))",
                  c10::DeviceTypeName(device_type, true), shape, fmt::join(dim_names, ", "));
  check_layout(what, device_type, shape, dim_names);
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  if (!is_initialized()) {
    init_process_group();
  }
  int world = get_world_size();
  DTENSOR_CHECK(n == world, "{}: the mesh has {} ranks but the world has {}", what, n, world);
  auto opts = dim_options(what, device_type, shape, dim_names, options.backend_override());
  GroupOptions flat = GroupOptions().backend(is_simulated() ? BackendType::Fake
                                                            : default_backend(what, device_type));
  std::vector<int> ranks(static_cast<size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  // A simulated world's meshes hold tensors of the simulated device, whichever device they
  // stand for ([Note: the simulated device]).
  return DeviceMesh(make_root(is_simulated() ? detail::kSimulatedDevice : device_type, shape,
                              std::move(ranks), dim_names, std::move(opts), flat, {}));
}

DeviceMesh DeviceMesh::from_group(const Group& group, c10::DeviceType device_type,
                                  const std::vector<std::string>& dim_names) {
  DTENSOR_CHECK(group.defined(), "DeviceMesh::from_group: undefined group (this rank is not a "
                                 "member)");
  return from_group(std::vector<Group>{group}, device_type, {group.size()}, group.ranks(),
                    dim_names);
}

DeviceMesh DeviceMesh::from_group(const std::vector<Group>& groups, c10::DeviceType device_type,
                                  const std::vector<int64_t>& shape, const std::vector<int>& ranks,
                                  const std::vector<std::string>& dim_names) {
  std::string what =
      fmt::format("DeviceMesh::from_group({}, shape={}, ranks={}, names=({}))",
                  c10::DeviceTypeName(device_type, true), shape, ranks, fmt::join(dim_names, ", "));
  check_layout(what, device_type, shape, dim_names);
  DTENSOR_CHECK(groups.size() == shape.size(), "{}: {} groups for {} dimensions", what,
                groups.size(), shape.size());
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  DTENSOR_CHECK(n == static_cast<int64_t>(ranks.size()), "{}: the shape has {} ranks, the list {}",
                what, n, ranks.size());
  DTENSOR_CHECK(std::set<int>(ranks.begin(), ranks.end()).size() == ranks.size(),
                "{}: a rank appears twice", what);
  auto coord = coordinate_of(dtensor::get_rank(), shape, ranks);
  DTENSOR_CHECK(coord.has_value(), "{}: this rank ({}) is not in the mesh", what,
                dtensor::get_rank());
  const bool simulated = is_simulated();
  auto root = std::make_shared<RootMesh>(); // for slice_ranks only
  root->shape = shape;
  root->ranks = ranks;
  root->my_coord = *coord;
  std::vector<GroupOptions> opts;
  for (size_t d = 0; d < groups.size(); ++d) {
    const std::string dim =
        dim_names.empty() ? fmt::format("{}", d) : fmt::format("'{}'", dim_names[d]);
    DTENSOR_CHECK(groups[d].defined(), "{}: the group of dimension {} is undefined", what, dim);
    std::vector<int> expected = slice_ranks(*root, {{static_cast<int64_t>(d)}});
    DTENSOR_CHECK(groups[d].ranks() == expected,
                  "{}: dimension {}: this rank's slice is ranks {} but the group ({}) spans {}",
                  what, dim, expected, groups[d].label(), groups[d].ranks());
    DTENSOR_CHECK(simulated || groups[d].device_type() == device_type,
                  "{}: dimension {}: the group's {} backend serves {} tensors, not {}", what, dim,
                  dtensor::to_string(groups[d].backend_type()),
                  c10::DeviceTypeName(groups[d].device_type(), true),
                  c10::DeviceTypeName(device_type, true));
    opts.push_back(GroupOptions().backend(groups[d].backend_type()));
  }
  GroupOptions flat =
      GroupOptions().backend(simulated ? BackendType::Fake : default_backend(what, device_type));
  return DeviceMesh(make_root(simulated ? detail::kSimulatedDevice : device_type, shape, ranks,
                              dim_names, std::move(opts), flat, groups));
}

} // namespace dtensor
