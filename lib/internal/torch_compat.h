#pragma once

// [Note: one home for LibTorch differences]
// dtensor builds against LibTorch 2.9.1 (the pinned default) and 2.15 from one tree
// (docs/build.md). Every API that differs between them is reached through this header, and
// nowhere else is a LibTorch version tested. Differences are detected from the types
// LibTorch declares (overloads, SFINAE), not from version numbers, so a release in between
// that has one change and not the other still builds.
//
//  - autograd nodes: held by std::shared_ptr / std::weak_ptr up to 2.9, by c10::intrusive_ptr
//    / c10::weak_intrusive_ptr in 2.15. NodePtr is whatever an Edge holds.
//  - Node::add_input_metadata(options, shape, subclass, nested) gained a fifth argument (the
//    gradient's dtype, std::nullopt for "as the input").
//  - c10::DebugInfoKind: an enum up to 2.9 (a slot is a number), a class in 2.15 (a slot is
//    the address of a string_view with static storage duration).
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace dtensor::detail::compat {

using Node = torch::autograd::Node;
using NodePtr = decltype(std::declval<torch::autograd::Edge>().function);

// A new autograd node of type T, held as LibTorch holds nodes.
template <class T, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// Installs `node` as the gradient accumulator of leaf `t` (autograd keeps a weak reference).
// (Templates, so only the overload LibTorch's holder picks is instantiated.)
template <class N, std::enable_if_t<std::is_same_v<N, Node>, int> = 0>
void set_grad_accumulator(const at::Tensor& t, const std::shared_ptr<N>& node) {
  torch::autograd::impl::set_grad_accumulator(t, std::weak_ptr<N>(node));
}
template <class N, std::enable_if_t<std::is_same_v<N, Node>, int> = 0>
void set_grad_accumulator(const at::Tensor& t, const c10::intrusive_ptr<N>& node) {
  torch::autograd::impl::set_grad_accumulator(t, c10::weak_intrusive_ptr<N>(node));
}

namespace detail_ {
template <class N, class = void>
struct HasGradDtypeMetadata : std::false_type {};
template <class N>
struct HasGradDtypeMetadata<
    N, std::void_t<decltype(std::declval<N&>().add_input_metadata(
           std::declval<const at::TensorOptions&>(), std::declval<c10::SymIntArrayRef>(), false,
           false, std::optional<at::ScalarType>()))>> : std::true_type {};
} // namespace detail_

// Adds the metadata of a plain (not nested, not subclass) input of `options` and `shape` to
// `node`, whose gradient keeps the input's dtype. Returns the input's index.
template <class N>
uint32_t add_input_metadata(N& node, const at::TensorOptions& options, c10::SymIntArrayRef shape) {
  if constexpr (detail_::HasGradDtypeMetadata<N>::value) {
    return node.add_input_metadata(options, shape, false, false, std::nullopt);
  } else {
    return node.add_input_metadata(options, shape, false, false);
  }
}

// A thread-local debug-info slot of dtensor's own: `name` names it where slots are
// addresses (2.15), `code` where they are numbers (2.9; a value c10 does not use).
template <class Kind = c10::DebugInfoKind>
Kind debug_info_kind(const std::string_view* name, int code) {
  if constexpr (std::is_enum_v<Kind>) {
    return static_cast<Kind>(code);
  } else {
    return Kind(name);
  }
}

} // namespace dtensor::detail::compat
