#include "tensorboard/writer.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>

#include <isa-l/crc.h>

namespace dtensor::train {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("localhost");
}

// TensorBoard lists files whose name holds "tfevents"; this is the name TensorFlow and
// PyTorch's SummaryWriter give them, with a counter against a file of the same name.
std::FILE* create_event_file(const std::filesystem::path& folder, std::string& path) {
  const std::string stem = "events.out.tfevents." + std::to_string(static_cast<int64_t>(now_s())) +
                           "." + host_name() + "." + std::to_string(getpid()) + ".";
  for (int n = 0; n < 1000; ++n) {
    path = (folder / (stem + std::to_string(n))).string();
    // "x": fails when the file exists (C11), so another's file is never replaced.
    if (std::FILE* f = std::fopen(path.c_str(), "wbx")) {
      return f;
    }
    if (errno != EEXIST) {
      break;
    }
  }
  throw std::runtime_error("TensorBoard: cannot create an event file " + path + ": " +
                           std::strerror(errno));
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}

// Protobuf's wire format: a field's key is its number << 3 | its wire type.
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, Wire wire) {
  put_varint(out, (field << 3) | wire);
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_u32(out, static_cast<uint32_t>(bits & 0xffffffffu));
  put_u32(out, static_cast<uint32_t>(bits >> 32));
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_u32(out, bits);
}

// An Event: wall_time (1), step (2), then file_version (3) or summary (5).
std::string event(double wall_time, int64_t step, const std::string& file_version,
                  const std::vector<std::pair<std::string, double>>& scalars) {
  std::string out;
  put_double(out, 1, wall_time);
  put_key(out, 2, kVarint);
  put_varint(out, static_cast<uint64_t>(step)); // int64: two's complement, as protobuf's
  if (!file_version.empty()) {
    put_bytes(out, 3, file_version);
    return out;
  }
  std::string summary;
  for (const auto& [tag, value] : scalars) { // Summary.value (1): Value {tag 1, simple_value 2}
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  put_bytes(out, 5, summary);
  return out;
}

} // namespace

uint32_t masked_crc32c(const std::string& bytes) {
  // ISA-L's iSCSI CRC is CRC-32C without the final inversion.
  auto* data = reinterpret_cast<unsigned char*>(const_cast<char*>(bytes.data()));
  const uint32_t crc = crc32_iscsi(data, static_cast<int>(bytes.size()), 0xffffffffu) ^ 0xffffffffu;
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) {
    throw std::runtime_error("TensorBoard: cannot create the folder " + folder + ": " +
                             ec.message());
  }
  file_ = create_event_file(folder, path_);
  // The first event names the format's version, as TensorBoard's reader expects.
  if (!write_record(event(now_s(), 0, "brain.Event:2", {}))) {
    throw std::runtime_error("TensorBoard: cannot write " + path_ + ": " + std::strerror(errno));
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
  }
}

bool TensorBoardWriter::add_scalars(int64_t step,
                                    const std::vector<std::pair<std::string, double>>& scalars) {
  if (file_ == nullptr) {
    return false;
  }
  if (write_record(event(now_s(), step, "", scalars))) {
    return true;
  }
  std::fprintf(stderr, "warning: cannot write the TensorBoard file %s (%s); no more events\n",
               path_.c_str(), std::strerror(errno));
  std::fclose(file_);
  file_ = nullptr;
  return false;
}

bool TensorBoardWriter::write_record(const std::string& bytes) {
  std::string header;
  const uint64_t n = bytes.size();
  put_u32(header, static_cast<uint32_t>(n & 0xffffffffu));
  put_u32(header, static_cast<uint32_t>(n >> 32));
  std::string record = header;
  put_u32(record, masked_crc32c(header));
  record += bytes;
  put_u32(record, masked_crc32c(bytes));
  return std::fwrite(record.data(), 1, record.size(), file_) == record.size() &&
         std::fflush(file_) == 0;
}

} // namespace dtensor::train
