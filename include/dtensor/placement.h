#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <dtensor/reduce_op.h>

namespace dtensor {

// How a tensor is laid out over one mesh dimension.
//   Shard(d):     each rank holds a chunk of tensor dimension d, with torch.chunk semantics
//                 (chunk size ceil(n / k); trailing ranks may hold a smaller or empty chunk).
//   Replicate():  each rank holds the whole tensor.
//   Partial(op):  each rank holds a partial value; the tensor is their reduction by `op`.
//   Partial::norm(p): each rank holds the p-norm of its part; the tensor is the p-norm of
//                 the parts (for finite p: (sum |x_r|^p)^(1/p); inf: max; -inf: min; 0: sum).
class Placement {
 public:
  enum class Kind { Shard, Replicate, Partial };

  static Placement shard(int64_t dim);
  static Placement replicate();
  static Placement partial(ReduceOp op = ReduceOp::Sum);
  static Placement partial_norm(double p);

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::Shard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::Shard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::Replicate; }
  bool is_partial() const { return kind_ == Kind::Partial; }
  bool is_norm_partial() const { return kind_ == Kind::Partial && norm_; }

  int64_t dim() const; // Shard only (normalised once the tensor's rank is known)
  ReduceOp reduce_op() const; // Partial only (for norm partials: the op of the reduction)
  double norm_p() const; // norm partials only

  // This placement with a negative shard dim made non-negative for a tensor of rank `ndim`.
  Placement normalized(int64_t ndim) const;

  std::string to_string() const; // "Shard(0)", "Replicate()", "Partial(sum)", "Partial(norm 2)"
  bool operator==(const Placement& other) const;
  bool operator!=(const Placement& other) const { return !(*this == other); }
  size_t hash() const;

 private:
  Placement(Kind kind, int64_t dim, ReduceOp op, bool norm, double p)
      : kind_(kind), dim_(dim), op_(op), norm_(norm), p_(p) {}
  Kind kind_;
  int64_t dim_ = 0;
  ReduceOp op_ = ReduceOp::Sum;
  bool norm_ = false;
  double p_ = 0;
};

using Placements = std::vector<Placement>;

// PyTorch-like spellings: Shard(0), Replicate(), Partial().
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement Partial(ReduceOp op = ReduceOp::Sum) { return Placement::partial(op); }

std::string to_string(const Placements& placements); // "(Shard(0), Replicate())"
std::ostream& operator<<(std::ostream& os, const Placement& p);

// torch.chunk semantics: size and offset of chunk `index` of `n` elements cut in `chunks`.
int64_t chunk_size(int64_t n, int64_t chunks, int64_t index);
int64_t chunk_offset(int64_t n, int64_t chunks, int64_t index);

} // namespace dtensor
