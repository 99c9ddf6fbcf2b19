// The simulated world's c10d backend ([Note: the fake backend]).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

  // Point-to-point between identical simulated ranks: the receiving buffer keeps its values.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& /*tensors*/, int /*dst*/,
                                      int /*tag*/) override {
    return done();
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& /*tensors*/, int /*src*/,
                                      int /*tag*/) override {
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
