// The recipe's SentencePiece tokenizer (examples/train/tokenizer.h).
#include "tokenizer.h"

#include "common.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <stdexcept>

namespace dtensor::train {

namespace {

// The text's sentences, for the trainer.
class Sentences : public sentencepiece::SentenceIterator {
 public:
  explicit Sentences(const std::string& text) {
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find_first_of(",.", start);
      end = end == std::string::npos ? text.size() : end + 1;
      sentences_.push_back(text.substr(start, end - start));
      start = end;
    }
  }
  bool done() const override { return next_ >= sentences_.size(); }
  void Next() override { ++next_; }
  const std::string& value() const override { return sentences_[next_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  std::vector<std::string> sentences_;
  size_t next_ = 0;
};

void check(const sentencepiece::util::Status& status, const char* what) {
  if (!status.ok()) {
    throw std::runtime_error(std::string("tokenizer: ") + what + ": " + status.ToString());
  }
}

} // namespace

// [Note: the recipe's tokenizer] BPE without normalization (identity rules, spaces kept as
// they are, no dummy prefix), so that decode(encode(text)) is the text; every character of
// the text is covered. Training is in memory, on one thread: every rank gets the same model.
Tokenizer::Tokenizer(const std::string& text, int vocab_size)
    : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  Sentences sentences(text);
  std::string model;
  const std::string args = "--model_type=bpe --vocab_size=" + std::to_string(vocab_size) +
                           " --character_coverage=1.0 --num_threads=1 --hard_vocab_limit=false"
                           " --normalization_rule_name=identity --add_dummy_prefix=false"
                           " --remove_extra_whitespaces=false --split_by_whitespace=false"
                           " --minloglevel=2";
  sentencepiece::util::Status trained;
  {
    Muted quiet(STDERR_FILENO); // the trainer logs its command line before --minloglevel
    trained = sentencepiece::SentencePieceTrainer::Train(args, &sentences, &model);
  }
  check(trained, "training");
  check(processor_->LoadFromSerializedProto(model), "loading the trained model");
}

Tokenizer::Tokenizer(const std::string& model_path)
    : processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  check(processor_->Load(model_path), model_path.c_str());
}

std::string Tokenizer::serialized() const {
  return processor_->serialized_model_proto();
}

void Tokenizer::save(const std::string& path) const {
  write_output(path, processor_->serialized_model_proto());
}

Tokenizer::~Tokenizer() = default;

std::vector<int64_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  check(processor_->Encode(text, &ids), "encode");
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  check(processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &out), "decode");
  return out;
}

int64_t Tokenizer::size() const {
  return processor_->GetPieceSize();
}

int64_t Tokenizer::bos() const {
  return processor_->bos_id();
}

int64_t Tokenizer::eos() const {
  return processor_->eos_id();
}

} // namespace dtensor::train
