#pragma once

// What fully_shard needs of the post-accumulate-grad hooks (dtensor/grad_hooks.h).
#include <ATen/core/Tensor.h>

namespace dtensor::detail {

// Runs `param`'s post-accumulate-grad hooks, if any (fully_shard, after writing .grad).
void run_post_accumulate_grad_hooks(const at::Tensor& param);

} // namespace dtensor::detail
