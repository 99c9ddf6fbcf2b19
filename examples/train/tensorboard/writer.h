#pragma once

// TensorBoard event files: the scalars of each step in the format TensorBoard reads
// (`tensorboard --logdir DIR`): Event messages of TensorBoard's schema, framed as TFRecords
// with ISA-L's CRC-32C (Debian's libisal). Nothing here knows about training.
//
// [Note: TensorBoard's event schema] What is written is the part of TensorBoard's published
// schema that scalars need (tensorboard/compat/proto/event.proto and summary.proto), with
// the field numbers and wire types those files give: Event {double wall_time = 1; int64 step
// = 2; string file_version = 3; Summary summary = 5}, Summary {repeated Value value = 1},
// Value {string tag = 1; float simple_value = 2}. The protobuf encoding of these seven fields
// is written here rather than by protobuf itself: the recipe's tokenizer library, Debian's
// libsentencepiece, carries a protobuf-lite (3.14) of its own and exports its symbols, and a
// second protobuf runtime in the process collides with it either way (Debian's shared
// libprotobuf-lite 3.21: the writer's calls resolved into sentencepiece's copy and crashed;
// its static archive: sentencepiece's version check then failed against 3.21). TensorBoard's
// own reader, which parses with protobuf, judges the result (test/llama3/observability_recipe.py).
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dtensor::train {

class TensorBoardWriter {
 public:
  // Opens a new event file in `folder`, created when missing, and writes its first event
  // (the file version). The name carries the time, the host and the process id, and a
  // counter when a file of that name exists: no file is ever replaced. Raises
  // std::runtime_error naming the path when the folder or file cannot be made.
  explicit TensorBoardWriter(const std::string& folder);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event holding `scalars` (tag, value) at `step`, stamped with the wall time, flushed
  // so a running TensorBoard shows it. False, after one warning, once a write failed (a full
  // disk): the caller goes on without TensorBoard.
  bool add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  bool write_record(const std::string& bytes);

  std::string path_;
  std::FILE* file_ = nullptr;
};

// [Note: TFRecord framing] What TensorBoard's reader expects around each serialized Event:
// its length (uint64, little-endian), the masked CRC-32C of those 8 bytes, the bytes, their
// masked CRC-32C. Masking (rotate right by 15, add 0xa282ead8) is TensorFlow's. Hand-written:
// it is these few lines, and the library that defines it (TensorFlow's record writer) is not
// one to take in for them.
uint32_t masked_crc32c(const std::string& bytes);

} // namespace dtensor::train
