// The C++ side of test/checkpoint_driver.py: runs under torchrun, one mode per job.
//   resume a|b|c DIR   the resume chain: a (4 ranks, dp=2 x tp=2) trains 6 steps, saving at
//                      step 2 and recording every loss and the final parameters; b (2 ranks,
//                      1-D FSDP) resumes at step 2, saves at step 4, checks steps 2..6;
//                      c (1 rank, plain) resumes at step 4, checks steps 4..6.
//   kill-setup DIR     saves a checkpoint of known values
//   kill-save DIR      saves other values (the driver sets DTENSOR_CHECKPOINT_FAULT)
//   kill-verify DIR    loads: the first values, then saves anew and loads those
//   disk-setup DIR     saves a small checkpoint DIR/ckpt (on the driver's tmpfs)
//   disk-fail DIR TEXT saves 4 MiB into DIR/ckpt, which must fail on every rank with TEXT in
//                      the error (the full disk, the read-only file system); then the small
//                      checkpoint still loads and nothing of the save is left beside it
//   interop-write DIR  MLPStack (dp=2 x tp=2) and Transformer (HSDP 2x2) after one AdamW step:
//                      checkpoints DIR/dt_<model>, their full values DIR/dt_<model>.ref.pt, and
//                      the consolidated weights DIR/dt_<model>_hf
//   interop-read DIR   loads DIR/pt_<model> (written by PyTorch) into MLPStack (1-D FSDP) and
//                      Transformer (dp=2 x tp=2 for the MLP layers, else FSDP), compares
//                      with DIR/pt_<model>.ref.pt
// Exits non-zero (with the reason) on any mismatch.
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <dtensor/all.h>
#include <dtensor/checkpoint.h>
#include <dtensor/optim_state_dict.h>

#include <models/fsdp_models.h>
#include <models/mlp_models.h>

namespace {

using dtensor::StateDict;

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "checkpoint_worker rank " << dtensor::get_rank() << ": " << what << std::endl;
  std::exit(3);
}

at::Tensor full_of(const at::Tensor& t) {
  return dtensor::is_dtensor(t) ? dtensor::DTensor(t).full_tensor() : t.detach();
}

void write_ref(const std::string& path, const c10::Dict<std::string, at::Tensor>& values) {
  const std::vector<char> bytes = torch::pickle_save(values);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

c10::Dict<std::string, at::Tensor> read_ref(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const c10::IValue v = torch::pickle_load(bytes);
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& item : v.toGenericDict()) {
    out.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (got.sizes() != want.sizes() || !at::allclose(got.to(at::kFloat), want.to(at::kFloat), 1e-5, 1e-6)) {
    fail(what + ": got " + c10::str(got) + " want " + c10::str(want));
  }
}

StateDict merged(torch::nn::Module& m, torch::optim::Optimizer& opt, bool hyperparameters) {
  StateDict sd = dtensor::get_model_state_dict(m);
  for (const auto& item : dtensor::get_optimizer_state_dict(m, opt)) {
    if (hyperparameters || item.key().rfind("param_groups.", 0) != 0) {
      sd.insert(item.key(), item.value());
    }
  }
  return sd;
}

void apply_state(torch::nn::Module& m, torch::optim::Optimizer& opt, const StateDict& sd) {
  StateDict model;
  StateDict optim;
  for (const auto& item : sd) {
    const std::string& k = item.key();
    if (k.rfind("state.", 0) == 0 || k.rfind("param_groups.", 0) == 0) {
      optim.insert(k, item.value());
    } else if (k != "step") {
      model.insert(k, item.value());
    }
  }
  dtensor::set_model_state_dict(m, model);
  dtensor::set_optimizer_state_dict(m, opt, optim);
}

// ---- resume ---------------------------------------------------------------------------

constexpr int kSteps = 6;
constexpr int64_t kBatch = 8;
constexpr int64_t kDim = 16;

torch::nn::Sequential resume_model(char phase) {
  torch::manual_seed(0);
  auto s = dtensor::models::mlp_stack(kDim);
  if (phase == 'a') { // dp=2 x tp=2
    auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {2, 2}, {"dp", "tp"});
    dtensor::parallelize_module(*s, mesh["tp"],
                                dtensor::ParallelizePlan{
                                    {"*.in_proj", std::make_shared<dtensor::ColwiseParallel>()},
                                    {"*.out_proj", std::make_shared<dtensor::RowwiseParallel>()},
                                });
    for (size_t i = 0; i < 3; ++i) {
      dtensor::fully_shard(*s[i], dtensor::FullyShardOptions().mesh(mesh["dp"]));
    }
    dtensor::fully_shard(*s, dtensor::FullyShardOptions().mesh(mesh["dp"]));
  } else if (phase == 'b') { // 1-D FSDP on 2 ranks
    auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {2}, {"dp"});
    for (size_t i = 0; i < 3; ++i) {
      dtensor::fully_shard(*s[i], dtensor::FullyShardOptions().mesh(mesh));
    }
    dtensor::fully_shard(*s, dtensor::FullyShardOptions().mesh(mesh));
  }
  return s;
}

// One step on this rank's slice of the global batch; returns the global loss.
double train_step(torch::nn::Sequential& s, torch::optim::AdamW& opt, int step, int64_t dp, int64_t dp_rank) {
  torch::manual_seed(1000 + static_cast<uint64_t>(step));
  const at::Tensor x = at::randn({kBatch, kDim}).narrow(0, dp_rank * (kBatch / dp), kBatch / dp);
  opt.zero_grad();
  at::Tensor loss = s->forward(x).pow(2).mean();
  loss.backward();
  std::vector<at::Tensor> params = s->parameters();
  dtensor::clip_grad_norm_(params, 0.5);
  opt.step();
  at::Tensor l = loss.detach().reshape({1});
  if (dtensor::get_world_size() > 1) { // the mean over dp of the slices' means; tp ranks agree
    l = dtensor::all_reduce(l, dtensor::ReduceOp::Sum, dtensor::world_group()) / dtensor::get_world_size();
  }
  return l.item<double>();
}

void resume(char phase, const std::string& dir) {
  const int64_t dp = phase == 'a' ? 2 : (phase == 'b' ? 2 : 1);
  const int64_t dp_rank = phase == 'a' ? dtensor::get_rank() / 2 : dtensor::get_rank();
  auto s = resume_model(phase);
  torch::optim::AdamW opt(s->parameters(), torch::optim::AdamWOptions(1e-2));
  int start = 0;
  if (phase != 'a') {
    StateDict sd = merged(*s, opt, true);
    sd.insert("step", at::scalar_tensor(0, at::kLong));
    dtensor::checkpoint::load(sd, dir + (phase == 'b' ? "/ckpt_step2" : "/ckpt_step4"));
    apply_state(*s, opt, sd);
    start = static_cast<int>(sd["step"].item<int64_t>());
    if (start != (phase == 'b' ? 2 : 4)) {
      fail("resumed at step " + std::to_string(start));
    }
  }
  const c10::Dict<std::string, at::Tensor> ref = phase == 'a' ? c10::Dict<std::string, at::Tensor>()
                                                              : read_ref(dir + "/resume_ref.pt");
  std::vector<double> losses;
  for (int step = start; step < kSteps; ++step) {
    if ((phase == 'a' && step == 2) || (phase == 'b' && step == 4)) {
      StateDict sd = merged(*s, opt, true);
      sd.insert("step", at::scalar_tensor(step, at::kLong));
      dtensor::checkpoint::save(sd, dir + "/ckpt_step" + std::to_string(step));
    }
    losses.push_back(train_step(s, opt, step, dp, dp_rank));
  }
  if (phase == 'a') {
    c10::Dict<std::string, at::Tensor> out;
    out.insert("losses", at::tensor(losses, at::kDouble));
    for (const auto& item : s->named_parameters()) {
      out.insert(item.key(), full_of(item.value()));
    }
    if (dtensor::get_rank() == 0) {
      write_ref(dir + "/resume_ref.pt", out);
    }
    return;
  }
  const at::Tensor want = ref.at("losses").narrow(0, start, kSteps - start);
  expect_close("losses of steps " + std::to_string(start) + ".." + std::to_string(kSteps),
               at::tensor(losses, at::kDouble), want);
  for (const auto& item : s->named_parameters()) {
    expect_close("parameter " + item.key() + " after step 6", full_of(item.value()), ref.at(item.key()));
  }
  std::cout << "resume " << phase << ": steps " << start << ".." << kSteps << " match" << std::endl;
}

// ---- a rank killed during save ---------------------------------------------------------

at::Tensor kill_value(double shift) { return at::arange(72, at::kFloat).reshape({12, 6}) + shift; }

void kill_mode(const std::string& mode, const std::string& dir) {
  auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {dtensor::get_world_size()});
  const std::string ckpt = dir + "/ckpt";
  auto state_of = [&](const at::Tensor& v, const dtensor::Placements& p) {
    StateDict sd;
    sd.insert("w", dtensor::distribute_tensor(v, mesh, p));
    return sd;
  };
  if (mode == "kill-setup" || mode == "kill-save") {
    dtensor::checkpoint::save(state_of(kill_value(mode == "kill-setup" ? 0 : 100), {dtensor::Shard(0)}), ckpt);
    return;
  }
  // kill-verify, on another number of ranks and placement: the first checkpoint is intact.
  StateDict target = state_of(at::zeros({12, 6}), {dtensor::Shard(1)});
  dtensor::checkpoint::load(target, ckpt);
  expect_close("checkpoint after the killed save", full_of(target["w"]), kill_value(0));
  dtensor::checkpoint::save(state_of(kill_value(7), {dtensor::Shard(1)}), ckpt);
  dtensor::checkpoint::load(target, ckpt);
  expect_close("checkpoint saved after the killed save", full_of(target["w"]), kill_value(7));
  std::cout << "kill-verify: previous checkpoint intact, next save replaced it" << std::endl;
}

// ---- a save on a full disk or a read-only file system ----------------------------------

void disk_mode(const std::string& mode, const std::string& dir, const std::string& expected) {
  auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {dtensor::get_world_size()});
  const std::string ckpt = dir + "/ckpt";
  auto state_of = [&](const at::Tensor& v) {
    StateDict sd;
    sd.insert("w", dtensor::distribute_tensor(v, mesh, {dtensor::Shard(0)}));
    return sd;
  };
  if (mode == "disk-setup") {
    dtensor::checkpoint::save(state_of(kill_value(0)), ckpt);
    return;
  }
  if (const char* limit = std::getenv("DTENSOR_TEST_FSIZE_LIMIT")) { // where no tmpfs can be had
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit r{static_cast<rlim_t>(std::stoll(limit)), static_cast<rlim_t>(std::stoll(limit))};
    ::setrlimit(RLIMIT_FSIZE, &r);
  }
  std::string error;
  try {
    dtensor::checkpoint::save(state_of(at::ones({1 << 20}, at::kFloat)), ckpt);
  } catch (const dtensor::Error& e) {
    error = e.what();
  }
  if (error.find(expected) == std::string::npos || error.find("checkpoint::save(" + ckpt) != 0) {
    fail("the save did not fail with '" + expected + "' but with: '" + error + "'");
  }
  StateDict target = state_of(at::zeros({12, 6}));
  dtensor::checkpoint::load(target, ckpt);
  expect_close("the checkpoint before the failed save", full_of(target["w"]), kill_value(0));
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename() != "ckpt") {
      fail("the failed save left " + e.path().string());
    }
  }
  std::cout << "disk-fail: every rank raised '" << expected << "', the previous checkpoint loads"
            << std::endl;
}

// ---- interop with PyTorch --------------------------------------------------------------

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor()> loss;
};

// MLPStack(16) or the toy Transformer (dropout 0, untied output), laid out as `layout`:
// "tp" (dp=2 x tp=2, MLP only), "hsdp" (2x2) or "fsdp" (1-D over all ranks).
Model interop_model(const std::string& name, const std::string& layout) {
  using namespace dtensor::models;
  torch::manual_seed(0);
  Model m;
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  if (name == "mlp") {
    auto s = mlp_stack(16);
    m.module = s.ptr();
    m.loss = [s]() mutable { return s->forward(at::randn({4, 16})).pow(2).mean(); };
    for (const auto& c : s->children()) {
      blocks.push_back(c);
    }
  } else {
    Transformer t(ModelArgs().n_layers(2).vocab_size(8).max_seq_len(16).dim(16).n_heads(4).dropout_p(0.0).weight_tying(false));
    m.module = t.ptr();
    m.loss = [t]() mutable { return t->forward(at::randint(0, 8, {2, 8})).pow(2).mean(); };
    for (const auto& c : t->layers->children()) {
      blocks.push_back(c);
    }
  }
  const int w = dtensor::get_world_size();
  dtensor::DeviceMesh dp;
  if (layout == "tp") {
    auto mesh = dtensor::init_device_mesh(c10::DeviceType::CPU, {2, w / 2}, {"dp", "tp"});
    dtensor::parallelize_module(*m.module, mesh["tp"],
                                dtensor::ParallelizePlan{
                                    {"*.in_proj", std::make_shared<dtensor::ColwiseParallel>()},
                                    {"*.out_proj", std::make_shared<dtensor::RowwiseParallel>()},
                                });
    dp = mesh["dp"];
  } else if (layout == "hsdp") {
    dp = dtensor::init_device_mesh(c10::DeviceType::CPU, {2, w / 2}, {"replicate", "shard"});
  } else {
    dp = dtensor::init_device_mesh(c10::DeviceType::CPU, {w}, {"dp"});
  }
  for (auto& b : blocks) {
    dtensor::fully_shard(*b, dtensor::FullyShardOptions().mesh(dp));
  }
  dtensor::fully_shard(*m.module, dtensor::FullyShardOptions().mesh(dp));
  return m;
}

void interop(const std::string& mode, const std::string& dir) {
  for (const std::string name : {"mlp", "transformer"}) {
    const bool write = mode == "interop-write";
    Model m = interop_model(name, write ? (name == "mlp" ? "tp" : "hsdp") : "fsdp");
    torch::optim::AdamW opt(m.module->parameters(), torch::optim::AdamWOptions(1e-2));
    if (write) {
      torch::manual_seed(5);
      opt.zero_grad();
      m.loss().backward();
      opt.step();
      const StateDict sd = merged(*m.module, opt, true);
      dtensor::checkpoint::save(sd, dir + "/dt_" + name);
      c10::Dict<std::string, at::Tensor> ref;
      for (const auto& item : sd) {
        ref.insert(item.key(), full_of(item.value()));
      }
      if (dtensor::get_rank() == 0) {
        write_ref(dir + "/dt_" + name + ".ref.pt", ref);
        dtensor::checkpoint::consolidate(dir + "/dt_" + name, dir + "/dt_" + name + "_hf");
      }
      continue;
    }
    // PyTorch's HuggingFaceStorageWriter holds tensors only: no hyperparameters.
    StateDict sd = merged(*m.module, opt, false);
    dtensor::checkpoint::load(sd, dir + "/pt_" + name);
    apply_state(*m.module, opt, sd);
    const auto ref = read_ref(dir + "/pt_" + name + ".ref.pt");
    for (const auto& item : sd) {
      if (!ref.contains(item.key())) {
        fail(name + ": PyTorch's reference lacks " + item.key());
      }
      expect_close(name + " " + item.key(), full_of(item.value()), ref.at(item.key()));
    }
    std::cout << "interop-read " << name << ": " << sd.size() << " tensors equal PyTorch's" << std::endl;
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: checkpoint_worker MODE [PHASE] DIR\n";
    return 2;
  }
  dtensor::init_process_group();
  const std::string mode = argv[1];
  try {
    if (mode == "resume" && argc == 4) {
      resume(argv[2][0], argv[3]);
    } else if (mode.rfind("kill-", 0) == 0) {
      kill_mode(mode, argv[2]);
    } else if (mode.rfind("disk-", 0) == 0) {
      disk_mode(mode, argv[2], argc > 3 ? argv[3] : "");
    } else if (mode.rfind("interop-", 0) == 0) {
      interop(mode, argv[2]);
    } else {
      fail("unknown mode " + mode);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
  dtensor::destroy_process_group();
  return 0;
}
