// dtensor::checkpoint::save / load / consolidate (include/dtensor/checkpoint.h).
#include <dtensor/checkpoint.h>

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>

#include "checkpoint/layout.h"
#include "checkpoint/safetensors.h"
#include "internal/check.h"
#include "mesh/agree.h"
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
  DTENSOR_CHECK(fd >= 0, "checkpoint: cannot open directory {}: {}", dir.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  DTENSOR_CHECK(rc == 0, "checkpoint: cannot sync directory {}: {}", dir.string(), std::strerror(errno));
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

// This rank's file of the plan, written into `tmp` (nothing when it owns no chunk).
SaveResult write_own_file(const std::vector<detail::SavedTensor>& tensors, const detail::WritePlan& plan,
                          const fs::path& tmp, const fs::path& dir, const SaveOptions& options) {
  const int rank = get_rank();
  SaveResult result;
  const std::vector<detail::WriteChunk>& mine = plan.chunks[static_cast<size_t>(rank)];
  if (mine.empty()) {
    return result;
  }
  std::vector<st::Item> items;
  std::vector<at::Tensor> data;
  for (const detail::WriteChunk& c : mine) {
    data.push_back(detail::chunk_data(tensors[c.tensor]));
    const at::Tensor& d = data.back();
    st::Item item{tensors[c.tensor].key, d.scalar_type(), d.sizes().vec(), c.offsets, {}};
    if (options.checksums()) {
      item.hash = st::hash_of(d.data_ptr(), static_cast<int64_t>(d.nbytes()));
    }
    result.data_bytes += static_cast<int64_t>(d.nbytes());
    items.push_back(std::move(item));
  }
  st::WriteOptions wo;
  for (int r : plan.writers) {
    wo.listed_files.push_back(file_name(r));
  }
  wo.fsync = options.fsync();
  result.file = (dir / file_name(rank)).string();
  result.file_bytes = st::write_file((tmp / file_name(rank)).string(), items, [&](size_t i) { return data[i]; }, wo);
  return result;
}

} // namespace

SaveResult save(const StateDict& state, const std::string& dir_name, const SaveOptions& options) {
  at::NoGradGuard no_grad;
  const Group world = world_group();
  const int rank = get_rank();
  const fs::path dir = checkpoint_path(dir_name);
  const fs::path tmp = temp_dir_of(dir);

  std::vector<detail::SavedTensor> tensors;
  std::string error = attempt([&] { tensors = detail::saved_tensors(state); });
  detail::agree_on_errors("checkpoint::save(" + dir.string() + ")", error, world);
  const detail::WritePlan plan = detail::plan_writes(tensors, "checkpoint::save(" + dir.string() + ")");
  detail::reduce_partials(tensors);

  error = attempt([&] {
    if (rank == 0) {
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    }
  });
  detail::agree_on_errors("checkpoint::save(" + dir.string() + "): preparing " + tmp.string(), error, world);

  SaveResult result;
  error = attempt([&] {
    result = write_own_file(tensors, plan, tmp, dir, options);
    injected_fault(rank);
  });
  if (!error.empty() && rank == 0) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
  }
  detail::agree_on_errors("checkpoint::save(" + dir.string() + "): writing", error, world);

  error = attempt([&] {
    if (rank == 0) {
      publish(tmp, dir, options.fsync());
    }
  });
  detail::agree_on_errors("checkpoint::save(" + dir.string() + "): publishing", error, world);
  return result;
}

void load(const StateDict& state, const std::string& dir_name, const LoadOptions& options) {
  at::NoGradGuard no_grad;
  const fs::path dir = checkpoint_path(dir_name);
  detail::LoadPlan plan;
  const std::string error = attempt([&] { plan = detail::plan_reads(state, dir.string(), options.verify()); });
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
    const bool excluded = std::any_of(options.exclude_prefixes().begin(), options.exclude_prefixes().end(),
                                      [&](const std::string& p) { return key.rfind(p, 0) == 0; });
    if (!excluded) {
      detail::check_coverage(index, key);
      items.push_back({key, entry.dtype, entry.shape, std::vector<int64_t>(entry.shape.size(), 0), {}});
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
    DTENSOR_CHECK(f.good(), "checkpoint::consolidate: cannot write {}", (tmp / "model.safetensors.index.json").string());
  }
  for (const auto& [file, content] : options.extra_files()) {
    std::ofstream f(tmp / file);
    f << content;
    DTENSOR_CHECK(f.good(), "checkpoint::consolidate: cannot write {}", (tmp / file).string());
  }
  publish(tmp, out, true);
}

} // namespace dtensor::checkpoint
