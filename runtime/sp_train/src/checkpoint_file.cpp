#include "checkpoint_file.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "sp/runtime/atomic_file.h"
#include "sp/runtime/hash.h"
#include "sp/runtime/read_file.h"

namespace sp::train {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'T', 'R', 'C', 'K', 'P', 'T'};
constexpr std::uint32_t kVersion = 1;

template <typename T>
void append(Bytes& out, T value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

class Cursor {
 public:
  Cursor(const Bytes& data, std::size_t end, std::string file) : data_(data), end_(end), file_(std::move(file)) {}

  template <typename T>
  T read(const char* what) {
    T value;
    take(&value, sizeof value, what);
    return value;
  }
  void take(void* dst, std::size_t bytes, const std::string& what) {
    if (bytes > end_ - pos_) {
      throw CheckpointError(fmt::format("{}: truncated: {} needs {} bytes at offset {}, {} remain", file_, what, bytes,
                                        pos_, end_ - pos_));
    }
    if (bytes != 0) std::memcpy(dst, data_.data() + pos_, bytes);
    pos_ += bytes;
  }
  std::size_t position() const { return pos_; }

 private:
  const Bytes& data_;
  std::size_t end_;
  std::size_t pos_ = 0;
  std::string file_;
};

}  // namespace

void CheckpointSections::put(const std::string& name, Bytes payload) {
  views_.erase(name);
  sections_[name] = std::move(payload);
}

void CheckpointSections::put(const std::string& name, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  put(name, Bytes(p, p + bytes));
}

void CheckpointSections::put_view(const std::string& name, const void* data, std::size_t bytes) {
  sections_.erase(name);
  views_[name] = View{static_cast<const std::uint8_t*>(data), bytes};
}

void CheckpointSections::merge(CheckpointSections other) {
  for (auto& [name, payload] : other.sections_) put(name, std::move(payload));
  for (const auto& [name, view] : other.views_) put_view(name, view.data, view.bytes);
}

const Bytes& CheckpointSections::get(const std::string& name) const {
  const auto it = sections_.find(name);
  if (it == sections_.end()) {
    throw CheckpointError(fmt::format("{}: section '{}' is missing", source_, name));
  }
  return it->second;
}

void CheckpointSections::get_into(const std::string& name, void* dst, std::size_t bytes) const {
  const Bytes& payload = get(name);
  if (payload.size() != bytes) {
    throw CheckpointError(
        fmt::format("{}: section '{}' holds {} bytes; this model needs {}", source_, name, payload.size(), bytes));
  }
  if (bytes != 0) std::memcpy(dst, payload.data(), bytes);
}

void CheckpointSections::write_atomically(const std::filesystem::path& file) const {
  // Every section, owned or viewed, in name order.
  std::map<std::string, View> all;
  for (const auto& [name, payload] : sections_) all.emplace(name, View{payload.data(), payload.size()});
  for (const auto& [name, view] : views_) all.emplace(name, view);
  sp::runtime::AtomicFileWriter writer(file);
  std::uint64_t checksum = sp::runtime::fnv1a64(nullptr, 0);
  const auto emit = [&](const void* data, std::size_t bytes) {
    checksum = sp::runtime::fnv1a64(data, bytes, checksum);
    writer.stream().write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  };
  Bytes header(std::begin(kMagic), std::end(kMagic));
  append(header, kVersion);
  append(header, static_cast<std::uint32_t>(all.size()));
  emit(header.data(), header.size());
  for (const auto& [name, view] : all) {
    Bytes head;
    append(head, static_cast<std::uint32_t>(name.size()));
    head.insert(head.end(), name.begin(), name.end());
    append(head, static_cast<std::uint64_t>(view.bytes));
    emit(head.data(), head.size());
    emit(view.data, view.bytes);
  }
  Bytes tail;
  append(tail, checksum);
  writer.stream().write(reinterpret_cast<const char*>(tail.data()), static_cast<std::streamsize>(tail.size()));
  writer.commit();
}

CheckpointSections CheckpointSections::read(const std::filesystem::path& file) {
  Bytes data;
  try {
    const std::string bytes = sp::runtime::read_whole_file(file, "checkpoint");
    data.assign(bytes.begin(), bytes.end());
  } catch (const sp::runtime::FileReadError& e) {
    throw CheckpointError(e.what());
  }
  const std::string name = file.string();
  if (data.size() < sizeof kMagic + 8 + 8) {
    throw CheckpointError(fmt::format("{}: truncated: {} bytes is shorter than any checkpoint", name, data.size()));
  }
  if (std::memcmp(data.data(), kMagic, sizeof kMagic) != 0) {
    throw CheckpointError(fmt::format("{}: not an sp-train checkpoint (bad magic)", name));
  }
  const std::size_t body = data.size() - sizeof(std::uint64_t);
  std::uint64_t stored = 0;
  std::memcpy(&stored, data.data() + body, sizeof stored);
  if (stored != sp::runtime::fnv1a64(data.data(), body)) {
    throw CheckpointError(fmt::format("{}: checksum mismatch: the file is corrupt or truncated", name));
  }
  Cursor cursor(data, body, name);
  char magic[sizeof kMagic];
  cursor.take(magic, sizeof magic, "the magic");
  const auto version = cursor.read<std::uint32_t>("the version");
  if (version != kVersion) {
    throw CheckpointError(
        fmt::format("{}: format version {}; this sp-train reads version {}", name, version, kVersion));
  }
  const auto count = cursor.read<std::uint32_t>("the section count");
  CheckpointSections sections;
  sections.source_ = name;
  for (std::uint32_t i = 0; i < count; ++i) {
    const auto name_length = cursor.read<std::uint32_t>("a section name length");
    if (name_length > body - cursor.position()) {  // before allocating what the header claims
      throw CheckpointError(
          fmt::format("{}: the name of section {} claims {} bytes, more than the file", name, i, name_length));
    }
    std::string section(name_length, '\0');
    cursor.take(section.data(), name_length, fmt::format("the name of section {}", i));
    const auto bytes = cursor.read<std::uint64_t>(fmt::format("the length of section '{}'", section).c_str());
    if (bytes > body) {
      throw CheckpointError(fmt::format("{}: section '{}' claims {} bytes, more than the file", name, section, bytes));
    }
    Bytes payload(static_cast<std::size_t>(bytes));
    cursor.take(payload.data(), payload.size(), fmt::format("section '{}'", section));
    if (!sections.sections_.emplace(section, std::move(payload)).second) {
      throw CheckpointError(fmt::format("{}: section '{}' appears twice", name, section));
    }
  }
  if (cursor.position() != body) {
    throw CheckpointError(
        fmt::format("{}: {} unexpected bytes after the last section", name, body - cursor.position()));
  }
  return sections;
}

}  // namespace sp::train
