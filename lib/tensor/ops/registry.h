#pragma once

// The sharding-rule registry: rules registered by op name, in lib/tensor/ops/registry.cpp
// (one explicit list: no static-initialisation order games), and the table of ops whose
// shape arguments are global ([Note: shape arguments]).

#include <string>

#include "tensor/ops/rule.h"

namespace dtensor::detail {

// [Note: shape arguments] As PyTorch's op_to_shape_and_stride_idx: ops whose size (and
// stride) argument describes the output's global shape take this rank's local shape (and
// its contiguous strides) instead, computed from the output's placements and global shape.
// Rules of these ops decide placements only.
struct ShapeArgs {
  int shape = -1;  // argument index of the size
  int stride = -1; // argument index of the stride (-1: none)
};
// The table entry of `schema_name` ("aten::view"), or nullptr.
const ShapeArgs* shape_args_of(const std::string& schema_name);

// The registry. Lookup tries "ns::name.overload", then "ns::name".
// `scalar_sign_only`: the rule reads no Scalar argument beyond its sign, so decisions are
// cached by the signs of Scalar arguments, not their values (optimizer steps pass
// step-dependent scalars to the same pointwise ops on every step).
void register_rule(const std::string& name, ShardingRule rule, bool scalar_sign_only = false);
bool rule_reads_scalar_sign_only(const std::string& full_name, const std::string& base_name);
ShardingRule find_rule(const std::string& full_name, const std::string& base_name);
ShardingRule exact_rule(const std::string& name); // registered under exactly this name
void unregister_rule(const std::string& name);
void register_builtin_rules(); // calls the register_* of every op family once

// Families (lib/tensor/ops/*.cpp).
void register_tensor_ops();    // clone, detach, *_like, copy_, fill_, zero_, _to_copy
void register_pointwise_ops(); // unary / binary / ternary, in-place and out=
void register_reduction_ops(); // sum, mean, amax, amin, linalg_vector_norm
void register_matmul_ops();    // mm, addmm, bmm, baddbmm
void register_view_ops();      // t, transpose, view-like
void register_nn_ops();        // softmax, layer norm, nll_loss (+ backward)
void register_attention_ops(); // the attention kernels of CPU and CUDA (+ backward)
void register_conv_ops();      // convolution (+ backward)
void register_embedding_ops(); // embedding (+ backward), vocab-sharded lookups
void register_list_ops();      // cat, stack, split, unbind
void register_dim_ops();       // cumsum, sort, topk, var, prod, any, index_select, gather, ...
void register_whole_ops();     // pooling, upsampling, tril, flip, roll, linalg, scatter, ...
void register_random_ops();    // uniform_, normal_, bernoulli, dropout, ... (lib/tensor/random/)

} // namespace dtensor::detail
