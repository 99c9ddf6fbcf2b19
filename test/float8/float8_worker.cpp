// One job of test/float8/torchao_judge.py: dtensor's float8 linear (include/dtensor/float8.h)
// on seeded inputs, written with its outputs and gradients to a safetensors checkpoint for the
// driver to judge against torchao's Float8Linear on the same tensors.
//
//   torchrun --nproc-per-node 1 float8_worker OUT_DIR
//
// Keys: "<recipe>.<dtype>.<name>" for float8_linear alone (x, w, b where there is a bias, g:
// the output gradient; y, dx, dw, db: the results), and "model.<recipe>.<name>" for a
// two-Linear module converted with float8_skip_output_and_unaligned (proj 32 -> 64
// converted, output 64 -> 10 not): x, proj.weight, output.weight, g, y, dx, proj.grad,
// output.grad. "grouped.<dtype>.<name>" for float8_grouped_mm over 4 experts with 5, 0, 11
// and 8 rows (an expert without rows): x [24, 32], w [4, 48, 32], counts, g; y, dx, dw.
#include <iostream>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <dtensor/all.h>
#include <dtensor/float8.h>

namespace {

using dtensor::Float8LinearOptions;
using dtensor::Float8Recipe;

void linear_cases(std::map<std::string, at::Tensor>& out, Float8Recipe recipe,
                  c10::ScalarType dtype) {
  const std::string key = std::string(dtensor::name_of(recipe)) + "." +
                          (dtype == at::kFloat ? "float32" : "bfloat16") + ".";
  const bool with_bias = dtype == at::kFloat;
  at::Tensor x = at::randn({2, 8, 32}).to(dtype).requires_grad_();
  at::Tensor w = (at::randn({64, 32}) * 0.1).to(dtype).requires_grad_();
  at::Tensor b = with_bias ? at::randn({64}).to(dtype).requires_grad_() : at::Tensor();
  at::Tensor g = at::randn({2, 8, 64}).to(dtype);
  at::Tensor y = dtensor::float8_linear(x, w, b, Float8LinearOptions().recipe(recipe));
  y.backward(g);
  out[key + "x"] = x.detach();
  out[key + "w"] = w.detach();
  out[key + "g"] = g;
  out[key + "y"] = y.detach();
  out[key + "dx"] = x.grad();
  out[key + "dw"] = w.grad();
  if (with_bias) {
    out[key + "b"] = b.detach();
    out[key + "db"] = b.grad();
  }
}

struct TwoLinearsImpl : torch::nn::Module {
  TwoLinearsImpl()
      : proj(register_module("proj",
                             torch::nn::Linear(torch::nn::LinearOptions(32, 64).bias(false)))),
        output(register_module("output",
                               torch::nn::Linear(torch::nn::LinearOptions(64, 10).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) {
    return dtensor::call(output, at::relu(dtensor::call(proj, x)));
  }
  torch::nn::Linear proj;
  torch::nn::Linear output;
};
TORCH_MODULE(TwoLinears);

void model_case(std::map<std::string, at::Tensor>& out, Float8Recipe recipe) {
  const std::string key = "model." + std::string(dtensor::name_of(recipe)) + ".";
  TwoLinears model;
  const std::vector<std::string> converted = dtensor::convert_to_float8_training(
      *model, Float8LinearOptions().recipe(recipe), dtensor::float8_skip_output_and_unaligned);
  TORCH_CHECK(converted == std::vector<std::string>{"proj"}, "converted: ", converted);
  at::Tensor x = at::randn({4, 32}).requires_grad_();
  at::Tensor g = at::randn({4, 10});
  at::Tensor y = dtensor::call(model, x);
  y.backward(g);
  out[key + "x"] = x.detach();
  out[key + "proj.weight"] = model->proj->weight.detach().clone();
  out[key + "output.weight"] = model->output->weight.detach().clone();
  out[key + "g"] = g;
  out[key + "y"] = y.detach();
  out[key + "dx"] = x.grad();
  out[key + "proj.grad"] = model->proj->weight.grad();
  out[key + "output.grad"] = model->output->weight.grad();
}

void grouped_case(std::map<std::string, at::Tensor>& out, c10::ScalarType dtype) {
  const std::string key =
      std::string("grouped.") + (dtype == at::kFloat ? "float32" : "bfloat16") + ".";
  at::Tensor x = at::randn({24, 32}).to(dtype).requires_grad_();
  at::Tensor w = (at::randn({4, 48, 32}) * 0.1).to(dtype).requires_grad_();
  const at::Tensor counts = at::tensor({5, 0, 11, 8}, at::kLong);
  at::Tensor g = at::randn({24, 48}).to(dtype);
  at::Tensor y = dtensor::float8_grouped_mm(x, w, counts);
  y.backward(g);
  out[key + "x"] = x.detach();
  out[key + "w"] = w.detach();
  out[key + "counts"] = counts;
  out[key + "g"] = g;
  out[key + "y"] = y.detach();
  out[key + "dx"] = x.grad();
  out[key + "dw"] = w.grad();
}

} // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc == 2, "usage: float8_worker OUT_DIR");
  dtensor::init_process_group();
  at::manual_seed(0);
  std::map<std::string, at::Tensor> out;
  for (Float8Recipe r :
       {Float8Recipe::Tensorwise, Float8Recipe::Rowwise, Float8Recipe::RowwiseWithGwHp}) {
    for (c10::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      linear_cases(out, r, dtype);
    }
    model_case(out, r);
  }
  for (c10::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    grouped_case(out, dtype);
  }
  dtensor::StateDict dict;
  for (auto& [k, v] : out) {
    dict.insert(k, v.contiguous());
  }
  dtensor::checkpoint::save(dict, argv[1]);
  dtensor::destroy_process_group();
  return 0;
}
