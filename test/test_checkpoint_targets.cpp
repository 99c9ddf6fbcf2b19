// What a save may replace ([Note: what a save may replace], docs/checkpoint.md): save,
// async_save, consolidate and the Llama 3 export into a regular file, a foreign directory,
// an empty directory, a previous checkpoint, a symbolic link, ".", a target locked by
// another save. Guards against data loss (a save that deletes whatever is at its
// path): every refusal is asserted on every rank, with the path and what is there named,
// and the foreign file or directory is byte-identical afterwards. The full disk and the
// read-only file system are in test/checkpoint_driver.py (disk), which needs a mount.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <dtensor/checkpoint.h>

#include "checkpoint/target.h"
#include "support/prelude.h"
#include <models/llama3.h>

namespace fs = std::filesystem;
namespace ckpt = dtensor::checkpoint;

namespace {

std::string fresh_dir(const std::string& name) {
  return dtensor::testing::fresh_shared_dir("checkpoint-targets", name);
}

void write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

// Every entry under `dir` (or `dir` itself when a file) with its bytes: what must not change.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  const auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  if (!fs::is_directory(dir)) {
    out[""] = read(dir);
    return out;
  }
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    out[fs::relative(e.path(), dir).string()] = e.is_directory() ? "<dir>" : read(e.path());
  }
  return out;
}

dtensor::StateDict state_of(const at::Tensor& value) {
  auto m = init_device_mesh(device_type(), {world()});
  dtensor::StateDict sd;
  sd.insert("w", dtensor::distribute_tensor(value.to(options().device()), m, {dtensor::Shard(0)}));
  return sd;
}

at::Tensor value(double shift) {
  return at::arange(24, at::kFloat).reshape({8, 3}) + shift;
}

at::Tensor loaded(const std::string& dir) {
  dtensor::StateDict target = state_of(at::zeros({8, 3}));
  ckpt::load(target, dir);
  return full_value(target["w"]).cpu();
}

// Nothing of a save is left beside `dir` (its temporary directory, its lock file).
bool no_leftovers(const fs::path& dir) {
  const std::string hidden = "." + dir.filename().string() + ".dtensor-";
  for (const auto& e : fs::directory_iterator(dir.parent_path())) {
    if (e.path().filename().string().rfind(hidden, 0) == 0) {
      UNSCOPED_INFO("left beside " << dir.string() << " on rank " << rank() << ": " << e.path().string());
      return false;
    }
  }
  return true;
}

} // namespace

TEST_CASE("checkpoint targets: a file or a foreign directory is refused on every rank, untouched",
          "[checkpoint][world2][world4]") {
  const fs::path base = fresh_dir("refused");
  const fs::path file = base / "model.pt", foreign = base / "run", half = base / "half";
  if (rank() == 0) {
    write(file, "the user's weights");
    write(foreign / "notes.txt", "notes");
    write(foreign / "configs" / "a.toml", "lr = 1");
  }
  dtensor::barrier(dtensor::world_group());
  const auto before_file = snapshot(file), before_dir = snapshot(foreign);
  const std::string refused =
      "a save replaces only an empty directory or a complete dtensor checkpoint";

  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(0)), file.string()),
                      contains(file.string() + " is a regular file") && contains(refused) &&
                          contains("rank 0"));
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(0)), foreign.string()),
                      contains(foreign.string() + " is a directory holding 2 entries") &&
                          contains("configs/, notes.txt") && contains(refused));
  // async_save checks before it returns (nothing is in flight afterwards), naming itself.
  REQUIRE_THROWS_WITH(ckpt::async_save(state_of(value(0)), foreign.string()),
                      contains(refused) && contains("checkpoint::async_save(" + foreign.string()));
  // A checkpoint with an entry added since it was written is no longer only dtensor's.
  ckpt::save(state_of(value(1)), half.string());
  if (rank() == 0) {
    write(half / "README", "mine");
  }
  dtensor::barrier(dtensor::world_group());
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(2)), half.string()),
                      contains("entries added since it was written (README)"));
  REQUIRE(snapshot(file) == before_file);
  REQUIRE(snapshot(foreign) == before_dir);
  REQUIRE(same(loaded(half.string()), value(1)));
  REQUIRE((no_leftovers(file) && no_leftovers(foreign) && no_leftovers(half)));
  dtensor::barrier(dtensor::world_group()); // every rank has looked before rank 0 locks `foreign`
  if (rank() == 0) { // not collective
    REQUIRE_THROWS_WITH(ckpt::remove(foreign.string()), contains("nothing was deleted"));
  }
  dtensor::barrier(dtensor::world_group());
  REQUIRE(snapshot(foreign) == before_dir);

  // overwrite(true): the user asked for it; the checkpoint replaces the directory.
  ckpt::save(state_of(value(3)), foreign.string(), ckpt::SaveOptions().overwrite(true));
  REQUIRE(same(loaded(foreign.string()), value(3)));
  REQUIRE(ckpt::is_complete(foreign.string()));
  REQUIRE(no_leftovers(foreign));
}

TEST_CASE("checkpoint targets: an empty directory, a previous checkpoint, a symbolic link",
          "[checkpoint][world2][world4]") {
  const fs::path base = fresh_dir("accepted");
  const fs::path empty = base / "empty", real = base / "real", link = base / "latest";
  const fs::path foreign = base / "foreign", to_foreign = base / "to-foreign",
                 dangling = base / "dangling";
  if (rank() == 0) {
    fs::create_directories(empty);
    fs::create_directories(real);
    fs::create_symlink(real, link);
    write(foreign / "keep.txt", "keep");
    fs::create_symlink(foreign, to_foreign);
    fs::create_symlink(base / "nowhere", dangling);
  }
  dtensor::barrier(dtensor::world_group());
  ckpt::save(state_of(value(0)), empty.string());
  REQUIRE(same(loaded(empty.string()), value(0)));
  ckpt::save(state_of(value(5)), empty.string()); // a complete checkpoint is replaced
  REQUIRE(same(loaded(empty.string()), value(5)));
  REQUIRE(fs::exists(empty / dtensor::detail::kManifest));
  // Through a link: the checkpoint goes where it points, the link stays.
  ckpt::save(state_of(value(6)), link.string());
  REQUIRE(fs::is_symlink(link));
  REQUIRE(same(loaded(real.string()), value(6)));
  ckpt::save(state_of(value(7)), link.string());
  REQUIRE(same(loaded(link.string()), value(7)));
  REQUIRE(no_leftovers(real));
  const auto before = snapshot(foreign);
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(8)), to_foreign.string()),
                      contains("a symbolic link to " + foreign.string()) &&
                          contains("a directory holding 1 entry"));
  REQUIRE(snapshot(foreign) == before);
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(8)), dangling.string()),
                      contains("which does not exist"));
  REQUIRE(fs::is_symlink(dangling));
}

TEST_CASE("checkpoint targets: the current directory is never replaced, even with overwrite",
          "[checkpoint][world2][world4]") {
  const fs::path base = fresh_dir("cwd");
  const fs::path work = base / "work";
  if (rank() == 0) {
    write(work / "train.log", "log");
  }
  dtensor::barrier(dtensor::world_group());
  const fs::path was = fs::current_path();
  fs::current_path(work);
  const auto before = snapshot(work);
  const auto overwrite = ckpt::SaveOptions().overwrite(true);
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(0)), ".", overwrite),
                      contains("the current directory, which a save never replaces"));
  REQUIRE_THROWS_WITH(ckpt::save(state_of(value(0)), "..", overwrite),
                      contains("a directory above the current one"));
  fs::current_path(was);
  REQUIRE(snapshot(work) == before);
}

TEST_CASE("checkpoint targets: a second save into a target being saved is refused",
          "[checkpoint][world2][world4]") {
  const fs::path dir = fs::path(fresh_dir("locked")) / "ckpt";
  ckpt::save(state_of(value(0)), dir.string());
  {
    // What another job's save holds while it writes (flock is per open file description,
    // so a lock taken here is what a second process would meet).
    std::optional<dtensor::detail::TargetLock> other;
    if (rank() == 0) {
      other.emplace(dir, "another job");
    }
    REQUIRE_THROWS_WITH(ckpt::save(state_of(value(1)), dir.string()),
                        contains("another save into " + dir.string() + " is in progress"));
    dtensor::barrier(dtensor::world_group());
  }
  REQUIRE(same(loaded(dir.string()), value(0)));
  ckpt::save(state_of(value(1)), dir.string()); // released: the next save goes through
  REQUIRE(same(loaded(dir.string()), value(1)));
  REQUIRE(no_leftovers(dir));
}

TEST_CASE("checkpoint targets: consolidate and export_hf replace only their own output",
          "[checkpoint][world2][world4]") {
  const fs::path base = fresh_dir("export");
  const fs::path src = base / "ckpt", out = base / "hf", foreign = base / "mine";
  if (rank() == 0) {
    write(foreign / "tokenizer.json", "{}");
  }
  ckpt::save(state_of(value(0)), src.string());
  if (rank() == 0) {
    ckpt::consolidate(src.string(), out.string());
    ckpt::consolidate(src.string(), out.string()); // its own export: replaced
    REQUIRE(ckpt::is_complete(out.string()));
    REQUIRE_THROWS_WITH(ckpt::consolidate(src.string(), foreign.string()),
                        contains(foreign.string() + " is a directory holding 1 entry"));
    REQUIRE_THROWS_WITH(ckpt::consolidate(src.string(), src.string()),
                        contains("would replace the checkpoint it is read from"));
  }
  dtensor::barrier(dtensor::world_group());
  REQUIRE(snapshot(foreign) == std::map<std::string, std::string>{{"tokenizer.json", "{}"}});

  // The Llama 3 export refuses before anything is written, on every rank.
  auto args =
      dtensor::models::Llama3Args().dim(16).n_layers(1).n_heads(2).n_kv_heads(2).vocab_size(32);
  dtensor::models::Llama3 model(args);
  REQUIRE_THROWS_WITH(dtensor::models::export_hf(model, foreign.string()),
                      contains("checkpoint::save_hf(" + foreign.string() + "): rank 0:") &&
                          contains("is a directory holding 1 entry"));
  REQUIRE(snapshot(foreign) == std::map<std::string, std::string>{{"tokenizer.json", "{}"}});
  REQUIRE(!fs::exists(foreign.string() + ".dtensor-parts"));
  dtensor::models::export_hf(model, out.string()); // replaces the earlier export
  REQUIRE(fs::exists(out / "config.json"));
  REQUIRE(!fs::exists(out.string() + ".dtensor-parts"));
}

TEST_CASE("checkpoint targets: from_local names a placement count the mesh lacks",
          "[dtensor][world2][world4]") {
  auto m = init_device_mesh(device_type(), {world()});
  REQUIRE_THROWS_WITH(
      DTensor::from_local(at::ones({2, 2}, options()), m, {dtensor::Shard(0), dtensor::Shard(1)}),
      contains(
          "DTensor::from_local: 2 placements (Shard(0), Shard(1)) for a mesh of 1 dimensions"));
}

TEST_CASE("checkpoint targets: a model's bad configuration raises dtensor::Error",
          "[models][world2][world4]") {
  auto args =
      dtensor::models::Llama3Args().dim(16).n_layers(1).n_heads(3).n_kv_heads(3).vocab_size(32);
  REQUIRE_THROWS_AS(dtensor::models::Llama3(args), dtensor::Error);
}
