// dtensor::checkpoint::save / load / consolidate (include/dtensor/checkpoint.h).
#include <dtensor/checkpoint.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "checkpoint/layout.h"
#include "checkpoint/prepared.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/target.h"
#include "internal/check.h"
#include "mesh/agree.h"
#include "mesh/process_group_state.h"
#include "tensor/dtensor_impl.h"

namespace dtensor::checkpoint {

namespace fs = std::filesystem;
namespace st = detail::safetensors;
using detail::attempt;

namespace {

// [Note: atomic checkpoints] The files are written into a hidden sibling of the target
// directory; once every rank has written and synced its file, rank 0 writes the manifest,
// syncs that directory and exchanges it with the target in one renameat2(RENAME_EXCHANGE)
// (a plain rename when there is nothing there), then removes what it replaced. A reader sees
// the old checkpoint or the new one, never a mixture; a rank failing or killed before the
// exchange leaves only the hidden directory behind, which the next save clears. What may be
// replaced at all: [Note: what a save may replace] (target.cpp).

// [Note: checkpoint fault injection] DTENSOR_CHECKPOINT_FAULT="<rank>:<throw|exit>" makes
// that rank fail right after writing its file, before the checkpoint is published: by an
// exception (the other ranks learn of it when agreeing) or by _exit (a killed process). The
// fault tests (test_checkpoint, test/checkpoint_driver.py) use it; nothing else sets it.
void injected_fault(int rank) {
  const char* spec = std::getenv("DTENSOR_CHECKPOINT_FAULT");
  if (spec == nullptr) {
    return;
  }
  const std::string s(spec);
  const auto colon = s.find(':');
  if (colon == std::string::npos || std::stoi(s.substr(0, colon)) != rank) {
    return;
  }
  if (s.substr(colon + 1) == "exit") {
    std::_Exit(17);
  }
  DTENSOR_FAIL("injected fault on rank {} (DTENSOR_CHECKPOINT_FAULT)", rank);
}

std::string file_name(int rank) {
  return fmt::format("shard-{:05d}-model-00001-of-00001.safetensors", rank + 1);
}

// An absolute, normalised path without a trailing separator ("ckpt/" names "ckpt").
fs::path checkpoint_path(const std::string& name) {
  fs::path p = fs::absolute(name).lexically_normal();
  return p.filename().empty() ? p.parent_path() : p;
}

// This rank's chunks of the plan, ready to write: their header items and data. `copy`:
// the data are copies in host memory, so that the state may change while they are written
// ([Note: asynchronous save]); otherwise they may view the state's own CPU tensors.
struct Staged {
  std::vector<st::Item> items;
  std::vector<at::Tensor> data;
  std::vector<std::string> listed_files;
  int64_t data_bytes = 0;
};

Staged stage_own_chunks(const std::vector<detail::SavedTensor>& tensors,
                        const detail::WritePlan& plan, const SaveOptions& options, bool copy) {
  Staged staged;
  for (const detail::WriteChunk& c : plan.chunks[static_cast<size_t>(get_rank())]) {
    at::Tensor d = detail::chunk_data(tensors[c.tensor]);
    staged.data.push_back(copy ? d.clone() : d);
    st::Item item{tensors[c.tensor].key, d.scalar_type(), d.sizes().vec(), c.offsets, {}};
    if (options.checksums()) {
      item.hash = st::hash_of(d.data_ptr(), static_cast<int64_t>(d.nbytes()));
    }
    staged.data_bytes += static_cast<int64_t>(d.nbytes());
    staged.items.push_back(std::move(item));
  }
  for (int r : plan.writers) {
    staged.listed_files.push_back(file_name(r));
  }
  return staged;
}

// This rank's file, written into `tmp` (nothing when it owns no chunk).
SaveResult write_staged(const Staged& staged, const fs::path& tmp, const fs::path& dir,
                        const SaveOptions& options) {
  SaveResult result;
  if (staged.items.empty()) {
    return result;
  }
  const int rank = get_rank();
  st::WriteOptions wo;
  wo.listed_files = staged.listed_files;
  wo.fsync = options.fsync();
  result.data_bytes = staged.data_bytes;
  result.file = (dir / file_name(rank)).string();
  result.file_bytes = st::write_file((tmp / file_name(rank)).string(), staged.items,
                                     [&](size_t i) { return staged.data[i]; }, wo);
  return result;
}

// Writes the staged file, agrees over `group` and publishes: the part of a save after the
// data are staged (on the caller's thread for save, in the background for async_save).
SaveResult write_and_publish(const Staged& staged, const detail::PreparedSave& p,
                             const SaveOptions& options, const Group& group) {
  const int rank = get_rank();
  const std::string what = p.api + "(" + p.target.name + ")";
  SaveResult result;
  std::string error = attempt([&] {
    result = write_staged(staged, p.tmp, p.target.dir, options);
    injected_fault(rank);
  });
  const auto discard = [&] { // rank 0: the new files, never published
    if (rank == 0) {
      std::error_code ignored;
      fs::remove_all(p.tmp, ignored);
    }
  };
  if (!error.empty()) {
    discard();
  }
  detail::agree_on_errors(what + ": writing", error, group);
  error = attempt([&] {
    if (rank == 0) {
      detail::write_manifest(p.tmp, detail::OutputKind::kCheckpoint, staged.listed_files,
                             options.fsync());
      detail::publish(p.tmp, p.target, options.overwrite(), options.fsync(), "");
    }
  });
  if (!error.empty()) {
    discard();
  }
  detail::agree_on_errors(what + ": publishing", error, group);
  return result;
}

} // namespace

} // namespace dtensor::checkpoint

namespace dtensor::detail {

PreparedSave prepare_save(const StateDict& state, const std::string& dir_name, bool overwrite,
                          const char* api) {
  const Group world = world_group();
  PreparedSave p;
  p.api = api;
  std::string what = p.api + "(" + dir_name + ")";
  std::string error = attempt([&] {
    p.target = resolve_target(dir_name);
    what = p.api + "(" + p.target.name + ")";
    p.tmp = temp_dir_of(p.target.dir);
    if (get_rank() == 0) { // nothing is written before the target is known replaceable
      check_replaceable(p.target, overwrite, ""); // agreement names the call
      fs::create_directories(p.target.dir.parent_path());
      p.lock = std::make_shared<TargetLock>(p.target.dir, "");
    }
    p.tensors = saved_tensors(state);
  });
  agree_on_errors(what, error, world);
  p.plan = plan_writes(p.tensors, what);
  reduce_partials(p.tensors);
  error = attempt([&] {
    if (get_rank() == 0) {
      make_temp_dir(p.tmp);
    }
  });
  agree_on_errors(what + ": preparing " + p.tmp.string(), error, world);
  return p;
}

} // namespace dtensor::detail

namespace dtensor::checkpoint {

// [Note: asynchronous save] As torchtitan's async checkpointing (DCP's async_save): the
// caller's thread plans the save, reduces Partial pieces and copies this rank's chunks to
// host memory (collectives of the training's own communicators, in step with every rank);
// a background thread then writes the file, agrees and publishes atomically, its
// collectives on a communicator of its own ([Note: background groups]) so that they never
// interleave with the training's. At most one save is in flight: a new one (save or
// async_save) first waits for the previous. A failed or killed background write leaves the
// previous checkpoint in place.
struct AsyncSave::State {
  std::thread worker;
  SaveResult result;
  std::string error;
  std::atomic<bool> finished{false};
};

namespace {

std::mutex& in_flight_mutex() {
  static std::mutex m;
  return m;
}

std::shared_ptr<AsyncSave::State>& in_flight() {
  static std::shared_ptr<AsyncSave::State> s;
  return s;
}

// Joins the save in flight, if any; its outcome is its handle's to report.
void wait_for_in_flight() {
  std::lock_guard<std::mutex> lock(in_flight_mutex());
  if (auto previous = in_flight(); previous != nullptr && previous->worker.joinable()) {
    previous->worker.join();
  }
}

const Group& background_group() {
  static const Group g = detail::new_background_group("checkpoint");
  return g;
}

} // namespace

SaveResult save(const StateDict& state, const std::string& dir_name, const SaveOptions& options) {
  at::NoGradGuard no_grad;
  wait_for_in_flight();
  const detail::PreparedSave p =
      detail::prepare_save(state, dir_name, options.overwrite(), "checkpoint::save");
  return write_and_publish(stage_own_chunks(p.tensors, p.plan, options, /*copy=*/false), p, options,
                           world_group());
}

bool AsyncSave::done() const {
  return state_ == nullptr || state_->finished.load();
}

SaveResult AsyncSave::wait() {
  DTENSOR_CHECK(state_ != nullptr,
                "checkpoint::AsyncSave::wait: no save (default-constructed or already waited for)");
  std::shared_ptr<State> s = std::move(state_);
  {
    std::lock_guard<std::mutex> lock(in_flight_mutex());
    if (s->worker.joinable()) {
      s->worker.join();
    }
    if (in_flight() == s) {
      in_flight().reset();
    }
  }
  DTENSOR_CHECK(s->error.empty(), "{}", s->error);
  return s->result;
}

AsyncSave async_save(const StateDict& state, const std::string& dir_name,
                     const SaveOptions& options) {
  at::NoGradGuard no_grad;
  wait_for_in_flight();
  const Group& group = background_group();
  auto p = std::make_shared<detail::PreparedSave>(
      detail::prepare_save(state, dir_name, options.overwrite(), "checkpoint::async_save"));
  auto staged =
      std::make_shared<Staged>(stage_own_chunks(p->tensors, p->plan, options, /*copy=*/true));
  p->tensors.clear(); // the staged copies are what is written
  auto s = std::make_shared<AsyncSave::State>();
  s->worker = std::thread([s, staged, p, options, group] {
    s->error = attempt([&] { s->result = write_and_publish(*staged, *p, options, group); });
    s->finished = true;
  });
  {
    std::lock_guard<std::mutex> lock(in_flight_mutex());
    in_flight() = s;
  }
  AsyncSave handle;
  handle.state_ = s;
  return handle;
}

void load(const StateDict& state, const std::string& dir_name, const LoadOptions& options) {
  at::NoGradGuard no_grad;
  const fs::path dir = checkpoint_path(dir_name);
  detail::LoadPlan plan;
  const std::string error = attempt([&] {
    plan = detail::plan_reads(state, dir.string(), options.verify(), options.stacked(),
                              options.convert_dtype());
  });
  detail::agree_on_errors("checkpoint::load(" + dir.string() + ")", error, world_group());
  detail::execute_reads(plan);
}

std::vector<TensorInfo> read_metadata(const std::string& dir) {
  const detail::CheckpointIndex index = detail::read_checkpoint(checkpoint_path(dir).string());
  std::vector<TensorInfo> out;
  for (const auto& [key, entry] : index.tensors) {
    out.push_back({key, entry.dtype, entry.shape, static_cast<int64_t>(entry.chunks.size())});
  }
  return out;
}

namespace {

// consolidate's files, written into `tmp`: the weights, their index, the extra files and the
// manifest listing them.
// An item of the export: a stored tensor, or row `row` of one ([Note: stacked names]).
struct ExportSource {
  std::string key;
  int64_t row = -1;
};

void write_export(const detail::CheckpointIndex& index, const std::vector<st::Item>& items,
                  const std::vector<ExportSource>& sources, const fs::path& tmp,
                  const ConsolidateOptions& options) {
  const std::string name = "model-00001-of-00001.safetensors";
  detail::MappedFiles files(index);
  st::WriteOptions wo;
  wo.sharding_info = false;
  // The rows of an unstacked tensor come one after another: it is assembled once for them.
  std::string held_key;
  at::Tensor held;
  auto data = [&](size_t i) {
    const ExportSource& source = sources[i];
    if (source.row < 0) {
      return detail::assemble(index, source.key, files);
    }
    if (held_key != source.key) {
      held = detail::assemble(index, source.key, files);
      held_key = source.key;
    }
    return held.select(0, source.row).contiguous();
  };
  st::write_file((tmp / name).string(), items, data, wo);
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (const st::Item& item : items) {
    weight_map[item.key] = name;
    total += static_cast<int64_t>(at::elementSize(item.dtype)) *
             c10::multiply_integers(item.shape.begin(), item.shape.end());
  }
  std::vector<std::string> written = {name, "model.safetensors.index.json"};
  detail::write_text_file(
      tmp / written[1],
      nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2),
      true);
  for (const auto& [file, content] : options.extra_files()) {
    DTENSOR_CHECK(!file.empty() && fs::path(file).filename() == file && file != detail::kManifest &&
                      std::find(written.begin(), written.end(), file) == written.end(),
                  "checkpoint::consolidate: extra file '{}' is not a plain file name of its own",
                  file);
    detail::write_text_file(tmp / file, content, true);
    written.push_back(file);
  }
  detail::write_manifest(tmp, detail::OutputKind::kHfExport, written, true);
}

} // namespace

void consolidate(const std::string& dir_name, const std::string& out_name,
                 const ConsolidateOptions& options) {
  at::NoGradGuard no_grad;
  const detail::Target out = detail::resolve_target(out_name);
  const std::string what = "checkpoint::consolidate(" + dir_name + ", " + out.name + ")";
  const fs::path source = checkpoint_path(dir_name);
  std::error_code ec;
  DTENSOR_CHECK(!fs::equivalent(source, out.dir, ec),
                "{}: the output would replace the checkpoint it is read from", what);
  detail::check_replaceable(out, options.overwrite(), what);
  const detail::CheckpointIndex index = detail::read_checkpoint(source.string());
  std::vector<st::Item> items;
  std::vector<ExportSource> sources;
  for (const auto& [key, entry] : index.tensors) {
    const bool excluded =
        std::any_of(options.exclude_prefixes().begin(), options.exclude_prefixes().end(),
                    [&](const std::string& p) { return key.rfind(p, 0) == 0; });
    if (excluded) {
      continue;
    }
    detail::check_coverage(index, key);
    auto stack = options.unstack().find(key);
    if (stack == options.unstack().end()) {
      items.push_back(
          {key, entry.dtype, entry.shape, std::vector<int64_t>(entry.shape.size(), 0), {}});
      sources.push_back({key, -1});
      continue;
    }
    DTENSOR_CHECK(!entry.shape.empty(), "{}: '{}' is a scalar: it has no rows to unstack", what,
                  key);
    const std::vector<int64_t> row(entry.shape.begin() + 1, entry.shape.end());
    for (int64_t r = 0; r < entry.shape[0]; ++r) {
      items.push_back({detail::stacked_name(stack->second, r),
                       entry.dtype,
                       row,
                       std::vector<int64_t>(row.size(), 0),
                       {}});
      sources.push_back({key, r});
    }
  }
  for (const auto& [key, pattern] : options.unstack()) {
    DTENSOR_CHECK(index.tensors.count(key) > 0, "{}: no tensor '{}' to unstack as '{}'", what, key,
                  pattern);
  }
  std::set<std::string> names;
  for (const st::Item& item : items) {
    DTENSOR_CHECK(names.insert(item.key).second, "{}: two tensors would be written as '{}'", what,
                  item.key);
  }
  fs::create_directories(out.dir.parent_path());
  const detail::TargetLock lock(out.dir, what);
  const fs::path tmp = detail::temp_dir_of(out.dir);
  detail::make_temp_dir(tmp);
  try {
    write_export(index, items, sources, tmp, options);
    detail::publish(tmp, out, options.overwrite(), true, what);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
}

void check_target(const std::string& dir, bool overwrite) {
  const detail::Target target = detail::resolve_target(dir);
  detail::check_replaceable(target, overwrite, "checkpoint::check_target(" + target.name + ")");
}

bool is_complete(const std::string& dir) {
  return detail::is_output(detail::resolve_target(dir).dir);
}

void remove(const std::string& dir) {
  const detail::Target target = detail::resolve_target(dir);
  const std::string what = "checkpoint::remove(" + target.name + ")";
  const detail::TargetLock lock(target.dir, what);
  std::string why;
  DTENSOR_CHECK(detail::is_output(target.dir, &why),
                "{}: it is {}, not a complete dtensor checkpoint; nothing was deleted", what, why);
  const fs::path aside = detail::temp_dir_of(target.dir);
  fs::remove_all(aside);
  fs::rename(target.dir, aside); // gone at once, never half deleted in place
  fs::remove_all(aside);
}

} // namespace dtensor::checkpoint
