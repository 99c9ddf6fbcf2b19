#pragma once

// Distributed checkpoints in PyTorch DCP's Hugging Face safetensors layout (docs/checkpoint.md).
//
//   auto state = dtensor::get_model_state_dict(model);
//   for (auto& item : dtensor::get_optimizer_state_dict(model, opt)) state.insert(item.key(),
//   item.value()); state.insert("step", at::scalar_tensor(step, at::kLong));
//   dtensor::checkpoint::save(state, "ckpt/step-100");
//   ...
//   dtensor::checkpoint::load(state, "ckpt/step-100");   // any mesh, any placements
//   dtensor::set_model_state_dict(model, state);  dtensor::set_optimizer_state_dict(model, opt,
//   state);
//
// A checkpoint is a directory of files `shard-<rank+1>-model-00001-of-00001.safetensors`,
// one per rank that owns data; each chunk's global offsets are in the header, so
// torch.distributed.checkpoint.load(..., storage_reader=HuggingFaceStorageReader(dir)) reads it
// into any PyTorch layout, and load() reads what PyTorch's HuggingFaceStorageWriter writes.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>

#include <dtensor/state_dict.h>

namespace dtensor::checkpoint {

// [Note: stacked names] A tensor stored as one tensor per index of its dim 0, as Hugging
// Face's checkpoints store a mixture of experts' weights (one [F, D] tensor per expert where
// the model holds [E, F, D]): the tensor's key -> the stored names, "{}" standing for the
// index ("model.layers.1.mlp.experts.{}.gate_proj.weight"). load() reads such a tensor from
// the stored ones, each rank only the rows of its own piece; consolidate() writes one as them.
using StackedNames = std::map<std::string, std::string>;

struct SaveOptions {
  // An XXH3-64 hash of every chunk in the header (dtensor_xxh3; PyTorch ignores it), checked by
  // load.
  TORCH_ARG(bool, checksums) = true;
  // fsync every file and the directory before the checkpoint becomes visible.
  TORCH_ARG(bool, fsync) = true;
  // Replace whatever is at `dir` (a foreign directory's whole content, a file), not only a
  // complete dtensor checkpoint or an empty directory ("What a save replaces" below).
  TORCH_ARG(bool, overwrite) = false;
};

struct SaveResult {
  std::string file;       // this rank's file ("" when it owns no chunk)
  int64_t data_bytes = 0; // tensor bytes this rank wrote
  int64_t file_bytes = 0; // its file's size (headers included)
};

// Collective over all ranks, each passing the same names with the same global shapes, dtypes
// and layouts. Every rank writes only the chunks it holds, each distinct chunk once (a chunk
// replicated over several ranks is written by one of them, balancing bytes); Partial
// DTensors are reduced first. Plain tensors (0-dim ones for scalars such as a step counter)
// count as replicated on every rank. The files go to a temporary directory next to `dir`,
// which replaces `dir` by one atomic rename once every rank's files are synced: a failed or
// killed save leaves the previous checkpoint in `dir` untouched.
//
// What a save replaces (docs/checkpoint.md): `dir` may be absent (its parents are created),
// an empty directory, or a complete checkpoint or export dtensor published (its manifest,
// `.dtensor-manifest.json`, lists every entry: nothing was added or removed since). Anything
// else there (a file, a directory holding other entries, a damaged checkpoint) is refused on
// every rank before anything is written, naming the path and what is there, unless
// `SaveOptions().overwrite(true)`. A symbolic link at `dir` is followed: the checkpoint goes
// where it points and the link stays. The file system's root, the home directory and the
// current directory or one above it are never replaced. One save into a target at a time: a
// second one (another job) is refused while the first is in progress.
SaveResult save(const StateDict& state, const std::string& dir, const SaveOptions& options = {});

// save() with the writing in the background ([Note: asynchronous save] in
// lib/checkpoint/checkpoint.cpp), as torchtitan's async checkpointing: the call plans the
// save and copies this rank's chunks to host memory, then returns; `state` may change from
// then on. A background thread writes the files and publishes the checkpoint atomically. At
// most one save is in flight: a new async_save first waits for the previous one. Collective
// like save(); every rank must wait() (or start the next async_save) before the process
// ends. A failed write raises from wait() on every rank and leaves the previous checkpoint
// in `dir` untouched.
class AsyncSave {
 public:
  // Whether the background write has finished (successfully or not).
  bool done() const;
  // Blocks until it has; returns save()'s result or raises its error (the same on every rank).
  SaveResult wait();

  struct State;

 private:
  std::shared_ptr<State> state_;
  friend AsyncSave async_save(const StateDict&, const std::string&, const SaveOptions&);
};
AsyncSave async_save(const StateDict& state, const std::string& dir,
                     const SaveOptions& options = {});

// Fills the tensors of `state` in place from the checkpoint in `dir`, whatever layout wrote
// it: each rank reads the parts of the stored chunks that overlap its own piece (other world
// size, mesh shape, placements, uneven shards). No communication beyond agreeing on errors.
// Every name of `state` must be in the checkpoint with the same global shape and dtype (names
// the checkpoint has beyond them are ignored). A missing, truncated or corrupt file, a missing
// key, a chunk not covering its tensor or a shape or dtype mismatch is an error naming the file
// and the key, raised on every rank before any tensor is written.
struct LoadOptions {
  // Check each chunk's hash (when the file has them) before anything is written. Off: a
  // corrupt chunk loads silently (as with PyTorch's readers), about 1.3x faster from the
  // page cache.
  TORCH_ARG(bool, verify) = true;
  // Names of `state` read from one stored tensor per index of dim 0 ([Note: stacked names]):
  // pattern(0) ... pattern(n - 1) for a target of n rows, each with the target's other
  // dimensions; one missing is an error naming it.
  TORCH_ARG(StackedNames, stacked) = {};
  // Read a stored floating dtype into a target of another (a bfloat16 Hugging Face checkpoint
  // into a float32 model), converted as each piece is copied; other mismatches stay errors.
  TORCH_ARG(bool, convert_dtype) = false;
};
void load(const StateDict& state, const std::string& dir, const LoadOptions& options = {});

struct TensorInfo {
  std::string key;
  c10::ScalarType dtype;
  std::vector<int64_t> shape; // global
  int64_t chunks = 0;
};

// What a checkpoint holds, by name (reads the headers only; not collective).
std::vector<TensorInfo> read_metadata(const std::string& dir);

struct ConsolidateOptions {
  // Names starting with one of these are left out (by default the optimizer's state).
  TORCH_ARG(std::vector<std::string>, exclude_prefixes) = std::vector<std::string>{"state.",
                                                                                   "param_groups."};
  // Further files written into `out` beside the weights, by name, before it is published
  // (a Hugging Face config.json).
  using Files = std::map<std::string, std::string>; // name -> content
  TORCH_ARG(Files, extra_files) = {};
  // As SaveOptions::overwrite: replace whatever is at `out`.
  TORCH_ARG(bool, overwrite) = false;
  // Tensors written as one tensor per index of dim 0 ([Note: stacked names]), under the
  // pattern's names instead of their own.
  TORCH_ARG(StackedNames, unstack) = {};
};

// Writes the full (unsharded) tensors of the checkpoint in `dir` as one Hugging Face-style
// file `out/model-00001-of-00001.safetensors` plus `out/model.safetensors.index.json`, one
// tensor in memory at a time. Not collective: run it on one process. `out` is replaced as
// save() replaces its `dir`; it may not be `dir` itself.
void consolidate(const std::string& dir, const std::string& out,
                 const ConsolidateOptions& options = {});

struct HfSaveOptions {
  using Files = std::map<std::string, std::string>; // name -> content

  // The largest weights file, in bytes: tensors go into files in order, a new file when the
  // next would pass this size (one larger than it gets a file of its own), as transformers'
  // save_pretrained(max_shard_size=...), whose default (50 GB) this is.
  TORCH_ARG(int64_t, max_shard_bytes) = 50'000'000'000;
  // Further files written beside the weights, by name (config.json, tokenizer files).
  TORCH_ARG(Files, extra_files) = {};
  // Tensors written as one tensor per index of dim 0 ([Note: stacked names]).
  TORCH_ARG(StackedNames, unstack) = {};
  // As SaveOptions.
  TORCH_ARG(bool, overwrite) = false;
  TORCH_ARG(bool, fsync) = true;
};

// Writes `state` (any layouts, names as they are to be stored) as a Hugging Face model
// folder: `dir/model.safetensors`, or `model-0000k-of-0000n.safetensors` files with
// `model.safetensors.index.json` when they pass max_shard_bytes, plus the extra files. Every
// rank writes the bytes of the chunks save() would give it straight into their place in the
// files ([Note: Hugging Face export in place] in lib/checkpoint/hf_save.cpp): nothing is
// gathered, no rank holds more than its own pieces. Published atomically under save()'s rules
// for what may be replaced. Collective over all ranks.
void save_hf(const StateDict& state, const std::string& dir, const HfSaveOptions& options = {});

// Raises the error save(dir, SaveOptions().overwrite(overwrite)) would raise because of
// what is at `dir`, before anything is written (save checks again). Not collective.
void check_target(const std::string& dir, bool overwrite = false);

// Whether `dir` holds a complete checkpoint or export that dtensor published (its manifest
// lists every entry, each present). Not collective.
bool is_complete(const std::string& dir);

// Deletes `dir` if it holds a complete checkpoint or export dtensor published (first renamed
// aside, so that it never looks complete while half deleted); otherwise raises, naming what
// is there, and deletes nothing. Not collective.
void remove(const std::string& dir);

} // namespace dtensor::checkpoint
