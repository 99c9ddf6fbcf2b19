// Meta kernels for the ATen ops that LibTorch has none for ([Note: meta kernels for simulation]).
#include <ATen/ATen.h>
#include <torch/library.h>

namespace dtensor {

namespace {

// [Note: meta kernels for simulation]
// PyTorch registers some meta kernels in Python (torch/_meta_registrations.py), so LibTorch
// alone cannot run those ops on meta tensors, which a simulated world's ranks need
// ([Note: simulated worlds]). The ops a training step uses get one here: the output's shape
// and dtype, as ATen's CPU kernel gives them (the judge: the same op on CPU tensors, in
// test_simulate), no values.

at::Tensor meta_index_select(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  const int64_t d = at::maybe_wrap_dim(dim, std::max<int64_t>(self.dim(), 1));
  std::vector<int64_t> sizes = self.sizes().vec();
  if (self.dim() > 0) {
    sizes[static_cast<size_t>(d)] = index.numel();
  }
  return at::empty(sizes, self.options());
}

at::Tensor meta_floor_divide(const at::Tensor& self, const at::Tensor& other) {
  const auto sizes = at::infer_size(self.sizes(), other.sizes());
  return at::empty(sizes, self.options().dtype(at::result_type(self, other)));
}

at::Tensor meta_floor_divide_scalar(const at::Tensor& self, const at::Scalar& other) {
  return at::empty(self.sizes(), self.options().dtype(at::result_type(self, other)));
}

at::Tensor meta_embedding_dense_backward(const at::Tensor& grad, const at::Tensor& /*indices*/,
                                         c10::SymInt num_weights, c10::SymInt /*padding_idx*/,
                                         bool /*scale_grad_by_freq*/) {
  return at::empty({num_weights.expect_int(), grad.size(-1)}, grad.options());
}

at::Tensor meta_where(const at::Tensor& condition, const at::Tensor& self,
                      const at::Tensor& other) {
  const auto sizes = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  return at::empty(sizes, self.options().dtype(at::result_type(self, other)));
}

at::Tensor& meta_where_out(const at::Tensor& condition, const at::Tensor& self,
                           const at::Tensor& other, at::Tensor& out) {
  const auto sizes = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  out.resize_(sizes);
  return out;
}

at::Tensor& meta_unary_out(const at::Tensor& self, at::Tensor& out) {
  out.resize_(self.sizes());
  return out;
}

// (B, H, L, E) laid out as (B, L, H, E), as the CPU flash kernel lays its outputs out.
at::Tensor heads_second(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  std::vector<int64_t> blhe(sizes.begin(), sizes.end());
  std::swap(blhe[1], blhe[2]);
  return at::empty(blhe, options).transpose(1, 2);
}

std::tuple<at::Tensor, at::Tensor> meta_flash_cpu(const at::Tensor& q, const at::Tensor& /*k*/,
                                                  const at::Tensor& v, double /*dropout_p*/,
                                                  bool /*is_causal*/,
                                                  const std::optional<at::Tensor>& /*mask*/,
                                                  std::optional<double> /*scale*/) {
  std::vector<int64_t> out = q.sizes().vec();
  out.back() = v.size(-1);
  std::vector<int64_t> lse(q.sizes().begin(), q.sizes().end() - 1);
  lse.push_back(1);
  return {heads_second(out, q.options()),
          heads_second(lse, q.options().dtype(at::kFloat)).squeeze(-1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor>
meta_flash_cpu_backward(const at::Tensor& /*grad_out*/, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& /*out*/,
                        const at::Tensor& /*logsumexp*/, double /*dropout_p*/, bool /*is_causal*/,
                        const std::optional<at::Tensor>& /*mask*/,
                        std::optional<double> /*scale*/) {
  return {heads_second(q.sizes(), q.options()), heads_second(k.sizes(), k.options()),
          heads_second(v.sizes(), v.options())};
}

// Expert parallelism's capacity dispatch finds each row's expert by searchsorted.
at::Tensor meta_searchsorted(const at::Tensor& /*sorted*/, const at::Tensor& self, bool out_int32,
                             bool /*right*/, std::optional<c10::string_view> /*side*/,
                             const std::optional<at::Tensor>& /*sorter*/) {
  return at::empty(self.sizes(), self.options().dtype(out_int32 ? at::kInt : at::kLong));
}

} // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("searchsorted.Tensor", meta_searchsorted);
  m.impl("index_select", meta_index_select);
  m.impl("floor_divide", meta_floor_divide);
  m.impl("floor_divide.Scalar", meta_floor_divide_scalar);
  m.impl("embedding_dense_backward", meta_embedding_dense_backward);
  m.impl("where.self", meta_where);
  m.impl("where.self_out", meta_where_out);
  m.impl("abs.out", meta_unary_out);
  m.impl("_scaled_dot_product_flash_attention_for_cpu", meta_flash_cpu);
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward", meta_flash_cpu_backward);
}

} // namespace dtensor
