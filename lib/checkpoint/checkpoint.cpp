// dtensor::checkpoint::save / load / consolidate (include/dtensor/checkpoint.h).
#include <dtensor/checkpoint.h>

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "checkpoint/layout.h"
#include "checkpoint/safetensors.h"
#include "internal/check.h"
#include "mesh/agree.h"
#include "mesh/process_group_state.h"
#include "tensor/dtensor_impl.h"

namespace dtensor::checkpoint {

namespace fs = std::filesystem;
namespace st = detail::safetensors;

namespace {

// [Note: atomic checkpoints] The files are written into a hidden sibling of the target
// directory; once every rank has written and synced its file, rank 0 syncs that directory
// and exchanges it with the target in one renameat2(RENAME_EXCHANGE) (a plain rename when
// there is no previous checkpoint), then removes the old one. A reader sees the old
// checkpoint or the new one, never a mixture; a rank failing or killed before the exchange
// leaves only the hidden directory behind, which the next save clears.
fs::path temp_dir_of(const fs::path& dir) {
  return dir.parent_path() / ("." + dir.filename().string() + ".dtensor-tmp");
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot open directory {}: {}", dir.string(),
                std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  DTENSOR_CHECK(rc == 0, "checkpoint: cannot sync directory {}: {}", dir.string(),
                std::strerror(errno));
}

void publish(const fs::path& tmp, const fs::path& dir, bool sync) {
  if (sync) {
    fsync_dir(tmp);
  }
  if (fs::exists(dir)) {
    DTENSOR_CHECK(::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0,
                  "checkpoint: cannot replace {} by {}: {}", dir.string(), tmp.string(),
                  std::strerror(errno));
    fs::remove_all(tmp); // now the previous checkpoint
  } else {
    fs::rename(tmp, dir);
  }
  if (sync) {
    fsync_dir(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
  }
}

// Runs `body`, turning a dtensor::Error or filesystem error into the text agree_on_errors takes.
template <class F>
std::string attempt(F&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

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
SaveResult write_and_publish(const Staged& staged, const fs::path& tmp, const fs::path& dir,
                             const SaveOptions& options, const Group& group) {
  const int rank = get_rank();
  SaveResult result;
  std::string error = attempt([&] {
    result = write_staged(staged, tmp, dir, options);
    injected_fault(rank);
  });
  if (!error.empty() && rank == 0) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
  }
  detail::agree_on_errors("checkpoint::save(" + dir.string() + "): writing", error, group);
  error = attempt([&] {
    if (rank == 0) {
      publish(tmp, dir, options.fsync());
    }
  });
  detail::agree_on_errors("checkpoint::save(" + dir.string() + "): publishing", error, group);
  return result;
}

// Everything before the write: the plan, Partial pieces reduced, the temporary directory
// made. Collective over the world.
struct Prepared {
  std::vector<detail::SavedTensor> tensors;
  detail::WritePlan plan;
  fs::path dir, tmp;
};

Prepared prepare_save(const StateDict& state, const std::string& dir_name) {
  const Group world = world_group();
  Prepared p;
  p.dir = checkpoint_path(dir_name);
  p.tmp = temp_dir_of(p.dir);
  const std::string what = "checkpoint::save(" + p.dir.string() + ")";
  std::string error = attempt([&] { p.tensors = detail::saved_tensors(state); });
  detail::agree_on_errors(what, error, world);
  p.plan = detail::plan_writes(p.tensors, what);
  detail::reduce_partials(p.tensors);
  error = attempt([&] {
    if (get_rank() == 0) {
      fs::remove_all(p.tmp);
      fs::create_directories(p.tmp);
    }
  });
  detail::agree_on_errors(what + ": preparing " + p.tmp.string(), error, world);
  return p;
}

} // namespace

SaveResult save(const StateDict& state, const std::string& dir_name, const SaveOptions& options) {
  at::NoGradGuard no_grad;
  const Prepared p = prepare_save(state, dir_name);
  return write_and_publish(stage_own_chunks(p.tensors, p.plan, options, /*copy=*/false), p.tmp,
                           p.dir, options, world_group());
}

// [Note: asynchronous save] As torchtitan's async checkpointing (DCP's async_save): the
// caller's thread plans the save, reduces Partial pieces and copies this rank's chunks to
// host memory (collectives of the training's own communicators, in step with every rank);
// a background thread then writes the file, agrees and publishes atomically, its
// collectives on a communicator of its own ([Note: background groups]) so that they never
// interleave with the training's. At most one save is in flight: a new one first waits for
// the previous. A failed or killed background write leaves the previous checkpoint in place.
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

const Group& background_group() {
  static const Group g = detail::new_background_group("checkpoint");
  return g;
}

} // namespace

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
  {
    std::lock_guard<std::mutex> lock(in_flight_mutex());
    if (auto previous = in_flight(); previous != nullptr && previous->worker.joinable()) {
      previous->worker.join(); // at most one in flight; its outcome is its handle's to report
    }
  }
  const Group& group = background_group();
  Prepared p = prepare_save(state, dir_name);
  auto staged =
      std::make_shared<Staged>(stage_own_chunks(p.tensors, p.plan, options, /*copy=*/true));
  auto s = std::make_shared<AsyncSave::State>();
  s->worker = std::thread([s, staged, tmp = p.tmp, dir = p.dir, options, group] {
    s->error = attempt([&] { s->result = write_and_publish(*staged, tmp, dir, options, group); });
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
  const std::string error =
      attempt([&] { plan = detail::plan_reads(state, dir.string(), options.verify()); });
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

void consolidate(const std::string& dir_name, const std::string& out_name,
                 const ConsolidateOptions& options) {
  at::NoGradGuard no_grad;
  const fs::path out = checkpoint_path(out_name);
  const detail::CheckpointIndex index = detail::read_checkpoint(checkpoint_path(dir_name).string());
  std::vector<st::Item> items;
  for (const auto& [key, entry] : index.tensors) {
    const bool excluded =
        std::any_of(options.exclude_prefixes().begin(), options.exclude_prefixes().end(),
                    [&](const std::string& p) { return key.rfind(p, 0) == 0; });
    if (!excluded) {
      detail::check_coverage(index, key);
      items.push_back(
          {key, entry.dtype, entry.shape, std::vector<int64_t>(entry.shape.size(), 0), {}});
    }
  }
  const std::string name = "model-00001-of-00001.safetensors";
  const fs::path tmp = temp_dir_of(out);
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  detail::MappedFiles files(index);
  st::WriteOptions wo;
  wo.sharding_info = false;
  st::write_file((tmp / name).string(), items,
                 [&](size_t i) { return detail::assemble(index, items[i].key, files); }, wo);
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (const st::Item& item : items) {
    weight_map[item.key] = name;
    total += static_cast<int64_t>(at::elementSize(item.dtype)) *
             c10::multiply_integers(item.shape.begin(), item.shape.end());
  }
  {
    std::ofstream f(tmp / "model.safetensors.index.json");
    f << nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
    DTENSOR_CHECK(f.good(), "checkpoint::consolidate: cannot write {}",
                  (tmp / "model.safetensors.index.json").string());
  }
  for (const auto& [file, content] : options.extra_files()) {
    std::ofstream f(tmp / file);
    f << content;
    DTENSOR_CHECK(f.good(), "checkpoint::consolidate: cannot write {}", (tmp / file).string());
  }
  publish(tmp, out, true);
}

} // namespace dtensor::checkpoint
