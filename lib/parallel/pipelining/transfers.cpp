// Point-to-point transfers of the pipeline runtime (PipelineSchedule::Impl,
// runtime_impl.h): receives into reused buffers, sends, their waits and early release, and
// the per-edge communicators.
//
// [Note: a communicator per pipeline edge] With group_per_edge, the transfers across stage
// boundary b (stage b to b+1) go on two communicators over [rank of b, rank of b+1]: one for
// the activations, one for the input gradients, each named for its boundary and direction.
// On each of them one rank only sends and the other only receives, both in the order of
// the microbatches (every schedule runs a stage's forwards, and its backwards, in microbatch
// order), so a receive posted ahead waits only for its own send, on no other transfer's
// stream. They are made at the first step, once the ranks have agreed on the schedule ([Note:
// agreeing before the first step] in runtime.cpp: ranks built with other stages would wait in
// each other's rendezvous), boundary after boundary on every rank: a rank waits only at a
// lower boundary whose two ranks have made every boundary below it, so the rendezvous cannot
// deadlock. Cached by name: another schedule over the same edges reuses them.
#include "parallel/pipelining/runtime_impl.h"

#include <string>

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work's c10d work, released here

namespace dtensor {

// [Note: the pipeline runtime] (runtime.cpp): the first step's shape exchange. A failure names
// the rank, the stage and what it was doing: its forward of microbatch 0, or the transfer of a
// shape and the peer that failed or is late.
void PipelineSchedule::Impl::find_shapes() {
  detail::Uncounted uncounted;
  std::vector<std::pair<int, Work>> sends; // (sending stage, its send)
  std::vector<at::Tensor> keep;
  std::map<int, at::Tensor> out; // for a V's turn
  at::NoGradGuard no_grad;
  const std::string exchange = "the first step's shape exchange";
  for (auto& [s, stage] : stages) {
    std::string doing = "its forward of microbatch 0";
    try {
      at::Tensor x;
      if (s == 0) {
        x = input_mbs.at(0);
      } else if (is_local(s - 1)) {
        x = out.at(s - 1);
      } else {
        // [Note: pipeline buffers on the rank's device] What a pipeline rank receives lands
        // on default_device(): cuda:LOCAL_RANK under NCCL (which moves device memory only),
        // the CPU under Gloo, the simulated device in a simulated world (shape messages
        // excepted: detail::shape_message_device()).
        at::Tensor meta = at::empty({detail::kShapeMetaLen},
                                    at::dtype(at::kLong).device(detail::shape_message_device()));
        doing = fmt::format("receiving its input's shape from pipeline rank {} (stage {}), "
                            "which failed or is late",
                            placement[s - 1], s - 1);
        dtensor::recv(meta, placement[s - 1], group, kMetaTag + s);
        doing = "its forward of microbatch 0";
        const Shape in = detail::decode_shape(meta);
        x = detail::from_wire(at::zeros(in.sizes, at::dtype(in.dtype).device(default_device())), in,
                              stage.mesh, fmt::format("stage {}", s));
      }
      in_shape[s] = detail::shape_of(x);
      if (options.before_compute()) {
        options.before_compute()(s, 0);
      }
      out[s] = stage.forward(x);
      out_shape[s] = detail::shape_of(out[s]);
      if (s + 1 < num_stages && !is_local(s + 1)) {
        doing = fmt::format("sending stage {}'s input shape to pipeline rank {}", s + 1,
                            placement[s + 1]);
        keep.push_back(detail::encode_shape(out_shape[s]));
        sends.emplace_back(s, dtensor::send(keep.back(), placement[s + 1], group, kMetaTag + s + 1,
                                            CollectiveOptions().async_op(true)));
      }
    } catch (const std::exception& e) {
      DTENSOR_FAIL("{}, stage {}, {} ({}): {}", rank_name(), s, exchange, doing, e.what());
    }
  }
  for (auto& [s, w] : sends) {
    try {
      w.wait();
    } catch (const std::exception& e) {
      DTENSOR_FAIL("{}, stage {}, {} (sending stage {}'s input shape to pipeline rank {}, which "
                   "failed or is late): {}",
                   rank_name(), s, exchange, s + 1, placement[s + 1], e.what());
    }
  }
  for (auto& [s, u] : dp_units) { // so that the step's UNSHARD gathers them, counted
    for (auto& unit : u.units) {
      unit.reshard();
    }
  }
  shapes_known = true;
}

void PipelineSchedule::Impl::make_edge_groups() {
  const std::vector<int>& ranks = group.ranks();
  for (int b = 0; b + 1 < num_stages; ++b) {
    const int lo = placement[b];
    const int hi = placement[b + 1];
    if (lo == hi || (group.rank() != lo && group.rank() != hi)) {
      continue;
    }
    for (bool fwd : {true, false}) {
      const std::string name = fmt::format("pp-{}-{}{}", b, b + 1, fwd ? "F" : "B");
      edges[{b, fwd}] =
          new_group({ranks[static_cast<size_t>(lo)], ranks[static_cast<size_t>(hi)]},
                    fmt::format("{}:{}", group.label(), name), GroupOptions().name(name));
    }
  }
}

std::pair<const Group*, int> PipelineSchedule::Impl::route(int b, bool fwd, bool to_next) const {
  auto it = edges.find({b, fwd});
  if (it == edges.end()) {
    return {&group, placement[to_next ? b + 1 : b]};
  }
  return {&it->second, to_next ? 1 : 0};
}

void PipelineSchedule::Impl::post_recv(bool fwd, int s, int mb) {
  // A forward receive fills stage s's input from stage s-1; a backward one its output's
  // gradient from stage s+1.
  const Shape& shape = fwd ? in_shape.at(s) : out_shape.at(s); // local sizes
  at::Tensor buf = recv_buffer(shape);
  const auto [on, peer] = fwd ? route(s - 1, true, false) : route(s, false, true);
  Work w = dtensor::recv(buf, peer, *on, tag(fwd, s, mb), CollectiveOptions().async_op(true));
  in_flight.emplace(std::tuple{fwd ? AT::RecvF : AT::RecvB, s, mb}, std::pair{std::move(w), buf});
}

at::Tensor PipelineSchedule::Impl::recv_buffer(const Shape& shape) {
  for (const at::Tensor& t : recv_pool) {
    // Only the list holds it: this handle (no receive or action holds the tensor) and its
    // storage (no view, detached copy or tensor autograd saved).
    if (t.use_count() == 1 && t.storage().use_count() == 1 && t.scalar_type() == shape.dtype &&
        t.sizes() == at::IntArrayRef(shape.sizes)) {
      return t; // its storage's other owners are gone: reused ([Note: receive buffers])
    }
  }
  // [Note: pipeline buffers on the rank's device] (find_shapes, above).
  recv_pool.push_back(at::empty(shape.sizes, at::dtype(shape.dtype).device(default_device())));
  return recv_pool.back();
}

at::Tensor PipelineSchedule::Impl::take_recv(bool fwd, int s, int mb) {
  const std::tuple<AT, int, int> key{fwd ? AT::RecvF : AT::RecvB, s, mb};
  auto it = in_flight.find(key);
  DTENSOR_CHECK(it != in_flight.end(), "nothing was received for stage {}, microbatch {} ({})", s,
                mb, fwd ? "its input" : "its output's gradient");
  try {
    it->second.first.wait();
  } catch (const std::exception& e) {
    const int from = fwd ? s - 1 : s + 1;
    DTENSOR_FAIL("waiting for {} of microbatch {} from pipeline rank {} (stage {}), which failed "
                 "or is late: {}",
                 fwd ? "the input" : "the output's gradient", mb, placement.at(from), from,
                 e.what());
  }
  at::Tensor t = it->second.second;
  in_flight.erase(it);
  auto proven = proven_by.find(key); // [Note: sends a receive proves received]
  if (proven != proven_by.end()) {
    for (const auto& send : proven->second) {
      auto sent = in_flight.find(send);
      if (sent != in_flight.end() && sent->second.second.defined()) {
        release(sent->first, sent->second);
      }
    }
  }
  return t;
}

// [Note: sends a receive proves received] A send's tensor can be let go of only once the send
// completed, which a Gloo send reports only when waited for, and waiting is safe only once
// the peer has posted the matching receive. Every rank's program is known here, and each
// rank runs its own in order: when this rank receives what the peer sent at position i of
// its program, the peer has posted every receive before i. So this rank's sends whose
// matching receives come before i can be waited for then without waiting on anything else
// (the transfer has been under way since both sides were posted), and their tensors let go
// of. On 1F1B's first stage, the gradient of microbatch i proves the activation of i + 1
// received, which PyTorch 2.15 also waits for and releases before the backward of i (its send
// and that receive are one batch); without it the activation lives through that backward.
void PipelineSchedule::Impl::find_proven_sends() {
  using Key = std::tuple<AT, int, int>;
  std::map<std::pair<int, Key>, size_t> position; // (rank, transfer) -> index in its program
  for (size_t r = 0; r < program.size(); ++r) {
    for (size_t i = 0; i < program[r].size(); ++i) {
      const auto& a = program[r][i];
      if (a && a->microbatch) {
        position[{static_cast<int>(r), Key{a->type, a->stage, *a->microbatch}}] = i;
      }
    }
  }
  auto where = [&](int rank, const Key& k) -> std::optional<size_t> {
    auto it = position.find({rank, k});
    return it == position.end() ? std::nullopt : std::optional<size_t>(it->second);
  };
  const auto& mine = program.at(static_cast<size_t>(group.rank()));
  for (const auto& x : mine) {
    if (!x || (x->type != AT::RecvF && x->type != AT::RecvB) || !x->microbatch) {
      continue;
    }
    const bool fwd = x->type == AT::RecvF;
    const int from = fwd ? x->stage - 1 : x->stage + 1;
    const int peer = placement.at(static_cast<size_t>(from));
    const auto sent_at = where(peer, Key{fwd ? AT::SendF : AT::SendB, from, *x->microbatch});
    for (const auto& y : mine) {
      if (!y || (y->type != AT::SendF && y->type != AT::SendB) || !y->microbatch) {
        continue;
      }
      const bool out = y->type == AT::SendF;
      const int to = out ? y->stage + 1 : y->stage - 1;
      if (placement.at(static_cast<size_t>(to)) != peer) {
        continue;
      }
      const auto recv_at = where(peer, Key{out ? AT::RecvF : AT::RecvB, to, *y->microbatch});
      if (sent_at && recv_at && *recv_at < *sent_at) {
        proven_by[Key{x->type, x->stage, *x->microbatch}].push_back(
            Key{y->type, y->stage, *y->microbatch});
      }
    }
  }
}

void PipelineSchedule::Impl::post_send(bool fwd, int s, int mb) {
  // Stage s's output goes to s+1; its input's gradient to s-1. The tag is the receiver's.
  at::Tensor t = fwd ? detail::wire_of(outputs.at({s, mb}))
                     : detail::grad_to_wire(input_grads.at({s, mb}), in_shape.at(s));
  int to = fwd ? s + 1 : s - 1;
  const auto [on, peer] = fwd ? route(s, true, true) : route(s - 1, false, false);
  Work w = dtensor::send(t, peer, *on, tag(fwd, to, mb), CollectiveOptions().async_op(true));
  in_flight.emplace(std::tuple{fwd ? AT::SendF : AT::SendB, s, mb}, std::pair{std::move(w), t});
  if (!fwd) {
    input_grads.erase({s, mb});
  }
}

// [Note: releasing sent tensors] A send's tensor (an activation, or an input gradient nothing
// else refers to) is held by its Work until the schedule's WAIT_SEND, which the lowering puts
// after the backward that proves arrival (activations) or at the end of the step (input
// gradients). Sends are completed and let go of their tensors earlier, their WAIT_SEND then
// finding them done: before each compute action, those the backend reports delivered (NCCL;
// a Gloo send reports nothing until waited for), and an activation's send as soon as its
// gradient has come back (which proves it arrived), before the backward. A sent activation
// (a plain tensor) is also let go of by its stage, which keeps only the autograd edge its
// backward starts from (PyTorch 2.15's release_fwd_send_outputs): the output's memory is
// freed unless its own backward saved it, instead of living through that backward.
void PipelineSchedule::Impl::release_sent() {
  for (auto& [key, entry] : in_flight) {
    const AT type = std::get<0>(key);
    if ((type == AT::SendF || type == AT::SendB) && entry.second.defined() &&
        entry.first.is_ready()) {
      release(key, entry);
    }
  }
}

namespace {

// Waits for a send of stage s (SEND_F to s + 1, SEND_B to s - 1); a failure names the peer.
void wait_for_send(Work& work, bool fwd, int s, int mb, const std::vector<int>& placement) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    const int to = fwd ? s + 1 : s - 1;
    DTENSOR_FAIL("the send of {} of microbatch {} to pipeline rank {} (stage {}), which failed or "
                 "is late: {}",
                 fwd ? "the output" : "the input's gradient", mb, placement.at(to), to, e.what());
  }
}

} // namespace

void PipelineSchedule::Impl::release(const std::tuple<AT, int, int>& key,
                                     std::pair<Work, at::Tensor>& entry) {
  const auto [type, s, mb] = key;
  wait_for_send(entry.first, type == AT::SendF, s, mb, placement); // raises a failed send here
  entry = {Work(), at::Tensor()};
  auto out = outputs.find({s, mb});
  if (type == AT::SendF && out != outputs.end() && !is_dtensor(out->second) &&
      out->second.requires_grad()) {
    released[{s, mb}] = torch::autograd::impl::gradient_edge(out->second);
    out->second = at::Tensor();
  }
}

void PipelineSchedule::Impl::wait_send(bool fwd, int s, int mb) {
  auto it = in_flight.find({fwd ? AT::SendF : AT::SendB, s, mb});
  DTENSOR_CHECK(it != in_flight.end(), "no send of stage {}, microbatch {} to wait for", s, mb);
  wait_for_send(it->second.first, fwd, s, mb, placement);
  in_flight.erase(it);
}

} // namespace dtensor
