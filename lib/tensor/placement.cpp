// Placements and chunk arithmetic.
#include <dtensor/placement.h>

#include <cmath>
#include <functional>
#include <ostream>

#include "internal/check.h"

namespace dtensor {

Placement Placement::shard(int64_t dim) { return Placement(Kind::Shard, dim, ReduceOp::Sum, false, 0); }

Placement Placement::replicate() { return Placement(Kind::Replicate, 0, ReduceOp::Sum, false, 0); }

Placement Placement::partial(ReduceOp op) { return Placement(Kind::Partial, 0, op, false, 0); }

Placement Placement::partial_norm(double p) {
  DTENSOR_CHECK(p >= 0 || std::isinf(p), "Partial::norm: p must be > 0, 0, inf or -inf, got {}", p);
  ReduceOp op = std::isinf(p) ? (p > 0 ? ReduceOp::Max : ReduceOp::Min) : ReduceOp::Sum;
  return Placement(Kind::Partial, 0, op, true, p);
}

int64_t Placement::dim() const {
  DTENSOR_CHECK(is_shard(), "Placement::dim: {} is not a Shard", to_string());
  return dim_;
}

ReduceOp Placement::reduce_op() const {
  DTENSOR_CHECK(is_partial(), "Placement::reduce_op: {} is not a Partial", to_string());
  return op_;
}

double Placement::norm_p() const {
  DTENSOR_CHECK(is_norm_partial(), "Placement::norm_p: {} is not a norm Partial", to_string());
  return p_;
}

Placement Placement::normalized(int64_t ndim) const {
  if (!is_shard()) {
    return *this;
  }
  DTENSOR_CHECK(dim_ >= -ndim && dim_ < ndim, "{} is out of range for a tensor of {} dimensions",
                to_string(), ndim);
  return dim_ < 0 ? shard(dim_ + ndim) : *this;
}

std::string Placement::to_string() const {
  switch (kind_) {
  case Kind::Shard:
    return fmt::format("Shard({})", dim_);
  case Kind::Replicate:
    return "Replicate()";
  case Kind::Partial:
    return norm_ ? fmt::format("Partial(norm {})", p_)
                 : fmt::format("Partial({})", dtensor::to_string(op_));
  }
  return "?";
}

bool Placement::operator==(const Placement& other) const {
  if (kind_ != other.kind_) {
    return false;
  }
  switch (kind_) {
  case Kind::Shard:
    return dim_ == other.dim_;
  case Kind::Replicate:
    return true;
  case Kind::Partial:
    return op_ == other.op_ && norm_ == other.norm_ && (!norm_ || p_ == other.p_);
  }
  return false;
}

size_t Placement::hash() const {
  // Distinct kinds never collide: the kind sits above any dim or op value.
  size_t h = static_cast<size_t>(kind_) << 56;
  if (is_shard()) {
    h ^= std::hash<int64_t>()(dim_) & ((size_t{1} << 56) - 1);
  } else if (is_partial()) {
    h ^= static_cast<size_t>(op_) << 48;
    h ^= norm_ ? (std::hash<double>()(p_) & ((size_t{1} << 48) - 1)) | (size_t{1} << 47) : 0;
  }
  return h;
}

std::string to_string(const Placements& placements) {
  std::vector<std::string> parts;
  for (const auto& p : placements) {
    parts.push_back(p.to_string());
  }
  return fmt::format("({})", fmt::join(parts, ", "));
}

std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.to_string(); }

int64_t chunk_offset(int64_t n, int64_t chunks, int64_t index) {
  int64_t c = chunks == 0 ? 0 : (n + chunks - 1) / chunks;
  return std::min(index * c, n);
}

int64_t chunk_size(int64_t n, int64_t chunks, int64_t index) {
  int64_t c = chunks == 0 ? 0 : (n + chunks - 1) / chunks;
  return std::max<int64_t>(0, std::min((index + 1) * c, n) - index * c);
}

} // namespace dtensor
