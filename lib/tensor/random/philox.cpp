// Philox4x32-10 over tensors of element indices (see philox.h).
#include "tensor/random/philox.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>

#include "internal/check.h"

namespace dtensor::detail {

namespace {

constexpr int64_t kMask32 = 0xFFFFFFFFLL;
constexpr int64_t kMulA = 0xD2511F53LL;
constexpr int64_t kMulB = 0xCD9E8D57LL;
constexpr uint32_t kKeyBumpA = 0x9E3779B9U;
constexpr uint32_t kKeyBumpB = 0xBB67AE85U;

// [Note: Philox in int64 tensor ops]
// A Philox round multiplies two 32-bit numbers into 64 bits. int64 tensors cannot hold that
// product (it overflows past 2^63, and signed overflow is undefined in the kernels), so the
// factor `c` is split into 16-bit halves: M*c = a + b*2^16 with a = M*(c & 0xFFFF) and
// b = M*(c >> 16), both below 2^48. With t = a + ((b & 0xFFFF) << 16) (below 2^49):
// lo = t & 0xFFFFFFFF and hi = (t >> 32) + (b >> 16). Every intermediate is non-negative
// and below 2^49, so the result is exact on every device and equals the 32-bit mulhilo.
std::pair<at::Tensor, at::Tensor> mulhilo(int64_t m, const at::Tensor& c) {
  at::Tensor a = at::bitwise_and(c, 0xFFFF).mul_(m);
  at::Tensor b = at::bitwise_right_shift(c, 16).mul_(m);
  at::Tensor t = at::bitwise_and(b, 0xFFFF).bitwise_left_shift_(16).add_(a);
  at::Tensor lo = at::bitwise_and(t, kMask32);
  at::Tensor hi = t.bitwise_right_shift_(32).add_(b.bitwise_right_shift_(16));
  return {lo, hi};
}

PhiloxWords loop_on_cpu(const at::Tensor& index, uint64_t seed, uint64_t offset) {
  at::Tensor idx = index.contiguous();
  at::Tensor words = at::empty({idx.numel(), 4}, idx.options());
  const int64_t* in = idx.const_data_ptr<int64_t>();
  int64_t* out = words.mutable_data_ptr<int64_t>();
  at::parallel_for(0, idx.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      at::Philox4_32 engine(seed, static_cast<uint64_t>(in[k]), offset);
      for (int w = 0; w < 4; ++w) {
        out[k * 4 + w] = static_cast<int64_t>(engine());
      }
    }
  });
  PhiloxWords result;
  for (int w = 0; w < 4; ++w) {
    result[w] = words.select(1, w).view(index.sizes());
  }
  return result;
}

} // namespace

PhiloxWords philox_words_by_ops(const at::Tensor& index, uint64_t seed, uint64_t offset) {
  at::Tensor c0 = at::full_like(index, static_cast<int64_t>(offset & kMask32));
  at::Tensor c1 = at::full_like(index, static_cast<int64_t>(offset >> 32));
  at::Tensor c2 = at::bitwise_and(index, kMask32);
  at::Tensor c3 = at::bitwise_right_shift(index, 32);
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    auto [lo0, hi0] = mulhilo(kMulA, c0);
    auto [lo1, hi1] = mulhilo(kMulB, c2);
    at::Tensor n0 = hi1.bitwise_xor_(c1).bitwise_xor_(static_cast<int64_t>(k0));
    at::Tensor n2 = hi0.bitwise_xor_(c3).bitwise_xor_(static_cast<int64_t>(k1));
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kKeyBumpA; // wraps mod 2^32, as the engine's keys do
    k1 += kKeyBumpB;
  }
  return {c0, c1, c2, c3};
}

PhiloxWords philox_words(const at::Tensor& index, uint64_t seed, uint64_t offset) {
  DTENSOR_CHECK(index.scalar_type() == at::kLong, "philox_words: index must be int64, got {}",
                c10::toString(index.scalar_type()));
  if (index.device().is_cpu()) {
    return loop_on_cpu(index, seed, offset);
  }
  return philox_words_by_ops(index, seed, offset);
}

} // namespace dtensor::detail
