// The pipeline action notation (include/dtensor/pipeline_schedule.h): names, printing,
// parsing, schedule kinds and stage placement, and the CSV and text forms of an order.
#include <dtensor/pipeline_schedule.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <utility>

#include "internal/check.h"
#include "parallel/pipelining/schedule_parts.h"

namespace dtensor {

namespace {

// [Note: action names in match order]
// After the stage number, each name is tried in this order and must be followed by digits
// only (the microbatch) or nothing. The longer names come first, so that `1WAIT_SEND_F2`
// never reads as stage 1's W; PyTorch matches a prefix and so accepts `0FX` as `0F`, which
// here is an error.
constexpr std::array<std::pair<std::string_view, ActionType>, 15> kNames{{
    {"WAIT_REDUCE_GRAD", ActionType::WaitReduceGrad},
    {"WAIT_SEND_F", ActionType::WaitSendF},
    {"WAIT_SEND_B", ActionType::WaitSendB},
    {"REDUCE_GRAD", ActionType::ReduceGrad},
    {"OVERLAP_F_B", ActionType::OverlapFB},
    {"UNSHARD", ActionType::Unshard},
    {"RESHARD", ActionType::Reshard},
    {"SEND_F", ActionType::SendF},
    {"RECV_F", ActionType::RecvF},
    {"SEND_B", ActionType::SendB},
    {"RECV_B", ActionType::RecvB},
    {"F", ActionType::Forward},
    {"I", ActionType::BackwardInput},
    {"B", ActionType::FullBackward},
    {"W", ActionType::BackwardWeight},
}};

constexpr std::array<std::pair<std::string_view, ScheduleKind>, 7> kSchedules{{
    {"GPipe", ScheduleKind::GPipe},
    {"1F1B", ScheduleKind::OneFOneB},
    {"Interleaved1F1B", ScheduleKind::Interleaved1F1B},
    {"LoopedBFS", ScheduleKind::LoopedBFS},
    {"InterleavedZeroBubble", ScheduleKind::InterleavedZeroBubble},
    {"ZBVZeroBubble", ScheduleKind::ZBVZeroBubble},
    {"DualPipeV", ScheduleKind::DualPipeV},
}};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) {
    s.remove_suffix(1);
  }
  return s;
}

bool all_digits(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int to_int(std::string_view digits, std::string_view text) {
  DTENSOR_CHECK(digits.size() <= 9, "invalid pipeline action '{}': number {} too large", text,
                digits);
  int v = 0;
  for (char c : digits) {
    v = v * 10 + (c - '0');
  }
  return v;
}

[[noreturn]] void bad_action(std::string_view text) {
  DTENSOR_FAIL(
      "invalid pipeline action '{}': expected [stage][type][microbatch] (e.g. 2F0, 1UNSHARD, "
      "3SEND_F1) or (sub;sub)OVERLAP_F_B",
      text);
}

PipelineAction parse_simple(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    ++digits;
  }
  if (digits == 0) {
    bad_action(text);
  }
  std::string_view rest = text.substr(digits);
  for (const auto& [name, type] : kNames) {
    if (type == ActionType::OverlapFB || rest.substr(0, name.size()) != name) {
      continue;
    }
    std::string_view mb = rest.substr(name.size());
    if (!all_digits(mb)) {
      continue;
    }
    PipelineAction a;
    a.stage = to_int(text.substr(0, digits), text);
    a.type = type;
    if (!mb.empty()) {
      a.microbatch = to_int(mb, text);
    }
    return a;
  }
  bad_action(text);
}

} // namespace

std::string_view action_type_name(ActionType type) {
  for (const auto& [name, t] : kNames) {
    if (t == type) {
      return name;
    }
  }
  return "?";
}

std::string PipelineAction::str() const {
  if (!sub_actions.empty()) {
    std::string s = "(";
    for (size_t i = 0; i < sub_actions.size(); ++i) {
      s += (i ? ";" : "") + sub_actions[i].str();
    }
    return s + ")" + std::string(action_type_name(type));
  }
  std::string s = std::to_string(stage) + std::string(action_type_name(type));
  if (microbatch) {
    s += std::to_string(*microbatch);
  }
  return s;
}

PipelineAction PipelineAction::parse(std::string_view text) {
  std::string_view t = trim(text);
  if (t.empty() || t.front() != '(') {
    return parse_simple(t);
  }
  size_t close = t.find(')');
  if (close == std::string_view::npos) {
    bad_action(text);
  }
  std::string_view inner = t.substr(1, close - 1);
  DTENSOR_CHECK(inner.find('(') == std::string_view::npos,
                "invalid pipeline action '{}': compound actions do not nest", text);
  PipelineAction a;
  a.stage = -1;
  std::string_view type = t.substr(close + 1);
  auto it =
      std::find_if(kNames.begin(), kNames.end(), [&](const auto& n) { return n.first == type; });
  if (it == kNames.end()) {
    bad_action(text);
  }
  a.type = it->second;
  while (!inner.empty()) {
    size_t semi = inner.find(';');
    std::string_view piece = trim(inner.substr(0, semi));
    if (!piece.empty()) {
      a.sub_actions.push_back(parse_simple(piece));
    }
    inner = semi == std::string_view::npos ? std::string_view{} : inner.substr(semi + 1);
  }
  DTENSOR_CHECK(!a.sub_actions.empty(),
                "invalid pipeline action '{}': a compound action needs sub-actions", text);
  return a;
}

bool PipelineAction::is_compute() const {
  switch (type) {
  case ActionType::Forward:
  case ActionType::BackwardInput:
  case ActionType::BackwardWeight:
  case ActionType::FullBackward:
  case ActionType::OverlapFB:
    return true;
  default:
    return false;
  }
}

ScheduleKind schedule_kind(std::string_view name) {
  auto lower = [](std::string_view s) {
    std::string out(s);
    std::transform(out.begin(), out.end(), out.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    return out;
  };
  std::vector<std::string_view> known;
  for (const auto& [n, kind] : kSchedules) {
    if (lower(n) == lower(name)) {
      return kind;
    }
    known.push_back(n);
  }
  DTENSOR_FAIL("unknown pipeline schedule '{}': the schedules are {}", name,
               fmt::join(known, ", "));
}

std::string_view schedule_name(ScheduleKind kind) {
  for (const auto& [n, k] : kSchedules) {
    if (k == kind) {
      return n;
    }
  }
  return "?";
}

bool is_single_stage(ScheduleKind kind) {
  return kind == ScheduleKind::GPipe || kind == ScheduleKind::OneFOneB;
}

std::vector<int> stage_to_rank(ScheduleKind kind, int pp, int num_stages) {
  DTENSOR_CHECK(pp > 0 && num_stages > 0 && num_stages % pp == 0,
                "{}: {} stages cannot be placed evenly on {} pipeline ranks", schedule_name(kind),
                num_stages, pp);
  bool v = kind == ScheduleKind::ZBVZeroBubble || kind == ScheduleKind::DualPipeV;
  std::vector<int> ranks(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    int round = s / pp;
    int pos = s % pp;
    ranks[s] = (v && round % 2 == 1) ? pp - 1 - pos : pos;
  }
  return ranks;
}

std::string schedule_to_csv(const PipelineOrder& order) {
  std::string out;
  for (const auto& rank : order) {
    for (size_t i = 0; i < rank.size(); ++i) {
      out += (i ? "," : "") + (rank[i] ? rank[i]->str() : std::string());
    }
    out += "\r\n"; // csv.writer's line ending, as PyTorch writes it
  }
  return out;
}

PipelineOrder schedule_from_csv(std::string_view text, std::string_view file) {
  std::string_view name = file.empty() ? std::string_view("<csv>") : file;
  PipelineOrder order;
  size_t line_no = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') {
      line.remove_suffix(1);
    }
    RankActions rank;
    // An empty line is a rank without actions (csv.reader's []), not one idle step.
    while (!line.empty()) {
      size_t comma = line.find(',');
      std::string_view cell = trim(line.substr(0, comma));
      if (cell.empty()) {
        rank.push_back(std::nullopt);
      } else {
        try {
          rank.push_back(PipelineAction::parse(cell));
        } catch (const Error& e) {
          DTENSOR_FAIL("{}: rank {} (line {}), step {}: {}", name, order.size(), line_no,
                       rank.size(), e.what());
        }
      }
      if (comma == std::string_view::npos) {
        break;
      }
      line = line.substr(comma + 1);
      if (line.empty()) { // a trailing comma: one more idle step
        rank.push_back(std::nullopt);
      }
    }
    order.push_back(std::move(rank));
  }
  return order;
}

std::string schedule_to_text(const PipelineOrder& order) {
  std::string out;
  for (const auto& rank : order) {
    for (size_t i = 0; i < rank.size(); ++i) {
      out += (i ? "," : "") + (rank[i] ? rank[i]->str() : std::string("_"));
    }
    out += "\n";
  }
  return out;
}

namespace detail {

std::vector<PipelineAction> parts_of(const PipelineAction& a) {
  return a.sub_actions.empty() ? std::vector<PipelineAction>{a} : a.sub_actions;
}

void check_compute_only(const PipelineOrder& order, const char* what) {
  for (size_t r = 0; r < order.size(); ++r) {
    for (size_t step = 0; step < order[r].size(); ++step) {
      const auto& a = order[r][step];
      DTENSOR_CHECK(!a || a->is_compute(),
                    "{}: expected a compute-only schedule, found {} at rank {}, step {}", what,
                    a->str(), r, step);
    }
  }
}

} // namespace detail

} // namespace dtensor
