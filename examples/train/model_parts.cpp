// The recipe's model_parts (examples/train/model_parts.h).
#include "model_parts.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <dtensor/collectives.h>
#include <dtensor/dtensor.h>
#include <dtensor/expert_parallel.h>
#include <dtensor/float8.h>
#include <dtensor/fully_shard.h>
#include <dtensor/materialize.h>
#include <dtensor/pipeline_schedule.h>
#include <dtensor/random.h>
#include <dtensor/reshard.h>
#include <dtensor/tensor_parallel.h>

#include <models/check.h>
#include <models/llama3/generate.h>

#include "recipe_model.h"

namespace dtensor::train {

namespace {

// --ep with its dispatch: variable, or capacity with its factor, overflow and overlapped
// chunks, either with float8 rows (docs/moe.md). The
// ranks of an ep group call the experts with the same rows (the same microbatch shape), so
// the buffers are sized from each call's rows.
models::MoEParallel moe_parallel(const Flags& f) {
  ExpertParallelOptions options;
  options.float8_dispatch(f.ep_float8_dispatch);
  if (f.ep_dispatch == "capacity") {
    options.dispatch(EpDispatch::Capacity)
        .capacity_factor(f.ep_capacity_factor)
        .overflow(f.ep_overflow == "drop" ? EpOverflow::Drop : EpOverflow::Refuse)
        .overlap(f.ep_overlap);
  }
  return {f.ep, options};
}

// A microbatch's loss: the cross-entropy sum over its tokens divided by `tokens`, this rank's
// token count of the step (vocab-sharded logits under LossParallel, as the unpipelined
// recipe's).
PipelineLoss token_sum_loss(double tokens) {
  return [tokens](const at::Tensor& logits, const at::Tensor& targets) {
    namespace F = torch::nn::functional;
    return F::cross_entropy(logits.to(at::kFloat).flatten(0, 1), targets.flatten(),
                            F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
           tokens;
  };
}

FullyShardOptions fsdp_options(const Flags& f) {
  auto fsdp = FullyShardOptions();
  if (f.precision == "bf16") {
    fsdp.mp_policy(MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  }
  return fsdp;
}

at::Tensor local_of(const at::Tensor& t) {
  return is_dtensor(t) ? DTensor(t).to_local() : t;
}

} // namespace

ModelParts::ModelParts(const Flags& f, const ParallelDims& dims, const DeviceMesh& mesh,
                       models::Llama3& model, const at::Device& device)
    : f_(f), dims_(dims), mesh_(mesh), model_(model), args_(model->model_args), device_(device) {
  if (dims.cp_enabled()) {
    const CpMethod method = f.cp_method == "ring"           ? CpMethod::Ring
                            : f.cp_method == "ulysses"      ? CpMethod::Ulysses
                            : f.cp_method == "hierarchical" ? CpMethod::Hierarchical
                                                            : CpMethod::AllGather;
    // Refused before anything is built, not at the first call.
    const int64_t degree = method == CpMethod::Ulysses ? dims.cp : f.cp_ulysses_degree;
    if (method == CpMethod::Hierarchical) {
      DTENSOR_MODEL_CHECK(degree >= 1 && dims.cp % degree == 0, "--cp-method hierarchical: "
                          "--cp-ulysses-degree ", degree, " must divide --cp ", dims.cp);
    }
    if (method == CpMethod::Ulysses || method == CpMethod::Hierarchical) {
      const int64_t heads = args_.n_heads() / dims.tp, kv = args_.kv_heads() / dims.tp;
      DTENSOR_MODEL_CHECK(heads % degree == 0 && kv % degree == 0, "--cp-method ", f.cp_method,
                          ": ", heads, " query heads and ", kv, " key / value heads per tp rank "
                          "must both be multiples of ", degree, " (the all-to-all's ranks)");
    }
    balance_ = f.cp_balance == "headtail" ? CpBalance::HeadTail
               : f.cp_balance == "none"   ? CpBalance::None
                                          : CpBalance::Documents;
    cp_.emplace(ContextParallelOptions().method(method).ulysses_degree(degree));
    cp_->set_layout(cp_layout()); // each step's documents, when split, in use_documents
  }
  const FullyShardOptions fsdp = fsdp_options(f);
  const std::optional<models::Llama3Ac> ac = ac_options(f);
  if (dims.pp_enabled()) {
    build_pipeline(fsdp, ac);
  } else { // torchtitan's model_parts = [model]
    models::parallelize_llama3(model_, mesh, /*loss_parallel=*/true, fsdp, ac, cp_,
                               moe_parallel(f));
    to_empty(*model_, device);
    models::Llama3 whole = model_;
    parts_.push_back({0, model_.ptr(), [whole](const at::Tensor& x) mutable {
                        return dtensor::call(whole, x);
                      }});
    placement_ = {0};
    holder_ = model_.ptr();
  }
  init_values();
}

ModelParts::~ModelParts() = default;

// [Note: initializing stages built on meta] (models/llama3/pipeline.h): the whole model's
// init, this rank's parts materialized and the rest on the meta device, gives every layout
// the same values. Then a Hugging Face folder's, if one is given.
void ModelParts::init_values() {
  set_rng_state({true, static_cast<uint64_t>(f_.seed), 0}); // docs/random.md
  model_->init_weights();
  if (!f_.init_from_hf.empty()) {
    load_hf(f_.init_from_hf);
  } else if (!f_.init_from.empty()) { // a checkpoint's weights (resolve_start chose which)
    StateDict state = model_state();
    StateDict weights = state;
    weights.erase("freqs_cis"); // recomputed, not trained
    checkpoint::load(weights, f_.init_from, checkpoint::LoadOptions().convert_dtype(true));
    load_model_state(state);
  }
}

void ModelParts::build_pipeline(const FullyShardOptions& fsdp,
                                const std::optional<models::Llama3Ac>& ac) {
  const ScheduleKind kind = schedule_kind(f_.pp_schedule);
  const int pp = static_cast<int>(dims_.pp);
  const int per_rank = is_single_stage(kind) ? 1 : 2;
  const int num_stages = pp * per_rank;
  const int micro = static_cast<int>(pipeline_microbatches(f_));
  const PipelineOrder order = generate_schedule(kind, pp, micro, per_rank);
  placement_ = validate_schedule(order, num_stages, micro);
  const Group group = mesh_.get_group("pp");
  holder_ = std::make_shared<torch::nn::Module>("Stages");
  std::vector<PipelineStage> stages;
  std::string here;
  for (int s = 0; s < num_stages; ++s) {
    if (placement_[static_cast<size_t>(s)] != group.rank()) {
      continue;
    }
    models::Llama3Stage stage(model_, s, num_stages);
    models::parallelize_llama3_stage(stage, mesh_, /*loss_parallel=*/true, fsdp, ac, cp_,
                                     moe_parallel(f_));
    to_empty(*stage, device_);
    // Called through the module seam, as every other part (its root unit's hooks).
    auto forward = [stage](const at::Tensor& x) mutable { return dtensor::call(stage, x); };
    parts_.push_back({s, stage.ptr(), forward});
    holder_->register_module("stage" + std::to_string(s), stage.ptr());
    // Sequence-parallel hidden states travel as their local tensors and are rebuilt over tp.
    stages.emplace_back(s, stage.ptr(), forward, mesh_["tp"]);
    here += (here.empty() ? "" : ", ") + std::to_string(s);
  }
  // This rank's tokens of the step (its cp piece of each row): the loss is a sum over them
  // divided by their count, no division by the microbatches afterwards (torchtitan's
  // scale_grads=False).
  const double tokens = static_cast<double>(f_.batch / dims_.dp() * (f_.seq / dims_.cp));
  PipelineOptions options = PipelineOptions().scale_grads(false);
  // Each pipeline microbatch's documents, before its forward and its backward (activation
  // checkpointing recomputes the forward there): [Note: document masks].
  options.before_compute([this](int /*stage*/, int mb) {
    use_documents(docs_first_ + mb * pp_rows_, pp_rows_);
  });
  schedule_ = std::make_unique<PipelineSchedule>(std::move(stages), group, order, micro,
                                                 token_sum_loss(tokens), options);
  describe_ = std::string(schedule_name(kind)) + ", " + std::to_string(micro) +
              " microbatches, stages " + here + " of " + std::to_string(num_stages) + " here";
}

// Without --cp a one-rank layout that cuts nothing (any --seq): the whole sequence.
CpLayout ModelParts::cp_layout() const {
  return cp_ ? CpLayout(f_.seq, dims_.cp, balance_) : CpLayout(f_.seq, 1, CpBalance::None);
}

// [Note: a layout per microbatch] Under --cp-balance cost the rows a cp rank holds follow the
// documents: each forward's rows (an accumulation microbatch's, under --pp a pipeline
// microbatch's) get the layout of their own documents, the balance that counts being each
// call's (its ranks wait on the busiest), as torchtitan shards each microbatch. inputs()
// shards the step's rows unit by unit with those layouts, and use_documents() sets the same
// layout before each unit's forward and backward: the rotary positions and the attention's
// mask follow it. Head-tail and none do not depend on the documents: one layout for the step.
CpLayout ModelParts::layout_of(int64_t first, int64_t count) const {
  return CpLayout(f_.seq, dims_.cp, balance_, documents(first, count));
}

std::vector<std::vector<int64_t>> ModelParts::documents(int64_t first, int64_t count) const {
  if (docs_.empty()) {
    return {};
  }
  return {docs_.begin() + first, docs_.begin() + first + count};
}

int64_t ModelParts::local_len() const {
  return cp_layout().local_len();
}

namespace {

// The lengths of each row's documents: one ends after each `eos` (and at the row's end).
std::vector<std::vector<int64_t>> documents_of(const at::Tensor& x, int64_t eos) {
  const at::Tensor ends = x.eq(eos).cpu();
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(x.size(0)));
  for (int64_t b = 0; b < x.size(0); ++b) {
    int64_t start = 0;
    const at::Tensor at = ends[b].nonzero().flatten();
    for (int64_t i = 0; i < at.numel(); ++i) {
      const int64_t end = at[i].item<int64_t>() + 1;
      out[static_cast<size_t>(b)].push_back(end - start);
      start = end;
    }
    if (start < x.size(1)) {
      out[static_cast<size_t>(b)].push_back(x.size(1) - start);
    }
  }
  return out;
}

} // namespace

void ModelParts::use_documents(int64_t first, int64_t count) {
  model_->set_documents(documents(first, count));
  if (cp_) {
    cp_->set_layout(layout_of(first, count));
  }
}

std::pair<at::Tensor, at::Tensor> ModelParts::inputs(const at::Tensor& rows, bool whole) {
  at::Tensor x = rows.narrow(1, 0, f_.seq).to(device_);
  at::Tensor y = rows.narrow(1, 1, f_.seq).to(device_);
  docs_ = eos_ >= 0 ? documents_of(rows.narrow(1, 0, f_.seq), eos_)
                    : std::vector<std::vector<int64_t>>{};
  use_documents(0, x.size(0));
  if (!cp_) {
    return {x, y};
  }
  // The rows of each forward: an accumulation microbatch's, a pipeline microbatch's under --pp.
  const int64_t unit =
      whole ? x.size(0) : x.size(0) / f_.accumulation / (schedule_ ? pipeline_microbatches(f_) : 1);
  const DeviceMesh cp_mesh = mesh_["cp"];
  std::vector<at::Tensor> xs, ys;
  int64_t busiest = 0, total = 0;
  for (int64_t first = 0; first < x.size(0); first += unit) {
    const CpLayout l = layout_of(first, unit); // [Note: a layout per microbatch]
    xs.push_back(cp_shard(x.narrow(0, first, unit), 1, l, cp_mesh));
    ys.push_back(cp_shard(y.narrow(0, first, unit), 1, l, cp_mesh));
    int64_t most = 0;
    for (int64_t r = 0; r < dims_.cp; ++r) {
      const int64_t w = l.work(r);
      most = std::max(most, w);
      total += w;
    }
    busiest += most;
  }
  if (!whole) {
    imbalance_ = static_cast<double>(busiest * dims_.cp) / static_cast<double>(total);
  }
  return {at::cat(xs), at::cat(ys)};
}

std::string ModelParts::layout() const {
  std::string s = dims_.pp_enabled() ? "pp=" + std::to_string(dims_.pp) + " (" + describe_ + "), "
                                     : "";
  s += "dp_replicate=" + std::to_string(dims_.dp_replicate) +
       ", dp_shard=" + std::to_string(dims_.dp_shard) + ", ";
  if (dims_.cp_enabled()) {
    s += "cp=" + std::to_string(dims_.cp) + " " + f_.cp_method + " (" + name_of(balance_) + "), ";
  }
  s += "tp=" + std::to_string(dims_.tp);
  if (dims_.ep > 1) {
    s += ", ep=" + std::to_string(dims_.ep);
  }
  return s;
}

std::vector<at::Tensor> ModelParts::parameters() const {
  std::vector<at::Tensor> out;
  for (const ModelPart& part : parts_) {
    for (const auto& p : part.module->parameters()) {
      out.push_back(p);
    }
  }
  return out;
}

at::Tensor ModelParts::forward_backward(const at::Tensor& x, const at::Tensor& targets,
                                        const std::function<void(const char*)>& phase) {
  const int64_t a = f_.accumulation;
  const int64_t rows = x.size(0) / a; // a microbatch's rows
  at::Tensor loss;
  for (int64_t k = 0; k < a; ++k) {
    // HSDP under accumulation: every microbatch's backward reduce-scatters (the shards are
    // summed inside each unit, no unsharded gradient is kept), the all-reduce over the
    // replicas only after the last (fully_shard's set_requires_all_reduce).
    if (a > 1 && dims_.dp_replicate > 1) {
      for (const ModelPart& part : parts_) {
        if (std::optional<FSDPModule> root = fsdp_module(*part.module)) {
          root->set_requires_all_reduce(k + 1 == a);
        }
      }
    }
    const at::Tensor xk = x.narrow(0, k * rows, rows);
    const at::Tensor yk = targets.narrow(0, k * rows, rows);
    docs_first_ = k * rows; // under --pp each pipeline microbatch's (before_compute)
    pp_rows_ = schedule_ ? rows / pipeline_microbatches(f_) : rows;
    use_documents(docs_first_, rows);
    at::Tensor l;
    if (schedule_) { // forwards and backwards interleaved by the schedule
      phase("pipeline");
      LossParallel vocab_parallel; // the last stage's logits stay vocab-sharded
      l = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(x.device()));
      for (const at::Tensor& m : schedule_->step(xk, yk)) {
        l += local_of(m).detach().to(at::kFloat);
      }
    } else {
      l = microbatch(xk, yk, phase);
    }
    loss = k == 0 ? l : loss + l;
  }
  return loss;
}

// [Note: gradient accumulation] One of the step's `f.accumulation` microbatches, of equal
// size: its mean loss over its tokens divided by the number of microbatches, so that the
// accumulated gradient is the step's mean over all of its tokens (torchtitan's global-token
// normalization, every token counting here); under --pp the schedule's loss is a sum over
// the step's tokens divided by their count, the same gradient. Returns the microbatch's share
// of the step's loss, detached.
at::Tensor ModelParts::microbatch(const at::Tensor& x, const at::Tensor& y,
                                  const std::function<void(const char*)>& phase) {
  phase("forward");
  at::Tensor logits = parts_.front().forward(x);
  LossParallel vocab_parallel; // the logits stay vocab-sharded ([Note] in loss.cpp)
  at::Tensor loss =
      torch::nn::functional::cross_entropy(logits.to(at::kFloat).flatten(0, 1), y.flatten()) /
      static_cast<double>(f_.accumulation);
  phase("backward");
  loss.backward();
  return loss.detach();
}

at::Tensor ModelParts::evaluate(const at::Tensor& x, int64_t n,
                                const std::function<at::Tensor(const at::Tensor&)>& head) {
  c10::NoGradGuard no_grad;
  use_documents(0, docs_.empty() ? 0 : x.size(0)); // the whole batch at once, stage by stage
  const int last = static_cast<int>(placement_.size()) - 1;
  at::Tensor h = x;
  at::Tensor result = at::zeros({n}, at::TensorOptions().dtype(at::kDouble).device(device_));
  for (int s = 0; s <= last; ++s) {
    const ModelPart* part = nullptr;
    for (const ModelPart& p : parts_) {
      part = p.stage == s ? &p : part;
    }
    at::Tensor out = part != nullptr ? part->forward(h) : at::Tensor();
    if (s < last) {
      h = dims_.pp_enabled() ? hand_over(out, placement_[static_cast<size_t>(s)]) : out;
    } else if (part != nullptr) {
      result = head(out).to(at::kDouble).reshape({n}).to(device_);
    }
  }
  if (dims_.pp_enabled()) { // the last stage's ranks' result, to every rank
    broadcast_(result, placement_.back(), mesh_.get_group("pp"));
  }
  // Under --pp the stages keep their parameters gathered after forward (reshard_after_forward
  // off, for the backward that follows in training): let them go.
  for (const ModelPart& part : parts_) {
    for (const auto& m : part.module->modules()) {
      if (std::optional<FSDPModule> unit = fsdp_module(*m)) {
        unit->reshard();
      }
    }
  }
  return result.cpu();
}

// A stage's output, on the ranks of pipeline rank `owner`, to every rank of the pp group: the
// whole tensor (gathered over tp when it is a sequence-parallel DTensor), broadcast, and
// rebuilt as the DTensor the next stage takes (Shard(1) over tp: a local slice).
at::Tensor ModelParts::hand_over(const at::Tensor& out, int owner) {
  const Group group = mesh_.get_group("pp");
  const bool mine = group.rank() == owner;
  // DTensor, dtype, ndim (-1: an output that cannot be handed over), sizes.
  at::Tensor header = at::zeros({6}, at::kLong);
  at::Tensor whole;
  if (mine) {
    const bool sharded = is_dtensor(out);
    const bool fits = (!sharded || DTensor(out).placements() == Placements{Shard(1)}) &&
                      out.dim() <= 3;
    whole = !fits ? out : sharded ? DTensor(out).full_tensor() : out;
    header[0] = sharded ? 1 : 0;
    header[1] = static_cast<int64_t>(whole.scalar_type());
    header[2] = fits ? whole.dim() : -1;
    for (int64_t d = 0; fits && d < whole.dim(); ++d) {
      header[3 + d] = whole.size(d);
    }
  }
  header = header.to(device_);
  broadcast_(header, owner, group);
  header = header.cpu();
  // On every rank of the group alike, before the data's broadcast.
  DTENSOR_MODEL_CHECK(header[2].item<int64_t>() >= 0, "train: the output of pipeline rank ",
                      owner, "'s stage is not a tensor of at most 3 dimensions, plain or a ",
                      "DTensor sharded (Shard(1)) over tp: it cannot be handed to the next stage");
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < header[2].item<int64_t>(); ++d) {
    sizes.push_back(header[3 + d].item<int64_t>());
  }
  if (!mine) {
    whole = at::empty(sizes, at::TensorOptions()
                                 .dtype(static_cast<at::ScalarType>(header[1].item<int64_t>()))
                                 .device(device_));
  }
  whole = whole.contiguous();
  broadcast_(whole, owner, group);
  if (header[0].item<int64_t>() == 0) {
    return whole;
  }
  return DTensor::from_local(whole, mesh_["tp"], {Replicate()}).redistribute({Shard(1)});
}

double ModelParts::mean_loss(const at::Tensor& loss) const {
  at::Tensor l = local_of(loss).reshape({1}).to(at::kDouble) * static_cast<double>(dims_.pp);
  return all_reduce(l.to(device_), ReduceOp::Avg, world_group()).item<double>();
}

// The library's clip_grad_norm_ over every part's parameters: experts under ep on their own
// root, units over a flattened dimension (dp_shard x cp, the token-parallel units under tp)
// each reduced on their own and combined, and under pp one all-reduce more over the stages
// ([Note: gradients on several roots] in lib/train/clip_grad.cpp; torchtitan's
// _clip_grad_norm_with_ep and its pp_mesh).
at::Tensor ModelParts::clip_grad_norm(double max_norm) {
  return clip_grad_norm_(parameters(), max_norm, f_.norm_type, false,
                         dims_.pp_enabled() ? mesh_["pp"] : DeviceMesh());
}

void ModelParts::after_optimizer_step() {
  if (!f_.float8_all_gather) {
    return;
  }
  for (const ModelPart& part : parts_) { // one all-reduce each (docs/float8.md)
    precompute_float8_dynamic_scale_for_fsdp(*part.module);
  }
}

StateDict ModelParts::model_state() {
  StateDict out;
  for (const ModelPart& part : parts_) {
    for (const auto& item : get_model_state_dict(*part.module)) {
      if (!out.contains(item.key())) { // freqs_cis: every stage's, the same tensor
        out.insert(item.key(), item.value());
      }
    }
  }
  return out;
}

void ModelParts::load_model_state(const StateDict& state) {
  for (const ModelPart& part : parts_) {
    StateDict mine;
    for (const auto& item : get_model_state_dict(*part.module)) {
      const at::Tensor* value = state.find(item.key());
      DTENSOR_MODEL_CHECK(value != nullptr, "train: the state has no '", item.key(),
                          "' for stage ", part.stage);
      mine.insert(item.key(), *value);
    }
    set_model_state_dict(*part.module, mine);
  }
}

void ModelParts::export_hf(const std::string& dir, const models::HfExportOptions& options) {
  models::export_hf(model_state(), args_, dir, options);
}

void ModelParts::load_hf(const std::string& dir) {
  StateDict state = model_state();
  models::load_hf(state, args_, dir);
  load_model_state(state);
}

Group ModelParts::part_group() const {
  if (!dims_.pp_enabled()) {
    return world_group();
  }
  std::vector<std::string> inner = dims_.names();
  inner.erase(inner.begin()); // pp
  return mesh_[inner].flatten("pp_stage_ranks").get_group();
}

// [Note: the recipe samples with the generator] The closing sample runs on a tensor-parallel
// generator (models/llama3/generate.h), not on the training layout: a copy of the model over
// (world / tp, tp) with the generator's plan (parallelize_llama3_generator), filled from the
// trained parts by dtensor::reshard (each weight's pieces sent where the generator needs them,
// pipeline stages and expert shards included), then decoded greedily with the KV cache (latent
// attention has none: its tokens recompute the whole sequence). Every
// replica group of tp ranks decodes the same prompt, as far as the model's max_seq_len allows.
// The copy goes when it returns.
std::string sample(ModelParts& parts, const RecipeData& vocab, const std::string& prompt,
                   int64_t n, const at::Device& device) {
  const int64_t tp = parts.tp();
  const DeviceMesh mesh =
      init_device_mesh(device.type(), {get_world_size() / tp, tp}, {"replica", "tp"});
  models::Llama3 generator{nullptr};
  {
    MetaDeviceGuard meta;
    generator = models::Llama3(parts.args());
  }
  models::parallelize_llama3_generator(generator, mesh["tp"]);
  to_empty(*generator, device);
  reshard(parts.model_state(), get_model_state_dict(*generator), ReshardOptions().what("sample"));
  std::vector<int64_t> ids = vocab.encode(prompt);
  // No further than the positions the model has (its rotary table).
  n = std::min(n, parts.args().max_seq_len() - static_cast<int64_t>(ids.size()) + 1);
  if (n < 1) {
    return vocab.decode(ids);
  }
  const auto result = models::generate(generator, {ids},
                                       models::GenerateOptions()
                                           .max_new_tokens(n)
                                           .vocab_size(vocab.vocab_size())
                                           .kv_cache(!parts.args().mla()));
  ids.insert(ids.end(), result.tokens[0].begin(), result.tokens[0].end());
  return vocab.decode(ids);
}

} // namespace dtensor::train
