#pragma once

// C++ ports of the test models of PyTorch's
//  - torch/testing/_internal/distributed/_tensor/common_dtensor.py: ModelArgs, Attention,
//    FeedForward, TransformerBlock, Transformer (the toy nanoGPT-like model);
//  - torch/testing/_internal/common_fsdp.py: TransformerWithSharedParams,
//    NestedWrappedModule, NonUniformReqGradNWM, MixtureOfExperts.
// Plain modules with ordinary forward(): the FSDP wrapping, the CUDA init modes and the
// process-group arguments of the Python are left out (a group only gave `rank`, here an
// argument). Module and attribute names are the Python ones, so parameter names match
// PyTorch's named_parameters(). Submodules are created in the Python's order (never as
// arguments of one call, whose evaluation order C++ leaves unspecified), so a seed gives the
// same initial values as the Python (checked against torch 2.9.1 on CPU).
#include <cstdint>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/arg.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/transformer.h>
#include <torch/utils.h>

#include <dtensor/activation_checkpoint.h>
#include <dtensor/random.h>

#include <models/check.h>

namespace dtensor::models {

// ---------------------------------------------------------------------------------------------
// common_dtensor.py: Transformer
// ---------------------------------------------------------------------------------------------

// The Python dataclass; chainable like LibTorch options: ModelArgs().weight_tying(false).
// (checkpoint_activations is left out: no activation checkpointing in LibTorch.)
struct ModelArgs {
  TORCH_ARG(int64_t, n_layers) = 2;
  TORCH_ARG(int64_t, vocab_size) = 8;
  TORCH_ARG(int64_t, max_seq_len) = 16;
  TORCH_ARG(int64_t, dim) = 16;
  TORCH_ARG(int64_t, n_heads) = 4;
  TORCH_ARG(double, dropout_p) = 0.1;
  TORCH_ARG(bool, use_attn_mask) = true;
  TORCH_ARG(bool, weight_tying) = true;
  // dtensor's addition: dropout by dtensor::dropout, the same on every layout
  // (docs/random.md), in place of the Dropout modules' draws from each rank's generator;
  // attention weights are then not dropped (sdpa draws from the generator itself).
  TORCH_ARG(bool, layout_independent_dropout) = false;
  // dtensor's addition: each TransformerBlock's forward checkpointed with these options
  // (dtensor/activation_checkpoint.h; torchtitan's per-block activation checkpointing).
  TORCH_ARG(std::optional<dtensor::ActivationCheckpointOptions>,
            activation_checkpoint) = std::nullopt;
};

// A Dropout module, or with `layout_independent` dtensor::dropout at the module's p.
inline torch::Tensor apply_dropout(torch::nn::Dropout& dropout, const torch::Tensor& x,
                                   bool layout_independent) {
  return layout_independent ? dtensor::dropout(x, dropout->options.p(), dropout->is_training())
                            : dropout(x);
}

inline torch::nn::Linear linear_no_bias(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// wq/wk/wv/wo (no bias), scaled_dot_product_attention (causal when use_attn_mask, dropout
// only in training), wo, resid_dropout.
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const ModelArgs& args)
      : head_dim(args.dim() / args.n_heads()), n_heads(args.n_heads()), dropout_p(args.dropout_p()),
        resid_dropout(register_module("resid_dropout", torch::nn::Dropout(args.dropout_p()))),
        use_attn_mask(args.use_attn_mask()), layout_independent(args.layout_independent_dropout()),
        wq(register_module("wq", linear_no_bias(args.dim(), args.dim()))),
        wk(register_module("wk", linear_no_bias(args.dim(), args.dim()))),
        wv(register_module("wv", linear_no_bias(args.dim(), args.dim()))),
        wo(register_module("wo", linear_no_bias(args.dim(), args.dim()))) {
    DTENSOR_MODEL_CHECK(args.dim() % args.n_heads() == 0, "dim must be a multiple of n_heads");
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t bsz = x.size(0);
    const int64_t seq_len = x.size(1);
    // (bsz, seq_len, dim) -> (bsz, n_heads, seq_len, head_dim)
    auto heads = [&](const torch::Tensor& t) {
      return t.view({bsz, seq_len, n_heads, head_dim}).transpose(1, 2);
    };
    torch::Tensor output = torch::scaled_dot_product_attention(
        heads(wq(x)), heads(wk(x)), heads(wv(x)), /*attn_mask=*/std::nullopt,
        is_training() && !layout_independent ? dropout_p : 0.0, /*is_causal=*/use_attn_mask);
    output = output.transpose(1, 2).contiguous().view({bsz, seq_len, -1});
    return apply_dropout(resid_dropout, wo(output), layout_independent);
  }
  int64_t head_dim;
  int64_t n_heads;
  double dropout_p;
  torch::nn::Dropout resid_dropout;
  bool use_attn_mask;
  bool layout_independent;
  torch::nn::Linear wq;
  torch::nn::Linear wk;
  torch::nn::Linear wv;
  torch::nn::Linear wo;
};
TORCH_MODULE(Attention);

// w1 (dim -> hidden_dim, bias) -> gelu -> w2 (-> dim, bias) -> resid_dropout.
struct FeedForwardImpl : torch::nn::Module {
  FeedForwardImpl(int64_t dim, int64_t hidden_dim, double dropout_p,
                  bool layout_independent_dropout = false)
      : w1(register_module("w1", torch::nn::Linear(dim, hidden_dim))),
        gelu(register_module("gelu", torch::nn::GELU())),
        w2(register_module("w2", torch::nn::Linear(hidden_dim, dim))),
        resid_dropout(register_module("resid_dropout", torch::nn::Dropout(dropout_p))),
        layout_independent(layout_independent_dropout) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return apply_dropout(resid_dropout, w2(gelu(w1(x))), layout_independent);
  }
  torch::nn::Linear w1;
  torch::nn::GELU gelu;
  torch::nn::Linear w2;
  torch::nn::Dropout resid_dropout;
  bool layout_independent;
};
TORCH_MODULE(FeedForward);

// Pre-norm block: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h)).
struct TransformerBlockImpl : torch::nn::Module {
  explicit TransformerBlockImpl(const ModelArgs& args)
      : attention_norm(register_module(
            "attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim()})))),
        attention(register_module("attention", Attention(args))),
        ffn_norm(register_module("ffn_norm",
                                 torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim()})))),
        feed_forward(register_module("feed_forward",
                                     FeedForward(args.dim(), 4 * args.dim(), args.dropout_p(),
                                                 args.layout_independent_dropout()))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = x + attention(attention_norm(x));
    return h + feed_forward(ffn_norm(h));
  }
  torch::nn::LayerNorm attention_norm;
  Attention attention;
  torch::nn::LayerNorm ffn_norm;
  FeedForward feed_forward;
};
TORCH_MODULE(TransformerBlock);

// tok_embeddings + pos_embeddings, dropout, n_layers TransformerBlocks, norm, output.
// forward(tokens [bsz, seq_len] int64) returns float logits [bsz, seq_len, vocab_size].
// Weight tying: LibTorch cannot register one parameter under two names, so with weight_tying
// there is no `output` module (output stays null) and the logits are
// linear(h, tok_embeddings->weight); the parameter list is then PyTorch's, which lists the
// tied weight once, as tok_embeddings.weight. The Python's nn.Linear for output is still
// constructed (and thrown away) so that the random stream matches.
struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const ModelArgs& args = ModelArgs())
      : model_args(args), max_seq_len(args.max_seq_len()),
        tok_embeddings(
            register_module("tok_embeddings", torch::nn::Embedding(args.vocab_size(), args.dim()))),
        pos_embeddings(register_module("pos_embeddings",
                                       torch::nn::Embedding(args.max_seq_len(), args.dim()))),
        dropout(register_module("dropout", torch::nn::Dropout(args.dropout_p()))),
        layers(register_module("layers", torch::nn::ModuleList())) {
    for (int64_t i = 0; i < args.n_layers(); ++i) {
      layers->push_back(TransformerBlock(args));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim()})));
    auto out = linear_no_bias(args.dim(), args.vocab_size());
    if (!args.weight_tying()) {
      output = register_module("output", out);
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t seq_len = tokens.size(1);
    DTENSOR_MODEL_CHECK(seq_len <= max_seq_len, "sequence longer than max_seq_len");
    torch::Tensor h = tok_embeddings(tokens);
    torch::Tensor pos = torch::arange(0, seq_len, tokens.options().dtype(torch::kLong));
    // positional embeddings of shape (seq_len, dim)
    h = apply_dropout(dropout, h + pos_embeddings(pos), model_args.layout_independent_dropout());
    for (const auto& layer : *layers) {
      auto* block = layer->as<TransformerBlockImpl>();
      h = model_args.activation_checkpoint()
              ? dtensor::activation_checkpoint(
                    [block](const torch::Tensor& x) { return block->forward(x); }, h,
                    *model_args.activation_checkpoint())
              : block->forward(h);
    }
    h = norm(h);
    torch::Tensor logits =
        output ? output(h) : torch::nn::functional::linear(h, tok_embeddings->weight);
    return logits.to(torch::kFloat);
  }
  ModelArgs model_args;
  int64_t max_seq_len;
  torch::nn::Embedding tok_embeddings;
  torch::nn::Embedding pos_embeddings;
  torch::nn::Dropout dropout;
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear output{nullptr}; // null with weight_tying
};
TORCH_MODULE(Transformer);

// A layout-independent init of the Transformer (docs/meta_init.md): every parameter from
// dtensor's random ops or a constant, in named_parameters() order, so the full values are
// the same on every layout and world size as on one process. Weights truncated normal
// (std 0.02, within 2 std), biases zero, LayerNorm weights one.
inline void init_weights(torch::nn::Module& model, double std = 0.02) {
  torch::NoGradGuard no_grad;
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (auto& item : model.named_parameters()) {
    at::Tensor p = item.value();
    const std::string& name = item.key();
    if (ends_with(name, ".bias")) {
      p.zero_();
    } else if (ends_with(name, "norm.weight")) {
      p.fill_(1.0);
    } else {
      dtensor::trunc_normal_(p, 0.0, std, -2 * std, 2 * std);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// common_fsdp.py: FSDPTestModel subclasses. Each has get_input(device) (which, like the
// Python, also reseeds the global generator with 1 + rank) and get_loss(input, output); the
// Python's run_backward is loss.backward() (MixtureOfExperts: see there).
// ---------------------------------------------------------------------------------------------

// What is left of nn.Linear(in, out) once its weight is tied to another module's parameter:
// only `bias` is registered (so the tied weight is listed once, under its owner); the caller
// passes the tied weight to forward. The constructor makes the random draws of nn.Linear's
// init (the weight's are thrown away).
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const torch::nn::LinearOptions& options) {
    torch::nn::Linear full(options);
    if (options.bias()) {
      bias = register_parameter("bias", full->bias);
    }
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& tied_weight) {
    return torch::nn::functional::linear(x, tied_weight, bias);
  }
  torch::Tensor bias;
};
TORCH_MODULE(TiedLinear);

// embed_tokens (23 x 16) -> (+ vocab_bias + long_buffer on src; bn on tgt) -> nn::Transformer
// (d_model 16, nhead 8, 2 encoder + 2 decoder layers, dim_feedforward 8, dropout 0.1, relu,
// sequence-first) -> output_proj, whose weight is embed_tokens.weight (only output_proj.bias
// is its own). bn is BatchNorm1d(bs = 2) over tgt's batch dimension, or Identity without
// add_bn. Buffers: vocab_bias (ones(16)), long_buffer (zeros(16), int64).
// LibTorch's nn::Transformer draws other random numbers than PyTorch's while it is built (it
// re-creates the layers it clones), so the constructor then rewinds the generator and replays
// the Python constructor's draws (init_like_python): a seed gives PyTorch's initial values.
struct TransformerWithSharedParamsImpl : torch::nn::Module {
  static constexpr int64_t d_vocab = 23;
  static constexpr int64_t d_model = 16;

  explicit TransformerWithSharedParamsImpl(int64_t rank_ = 0, bool add_bn = true,
                                           bool deterministic = false)
      : rank(rank_) {
    if (deterministic) {
      torch::manual_seed(0);
    }
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor start;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      start = gen.get_state();
    }
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(d_vocab, d_model));
    transformer = register_module("transformer",
                                  torch::nn::Transformer(torch::nn::TransformerOptions(d_model, 8)
                                                             .num_encoder_layers(2)
                                                             .num_decoder_layers(2)
                                                             .dim_feedforward(8)
                                                             .dropout(0.1)));
    // Shares the embedding and output projection weights.
    output_proj =
        register_module("output_proj", TiedLinear(torch::nn::LinearOptions(d_model, d_vocab)));
    vocab_bias = register_buffer("vocab_bias", embed_tokens->weight.new_ones({d_model}));
    long_buffer = register_buffer("long_buffer", torch::zeros_like(vocab_bias, torch::kLong));
    if (add_bn) {
      bn = torch::nn::AnyModule(torch::nn::BatchNorm1d(bs));
    } else {
      bn = torch::nn::AnyModule(torch::nn::Identity());
    }
    register_module("bn", bn.ptr());
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(start);
    }
    init_like_python();
    if (deterministic) {
      eval();
    }
  }
  // The random draws of the Python constructor, in its order: embed_tokens; the encoder layer
  // that nn.Transformer deep-copies (self_attn's out_proj nn.Linear then xavier in_proj_weight,
  // linear1, linear2), the decoder layer (self_attn, multihead_attn, linear1, linear2); xavier on
  // every transformer parameter of dim > 1; output_proj's nn.Linear. Biases come from the copied
  // layers; the attention biases are zero and the LayerNorms ones/zeros, as built.
  void init_like_python() {
    torch::NoGradGuard no_grad;
    const int64_t dff = 8;
    embed_tokens->weight.normal_();
    auto attention = [] {
      torch::nn::Linear out_proj(d_model, d_model);
      torch::nn::init::xavier_uniform_(torch::empty({3 * d_model, d_model}));
    };
    attention();
    torch::nn::Linear enc_linear1(d_model, dff);
    torch::nn::Linear enc_linear2(dff, d_model);
    attention();
    attention();
    torch::nn::Linear dec_linear1(d_model, dff);
    torch::nn::Linear dec_linear2(dff, d_model);
    for (auto& p : transformer->named_parameters()) {
      const std::string& name = p.key();
      const bool enc = name.rfind("encoder.", 0) == 0;
      auto ends_with = [&](const std::string& suffix) {
        return name.size() >= suffix.size() &&
               name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
      };
      if (p.value().dim() > 1) {
        torch::nn::init::xavier_uniform_(p.value());
      } else if (ends_with(".linear1.bias")) {
        p.value().copy_(enc ? enc_linear1->bias : dec_linear1->bias);
      } else if (ends_with(".linear2.bias")) {
        p.value().copy_(enc ? enc_linear2->bias : dec_linear2->bias);
      }
    }
    output_proj->bias.copy_(TiedLinear(torch::nn::LinearOptions(d_model, d_vocab))->bias);
  }
  // (src [6, bs], tgt [4, bs]): aranges, time-major.
  std::vector<torch::Tensor> get_input(const torch::Device& device) const {
    torch::manual_seed(1 + rank); // keep everything deterministic
    auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
    return {torch::arange(12, opts).view({6, bs}), torch::arange(bs * 4, opts).view({4, bs})};
  }
  // [tgt_len, bs, d_vocab] logits.
  torch::Tensor forward(const torch::Tensor& src_ids, const torch::Tensor& tgt_ids) {
    torch::Tensor src = embed_tokens(src_ids);
    src = src + vocab_bias + long_buffer.type_as(src);
    torch::Tensor tgt = bn.forward(embed_tokens(tgt_ids));
    torch::Tensor x = transformer(src, tgt);
    return output_proj(x, embed_tokens->weight);
  }
  // Summed cross entropy of the logits against tgt.
  torch::Tensor get_loss(const std::vector<torch::Tensor>& input,
                         const torch::Tensor& output) const {
    return torch::nn::functional::cross_entropy(
        output.view({-1, output.size(-1)}), input.at(1).view(-1),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  }
  // The Python's get_ignored_modules().
  std::vector<std::shared_ptr<torch::nn::Module>> get_ignored_modules() const {
    return {transformer.ptr()};
  }

  int64_t rank;
  int64_t bs = 2;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::Transformer transformer{nullptr};
  TiedLinear output_proj{nullptr};
  torch::Tensor vocab_bias;
  torch::Tensor long_buffer;
  torch::nn::AnyModule bn; // BatchNorm1d(bs) or Identity
};
TORCH_MODULE(TransformerWithSharedParams);

// nn::Sequential with a plain forward(Tensor), so that it can sit inside another Sequential
// (AnyModule cannot hold nn::Sequential, whose forward is a template).
struct NestedSequentialImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(const torch::Tensor& x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(NestedSequential);

// module = Sequential(Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)), Linear(16, 4),
// Linear(4, 8)). (The FSDP-wrapped ones in the Python: module.1, module.1.0, module.2.)
// Input rand(4, 8); loss output.sum().
struct NestedWrappedModuleImpl : torch::nn::Module {
  explicit NestedWrappedModuleImpl(int64_t rank_ = 0, bool deterministic = false) : rank(rank_) {
    if (deterministic) {
      torch::manual_seed(0);
    }
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Linear(8, 4));
    NestedSequential inner;
    inner->push_back(torch::nn::Linear(4, 16));
    inner->push_back(torch::nn::Linear(16, 16));
    seq->push_back(inner);
    seq->push_back(torch::nn::Linear(16, 4));
    seq->push_back(torch::nn::Linear(4, 8));
    module = register_module("module", seq);
  }
  std::vector<torch::Tensor> get_input(const torch::Device& device) const {
    torch::manual_seed(1 + rank); // keep everything deterministic
    return {torch::rand({4, 8}, torch::TensorOptions().device(device))};
  }
  torch::Tensor forward(const torch::Tensor& x) { return module->forward(x); }
  torch::Tensor get_loss(const std::vector<torch::Tensor>& input,
                         const torch::Tensor& output) const {
    return output.sum();
  }

  int64_t rank;
  torch::nn::Sequential module{nullptr};

 protected:
  // For subclasses that build their own `module` (the Python's super(NestedWrappedModule, ...)).
  struct NoModule {};
  NestedWrappedModuleImpl(NoModule, int64_t rank_) : rank(rank_) {}
};
TORCH_MODULE(NestedWrappedModule);

// NestedWrappedModule whose last two linears sit in one Sequential: module = Sequential(
// Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)), Sequential(Linear(16, 4),
// Linear(4, 8))). The Python's init() then freezes every parameter but module.2.1.*: use
// nonuniform_req_grad_nwm() for that (the constructor, like the Python's, does not).
struct NonUniformReqGradNWMImpl : NestedWrappedModuleImpl {
  // re.match pattern of the parameters that keep requires_grad.
  static constexpr const char* req_grad_pattern = R"(module\.2.*\.1.*)";

  explicit NonUniformReqGradNWMImpl(int64_t rank_ = 0, bool deterministic = false)
      : NestedWrappedModuleImpl(NoModule{}, rank_) {
    if (deterministic) {
      torch::manual_seed(0);
    }
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Linear(8, 4));
    NestedSequential inner1;
    inner1->push_back(torch::nn::Linear(4, 16));
    inner1->push_back(torch::nn::Linear(16, 16));
    seq->push_back(inner1);
    NestedSequential inner2;
    inner2->push_back(torch::nn::Linear(16, 4));
    inner2->push_back(torch::nn::Linear(4, 8));
    seq->push_back(inner2);
    module = register_module("module", seq);
  }
};
TORCH_MODULE(NonUniformReqGradNWM);

// The Python's NonUniformReqGradNWM._set_nonuniform_req_grad: freezes every parameter whose
// name does not match `mask` from its start (re.match semantics).
inline void set_nonuniform_req_grad(torch::nn::Module& model, const std::regex& mask) {
  for (auto& p : model.named_parameters()) {
    if (!std::regex_search(p.key(), mask, std::regex_constants::match_continuous)) {
      p.value().requires_grad_(false);
    }
  }
}

// The Python's NonUniformReqGradNWM.init(..., NO_FSDP, ...): only module.2.1.{weight,bias}
// keep requires_grad.
inline NonUniformReqGradNWM nonuniform_req_grad_nwm(int64_t rank = 0, bool deterministic = false) {
  NonUniformReqGradNWM model(rank, deterministic);
  set_nonuniform_req_grad(*model, std::regex(NonUniformReqGradNWMImpl::req_grad_pattern));
  return model;
}

// module = Sequential(Linear(8, 12), shared = Linear(12, 23), expert = Linear(23, 12),
// Linear(12, 8)); get_input/get_loss are NestedWrappedModule's. module.2 (`expert`) holds the
// expert parameters (in the Python: p.expert = True; with deterministic, seeded 42 + rank so
// every rank has its own; FSDP-wrapped on a group of size 1, i.e. never sharded); the rest are
// non-expert (seeded 0, the same on every rank; `shared` is FSDP-wrapped on the whole group).
// Left out: delay_before_free_ms (a CUDA sleep patched into FSDP's reshard) and run_backward's
// manual gradient all-reduce (grad / world_size, then all_reduce on the group, of every
// non-expert parameter) used when the model is not FSDP-wrapped.
// Like the Python, the base constructor first builds NestedWrappedModule's module (drawing its
// random numbers), which is then replaced.
struct MixtureOfExpertsImpl : NestedWrappedModuleImpl {
  static constexpr int64_t d_expert = 23;
  static constexpr int64_t d_shared = 12;
  static constexpr int64_t d_input = 8;

  explicit MixtureOfExpertsImpl(int64_t rank_ = 0, bool deterministic = false)
      : NestedWrappedModuleImpl(rank_, deterministic) {
    if (deterministic) {
      torch::manual_seed(42 + rank); // give each rank different expert parameters
    }
    expert = torch::nn::Linear(d_expert, d_shared);
    num_expert_params = 0;
    for (const auto& p : expert->parameters()) {
      num_expert_params += p.numel();
    }
    if (deterministic) {
      torch::manual_seed(0); // keep all other parameters the same across ranks
    }
    shared = torch::nn::Linear(d_shared, d_expert);
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Linear(d_input, d_shared));
    seq->push_back(shared);
    seq->push_back(expert);
    seq->push_back(torch::nn::Linear(d_shared, d_input));
    replace_module("module", seq);
    module = seq;
  }
  // The Python's hasattr(p, "expert").
  bool is_expert_param(const torch::Tensor& p) const {
    for (const auto& q : expert->parameters()) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) {
        return true;
      }
    }
    return false;
  }

  torch::nn::Linear expert{nullptr}; // module.2, not registered under this name
  torch::nn::Linear shared{nullptr}; // module.1, likewise
  int64_t num_expert_params = 0;
};
TORCH_MODULE(MixtureOfExperts);

} // namespace dtensor::models
