// The registry of op interceptors ([Note: op interceptors] in lib/tensor/dispatch/interceptors.h).
#include "tensor/dispatch/interceptors.h"

#include <algorithm>
#include <set>
#include <string>

namespace dtensor::detail {

namespace {

std::vector<OpInterceptor>& interceptor_registry() {
  static std::vector<OpInterceptor> r;
  return r;
}

std::vector<LocalSourceResolver>& resolver_registry() {
  static std::vector<LocalSourceResolver> r;
  return r;
}

thread_local int local_region_depth = 0;

} // namespace

bool register_local_source_resolver(LocalSourceResolver resolver) {
  resolver_registry().push_back(resolver);
  return true;
}

at::Tensor local_source(const at::Tensor& dtensor) {
  if (local_region_depth > 0) {
    for (LocalSourceResolver r : resolver_registry()) {
      at::Tensor t = r(dtensor);
      if (t.defined()) {
        return t;
      }
    }
  }
  return dtensor;
}

LocalRegion::LocalRegion() {
  ++local_region_depth;
}
LocalRegion::~LocalRegion() {
  --local_region_depth;
}
bool LocalRegion::active() {
  return local_region_depth > 0;
}

bool register_interceptor(const OpInterceptor& interceptor) {
  auto& r = interceptor_registry();
  r.push_back(interceptor);
  std::stable_sort(r.begin(), r.end(), [](const OpInterceptor& a, const OpInterceptor& b) {
    return a.order < b.order;
  });
  return true;
}

const std::vector<OpInterceptor>& interceptors() {
  return interceptor_registry();
}

bool keeps_parameters_as_dtensors(const c10::FunctionSchema& schema) {
  static const std::set<std::string> names = {
      "aten::empty_like",   "aten::zeros_like", "aten::ones_like",
      "aten::full_like",    "aten::rand_like",  "aten::randn_like",
      "aten::randint_like", "aten::detach",     "aten::alias"};
  return names.count(schema.name()) != 0;
}

} // namespace dtensor::detail
