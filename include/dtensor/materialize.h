#pragma once

// Models larger than one device (docs/meta_init.md): build the module on the meta device,
// parallelize it there (parallelize_module, fully_shard, replicate, in any combination),
// then give it memory with to_empty and values with an init function. Each rank allocates
// only what it holds: its shards of sharded parameters, its copy of replicated ones.
//
//   Transformer model{nullptr};
//   { dtensor::MetaDeviceGuard meta; model = Transformer(args); }  // no memory
//   parallelize_module(*model, tp_mesh, plan);   // DTensors with meta local pieces
//   fully_shard(*block, {...}); fully_shard(*model, {...});
//   dtensor::to_empty(*model, torch::kCPU);      // local pieces allocated, uninitialized
//   dtensor::manual_seed(0, mesh);
//   init_weights(*model);                        // dtensor::trunc_normal_(p, ...), p.fill_(..)
//
// With dtensor's random ops the init gives the same full values on every layout as on one
// process (docs/random.md), so a model initialized this way needs no broadcast.
#include <c10/core/Device.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace dtensor {

// [Note: building on the meta device]
// While a MetaDeviceGuard lives on this thread, tensor factories (at::empty, zeros, ones,
// ..., as LibTorch's modules call them in their constructors) create meta tensors: shapes
// and dtypes without memory, and init functions on them do nothing. Python's
// `with torch.device("meta")`, for C++. It works in the dispatcher: BackendSelect, which
// sends a factory to the backend its TensorOptions name (the CPU by default), is skipped,
// and the Meta key is added, so the Meta kernels run. Only module construction belongs in
// its scope: an op on a real tensor there would run its Meta kernel too and compute
// nothing. The guard saves the thread's whole key set and restores it as it was: undoing
// an Include guard of Meta by subtraction, as LibTorch 2.9.1's IncludeDispatchKeyGuard
// does, keeps Meta's backend bit in the included set (DispatchKeySet's `-` leaves backend
// bits), and every later op on a CPU tensor then ran its Meta kernel.
class MetaDeviceGuard {
 public:
  MetaDeviceGuard() : keys_(with_meta(c10::impl::tls_local_dispatch_key_set())) {}
  MetaDeviceGuard(const MetaDeviceGuard&) = delete;
  MetaDeviceGuard& operator=(const MetaDeviceGuard&) = delete;

 private:
  static c10::impl::LocalDispatchKeySet with_meta(c10::impl::LocalDispatchKeySet keys) {
    keys.included_ = keys.included_ | c10::DispatchKeySet(c10::DispatchKey::Meta);
    keys.excluded_ = keys.excluded_ | c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
    return keys;
  }
  c10::impl::ForceDispatchKeyGuard keys_;
};

// Moves every parameter and buffer of `module` (recursively) that is on the meta device to
// `device`, in place (same tensors, same module members), uninitialized: a plain tensor
// gets its whole shape, a DTensor its local piece, a fully_shard unit its flat shard (the
// unit's parameters move together; its unsharded buffer is allocated only when the unit is
// first used). Tensors already on a real device are left as they are. Local, no
// communication. `device` must be a real device (the mesh's).
void to_empty(torch::nn::Module& module, c10::Device device);

} // namespace dtensor
