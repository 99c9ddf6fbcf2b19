#pragma once

// Which rank writes which chunk, and which stored chunks each rank reads
// (lib/checkpoint/checkpoint.cpp drives them; see docs/checkpoint.md).
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <dtensor/dtensor_spec.h>
#include <dtensor/state_dict.h>

#include "checkpoint/safetensors.h"

namespace dtensor::detail {

// ---- saving ---------------------------------------------------------------------------

struct SavedTensor {
  std::string key;
  at::Tensor local;           // this rank's data
  std::vector<int64_t> shape; // global
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::optional<DTensorSpec> spec; // DTensors only
};

// The entries of `state`, checked (dtypes safetensors can hold); no communication.
std::vector<SavedTensor> saved_tensors(const StateDict& state);
// Partial DTensors reduced to Replicate on those mesh dimensions (collective over their meshes).
void reduce_partials(std::vector<SavedTensor>& tensors);

struct WriteChunk {
  size_t tensor = 0;            // index into the SavedTensor list
  std::vector<int64_t> offsets; // global offsets of the writer's local piece
};

// A name some rank passes, as the ranks holding it agree it is.
struct PlannedTensor {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape; // global
};

struct WritePlan {
  std::vector<std::vector<WriteChunk>> chunks; // per rank
  std::vector<int> writers;                    // ranks with at least one chunk, ascending
  // Every name, in the order of first appearance (rank 0's list, then what rank 1 adds, ...).
  std::vector<PlannedTensor> tensors;
};

// Collective over the world (two all-gathers of a few bytes per tensor): every rank
// describes its pieces (name, dtype, global shape, offsets and shape of its piece; Partial
// pieces as if reduced). Every name some rank passes is saved ([Note: names held by some
// ranks] in layout.cpp): when the ranks holding it agree on its dtype and global shape and
// their pieces cover it, each distinct non-empty piece is given to one of the ranks holding
// it, the one with the fewest bytes so far (the same decision on every rank). Pieces are
// matched by name and offsets, as PyTorch's DCP does, so DTensors on sub-meshes (each rank
// its own) dedup like any other. Otherwise every rank throws naming the name and the ranks.
WritePlan plan_writes(const std::vector<SavedTensor>& tensors, const std::string& what);

// The local piece as a contiguous CPU tensor.
at::Tensor chunk_data(const SavedTensor& tensor);

// ---- loading --------------------------------------------------------------------------

struct StoredTensor {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;                    // global: the chunks' largest extents
  std::vector<std::pair<size_t, size_t>> chunks; // (file, chunk) indices
};

struct CheckpointIndex {
  std::string dir;
  std::vector<safetensors::FileIndex> files;
  std::map<std::string, StoredTensor> tensors;
};

// Every .safetensors file's header in `dir`; a file that another lists but that is missing,
// or chunks of one name with different dtypes, are errors naming them.
CheckpointIndex read_checkpoint(const std::string& dir);
// `pattern` with its "{}" replaced by `index` ([Note: stacked names] in dtensor/checkpoint.h);
// throws unless the pattern holds exactly one "{}".
std::string stacked_name(const std::string& pattern, int64_t index);
// Adds to `index` the tensor `key` whose row i is the stored tensor stacked_name(pattern, i),
// for i < rows: each of their chunks once more, one dimension deeper (the same bytes). Throws
// naming the first one missing, or `key` if it is stored already.
void add_stacked(CheckpointIndex& index, const std::string& key, const std::string& pattern,
                 int64_t rows);
// Throws naming the key and its files unless its chunks tile its global shape exactly.
void check_coverage(const CheckpointIndex& index, const std::string& key);

// The checkpoint's files, mapped on first use.
class MappedFiles {
 public:
  explicit MappedFiles(const CheckpointIndex& index) : index_(&index), maps_(index.files.size()) {}
  const safetensors::MappedFile& get(size_t file);

 private:
  const CheckpointIndex* index_;
  std::vector<std::unique_ptr<safetensors::MappedFile>> maps_;
};

// A stored tensor's full value (checksums verified).
at::Tensor assemble(const CheckpointIndex& index, const std::string& key, MappedFiles& files);

struct LoadPlan {
  std::unique_ptr<CheckpointIndex> index;
  std::unique_ptr<MappedFiles> files;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies; // (destination view, source view)
  std::vector<std::pair<at::Tensor, double>> fills;      // Partial pieces off coordinate 0
};

// Checks everything (keys, shapes, dtypes, coverage, hashes of the chunks to read unless
// !verify) before anything is written; throws naming the file and the key. With
// `convert_dtype`, a stored floating dtype may differ from the target's (converted on copy).
LoadPlan plan_reads(const StateDict& state, const std::string& dir, bool verify,
                    const std::map<std::string, std::string>& stacked = {},
                    bool convert_dtype = false);
void execute_reads(const LoadPlan& plan);

} // namespace dtensor::detail
