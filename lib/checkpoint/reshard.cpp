// reshard (include/dtensor/reshard.h): tensors from one layout to another by point-to-point
// transfers planned from every rank's pieces.
#include <dtensor/reshard.h>

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "mesh/agree.h"
#include "tensor/dtensor_impl.h"

namespace dtensor {

// [Note: the reshard plan]
// The checkpoint's saving plan knows which rank holds which piece of each name; resharding
// uses the same description to move pieces between ranks instead of through files:
//  - every rank describes its source pieces and its target pieces (name, dtype, global shape,
//    offsets and shape of its piece); one exchange of these few bytes per tensor gives every
//    rank the whole picture, and every rank then computes the same plan and the same errors;
//  - the distinct source pieces of a name must tile it (replicas hold the same piece); each
//    target piece takes its overlap with each of them from its own rank when it holds that
//    piece (a local copy), else from one holder, the one with the fewest bytes to send so far;
//  - the overlaps one rank sends another travel as one message, in the plan's order, each
//    overlap in the smaller dtype of its source and target (cast before sending when the
//    target's is smaller, after receiving otherwise): an element crosses the network at most
//    once per target piece needing it, and only where its target rank does not hold it.
// Sends and receives are all posted, then waited on: no ordering between peers can deadlock.

namespace {

using Box = std::pair<std::vector<int64_t>, std::vector<int64_t>>; // offsets, shape

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    n *= s;
  }
  return n;
}

// This rank's piece of one tensor.
struct Local {
  std::string key;
  at::Tensor local;
  std::vector<int64_t> shape; // global
  Box box;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

std::vector<Local> locals(const StateDict& state, const char* side) {
  std::vector<Local> out;
  for (const auto& item : state) {
    const at::Tensor& t = item.value();
    DTENSOR_CHECK(t.defined(), "{} '{}' is an undefined tensor", side, item.key());
    DTENSOR_CHECK(item.key().find_first_of("\t\n") == std::string::npos && !item.key().empty(),
                  "{} name '{}' is empty or holds a tab or newline", side, item.key());
    Local l{item.key(),
            t,
            t.sizes().vec(),
            {std::vector<int64_t>(t.dim(), 0), t.sizes().vec()},
            t.scalar_type()};
    if (const detail::DTensorMeta* m = detail::dtensor_meta(t)) {
      DTENSOR_CHECK(!m->spec.has_partial(), "{} '{}' is Partial ({}); reduce it first", side,
                    item.key(), to_string(m->spec.placements));
      if (!m->spec.mesh.get_coordinate()) {
        continue; // this rank is outside the tensor's mesh: it holds nothing of it
      }
      l.local = m->local;
      l.shape = m->spec.shape;
      l.box = {m->spec.local_offset(), m->spec.local_shape()};
    }
    out.push_back(std::move(l));
  }
  return out;
}

std::string describe(const std::vector<Local>& pieces, char side) {
  std::ostringstream text;
  for (const Local& l : pieces) {
    text << side << '\t' << l.key << '\t' << static_cast<int>(l.dtype) << ' ' << l.shape.size();
    for (const auto* v : {&l.shape, &l.box.first, &l.box.second}) {
      for (int64_t x : *v) {
        text << ' ' << x;
      }
    }
    text << '\n';
  }
  return text.str();
}

struct Piece {
  int rank = 0;
  size_t index = 0; // into that rank's source or target list
  Box box;
};

struct Name {
  std::string key;
  std::vector<int64_t> shape;
  c10::ScalarType source_dtype = c10::ScalarType::Float;
  c10::ScalarType target_dtype = c10::ScalarType::Float;
  std::vector<Piece> sources, targets;
};

// Every rank's pieces, by name in the order of first appearance.
std::vector<Name> gather_names(const std::vector<std::string>& texts, const std::string& what) {
  std::vector<Name> names;
  std::map<std::string, size_t> position;
  std::map<std::pair<int, char>, size_t> counts;
  for (size_t r = 0; r < texts.size(); ++r) {
    std::istringstream lines(texts[r]);
    std::string line;
    while (std::getline(lines, line)) {
      const size_t a = line.find('\t');
      const size_t b = line.find('\t', a + 1);
      const char side = line[0];
      const std::string key = line.substr(a + 1, b - a - 1);
      std::istringstream nums(line.substr(b + 1));
      int dtype = 0;
      size_t ndim = 0;
      nums >> dtype >> ndim;
      std::vector<int64_t> v(3 * ndim);
      for (auto& x : v) {
        nums >> x;
      }
      const std::vector<int64_t> shape(v.begin(), v.begin() + ndim);
      auto [it, added] = position.emplace(key, names.size());
      if (added) {
        names.push_back(Name{key, shape, {}, {}, {}, {}});
      }
      Name& n = names[it->second];
      DTENSOR_CHECK(n.shape == shape,
                    "{}: rank {} passes '{}' with global shape {} where another piece has {}", what,
                    r, key, shape, n.shape);
      const auto dt = static_cast<c10::ScalarType>(dtype);
      const bool source = side == 'S';
      DTENSOR_CHECK(!source || n.sources.empty() || n.source_dtype == dt,
                    "{}: the sources of '{}' disagree on its dtype ({} on rank {}, {} before)",
                    what, key, c10::toString(dt), r, c10::toString(n.source_dtype));
      (source ? n.source_dtype : n.target_dtype) = dt;
      (source ? n.sources : n.targets)
          .push_back({static_cast<int>(r),
                      counts[{static_cast<int>(r), side}]++,
                      {std::vector<int64_t>(v.begin() + ndim, v.begin() + 2 * ndim),
                       std::vector<int64_t>(v.begin() + 2 * ndim, v.end())}});
    }
  }
  return names;
}

std::optional<Box> overlap(const Box& x, const Box& y) {
  Box out;
  for (size_t d = 0; d < x.first.size(); ++d) {
    const int64_t lo = std::max(x.first[d], y.first[d]);
    const int64_t hi = std::min(x.first[d] + x.second[d], y.first[d] + y.second[d]);
    if (hi <= lo) {
      return std::nullopt;
    }
    out.first.push_back(lo);
    out.second.push_back(hi - lo);
  }
  return out;
}

// The region `global` of a piece whose box starts at `origin`.
at::Tensor region(at::Tensor t, const std::vector<int64_t>& origin, const Box& global) {
  for (size_t d = 0; d < origin.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), global.first[d] - origin[d], global.second[d]);
  }
  return t;
}

// One overlap of the plan: from a source piece to a target piece.
struct Move {
  const Name* name;
  const Piece* source;
  const Piece* target;
  Box box;
  c10::ScalarType dtype; // on the wire
};

std::vector<Move> plan(const std::vector<Name>& names, int world, const std::string& what) {
  std::vector<Move> moves;
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  for (const Name& n : names) {
    if (n.targets.empty()) {
      continue;
    }
    DTENSOR_CHECK(!n.sources.empty(), "{}: no rank passes a source for target '{}'", what, n.key);
    std::vector<Box> boxes;
    std::vector<std::vector<const Piece*>> holders;
    for (const Piece& p : n.sources) {
      auto it = std::find(boxes.begin(), boxes.end(), p.box);
      if (it == boxes.end()) {
        boxes.push_back(p.box);
        holders.emplace_back();
        it = boxes.end() - 1;
      }
      holders[static_cast<size_t>(it - boxes.begin())].push_back(&p);
    }
    int64_t covered = 0;
    for (const Box& b : boxes) {
      covered += numel(b.second);
    }
    DTENSOR_CHECK(covered == numel(n.shape),
                  "{}: the distinct source pieces of '{}' {} cover {} elements of its {}: they "
                  "must tile it",
                  what, n.key, n.shape, covered, numel(n.shape));
    const c10::ScalarType wire =
        c10::elementSize(n.target_dtype) <= c10::elementSize(n.source_dtype) ? n.target_dtype
                                                                             : n.source_dtype;
    for (const Piece& t : n.targets) {
      for (size_t b = 0; b < boxes.size(); ++b) {
        const std::optional<Box> o = overlap(t.box, boxes[b]);
        if (!o || numel(o->second) == 0) {
          continue;
        }
        const Piece* from = nullptr;
        for (const Piece* h : holders[b]) {
          if (h->rank == t.rank) {
            from = h;
          }
        }
        if (from == nullptr) {
          from = *std::min_element(
              holders[b].begin(), holders[b].end(), [&](const Piece* x, const Piece* y) {
                return load[static_cast<size_t>(x->rank)] < load[static_cast<size_t>(y->rank)];
              });
          load[static_cast<size_t>(from->rank)] +=
              numel(o->second) * static_cast<int64_t>(c10::elementSize(wire));
        }
        moves.push_back({&n, from, &t, *o, wire});
      }
    }
  }
  return moves;
}

at::Tensor as_bytes(const at::Tensor& t) {
  return t.contiguous().view({-1}).view(at::kByte);
}

} // namespace

ReshardStats reshard(const StateDict& source, const StateDict& target,
                     const ReshardOptions& options) {
  const std::string& what = options.what();
  const Group world = world_group();
  // A rank's own refusal is every rank's, before the exchange below could wait for it.
  std::vector<Local> src, tgt;
  std::string error;
  try {
    src = locals(source, "source");
    tgt = locals(target, "target");
  } catch (const Error& e) {
    error = e.what();
  }
  detail::agree_on_errors(what, error, world);
  const std::vector<std::string> texts =
      detail::all_gather_strings(describe(src, 'S') + describe(tgt, 'T'), world);
  const std::vector<Name> names = gather_names(texts, what);
  const std::vector<Move> moves = plan(names, world.size(), what);
  const int me = world.rank();
  at::NoGradGuard no_grad;
  ReshardStats stats;
  const auto source_of = [&](const Move& m) {
    return region(src[m.source->index].local, m.source->box.first, m.box);
  };
  const auto target_of = [&](const Move& m) {
    return region(tgt[m.target->index].local, m.target->box.first, m.box);
  };
  // Per peer, in the plan's order: what this rank sends and receives.
  std::vector<std::vector<at::Tensor>> out(static_cast<size_t>(world.size()));
  std::vector<std::vector<const Move*>> in(static_cast<size_t>(world.size()));
  std::vector<int64_t> in_bytes(static_cast<size_t>(world.size()), 0);
  std::vector<const Move*> local;
  for (const Move& m : moves) {
    const int from = m.source->rank;
    const int to = m.target->rank;
    if (from == me && to == me) {
      local.push_back(&m);
      stats.bytes_local += numel(m.box.second) * static_cast<int64_t>(c10::elementSize(m.dtype));
    } else if (from == me) {
      out[static_cast<size_t>(to)].push_back(as_bytes(source_of(m).to(m.dtype)));
    } else if (to == me) {
      in[static_cast<size_t>(from)].push_back(&m);
      in_bytes[static_cast<size_t>(from)] +=
          numel(m.box.second) * static_cast<int64_t>(c10::elementSize(m.dtype));
    }
  }
  std::vector<at::Tensor> received(static_cast<size_t>(world.size()));
  std::vector<at::Tensor> sent(static_cast<size_t>(world.size()));
  std::vector<Work> works;
  for (int p = 0; p < world.size(); ++p) {
    const auto i = static_cast<size_t>(p);
    if (in_bytes[i] > 0) {
      received[i] = at::empty({in_bytes[i]}, at::TensorOptions().dtype(at::kByte));
      works.push_back(recv(received[i], p, world, 0, CollectiveOptions().async_op(true)));
      stats.bytes_received += in_bytes[i];
    }
    if (!out[i].empty()) {
      sent[i] = at::cat(out[i]);
      works.push_back(send(sent[i], p, world, 0, CollectiveOptions().async_op(true)));
      stats.bytes_sent += sent[i].numel();
    }
    stats.peers += in_bytes[i] > 0 || !out[i].empty() ? 1 : 0;
  }
  for (Work& w : works) {
    w.wait();
  }
  // Targets are written only once every transfer has arrived: a failed peer (a timeout, a
  // lost rank) leaves this rank's targets as they were.
  for (const Move* m : local) {
    target_of(*m).copy_(source_of(*m));
  }
  for (int p = 0; p < world.size(); ++p) {
    const auto i = static_cast<size_t>(p);
    int64_t at_byte = 0;
    for (const Move* m : in[i]) {
      const int64_t n = numel(m->box.second) * static_cast<int64_t>(c10::elementSize(m->dtype));
      // A copy: the overlap's bytes may sit at an offset its dtype cannot be viewed at.
      target_of(*m).copy_(
          received[i].narrow(0, at_byte, n).clone().view(m->dtype).view(m->box.second));
      at_byte += n;
    }
  }
  return stats;
}

} // namespace dtensor
