#pragma once

// Hugging Face folders whose Linear weights are stored in float8 with one scale per block
// (DeepSeek-V3's and Kimi-K2's published checkpoints, Qwen3's "-FP8" ones): read into a
// model's floating parameters, each rank dequantizing only its own piece.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <dtensor/checkpoint.h>
#include <dtensor/dtensor.h>
#include <dtensor/state_dict.h>

#include <models/check.h>

namespace dtensor::models {

namespace llama3_detail {

// [Note: float8 block-quantized weights] A weight W [M, N] stored as float8 q (F8_E4M3) with
// `W_scale_inv` [ceil(M / bm), ceil(N / bn)] in float32, the blocks [bm, bn] given by
// config.json's quantization_config (quant_method "fp8", weight_block_size), stands for
// W[i, j] = float(q[i, j]) * scale_inv[i / bm, j / bn] (DeepSeek's weight_dequant, and
// transformers' FP8 dequantization). Each rank reads its piece of q in the target's layout
// (the layout's global offsets pick its scales) and all of the small scale tensor, and writes
// the product into its piece of the target: no rank holds a full weight. Experts' weights,
// stored one per expert, read with their scales the same way ([Note: stacked names]).

inline bool is_float8(c10::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// config.json's block shape [bm, bn]; throws naming what is missing or not "fp8".
inline std::pair<int64_t, int64_t> fp8_block(const std::string& dir, const std::string& tensor) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const auto q = config.is_object() ? config.find("quantization_config") : config.end();
  DTENSOR_MODEL_CHECK(q != config.end() && q->is_object() && q->value("quant_method", "") == "fp8",
                      "load_hf: ", dir, ": '", tensor,
                      "' is stored in float8, but config.json has no quantization_config with "
                      "quant_method \"fp8\" to say how it is scaled");
  const auto block = q->find("weight_block_size");
  DTENSOR_MODEL_CHECK(block != q->end() && block->is_array() && block->size() == 2 &&
                          (*block)[0].is_number_integer() && (*block)[1].is_number_integer() &&
                          (*block)[0].get<int64_t>() > 0 && (*block)[1].get<int64_t>() > 0,
                      "load_hf: ", path,
                      ": quantization_config needs weight_block_size, two positive integers "
                      "(per-tensor float8 scales are not read)");
  return {(*block)[0].get<int64_t>(), (*block)[1].get<int64_t>()};
}

inline std::string first_stored(const std::string& name, const checkpoint::StackedNames& stacked) {
  const auto it = stacked.find(name);
  if (it == stacked.end()) {
    return name;
  }
  std::string s = it->second;
  return s.replace(s.find("{}"), 2, "0");
}

// An empty tensor laid out as `target` (a DTensor's placements and global shape, or a plain
// tensor's shape), of dtype `dtype`.
inline at::Tensor empty_as(const at::Tensor& target, c10::ScalarType dtype) {
  if (!is_dtensor(target)) {
    return at::empty(target.sizes(), target.options().dtype(dtype));
  }
  const DTensor d(target);
  const at::Tensor local = d.to_local();
  return DTensor::from_local(at::empty(local.sizes(), local.options().dtype(dtype)),
                             d.device_mesh(), d.placements(), d.spec().shape);
}

// target's piece = q's piece (its float8 values) times its blocks' scales.
inline void dequantize_into(const at::Tensor& target, const at::Tensor& q, const at::Tensor& scale,
                            std::pair<int64_t, int64_t> block) {
  const bool dt = is_dtensor(target);
  at::Tensor out = dt ? DTensor(target).to_local() : target;
  const at::Tensor piece = dt ? DTensor(q).to_local() : q;
  std::vector<int64_t> offset(static_cast<size_t>(piece.dim()), 0);
  if (dt) {
    offset = DTensor(q).spec().local_offset();
  }
  at::Tensor s = scale.to(piece.device());
  const int64_t rows = piece.dim() - 2, cols = piece.dim() - 1;
  const auto blocks_of = [&](int64_t d, int64_t size) {
    return at::div(at::arange(piece.size(d), s.options().dtype(at::kLong)) + offset[d], size,
                   "floor");
  };
  s = s.index_select(rows, blocks_of(rows, block.first))
          .index_select(cols, blocks_of(cols, block.second));
  if (piece.dim() == 3) { // stacked experts: this rank's experts
    s = s.narrow(0, offset[0], piece.size(0));
  }
  out.copy_(piece.to(at::kFloat) * s);
}

} // namespace llama3_detail

// Reads the float8 tensors among `reads` (Hugging Face names -> targets; `stacked` as load's)
// with their scales, dequantized into the targets; returns the rest of `reads`, to be read as
// they are stored. A float8 tensor without its scale is an error naming it. Collective over all ranks: one checkpoint::load when the folder has a float8
// tensor, none otherwise.
inline dtensor::StateDict load_fp8_weights(const dtensor::StateDict& reads,
                                           const checkpoint::StackedNames& stacked,
                                           const std::string& dir) {
  std::map<std::string, checkpoint::TensorInfo> stored;
  std::string any; // a float8 tensor of the folder, if it has one
  for (const checkpoint::TensorInfo& t : checkpoint::read_metadata(dir)) {
    if (any.empty() && llama3_detail::is_float8(t.dtype)) {
      any = t.key;
    }
    stored.emplace(t.key, t);
  }
  // The same on every rank (the same folder); under pp a rank's names may have no float8
  // tensor while another's do: it still takes part in the load.
  if (any.empty()) {
    return reads;
  }
  const std::pair<int64_t, int64_t> block = llama3_detail::fp8_block(dir, any);
  dtensor::StateDict quant;
  checkpoint::StackedNames quant_stacked;
  std::vector<std::string> names;
  dtensor::StateDict rest;
  for (const auto& item : reads) {
    const std::string& name = item.key();
    const std::string first = llama3_detail::first_stored(name, stacked);
    const auto it = stored.find(first);
    if (it == stored.end() || !llama3_detail::is_float8(it->second.dtype)) {
      rest.insert(name, item.value());
      continue;
    }
    const auto scale = stored.find(first + "_scale_inv");
    DTENSOR_MODEL_CHECK(scale != stored.end(), "load_hf: ", dir, ": '", first,
                        "' is stored in float8 without its scales, '", first, "_scale_inv'");
    const at::Tensor& target = item.value();
    std::vector<int64_t> shape = is_dtensor(target) ? DTensor(target).spec().shape
                                                    : target.sizes().vec();
    DTENSOR_MODEL_CHECK(shape.size() >= 2, "load_hf: ", dir, ": '", first,
                        "' is stored in float8, but the model's tensor is not a matrix");
    shape[shape.size() - 2] = (shape[shape.size() - 2] + block.first - 1) / block.first;
    shape.back() = (shape.back() + block.second - 1) / block.second;
    quant.insert(name, llama3_detail::empty_as(target, it->second.dtype));
    quant.insert(name + "_scale_inv", at::empty(shape, at::kFloat));
    if (const auto pattern = stacked.find(name); pattern != stacked.end()) {
      quant_stacked[name] = pattern->second;
      quant_stacked[name + "_scale_inv"] = pattern->second + "_scale_inv";
    }
    names.push_back(name);
  }
  checkpoint::load(quant, dir,
                   checkpoint::LoadOptions().stacked(quant_stacked).convert_dtype(true));
  for (const std::string& name : names) {
    llama3_detail::dequantize_into(*reads.find(name), quant[name], quant[name + "_scale_inv"],
                                   block);
  }
  return rest;
}

} // namespace dtensor::models
