// Which rank writes which chunk, which stored chunks each rank reads (lib/checkpoint/layout.h).
#include "checkpoint/layout.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "internal/check.h"
#include "mesh/agree.h"
#include "tensor/dtensor_impl.h"
#include "tensor/redistribute/redistribute.h"

namespace dtensor::detail {

namespace fs = std::filesystem;

namespace {

int64_t elements_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  return n;
}

} // namespace

// ---- saving ---------------------------------------------------------------------------

std::vector<SavedTensor> saved_tensors(const StateDict& state) {
  std::vector<SavedTensor> out;
  for (const auto& item : state) {
    const at::Tensor& t = item.value();
    DTENSOR_CHECK(t.defined(), "checkpoint::save: '{}' is an undefined tensor", item.key());
    DTENSOR_CHECK(
        item.key().find_first_of("\t\n") == std::string::npos && !item.key().empty() &&
            item.key() != "__metadata__",
        "checkpoint::save: '{}' is not a usable name (empty, __metadata__, or with a tab or "
        "newline)",
        item.key());
    SavedTensor s;
    s.key = item.key();
    s.dtype = t.scalar_type();
    (void)safetensors::dtype_name(s.dtype); // throws for dtypes safetensors cannot hold
    if (const DTensorMeta* m = dtensor_meta(t)) {
      s.local = m->local;
      s.shape = m->spec.shape;
      s.spec = m->spec;
    } else {
      s.local = t;
      s.shape = t.sizes().vec();
    }
    out.push_back(std::move(s));
  }
  return out;
}

void reduce_partials(std::vector<SavedTensor>& tensors) {
  for (SavedTensor& t : tensors) {
    if (t.spec && t.spec->has_partial()) {
      Placements target = t.spec->placements;
      for (Placement& p : target) {
        if (p.is_partial()) {
          p = Placement::replicate();
        }
      }
      t.local = redistribute_local(t.local, *t.spec, target);
      t.spec->placements = target;
    }
  }
}

namespace {

// One rank's description of its pieces, one line per tensor.
std::string describe_pieces(const std::vector<SavedTensor>& tensors) {
  std::string text;
  for (const SavedTensor& t : tensors) {
    const std::vector<int64_t> offset =
        t.spec ? t.spec->local_offset() : std::vector<int64_t>(t.shape.size(), 0);
    const std::vector<int64_t> shape = t.spec ? t.spec->local_shape() : t.shape;
    text += fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\n", t.key, c10::toString(t.dtype),
                        fmt::join(t.shape, " "), fmt::join(offset, " "), fmt::join(shape, " "),
                        c10::elementSize(t.dtype), static_cast<int>(t.dtype));
  }
  return text;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == sep) {
      if (i > start || sep == '\t') { // empty fields count (a 0-dim shape), empty lines do not
        out.push_back(s.substr(start, i - start));
      }
      start = i + 1;
    }
  }
  return out;
}

std::vector<int64_t> ints(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& part : split(s, ' ')) {
    out.push_back(std::stoll(part));
  }
  return out;
}

} // namespace

namespace {

// One rank's line for one name: what it passes and where it sits in that rank's list.
struct Held {
  int rank = 0;
  size_t index = 0;                // into that rank's SavedTensor list
  std::vector<std::string> fields; // name, dtype, global shape, offsets, piece shape, bytes
                                   // per element, dtype's number (describe_pieces)
};

// Every name passed by some rank, in the order of first appearance (rank 0's list, then what
// rank 1 adds, ...), with the ranks holding it.
std::vector<std::pair<std::string, std::vector<Held>>>
names_and_holders(const std::vector<std::string>& texts) {
  std::vector<std::pair<std::string, std::vector<Held>>> out;
  std::map<std::string, size_t> position;
  for (size_t r = 0; r < texts.size(); ++r) {
    const std::vector<std::string> lines = split(texts[r], '\n');
    for (size_t i = 0; i < lines.size(); ++i) {
      Held h{static_cast<int>(r), i, split(lines[i], '\t')};
      auto [it, added] = position.emplace(h.fields[0], out.size());
      if (added) {
        out.emplace_back(h.fields[0], std::vector<Held>{});
      }
      out[it->second].second.push_back(std::move(h));
    }
  }
  return out;
}

} // namespace

// [Note: names held by some ranks] As DCP's global plan, the checkpoint holds every name any
// rank passes: under pipeline parallelism each pipeline rank passes its stages' names only.
// The ranks holding a name must agree on its dtype and global shape, and their pieces must
// cover the whole tensor (a rank that forgot its piece would otherwise leave rows unsaved);
// either failure is named, with the ranks, on every rank.
WritePlan plan_writes(const std::vector<SavedTensor>& tensors, const std::string& what) {
  const std::vector<std::string> texts =
      all_gather_strings(describe_pieces(tensors), world_group());
  const auto world_size = static_cast<int>(texts.size());
  WritePlan plan;
  plan.chunks.resize(static_cast<size_t>(world_size));
  std::vector<int64_t> assigned(static_cast<size_t>(world_size), 0);
  for (const auto& [name, held] : names_and_holders(texts)) {
    const Held& first = held.front();
    for (const Held& h : held) {
      DTENSOR_CHECK(h.fields[1] == first.fields[1] && h.fields[2] == first.fields[2],
                    "{}: rank {} passes '{}' as {} [{}] where rank {} passes it as {} [{}]: the "
                    "ranks holding a name must agree on its dtype and global shape",
                    what, h.rank, name, h.fields[1], h.fields[2], first.rank, first.fields[1],
                    first.fields[2]);
    }
    // Distinct pieces (offsets, shape) in rank order, each with the ranks holding it.
    std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;
    std::vector<std::vector<const Held*>> holders;
    for (const Held& h : held) {
      std::pair<std::vector<int64_t>, std::vector<int64_t>> box{ints(h.fields[3]),
                                                                ints(h.fields[4])};
      auto it = std::find(boxes.begin(), boxes.end(), box);
      if (it == boxes.end()) {
        boxes.push_back(std::move(box));
        holders.emplace_back();
        it = boxes.end() - 1;
      }
      holders[static_cast<size_t>(it - boxes.begin())].push_back(&h);
    }
    const std::vector<int64_t> shape = ints(first.fields[2]);
    plan.tensors.push_back({name, static_cast<c10::ScalarType>(std::stoi(first.fields[6])), shape});
    int64_t covered = 0;
    for (const auto& box : boxes) {
      covered += elements_of(box.second);
    }
    std::vector<int> ranks;
    for (const Held& h : held) {
      ranks.push_back(h.rank);
    }
    DTENSOR_CHECK(covered >= elements_of(shape),
                  "{}: the pieces of '{}' ([{}]) held by ranks [{}] cover {} of its {} elements",
                  what, name, first.fields[2], fmt::join(ranks, ", "), covered, elements_of(shape));
    const int64_t elem = std::stoll(first.fields[5]);
    for (size_t b = 0; b < boxes.size(); ++b) {
      const int64_t n = elements_of(boxes[b].second);
      if (n == 0 && !(elements_of(shape) == 0 && b == 0)) {
        continue; // an empty piece of a non-empty tensor: nothing to write
      }
      const Held* writer = *std::min_element(
          holders[b].begin(), holders[b].end(), [&](const Held* x, const Held* y) {
            return assigned[static_cast<size_t>(x->rank)] < assigned[static_cast<size_t>(y->rank)];
          });
      assigned[static_cast<size_t>(writer->rank)] += n * elem;
      plan.chunks[static_cast<size_t>(writer->rank)].push_back({writer->index, boxes[b].first});
    }
  }
  for (int r = 0; r < world_size; ++r) {
    if (!plan.chunks[static_cast<size_t>(r)].empty()) {
      plan.writers.push_back(r);
    }
  }
  return plan;
}

at::Tensor chunk_data(const SavedTensor& tensor) {
  return tensor.local.detach().cpu().contiguous();
}

// ---- loading --------------------------------------------------------------------------

namespace {

// A Hugging Face folder's model.safetensors.index.json, when there is one: its weight_map
// (tensor -> file), each file a plain name in the folder.
std::optional<std::map<std::string, std::string>> hf_weight_map(const std::string& dir) {
  const fs::path path = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(path)) {
    return std::nullopt;
  }
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  DTENSOR_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                "checkpoint: {}: not a safetensors index (no weight_map object)", path.string());
  std::map<std::string, std::string> map;
  for (const auto& [key, file] : j["weight_map"].items()) {
    DTENSOR_CHECK(file.is_string() && !file.get<std::string>().empty() &&
                      fs::path(file.get<std::string>()).filename() == file.get<std::string>(),
                  "checkpoint: {}: '{}' maps to {}, not a file name in the folder",
                  path.string(), key, file.dump());
    map[key] = file.get<std::string>();
  }
  return map;
}

// The files to read: those the index names (a stale shard beside them is not read), or every
// .safetensors file. A file the index names that is missing is named with a tensor it holds.
std::vector<std::string> checkpoint_files(
    const std::string& dir, const std::optional<std::map<std::string, std::string>>& map) {
  std::vector<std::string> paths;
  if (map) {
    std::set<std::string> files;
    for (const auto& [key, file] : *map) {
      DTENSOR_CHECK(fs::exists(fs::path(dir) / file),
                    "checkpoint: {}: file {} is missing (the index lists '{}' in it)", dir, file,
                    key);
      files.insert(file);
    }
    for (const std::string& file : files) {
      paths.push_back((fs::path(dir) / file).string());
    }
    return paths;
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      paths.push_back(e.path().string());
    }
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

// Every tensor the index names is in the file it names.
void check_weight_map(const std::string& dir, const CheckpointIndex& index,
                      const std::map<std::string, std::string>& map) {
  std::map<std::string, std::set<std::string>> keys_of; // file -> its tensors
  for (const auto& f : index.files) {
    for (const auto& c : f.chunks) {
      keys_of[fs::path(f.path).filename().string()].insert(c.key);
    }
  }
  for (const auto& [key, file] : map) {
    DTENSOR_CHECK(keys_of[file].count(key) > 0,
                  "checkpoint: {}: {} has no tensor '{}' (the index lists it there)", dir, file,
                  key);
  }
}

} // namespace

CheckpointIndex read_checkpoint(const std::string& dir) {
  DTENSOR_CHECK(fs::is_directory(dir), "checkpoint: no checkpoint at {} (not a directory)", dir);
  CheckpointIndex index;
  index.dir = dir;
  const std::optional<std::map<std::string, std::string>> weight_map = hf_weight_map(dir);
  const std::vector<std::string> paths = checkpoint_files(dir, weight_map);
  DTENSOR_CHECK(!paths.empty(), "checkpoint: no .safetensors files in {}", dir);
  std::set<std::string> present;
  for (const std::string& p : paths) {
    index.files.push_back(safetensors::read_index(p));
    present.insert(fs::path(p).filename().string());
  }
  if (weight_map) {
    check_weight_map(dir, index, *weight_map);
  }
  for (const auto& f : index.files) {
    for (const std::string& listed : f.listed_files) {
      DTENSOR_CHECK(present.count(listed) > 0, "checkpoint: {}: file {} is missing (listed by {})",
                    dir, listed, f.path);
    }
  }
  for (size_t fi = 0; fi < index.files.size(); ++fi) {
    const auto& file = index.files[fi];
    for (size_t ci = 0; ci < file.chunks.size(); ++ci) {
      const safetensors::Chunk& c = file.chunks[ci];
      auto [it, fresh] = index.tensors.try_emplace(c.key);
      StoredTensor& t = it->second;
      if (fresh) {
        t.dtype = c.dtype;
        t.shape.assign(c.shape.size(), 0);
      }
      DTENSOR_CHECK(t.dtype == c.dtype && t.shape.size() == c.shape.size(),
                    "checkpoint: {}: tensor '{}' is {}[{}-dim] here but {}[{}-dim] in another file",
                    file.path, c.key, c10::toString(c.dtype), c.shape.size(),
                    c10::toString(t.dtype), t.shape.size());
      for (size_t d = 0; d < c.shape.size(); ++d) {
        t.shape[d] = std::max(t.shape[d], c.offsets[d] + c.shape[d]);
      }
      t.chunks.emplace_back(fi, ci);
    }
  }
  return index;
}

std::string stacked_name(const std::string& pattern, int64_t index) {
  const size_t at = pattern.find("{}");
  DTENSOR_CHECK(at != std::string::npos && pattern.find("{}", at + 2) == std::string::npos,
                "checkpoint: stacked name pattern '{}' must hold exactly one {{}}", pattern);
  return pattern.substr(0, at) + std::to_string(index) + pattern.substr(at + 2);
}

void add_stacked(CheckpointIndex& index, const std::string& key, const std::string& pattern,
                 int64_t rows) {
  DTENSOR_CHECK(index.tensors.count(key) == 0,
                "checkpoint: {}: '{}' is stored as one tensor, not as the stacked '{}'", index.dir,
                key, pattern);
  StoredTensor stacked;
  for (int64_t i = 0; i < rows; ++i) {
    const std::string name = stacked_name(pattern, i);
    auto it = index.tensors.find(name);
    DTENSOR_CHECK(it != index.tensors.end(),
                  "checkpoint: {} has no tensor '{}' (row {} of '{}', {} rows)", index.dir, name, i,
                  key, rows);
    const StoredTensor& row = it->second;
    if (i == 0) {
      stacked.dtype = row.dtype;
      stacked.shape = row.shape;
      stacked.shape.insert(stacked.shape.begin(), rows);
    }
    DTENSOR_CHECK(row.dtype == stacked.dtype &&
                      std::equal(row.shape.begin(), row.shape.end(), stacked.shape.begin() + 1,
                                 stacked.shape.end()),
                  "checkpoint: {}: '{}' is {}{} but row 0 of '{}' is {}{}", index.dir, name,
                  c10::toString(row.dtype), row.shape, key, c10::toString(stacked.dtype),
                  std::vector<int64_t>(stacked.shape.begin() + 1, stacked.shape.end()));
    for (const auto& [fi, ci] : row.chunks) {
      safetensors::Chunk deeper = index.files[fi].chunks[ci];
      deeper.key = key;
      deeper.shape.insert(deeper.shape.begin(), 1);
      deeper.offsets.insert(deeper.offsets.begin(), i);
      auto& chunks = index.files[fi].chunks;
      chunks.push_back(std::move(deeper));
      stacked.chunks.emplace_back(fi, chunks.size() - 1);
    }
  }
  index.tensors.emplace(key, std::move(stacked));
}

void check_coverage(const CheckpointIndex& index, const std::string& key) {
  const StoredTensor& t = index.tensors.at(key);
  int64_t covered = 0;
  std::vector<std::string> where;
  for (const auto& [fi, ci] : t.chunks) {
    covered += elements_of(index.files[fi].chunks[ci].shape);
    where.push_back(fs::path(index.files[fi].path).filename().string());
  }
  DTENSOR_CHECK(
      covered == elements_of(t.shape),
      "checkpoint: {}: the chunks of tensor '{}' (in {}) hold {} elements of its {} (shape "
      "{}): a file is missing or chunks overlap",
      index.dir, key, where, covered, elements_of(t.shape), t.shape);
}

const safetensors::MappedFile& MappedFiles::get(size_t file) {
  if (!maps_[file]) {
    maps_[file] = std::make_unique<safetensors::MappedFile>(index_->files[file].path);
  }
  return *maps_[file];
}

namespace {

// The ranges (start, length) of each dimension where a stored chunk overlaps the box
// (offset, shape), in global coordinates; nullopt when they do not overlap.
using Ranges = std::vector<std::pair<int64_t, int64_t>>;
std::optional<Ranges> overlap(const safetensors::Chunk& c, const std::vector<int64_t>& offset,
                              const std::vector<int64_t>& shape) {
  Ranges out;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t lo = std::max(c.offsets[d], offset[d]);
    const int64_t hi = std::min(c.offsets[d] + c.shape[d], offset[d] + shape[d]);
    if (hi <= lo) {
      return std::nullopt;
    }
    out.emplace_back(lo, hi - lo);
  }
  return out;
}

// `t` (whose element 0 sits at global `origin`) cut to the global ranges.
at::Tensor cut(at::Tensor t, const std::vector<int64_t>& origin, const Ranges& ranges) {
  for (size_t d = 0; d < ranges.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), ranges[d].first - origin[d], ranges[d].second);
  }
  return t;
}

// The fill of a piece at a coordinate off 0 of a Partial mesh dimension, if any.
std::optional<double> partial_fill(const DTensorSpec& spec) {
  const auto coord = spec.mesh.get_coordinate();
  for (size_t d = 0; d < spec.placements.size(); ++d) {
    const Placement& p = spec.placements[d];
    if (p.is_partial() && coord && (*coord)[d] != 0) {
      if (p.is_norm_partial() || p.reduce_op() == ReduceOp::Sum) {
        return 0.0;
      }
      if (p.reduce_op() == ReduceOp::Product) {
        return 1.0;
      }
    }
  }
  return std::nullopt;
}

} // namespace

at::Tensor assemble(const CheckpointIndex& index, const std::string& key, MappedFiles& files) {
  const StoredTensor& t = index.tensors.at(key);
  at::Tensor full = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  const std::vector<int64_t> zero(t.shape.size(), 0);
  for (const auto& [fi, ci] : t.chunks) {
    const safetensors::Chunk& c = index.files[fi].chunks[ci];
    if (auto ranges = overlap(c, zero, t.shape)) {
      at::Tensor src = safetensors::chunk_tensor(files.get(fi), index.files[fi], c);
      cut(full, zero, *ranges).copy_(cut(src, c.offsets, *ranges));
    }
  }
  return full;
}

LoadPlan plan_reads(const StateDict& state, const std::string& dir, bool verify,
                    const std::map<std::string, std::string>& stacked, bool convert_dtype) {
  LoadPlan plan;
  plan.index = std::make_unique<CheckpointIndex>(read_checkpoint(dir));
  for (const auto& [key, pattern] : stacked) {
    const at::Tensor* found = state.find(key);
    DTENSOR_CHECK(found != nullptr, "checkpoint::load: stacked name '{}' is not in the state", key);
    const at::Tensor& t = *found;
    const DTensorMeta* m = dtensor_meta(t);
    const std::vector<int64_t> shape = m ? m->spec.shape : t.sizes().vec();
    DTENSOR_CHECK(!shape.empty(), "checkpoint::load: stacked '{}' is a scalar", key);
    add_stacked(*plan.index, key, pattern, shape[0]);
  }
  plan.files = std::make_unique<MappedFiles>(*plan.index);
  const CheckpointIndex& index = *plan.index;
  for (const auto& item : state) {
    const std::string& key = item.key();
    const at::Tensor& t = item.value();
    const DTensorMeta* m = dtensor_meta(t);
    const std::vector<int64_t> shape = m ? m->spec.shape : t.sizes().vec();
    auto it = index.tensors.find(key);
    DTENSOR_CHECK(it != index.tensors.end(),
                  "checkpoint::load: {} has no tensor '{}' ({} tensors in {} files)", dir, key,
                  index.tensors.size(), index.files.size());
    const StoredTensor& stored = it->second;
    const std::string file0 = index.files[stored.chunks[0].first].path;
    const bool both_floating =
        c10::isFloatingType(stored.dtype) && c10::isFloatingType(t.scalar_type());
    DTENSOR_CHECK(stored.dtype == t.scalar_type() || (convert_dtype && both_floating),
                  "checkpoint::load: {}: '{}' is {} but the target is {}{}", file0, key,
                  c10::toString(stored.dtype), c10::toString(t.scalar_type()),
                  convert_dtype ? " (only floating dtypes convert)"
                                : " (LoadOptions().convert_dtype(true) converts floating dtypes)");
    DTENSOR_CHECK(stored.shape == shape,
                  "checkpoint::load: {}: '{}' has shape {} but the target has {}", file0, key,
                  stored.shape, shape);
    check_coverage(index, key);
    at::Tensor local = m ? m->local : t;
    if (m) {
      if (auto fill = partial_fill(m->spec)) {
        plan.fills.emplace_back(local, *fill);
        continue;
      }
    }
    const std::vector<int64_t> offset =
        m ? m->spec.local_offset() : std::vector<int64_t>(shape.size(), 0);
    const std::vector<int64_t> local_shape = local.sizes().vec();
    if (elements_of(local_shape) == 0 && !local_shape.empty()) {
      continue;
    }
    for (const auto& [fi, ci] : stored.chunks) {
      const safetensors::Chunk& c = index.files[fi].chunks[ci];
      if (auto ranges = overlap(c, offset, local_shape)) {
        const at::Tensor src =
            safetensors::chunk_tensor(plan.files->get(fi), index.files[fi], c, verify);
        plan.copies.emplace_back(cut(local, offset, *ranges), cut(src, c.offsets, *ranges));
      }
    }
  }
  return plan;
}

void execute_reads(const LoadPlan& plan) {
  for (const auto& [dst, src] : plan.copies) {
    at::Tensor d = dst;
    d.copy_(src);
  }
  for (const auto& [dst, value] : plan.fills) {
    at::Tensor d = dst;
    d.fill_(value);
  }
}

} // namespace dtensor::detail
