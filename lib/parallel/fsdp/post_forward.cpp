// reshard_after_forward as an int k: after forward a unit keeps the piece that k
// neighbouring ranks need to rebuild it, and backward all-gathers over those k ranks.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp> // dtensor::Work held in pending collectives

#include <dtensor/collectives.h>
#include <dtensor/process_group.h>

#include "internal/check.h"
#include "parallel/fsdp/fsdp_param_group.h"
#include "parallel/fsdp/memory.h"

namespace dtensor::detail {

// [Note: reshard to a smaller group] FSDP2's reshard_after_forward=k. The S shard ranks are
// cut into groups of k consecutive ones (k divides S). The all-gather's layout is every
// rank's padded flat shard in rank order, S * shard_numel elements; member j of a group
// keeps elements [j, j + 1) * (S / k) * shard_numel of it -- the flat shards of ranks
// j * S / k ... (j + 1) * S / k - 1 -- so that an all-gather over the group, in group
// order, gives the whole layout back. Every group keeps the same pieces. Between forward
// and backward the unit then holds S / k flat shards instead of 1 (true) or S (false),
// and backward's all-gather runs over k ranks (often one host's) instead of S; the
// reduce-scatter stays over all S. The piece is cut from the unsharded parameters, so it
// does not matter whether the forward all-gather went into place. Counted with the
// unsharded bytes of fsdp_memory_stats(). k == 1 means false, k == S true (fully_shard
// resolves both).
struct PostForwardPiece {
  explicit PostForwardPiece(at::Tensor t)
      : tensor(std::move(t)), bytes(static_cast<int64_t>(tensor.nbytes())) {
    fsdp_memory().unsharded += bytes;
    fsdp_memory().note_peak();
  }
  ~PostForwardPiece() { fsdp_memory().unsharded -= bytes; }
  PostForwardPiece(const PostForwardPiece&) = delete;
  PostForwardPiece& operator=(const PostForwardPiece&) = delete;
  at::Tensor tensor;
  int64_t bytes;
};

void FSDPParamGroup::init_post_forward(int64_t k) {
  DTENSOR_CHECK(k >= 1 && k <= shard_size && shard_size % k == 0,
                "fully_shard({}): reshard_after_forward as an int is the size of the group to "
                "reshard to after forward, a factor of the shard dim's size {}; got {}",
                name, shard_size, k);
  if (k == 1 || k == shard_size) {
    reshard_after_forward = k == shard_size;
    return;
  }
  for (const FSDPParam& fp : params) {
    DTENSOR_CHECK(!fp.tp_spec,
                  "fully_shard({}): reshard_after_forward={} (an int) is not supported for "
                  "tensor-parallel parameters ('{}' is {}); use true or false",
                  name, k, fp.fqn, fp.tp_spec->to_string());
  }
  // The group of k consecutive shard ranks around this rank, over the mesh's global ranks
  // (HSDP: within this rank's replica, as FSDP2's view of the mesh as (-1, k)).
  const std::vector<int>& ranks = mesh.ranks();
  const int64_t row = mesh.ndim() == 2 ? mesh.get_local_rank(0) * shard_size : 0;
  const int64_t first = row + (shard_rank / k) * k;
  std::vector<int> members;
  for (int64_t i = 0; i < k; ++i) {
    members.push_back(ranks.at(static_cast<size_t>(first + i)));
  }
  post_forward_group = new_group(members, "post_forward");
  post_forward_size = k;
  reshard_after_forward = true;
}

void FSDPParamGroup::reshard_after_forward_step() {
  if (post_forward_size == 0 || state != ShardState::Unsharded) {
    reshard();
    return;
  }
  at::NoGradGuard no_grad;
  const int64_t per = shard_size / post_forward_size; // flat shards in the piece
  const int64_t j = shard_rank % post_forward_size;
  at::Tensor piece =
      at::zeros({per * shard_numel}, flat_shard.options().dtype(param_dtype).device(device));
  for (const FSDPParam& fp : params) {
    for (int64_t q = 0; q < per; ++q) {
      const int64_t r = j * per + q;
      const int64_t rows = fp.rows_on(r, shard_size);
      if (rows > 0) {
        piece.narrow(0, q * shard_numel + fp.offset, rows * fp.row_numel)
            .view(fp.chunk_shape(rows))
            .copy_(fp.unsharded.narrow(fp.shard_dim, r * fp.chunk, rows));
      }
    }
  }
  reshard(); // frees the unsharded buffer
  post_forward_piece = std::make_shared<PostForwardPiece>(std::move(piece));
  state = ShardState::ShardedPostForward;
}

void FSDPParamGroup::drop_post_forward_piece() {
  post_forward_piece.reset();
}

at::Tensor FSDPParamGroup::take_post_forward_piece() {
  at::Tensor t = post_forward_piece->tensor;
  post_forward_piece.reset();
  return t;
}

int64_t FSDPParamGroup::post_forward_bytes() const {
  return post_forward_piece ? post_forward_piece->bytes : 0;
}

} // namespace dtensor::detail
