// The planner's models and layouts: shapes by name, parameter counts, how a layout is written
// (dtensor/layout_planner.h).
#include <dtensor/layout_planner.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <map>

#include "internal/check.h"

namespace dtensor {

namespace {

// [Note: the planner's shapes] Each row is the model's Hugging Face config.json (hidden_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
// vocab_size; moe_intermediate_size, num_experts / n_routed_experts, num_experts_per_tok,
// n_shared_experts, first_k_dense_replace; q_lora_rank, kv_lora_rank, qk_nope_head_dim,
// qk_rope_head_dim, v_head_dim; sliding_window), DeepSeek-V3-16B as torchtitan's deepseek_v3
// "16B". Biases, q / k norms, attention sinks and DeepSeek-V3's multi-token prediction module
// are left out: under 0.1% of any row's parameters and FLOPs but the last, which no published
// row here trains.
const std::map<std::string, TransformerShape>& shapes() {
  static const std::map<std::string, TransformerShape> table = [] {
    std::map<std::string, TransformerShape> t;
    const auto llama = TransformerShape().vocab(128256).kv_heads(8).head_dim(128);
    t["llama3-8b"] = TransformerShape(llama).dim(4096).layers(32).heads(32).ffn_hidden(14336);
    t["llama3-70b"] = TransformerShape(llama).dim(8192).layers(80).heads(64).ffn_hidden(28672);
    t["llama3-405b"] = TransformerShape(llama).dim(16384).layers(126).heads(128).ffn_hidden(53248);
    const auto qwen3 =
        TransformerShape().vocab(151936).head_dim(128).experts(128).experts_per_token(8);
    t["qwen3-30b-a3b"] = TransformerShape(qwen3)
                             .dim(2048)
                             .layers(48)
                             .heads(32)
                             .kv_heads(4)
                             .ffn_hidden(6144)
                             .expert_hidden(768);
    t["qwen3-235b-a22b"] = TransformerShape(qwen3)
                               .dim(4096)
                               .layers(94)
                               .heads(64)
                               .kv_heads(4)
                               .ffn_hidden(12288)
                               .expert_hidden(1536);
    t["gpt-oss-120b"] = TransformerShape()
                            .dim(2880)
                            .layers(36)
                            .heads(64)
                            .kv_heads(8)
                            .head_dim(64)
                            .ffn_hidden(2880)
                            .vocab(201088)
                            .experts(128)
                            .experts_per_token(4)
                            .expert_hidden(2880)
                            .sliding_window(128);
    const auto mla = TransformerShape()
                         .head_dim(128)
                         .qk_rope_head_dim(64)
                         .v_head_dim(128)
                         .kv_lora_rank(512)
                         .dense_layers(1);
    t["deepseek-v3-16b"] = TransformerShape(mla)
                               .dim(2048)
                               .layers(27)
                               .heads(16)
                               .kv_heads(16)
                               .ffn_hidden(10944)
                               .vocab(102400)
                               .experts(64)
                               .experts_per_token(6)
                               .expert_hidden(1408)
                               .shared_experts(2);
    t["deepseek-v3"] = TransformerShape(mla)
                           .dim(7168)
                           .layers(61)
                           .heads(128)
                           .kv_heads(128)
                           .ffn_hidden(18432)
                           .vocab(129280)
                           .experts(256)
                           .experts_per_token(8)
                           .expert_hidden(2048)
                           .shared_experts(1)
                           .dense_layers(3)
                           .q_lora_rank(1536);
    for (auto& [name, shape] : t) {
      shape.name(name);
    }
    return t;
  }();
  return table;
}

int64_t attention_parameters(const TransformerShape& m) {
  if (m.kv_lora_rank() == 0) {
    return 2 * m.dim() * m.heads() * m.head_dim() + 2 * m.dim() * m.kv_heads() * m.head_dim();
  }
  const int64_t qk = m.head_dim() + m.qk_rope_head_dim();
  const int64_t q = m.q_lora_rank() > 0
                        ? m.dim() * m.q_lora_rank() + m.q_lora_rank() * m.heads() * qk
                        : m.dim() * m.heads() * qk;
  const int64_t kv = m.dim() * (m.kv_lora_rank() + m.qk_rope_head_dim()) +
                     m.kv_lora_rank() * m.heads() * (m.head_dim() + m.v_head_dim());
  return q + kv + m.heads() * m.v_head_dim() * m.dim();
}

} // namespace

TransformerShape transformer_shape(const std::string& name) {
  const auto it = shapes().find(name);
  DTENSOR_CHECK(it != shapes().end(), "no model shape named \"{}\" (the planner knows {})", name,
                fmt::join(transformer_shape_names(), ", "));
  return it->second;
}

std::vector<std::string> transformer_shape_names() {
  std::vector<std::string> names;
  for (const auto& [name, shape] : shapes()) {
    names.push_back(name);
  }
  return names;
}

int64_t block_parameters(const TransformerShape& m, bool moe) {
  const int64_t ffn = moe ? (m.experts() + m.shared_experts()) * 3 * m.dim() * m.expert_hidden() +
                                m.dim() * m.experts()
                          : 3 * m.dim() * m.ffn_hidden();
  return attention_parameters(m) + ffn + 2 * m.dim();
}

int64_t model_parameters(const TransformerShape& m) {
  const int64_t moe_layers = m.experts() > 0 ? m.layers() - m.dense_layers() : 0;
  return (m.layers() - moe_layers) * block_parameters(m, false) +
         moe_layers * block_parameters(m, true) + 2 * m.vocab() * m.dim() + m.dim();
}

std::string to_string(CheckpointMode policy) {
  switch (policy) {
  case CheckpointMode::None:
    return "none";
  case CheckpointMode::Selective:
    return "selective";
  case CheckpointMode::Full:
    return "full";
  }
  return "?";
}

std::string to_string(const Layout& l) {
  std::string pp = fmt::format("pp {}", l.pp());
  if (l.pp() > 1) {
    pp += fmt::format(" {}", l.schedule());
    if (l.virtual_stages() > 1) {
      pp += fmt::format(" v{}", l.virtual_stages());
    }
  }
  std::string cp = fmt::format("cp {}", l.cp());
  if (l.cp() > 1) {
    cp += " " + l.cp_method();
  }
  return fmt::format("dp_rep {} x dp_shard {} x tp {} x {} x {}, ep {}, {} AC, mb {}",
                     l.dp_replicate(), l.dp_shard(), l.tp(), pp, cp, l.ep(),
                     to_string(l.checkpoint()), l.microbatch());
}

std::string simulate_flags(const Layout& l, const JobShape& job) {
  std::string s =
      fmt::format("--simulate {} --mesh {}x{}x{} --seq {} --batch {}", l.world(), l.dp_replicate(),
                  l.dp_shard(), l.tp(), job.seq(), job.global_batch());
  const int64_t local = job.global_batch() / (l.dp_replicate() * l.dp_shard());
  if (l.pp() > 1) {
    s += fmt::format(" --pp {} --pp-schedule {} --microbatches {}", l.pp(), l.schedule(),
                     local / l.microbatch());
  } else if (l.microbatch() < local) { // gradient accumulation
    s += fmt::format(" --local-batch {}", l.microbatch());
  }
  if (l.cp() > 1) {
    s += fmt::format(" --cp {} --cp-method {}", l.cp(), l.cp_method());
  }
  if (l.ep() > 1) {
    s += fmt::format(" --ep {}", l.ep());
  }
  return s + " --ac " + to_string(l.checkpoint());
}

} // namespace dtensor
