// Running a lowered pipeline program (PipelineSchedule, include/dtensor/pipelining.h).
//
// [Note: the pipeline runtime]
// Each rank runs its own lowered program (lower_schedule) action by action. A forward takes
// its input from the microbatch (stage 0), a receive buffer (RECV_F posted earlier) or, at a
// V's turn, the previous stage's output on this rank; it keeps (input, output) for the
// backward. A full backward (B) starts from the loss (last stage) or the received output
// gradient, and leaves the input's gradient for SEND_B. A split backward computes the input
// gradient first (I, keeping the graph) and the weights' later (W, a backward whose only
// inputs are the parameters, so their gradient hooks fire as in any backward). Sends are
// asynchronous and waited for at WAIT_SEND; receives are posted at RECV and waited for by
// the action that reads them. Receive buffers need the shapes of each stage's input and
// output: the first step finds them by one forward per stage on its first microbatch, stage
// after stage, each rank sending the next stage's input shape ahead (uncounted, as the
// library's bookkeeping; find_shapes in transfers.cpp), once the ranks have agreed on the
// schedule and the batch ([Note: agreeing before the first step]). Later forwards whose
// output shape differs are refused. An error names the pipeline rank, the stage and the
// action, and a wait for a peer names the peer's rank and stage.
//
// [Note: fully_shard under pipelining]
// A stage whose module holds fully_shard units (its module the root, torchtitan's order) is
// driven by the schedule, as PyTorch's runtime drives FSDP2: every backward of a microbatch
// runs with gradient sync and reshard-after-backward off, so gradients accumulate unsharded;
// REDUCE_GRAD (after the stage's last backward) turns both on and reduces them with
// finalize_backward (one reduce-scatter per unit per step; HSDP: one all-reduce more), and
// WAIT_REDUCE_GRAD completes it. UNSHARD all-gathers every unit of the stage asynchronously
// (the units' first use waits), RESHARD frees them. Whether a unit also reshards after each
// forward stays the unit's own reshard_after_forward (torchtitan turns it off under PP).

#include <dtensor/pipelining.h>

#include "mesh/agree.h"
#include "parallel/pipelining/runtime_impl.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

namespace dtensor {

std::string PipelineSchedule::Impl::rank_name() const {
  return fmt::format("pipeline rank {} ({})", group.rank(), group.to_string());
}

std::string PipelineSchedule::Impl::stage_list() const {
  std::vector<int> mine;
  for (const auto& [s, stage] : stages) {
    mine.push_back(s);
  }
  return fmt::format("{}", fmt::join(mine, ", "));
}

std::string PipelineSchedule::Impl::split_batch(const at::Tensor& input, const at::Tensor& target) {
  input_mbs.clear();
  target_mbs.clear();
  std::vector<std::string> bad;
  auto split = [&](const at::Tensor& t, const char* what, int stage,
                   std::vector<at::Tensor>& into) {
    const bool reads = is_local(stage);
    if (!t.defined()) {
      if (reads) {
        bad.push_back(
            fmt::format("the {} is undefined, and this rank holds stage {}", what, stage));
      }
      return; // a rank given none contributes nothing
    }
    if (t.dim() == 0 || t.size(0) == 0 || t.size(0) % microbatches != 0) {
      bad.push_back(fmt::format("the {} ({}) does not split into {} microbatches along dim 0", what,
                                detail::describe(t), microbatches));
    } else if (reads) {
      into = t.split(t.size(0) / microbatches);
    }
  };
  split(input, "input", 0, input_mbs);
  split(target, "target", num_stages - 1, target_mbs);
  return fmt::format("{}", fmt::join(bad, "; "));
}

namespace {

// What one rank sent in the first step's agreement, and its fields.
struct RankLine {
  std::string built;     // what must agree: stages, microbatches, program, shared options
  std::string stages;    // its stages, "1, 2"
  std::string bad_batch; // why its batch does not split, or ""
};

RankLine parse_line(const std::string& line) {
  const size_t a = line.find('\x1f');
  const size_t b = line.find('\x1f', a + 1);
  return {line.substr(0, a), line.substr(a + 1, b - a - 1), line.substr(b + 1)};
}

} // namespace

// [Note: agreeing before the first step]
// Ranks built with different schedules (another stage count, schedule kind, microbatch count,
// lowering, or transfer options) would wait for transfers that never come, each until the
// collective timeout; a batch checked only on the ranks that read it would fail there while
// the others wait. So the first step, before any transfer (the shape exchange and the edge
// communicators' rendezvous), gathers one line from every rank of the pipeline group: what it
// was built with (the number of stages, the microbatches, a fingerprint of every rank's
// lowered program, the options the ranks must share) and why its batch does not split ("" when
// it splits or when the rank was given none). Every rank judges the same lines, so a
// disagreement, or any rank's bad batch, raises the same error on every rank at once, naming
// each rank, its stages and what it had. Two all-gathers (all_gather_strings: the lengths,
// then the bytes), once per schedule, not counted by CommDebugMode (the library's
// bookkeeping, as the shape exchange).
//
// [Note: a bad batch on a later step]
// Later steps check the batch on each rank given one, before any transfer, without a
// collective: a bad batch raises there at once, naming the rank, its stages and the batch,
// and the ranks waiting for its transfers fail in their receive or send, naming their rank,
// stage and action and the peer "which failed or is late": at once when that rank's process
// ends, at the group's timeout when it lives on. Agreeing every step would make that error
// immediate and the same everywhere, for one all-gather per step (as PyTorch, which checks
// nothing across ranks, does not pay) and, on NCCL, a host synchronization at the start of
// every step (reading the gathered result), which keeps the CPU from queuing the step's work
// while the GPU finishes the optimizer's step. A batch that changes size between steps is
// the only thing it would catch, so it is not agreed.
void PipelineSchedule::Impl::agree_first_step(const std::string& bad_batch) {
  const std::string built =
      fmt::format("{} stages, {} microbatches, program #{:016x}, transfers {}, scale_grads {}",
                  num_stages, microbatches, std::hash<std::string>{}(schedule_to_text(program)),
                  per_edge ? "per edge" : "on the pipeline group", options.scale_grads());
  std::vector<std::string> lines;
  try {
    const detail::Uncounted uncounted;
    lines = detail::all_gather_strings(
        fmt::format("{}\x1f{}\x1f{}", built, stage_list(), bad_batch), group);
  } catch (const std::exception& e) {
    DTENSOR_FAIL("{}, stages [{}], agreeing with the other ranks on the schedule and the batch "
                 "before the first step's transfers (a rank failed or is late): {}",
                 rank_name(), stage_list(), e.what());
  }
  std::vector<RankLine> ranks;
  bool same = true, splits = true;
  for (const auto& line : lines) {
    ranks.push_back(parse_line(line));
    same = same && ranks.back().built == ranks.front().built;
    splits = splits && ranks.back().bad_batch.empty();
  }
  std::vector<std::string> what;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!same) {
      what.push_back(
          fmt::format("pipeline rank {} (stages [{}]): {}", r, ranks[r].stages, ranks[r].built));
    } else if (!ranks[r].bad_batch.empty()) {
      what.push_back(fmt::format("pipeline rank {} (stages [{}]): {}", r, ranks[r].stages,
                                 ranks[r].bad_batch));
    }
  }
  DTENSOR_CHECK(same,
                "PipelineSchedule::step on {}: the pipeline ranks were built with different "
                "schedules, so nothing was sent: {}",
                group.to_string(), fmt::join(what, "; "));
  DTENSOR_CHECK(splits,
                "PipelineSchedule::step on {}: the batch does not split into the {} microbatches, "
                "so nothing was sent: {}",
                group.to_string(), microbatches, fmt::join(what, "; "));
}

// PyTorch's scale_grads (PipelineOptions::scale_grads), after the stage's last backward and
// its gradient reduction: every gradient of the stage's module, divided in place.
void PipelineSchedule::Impl::scale_grads(int s) {
  if (!options.scale_grads() || microbatches == 1) {
    return;
  }
  at::NoGradGuard no_grad;
  for (auto& p : stages.at(s).module->parameters()) {
    if (p.grad().defined()) {
      p.mutable_grad().div_(microbatches);
    }
  }
}

void PipelineSchedule::Impl::find_units(int s) {
  detail::StageUnits u;
  for (const auto& m : stages.at(s).module->modules(/*include_self=*/true)) {
    auto unit = fsdp_module(*m);
    if (unit && std::find(u.units.begin(), u.units.end(), *unit) == u.units.end()) {
      u.units.push_back(*unit);
    }
    if (auto replica = replicate_handle(*m)) {
      u.replicas.push_back(*replica);
    }
  }
  if (!u.units.empty()) {
    u.root = fsdp_module(*stages.at(s).module);
    DTENSOR_CHECK(u.root && u.root->is_root(),
                  "PipelineSchedule: stage {}'s module holds fully_shard units but is not itself "
                  "a root unit; apply fully_shard to the stage's module last (after its blocks), "
                  "so that the schedule can drive its gradient reduction",
                  s);
  }
  dp_units.emplace(s, std::move(u));
}

void PipelineSchedule::Impl::run_data_parallel(AT type, int s) {
  detail::StageUnits& u = dp_units.at(s);
  if ((type == AT::FullBackward || type == AT::BackwardWeight) && !u.replicas.empty()) {
    // replicate(): only the backward that completes the stage's weight gradients (its m-th B
    // or W) all-reduces them; a W is a real backward, so its hooks fire (pytorch#144530).
    const bool last = ++u.weight_backwards == microbatches;
    for (auto& r : u.replicas) {
      r.set_requires_gradient_sync(last);
    }
    if (last) {
      u.weight_backwards = 0;
    }
  }
  if (!u.root) {
    return; // a stage without fully_shard: nothing to unshard or reduce
  }
  switch (type) {
  case AT::Unshard:
    for (auto& unit : u.units) {
      unit.unshard(/*async_op=*/true);
    }
    break;
  case AT::Reshard:
    for (auto& unit : u.units) {
      unit.reshard();
    }
    break;
  case AT::ReduceGrad:
    u.root->set_requires_gradient_sync(true);
    u.root->set_reshard_after_backward(true);
    u.reduction = u.root->finalize_backward(/*async_op=*/true);
    break;
  case AT::WaitReduceGrad:
    u.reduction.wait();
    u.reduction = GradientReductionHandle();
    break;
  default: // before a backward of a microbatch
    u.root->set_requires_gradient_sync(false);
    u.root->set_reshard_after_backward(false);
    break;
  }
}

namespace {

// A backward from `root` (a released output's edge) with output gradient `dy` into `wrt`:
// accumulated into their .grad, or returned (accumulate false), as torch::autograd::backward
// and grad do from a tensor.
std::vector<at::Tensor> backward_from(const torch::autograd::Edge& root, const at::Tensor& dy,
                                      const std::vector<at::Tensor>& wrt, bool keep_graph,
                                      bool accumulate) {
  torch::autograd::edge_list outputs;
  for (const auto& t : wrt) {
    outputs.push_back(torch::autograd::impl::gradient_edge(t));
  }
  return torch::autograd::Engine::get_default_engine().execute({root}, {dy}, keep_graph,
                                                               /*create_graph=*/false, accumulate,
                                                               outputs);
}

} // namespace

void PipelineSchedule::Impl::forward(int s, int mb) {
  at::Tensor x;
  if (s == 0) {
    x = input_mbs.at(mb);
  } else if (is_local(s - 1)) {
    x = outputs.at({s - 1, mb}).detach(); // a V's turn: the previous stage is on this rank
  } else {
    x = detail::from_wire(take_recv(true, s, mb), in_shape.at(s), stages.at(s).mesh,
                          fmt::format("stage {}", s));
  }
  if (s > 0 && at::isFloatingType(x.scalar_type())) {
    x = x.detach().requires_grad_(true);
  }
  if (options.before_compute()) {
    options.before_compute()(s, mb);
  }
  compute_start = Clock::now();
  at::Tensor y = stages.at(s).forward(x);
  const Shape got = detail::shape_of(y);
  DTENSOR_CHECK(got == out_shape.at(s),
                "stage {}'s output for microbatch {} is {} but was {} on the first microbatch: a "
                "pipeline stage's output shape must not change",
                s, mb, got.str(), out_shape.at(s).str());
  inputs[{s, mb}] = x;
  if (s == num_stages - 1) {
    y = loss(y, target_mbs.at(mb)); // the backward starts here (scale_grads divides later)
    losses.at(mb) = y.detach();
  }
  outputs[{s, mb}] = y;
}

void PipelineSchedule::Impl::backward(AT type, int s, int mb) {
  if (options.before_compute()) { // activation checkpointing's recompute reads the same state
    options.before_compute()(s, mb);
  }
  Slot slot{s, mb};
  at::Tensor dy;
  if (type != AT::BackwardWeight) {
    if (s == num_stages - 1) {
      dy = at::Tensor(); // the loss: its gradient is one
    } else if (is_local(s + 1)) {
      dy = detail::as_grad_of(input_grads.at({s + 1, mb}), out_shape.at(s)); // a V's turn
      input_grads.erase({s + 1, mb});
    } else {
      dy = detail::from_wire(take_recv(false, s, mb), out_shape.at(s),
                             detail::mesh_of(outputs.at(slot)), fmt::format("stage {}", s));
      // The gradient came back, so the activation arrived: its send is done (no wait), and
      // the output is let go of before the backward ([Note: releasing sent tensors]).
      auto sent = in_flight.find({AT::SendF, s, mb});
      if (sent != in_flight.end() && sent->second.second.defined()) {
        release(sent->first, sent->second);
      }
    }
    grad_outputs[slot] = dy;
  } else {
    dy = grad_outputs.at(slot);
  }
  const at::Tensor y = outputs.at(slot);
  const at::Tensor x = inputs.at(slot);
  compute_start = Clock::now();
  run_data_parallel(type, s); // gradients accumulate unsharded until REDUCE_GRAD
  std::vector<at::Tensor> dys;
  if (dy.defined()) {
    dys.push_back(dy);
  }
  bool needs_input_grad = s > 0 && x.requires_grad();
  const auto edge = released.find(slot); // y let go of after its send, when there
  const bool from_edge = !y.defined() && edge != released.end();
  if (type == AT::BackwardInput) {
    if (needs_input_grad) {
      input_grads[slot] = from_edge
                              ? backward_from(edge->second, dy, {x}, /*keep_graph=*/true, false)[0]
                              : torch::autograd::grad({y}, {x}, dys, /*retain_graph=*/true)[0];
    }
    return; // the graph stays for W
  }
  std::vector<at::Tensor> params;
  for (const auto& p : stages.at(s).module->parameters()) {
    if (p.requires_grad()) {
      params.push_back(p);
    }
  }
  if (type == AT::FullBackward) {
    if (needs_input_grad) {
      params.push_back(x);
    }
  }
  // B into the parameters (and the input), or W into the parameters only, after I.
  if (from_edge) {
    backward_from(edge->second, dy, params, /*keep_graph=*/false, /*accumulate=*/true);
  } else {
    torch::autograd::backward({y}, dys, /*retain_graph=*/false, /*create_graph=*/false, params);
  }
  if (type == AT::FullBackward && needs_input_grad) {
    input_grads[slot] = x.grad();
  }
  inputs.erase(slot);
  outputs.erase(slot);
  grad_outputs.erase(slot);
  released.erase(slot);
}

void PipelineSchedule::Impl::run(const PipelineAction& a) {
  for (const auto& part : a.sub_actions) { // OVERLAP_F_B: one after the other
    run(part);
  }
  if (a.is_compute() && a.sub_actions.empty()) {
    release_sent(); // [Note: releasing sent tensors]
  }
  int s = a.stage;
  int mb = a.microbatch.value_or(-1);
  switch (a.type) {
  case AT::Forward:
    forward(s, mb);
    record(a);
    break;
  case AT::FullBackward:
  case AT::BackwardInput:
  case AT::BackwardWeight:
    backward(a.type, s, mb);
    record(a);
    break;
  case AT::RecvF:
  case AT::RecvB:
    post_recv(a.type == AT::RecvF, s, mb);
    break;
  case AT::SendF:
  case AT::SendB:
    post_send(a.type == AT::SendF, s, mb);
    break;
  case AT::WaitSendF:
  case AT::WaitSendB:
    wait_send(a.type == AT::WaitSendF, s, mb);
    break;
  case AT::Unshard:
  case AT::Reshard:
  case AT::ReduceGrad:
    run_data_parallel(a.type, s);
    break;
  case AT::WaitReduceGrad:
    run_data_parallel(a.type, s);
    scale_grads(s); // the stage's gradients are complete (and reduced) here
    break;
  case AT::OverlapFB:
    break;
  }
}

void PipelineSchedule::Impl::record(const PipelineAction& a) {
  if (options.record_timeline() && compute_start) {
    auto seconds = [&](Clock::time_point t) {
      return std::chrono::duration<double>(t - step_start).count();
    };
    timeline.push_back({group.rank(), a, seconds(*compute_start), seconds(Clock::now())});
  }
  compute_start.reset();
}

void PipelineSchedule::Impl::check_done() {
  std::vector<std::string> left;
  for (const auto& [k, v] : in_flight) {
    auto [type, s, mb] = k;
    left.push_back(fmt::format("{}{}{}", s, action_type_name(type), mb));
  }
  DTENSOR_CHECK(left.empty(), "pipeline step ended with transfers never waited for: {}",
                fmt::join(left, ", "));
  inputs.clear();
  outputs.clear();
  grad_outputs.clear();
  input_grads.clear();
  released.clear();
  recv_buffers = static_cast<int64_t>(recv_pool.size());
  recv_pool.clear(); // [Note: receive buffers]
}

PipelineSchedule::PipelineSchedule(std::vector<PipelineStage> stages, Group group,
                                   const PipelineOrder& compute, int microbatches,
                                   PipelineLoss loss, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.group = std::move(group);
  d.microbatches = microbatches;
  d.loss = std::move(loss);
  d.options = std::move(options);
  DTENSOR_CHECK(d.group.defined(), "PipelineSchedule: the pipeline group is undefined");
  DTENSOR_CHECK(static_cast<int>(compute.size()) == d.group.size(),
                "PipelineSchedule: the schedule has {} pipeline ranks but the group {} has {}",
                compute.size(), d.group.to_string(), d.group.size());
  for (const auto& rank : compute) {
    for (const auto& a : rank) {
      if (a) {
        for (const auto& part : detail::parts_of(*a)) {
          d.num_stages = std::max(d.num_stages, part.stage + 1);
        }
      }
    }
  }
  d.program = lower_schedule(compute, d.num_stages, microbatches, d.options.lowering());
  d.placement = validate_schedule(compute, d.num_stages, microbatches);
  std::vector<int> mine, given;
  for (int s = 0; s < d.num_stages; ++s) {
    if (d.placement[s] == d.group.rank()) {
      mine.push_back(s);
    }
  }
  for (auto& st : stages) {
    DTENSOR_CHECK(st.module && st.forward,
                  "PipelineSchedule: stage {} needs a module and a forward", st.index);
    given.push_back(st.index);
    int index = st.index;
    d.stages.emplace(index, std::move(st));
    d.find_units(index);
  }
  std::sort(given.begin(), given.end());
  DTENSOR_CHECK(given == mine,
                "PipelineSchedule: the schedule places stages [{}] on pipeline rank {}, but this "
                "rank was given stages [{}]",
                fmt::join(mine, ", "), d.group.rank(), fmt::join(given, ", "));
  d.per_edge = d.options.group_per_edge().value_or(d.group.backend_type() == BackendType::Nccl);
  d.find_proven_sends();
}

PipelineSchedule::~PipelineSchedule() = default;

const PipelineOrder& PipelineSchedule::program() const {
  return impl_->program;
}

const std::vector<TimedAction>& PipelineSchedule::last_step_timeline() const {
  return impl_->timeline;
}

double PipelineSchedule::last_step_seconds() const {
  return impl_->step_seconds;
}

int64_t PipelineSchedule::receive_buffer_count() const {
  return impl_->recv_buffers;
}

namespace {

// "stage 1", or an OVERLAP_F_B's "stages 0 and 3": the stages an action runs.
std::string stages_of(const PipelineAction& a) {
  std::vector<int> s;
  for (const auto& part : detail::parts_of(a)) {
    s.push_back(part.stage);
  }
  return s.size() == 1 ? fmt::format("stage {}", s[0])
                       : fmt::format("stages {}", fmt::join(s, " and "));
}

} // namespace

std::vector<at::Tensor> PipelineSchedule::step(const at::Tensor& input, const at::Tensor& target) {
  Impl& d = *impl_;
  const int m = d.microbatches;
  const bool last = d.is_local(d.num_stages - 1);
  const std::string bad_batch = d.split_batch(input, target);
  if (!d.agreed) {
    d.agree_first_step(bad_batch); // [Note: agreeing before the first step]
    if (d.per_edge) {
      try {
        d.make_edge_groups();
      } catch (const std::exception& e) {
        DTENSOR_FAIL("{}, stages [{}], making the communicators of its pipeline edges: {}",
                     d.rank_name(), d.stage_list(), e.what());
      }
    }
    d.agreed = true;
  }
  DTENSOR_CHECK(bad_batch.empty(), // [Note: a bad batch on a later step]
                "PipelineSchedule::step: {}, stages [{}], before the step's first transfer: {}",
                d.rank_name(), d.stage_list(), bad_batch);
  d.losses.assign(last ? m : 0, at::Tensor());
  if (!d.shapes_known) {
    d.find_shapes();
  }
  d.timeline.clear();
  for (auto& [s, u] : d.dp_units) {
    u.weight_backwards = 0;
  }
  d.step_start = Impl::Clock::now();
  const auto& mine = d.program.at(d.group.rank());
  for (size_t i = 0; i < mine.size(); ++i) {
    const PipelineAction& a = *mine[i];
    try {
      d.run(a);
    } catch (const std::exception& e) {
      DTENSOR_FAIL("{}, {}, action {} (step {} of its program): {}", d.rank_name(), stages_of(a),
                   a.str(), i, e.what());
    }
  }
  d.check_done();
  d.step_seconds = std::chrono::duration<double>(Impl::Clock::now() - d.step_start).count();
  return last ? d.losses : std::vector<at::Tensor>{};
}

} // namespace dtensor
