// The simulated world's c10d backend ([Note: the fake backend]).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "internal/check.h"
#include "mesh/process_group_state.h"

namespace dtensor::detail {

namespace {

// [Note: the fake backend]
// What c10d's FakeProcessGroup does, for both LibTorch versions dtensor builds against (2.15's
// FakeProcessGroup.hpp includes torch/csrc/utils.h and with it Python's headers, so a
// Python-free library cannot include it): every collective completes the moment it is
// issued and moves nothing. It serves one process playing rank r of a world of N
// (docs/simulation.md). The simulated device's tensors ([Note: the simulated device]) are
// left as they are: they have shapes and no values. Tensors with values (small CPU tensors of the
// library's own bookkeeping: error agreement, lengths) get what a world of N identical ranks would
// give, as FakeProcessGroup's simulate_uniform_ranks: sums are N times the value, gathers repeat
// it, a reduce-scatter keeps N times this rank's chunk.
class CompletedWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    future->markCompleted();
    return future;
  }
};

bool has_values(const at::Tensor& t) {
  return t.defined() && t.is_cpu();
}

void reduce_uniform(at::Tensor& t, const c10d::ReduceOp& op, int size) {
  if (!has_values(t)) {
    return;
  }
  at::NoGradGuard no_grad;
  if (op == c10d::ReduceOp::SUM) {
    t.mul_(size);
  } else if (op == c10d::ReduceOp::PRODUCT) {
    t.pow_(size);
  } // AVG, MIN, MAX, bitwise ops of equal values: the value itself
}

// [Note: shapes across simulated stages] A pipeline stage on another rank tells its
// successor the shape of what it sends, in a small host tensor, at the first step. A simulated
// world runs each rank as a process of its own, so under DTENSOR_SIMULATE_P2P=DIR (set by
// `train --simulate` for pipelined plans) a host tensor sent with tag T is written to DIR/tagT
// (the first sender's; every rank of a stage boundary sends the same shape), and a receive
// with tag T waits for that file. The driver makes sure a rank of every stage is simulated and
// runs them all at once. Device tensors (the activations themselves) move nothing, as before.
std::string fake_p2p_dir() {
  const char* dir = std::getenv("DTENSOR_SIMULATE_P2P");
  return dir == nullptr ? "" : dir;
}

void fake_publish(const std::string& dir, int tag, const at::Tensor& t) {
  const std::filesystem::path path = std::filesystem::path(dir) / ("tag" + std::to_string(tag));
  if (std::filesystem::exists(path)) {
    return;
  }
  const at::Tensor c = t.contiguous();
  const std::string tmp = path.string() + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
  std::filesystem::rename(tmp, path); // whole or absent for a reader
}

void fake_take(const std::string& dir, int tag, at::Tensor& t) {
  const std::filesystem::path path = std::filesystem::path(dir) / ("tag" + std::to_string(tag));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  while (!std::filesystem::exists(path)) {
    DTENSOR_CHECK(std::chrono::steady_clock::now() < deadline,
                  "simulated receive with tag {}: nothing in {} after 10 minutes (no simulated "
                  "rank sent it)",
                  tag, dir);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  at::Tensor c = at::empty_like(t).contiguous();
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  DTENSOR_CHECK(in.gcount() == static_cast<std::streamsize>(c.nbytes()),
                "simulated receive with tag {}: {} holds {} bytes, {} expected", tag, path.string(),
                in.gcount(), c.nbytes());
  t.copy_(c);
}

class FakeBackend : public c10d::Backend {
 public:
  FakeBackend(int rank, int size) : c10d::Backend(rank, size) {}

  const std::string getBackendName() const override { return "fake"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& /*tensors*/,
                                           const c10d::BroadcastOptions& /*opts*/) override {
    return done();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    for (auto& t : tensors) {
      reduce_uniform(t, opts.reduceOp, getSize());
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    if (has_values(output)) {
      at::NoGradGuard no_grad;
      output.view({getSize(), -1}).copy_(input.reshape({1, -1}));
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    gather_lists(outputs, inputs);
    return done();
  }

  c10::intrusive_ptr<c10d::Work>
  allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                      std::vector<at::Tensor>& inputs,
                      const c10d::AllgatherOptions& /*opts*/) override {
    gather_lists(outputs, inputs);
    return done();
  }

  c10::intrusive_ptr<c10d::Work>
  _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                       const c10d::ReduceScatterOptions& opts) override {
    if (has_values(output)) {
      at::NoGradGuard no_grad;
      output.copy_(input.reshape({getSize(), -1})[getRank()].view_as(output));
      reduce_uniform(output, opts.reduceOp, getSize());
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& /*output_splits*/,
                                               std::vector<int64_t>& /*input_splits*/,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    if (has_values(output) && output.sizes() == input.sizes()) {
      at::NoGradGuard no_grad;
      output.copy_(input); // equal splits of identical ranks: each gets back what it sent
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    return done();
  }

  // Point-to-point between identical simulated ranks: the receiving buffer keeps its values,
  // but for host tensors under DTENSOR_SIMULATE_P2P ([Note: shapes across simulated stages]).
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int /*dst*/,
                                      int tag) override {
    if (const std::string dir = fake_p2p_dir(); !dir.empty()) {
      for (const at::Tensor& t : tensors) {
        if (has_values(t)) {
          fake_publish(dir, tag, t);
        }
      }
    }
    return done();
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int /*src*/,
                                      int tag) override {
    if (const std::string dir = fake_p2p_dir(); !dir.empty()) {
      for (at::Tensor& t : tensors) {
        if (has_values(t)) {
          fake_take(dir, tag, t);
        }
      }
    }
    return done();
  }

 private:
  static c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<CompletedWork>(); }

  static void gather_lists(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < outputs.size() && i < inputs.size(); ++i) {
      for (auto& out : outputs[i]) {
        if (has_values(out)) {
          out.copy_(inputs[i]);
        }
      }
    }
  }
};

} // namespace

c10::intrusive_ptr<c10d::Backend> make_fake_backend(int rank, int size) {
  return c10::make_intrusive<FakeBackend>(rank, size);
}

} // namespace dtensor::detail
