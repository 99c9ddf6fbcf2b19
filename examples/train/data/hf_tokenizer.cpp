// Byte-level BPE from a tokenizer.json (hf_tokenizer.h). The pre-tokenizers' regexes run on
// PCRE2 (Debian's libpcre2-dev) in UTF mode with Unicode properties: \p{L}, \p{N}, (?i:...)
// and the look-aheads of GPT-2's and Llama 3's patterns.
#include "hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace dtensor::train {

namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer pattern (tokenizers' ByteLevel with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n.
std::vector<std::string> byte_chars() {
  std::vector<std::string> out(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    out[b] = utf8(printable ? b : next++);
  }
  return out;
}

// One UTF-8 character's length from its first byte.
size_t char_len(unsigned char c) {
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw std::invalid_argument(where + ": regex does not compile at " + std::to_string(offset) +
                                  ": " + reinterpret_cast<char*>(msg));
    }
    data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
  }
  ~Regex() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Isolated split: every match and every stretch between matches, in order.
  std::vector<std::string> split(const std::string& s) const {
    std::vector<std::string> out;
    size_t pos = 0, last = 0;
    while (pos < s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0,
                                 data_, nullptr);
      if (rc < 0) {
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data_);
      if (ov[1] == ov[0]) { // an empty match: step one character on
        pos = ov[0] + char_len(static_cast<unsigned char>(s[ov[0]]));
        continue;
      }
      if (ov[0] > last) {
        out.push_back(s.substr(last, ov[0] - last));
      }
      out.push_back(s.substr(ov[0], ov[1] - ov[0]));
      pos = last = ov[1];
    }
    if (last < s.size()) {
      out.push_back(s.substr(last));
    }
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* data_ = nullptr;
};

} // namespace

struct HfTokenizer::Impl {
  std::string path;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> tokens;                    // id -> token (vocab and added)
  std::unordered_map<std::string, int> ranks;         // "a b" -> merge rank
  std::vector<std::pair<std::string, int64_t>> added; // longest first
  std::vector<std::unique_ptr<Regex>> splits;         // Split pre-tokenizers, in order
  bool byte_regex = false;                            // ByteLevel's own GPT-2 split
  bool prefix_space = false;
  bool ignore_merges = false;
  std::vector<std::string> bytes = byte_chars();
  std::unordered_map<std::string, unsigned char> unbytes;

  [[noreturn]] void refuse(const std::string& key, const std::string& why) const {
    throw std::invalid_argument(path + ": " + key + ": " + why);
  }
  void read_pre_tokenizer(const json& p, const std::string& key);
  void read_model(const json& m);
  std::vector<int64_t> bpe(const std::string& piece) const;
};

void HfTokenizer::Impl::read_pre_tokenizer(const json& p, const std::string& key) {
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    const auto& list = p.at("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      read_pre_tokenizer(list[i], key + ".pretokenizers[" + std::to_string(i) + "]");
    }
  } else if (type == "Split") {
    if (p.value("behavior", "") != "Isolated" || p.value("invert", false) ||
        !p.at("pattern").contains("Regex")) {
      refuse(key, "only Split with a Regex pattern, behavior Isolated, not inverted");
    }
    splits.push_back(std::make_unique<Regex>(p.at("pattern").at("Regex").get<std::string>(),
                                             path + ": " + key + ".pattern"));
  } else if (type == "ByteLevel") {
    byte_regex = p.value("use_regex", true);
    prefix_space = p.value("add_prefix_space", false);
  } else {
    refuse(key + ".type", "'" + type + "' is not supported (ByteLevel, Split, Sequence)");
  }
}

void HfTokenizer::Impl::read_model(const json& m) {
  if (m.value("type", "") != "BPE") {
    refuse("model.type", "'" + m.value("type", "") + "' is not supported (BPE only)");
  }
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty()) {
      refuse(std::string("model.") + k, "is not supported by byte-level BPE here");
    }
  }
  ignore_merges = m.value("ignore_merges", false);
  for (const auto& [token, id] : m.at("vocab").items()) {
    vocab[token] = id.get<int64_t>();
  }
  const auto& merges = m.at("merges");
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string pair = merges[i].is_string() ? merges[i].get<std::string>()
                                                   : merges[i][0].get<std::string>() + " " +
                                                         merges[i][1].get<std::string>();
    ranks.emplace(pair, static_cast<int>(i));
  }
}

// [Note: BPE merges] The lowest-ranked adjacent pair merges first, the leftmost of equal
// ranks (tokenizers' priority queue by (rank, position)); until no pair has a rank.
std::vector<int64_t> HfTokenizer::Impl::bpe(const std::string& piece) const {
  if (ignore_merges) {
    if (auto it = vocab.find(piece); it != vocab.end()) {
      return {it->second};
    }
  }
  std::vector<std::string> syms;
  for (size_t i = 0; i < piece.size(); i += char_len(static_cast<unsigned char>(piece[i]))) {
    syms.push_back(piece.substr(i, char_len(static_cast<unsigned char>(piece[i]))));
  }
  while (syms.size() > 1) {
    int best = std::numeric_limits<int>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      auto it = ranks.find(syms[i] + " " + syms[i + 1]);
      if (it != ranks.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == std::numeric_limits<int>::max()) {
      break;
    }
    syms[at] += syms[at + 1];
    syms.erase(syms.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  std::vector<int64_t> ids;
  for (const std::string& s : syms) {
    auto it = vocab.find(s);
    if (it == vocab.end()) {
      throw std::invalid_argument(path + ": the piece '" + s + "' has no id (no unk_token)");
    }
    ids.push_back(it->second);
  }
  return ids;
}

HfTokenizer::HfTokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& t = *impl_;
  t.path = path;
  std::ifstream in(path);
  if (!in) {
    throw std::invalid_argument(path + ": cannot be read");
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw std::invalid_argument(path + ": not JSON: " + e.what());
  }
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    t.refuse("normalizer", "normalizers are not supported (byte-level BPE has none)");
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    t.read_pre_tokenizer(j["pre_tokenizer"], "pre_tokenizer");
  }
  t.read_model(j.at("model"));
  for (const auto& a : j.value("added_tokens", json::array())) {
    t.added.emplace_back(a.at("content").get<std::string>(), a.at("id").get<int64_t>());
  }
  std::stable_sort(t.added.begin(), t.added.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  int64_t n = 0;
  for (const auto& [s, id] : t.vocab) {
    n = std::max(n, id + 1);
  }
  for (const auto& [s, id] : t.added) {
    n = std::max(n, id + 1);
  }
  t.tokens.resize(static_cast<size_t>(n));
  for (const auto& [s, id] : t.vocab) {
    t.tokens[static_cast<size_t>(id)] = s;
  }
  for (const auto& [s, id] : t.added) {
    t.tokens[static_cast<size_t>(id)] = s;
  }
  for (int b = 0; b < 256; ++b) {
    t.unbytes[t.bytes[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
  }
}

HfTokenizer::~HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;

std::vector<int64_t> HfTokenizer::encode(const std::string& text) const {
  const Impl& t = *impl_;
  std::vector<int64_t> ids;
  // Text between added tokens goes through the pre-tokenizers and the model.
  auto plain = [&](const std::string& s) {
    if (s.empty()) {
      return;
    }
    std::vector<std::string> pieces{t.prefix_space && s[0] != ' ' ? " " + s : s};
    for (const auto& r : t.splits) {
      std::vector<std::string> next;
      for (const std::string& p : pieces) {
        for (std::string& q : r->split(p)) {
          next.push_back(std::move(q));
        }
      }
      pieces = std::move(next);
    }
    if (t.byte_regex) {
      static const Regex gpt2(kGpt2Pattern, "GPT-2's pattern");
      std::vector<std::string> next;
      for (const std::string& p : pieces) {
        for (std::string& q : gpt2.split(p)) {
          next.push_back(std::move(q));
        }
      }
      pieces = std::move(next);
    }
    for (const std::string& p : pieces) {
      std::string mapped;
      for (unsigned char c : p) {
        mapped += t.bytes[c];
      }
      for (int64_t id : t.bpe(mapped)) {
        ids.push_back(id);
      }
    }
  };
  size_t start = 0, pos = 0;
  while (pos < text.size()) {
    const auto hit = std::find_if(t.added.begin(), t.added.end(), [&](const auto& a) {
      return !a.first.empty() && text.compare(pos, a.first.size(), a.first) == 0;
    });
    if (hit == t.added.end()) {
      ++pos;
      continue;
    }
    plain(text.substr(start, pos - start));
    ids.push_back(hit->second);
    pos = start = pos + hit->first.size();
  }
  plain(text.substr(start));
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int64_t>& ids) const {
  const Impl& t = *impl_;
  std::string out;
  for (int64_t id : ids) {
    const std::string& tok = t.tokens.at(static_cast<size_t>(id));
    const bool added =
        std::any_of(t.added.begin(), t.added.end(), [&](const auto& a) { return a.second == id; });
    if (added) {
      out += tok;
      continue;
    }
    for (size_t i = 0; i < tok.size(); i += char_len(static_cast<unsigned char>(tok[i]))) {
      out += static_cast<char>(
          t.unbytes.at(tok.substr(i, char_len(static_cast<unsigned char>(tok[i])))));
    }
  }
  return out;
}

int64_t HfTokenizer::size() const {
  return static_cast<int64_t>(impl_->tokens.size());
}

std::optional<int64_t> HfTokenizer::token_id(const std::string& token) const {
  for (const auto& [s, id] : impl_->added) {
    if (s == token) {
      return id;
    }
  }
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? std::nullopt : std::optional<int64_t>(it->second);
}

} // namespace dtensor::train
