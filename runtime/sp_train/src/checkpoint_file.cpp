#include "checkpoint_file.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "sp/runtime/atomic_file.h"
#include "sp/runtime/hash.h"
#include "sp/input_files/read_file.h"

namespace sp::train {

namespace detail {

// A validated checkpoint file, open for as long as a section read from it is held.
class CheckpointSource {
 public:
  CheckpointSource(std::ifstream in, std::string name) : in_(std::move(in)), name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  // Reads [offset, offset + bytes) into dst; `what` names the bytes in the error.
  void read(std::uint64_t offset, void* dst, std::uint64_t bytes, const std::string& what) {
    if (bytes == 0) return;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
    if (!in_ || static_cast<std::uint64_t>(in_.gcount()) != bytes) {
      throw CheckpointError(
          fmt::format("{}: {} ({} bytes at offset {}) could not be read", name_, what, bytes, offset));
    }
  }

 private:
  std::ifstream in_;
  std::string name_;
};

}  // namespace detail

namespace {

constexpr char kMagic[8] = {'S', 'P', 'T', 'R', 'C', 'K', 'P', 'T'};
constexpr std::uint32_t kVersion = 1;
// Reads and copies of stored sections go through a buffer of this size.
constexpr std::uint64_t kChunkBytes = std::uint64_t{4} << 20;

template <typename T>
void append(Bytes& out, T value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

// Reads the structure of a file whose checksum held, each field checked against the body's end.
class Cursor {
 public:
  Cursor(detail::CheckpointSource& file, std::uint64_t end) : file_(file), end_(end) {}

  template <typename T>
  T read(const std::string& what) {
    T value;
    need(sizeof value, what);
    file_.read(pos_, &value, sizeof value, what);
    pos_ += sizeof value;
    return value;
  }
  std::string text(std::uint64_t bytes, const std::string& what) {
    need(bytes, what);
    std::string out(static_cast<std::size_t>(bytes), '\0');
    file_.read(pos_, out.data(), bytes, what);
    pos_ += bytes;
    return out;
  }
  void skip(std::uint64_t bytes, const std::string& what) {
    need(bytes, what);
    pos_ += bytes;
  }
  std::uint64_t position() const { return pos_; }

 private:
  void need(std::uint64_t bytes, const std::string& what) const {
    if (bytes > end_ - pos_) {
      throw CheckpointError(fmt::format("{}: truncated: {} needs {} bytes at offset {}, {} remain", file_.name(), what,
                                        bytes, pos_, end_ - pos_));
    }
  }
  detail::CheckpointSource& file_;
  std::uint64_t end_;
  std::uint64_t pos_ = 0;
};

}  // namespace

void CheckpointSections::forget(const std::string& name) {
  sections_.erase(name);
  views_.erase(name);
  stored_.erase(name);
}

void CheckpointSections::put(const std::string& name, Bytes payload) {
  forget(name);
  sections_[name] = std::move(payload);
}

void CheckpointSections::put(const std::string& name, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  put(name, Bytes(p, p + bytes));
}

void CheckpointSections::put_view(const std::string& name, const void* data, std::size_t bytes) {
  forget(name);
  views_[name] = View{static_cast<const std::uint8_t*>(data), bytes};
}

void CheckpointSections::merge(CheckpointSections other) {
  for (auto& [name, payload] : other.sections_) put(name, std::move(payload));
  for (const auto& [name, view] : other.views_) put_view(name, view.data, view.bytes);
  for (auto& [name, stored] : other.stored_) {
    if (other.sections_.count(name) != 0) continue;  // loaded, and taken above
    forget(name);
    stored_.emplace(name, std::move(stored));
  }
}

bool CheckpointSections::has(const std::string& name) const {
  return sections_.count(name) != 0 || stored_.count(name) != 0;
}

std::vector<std::string> CheckpointSections::names() const {
  std::vector<std::string> out;
  for (const auto& [name, payload] : sections_) out.push_back(name);
  for (const auto& [name, stored] : stored_) {
    if (sections_.count(name) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

const Bytes& CheckpointSections::get(const std::string& name) const {
  if (const auto loaded = sections_.find(name); loaded != sections_.end()) return loaded->second;
  const auto it = stored_.find(name);
  if (it == stored_.end()) {
    throw CheckpointError(fmt::format("{}: section '{}' is missing", source_, name));
  }
  Bytes payload(static_cast<std::size_t>(it->second.bytes));
  it->second.file->read(it->second.offset, payload.data(), payload.size(), fmt::format("section '{}'", name));
  return sections_.emplace(name, std::move(payload)).first->second;
}

std::uint64_t CheckpointSections::size_of(const std::string& name) const {
  if (const auto loaded = sections_.find(name); loaded != sections_.end()) return loaded->second.size();
  if (const auto it = stored_.find(name); it != stored_.end()) return it->second.bytes;
  throw CheckpointError(fmt::format("{}: section '{}' is missing", source_, name));
}

void CheckpointSections::get_into(const std::string& name, void* dst, std::size_t bytes) const {
  const std::uint64_t size = size_of(name);
  if (size != bytes) {
    throw CheckpointError(
        fmt::format("{}: section '{}' holds {} bytes; this model needs {}", source_, name, size, bytes));
  }
  if (const auto loaded = sections_.find(name); loaded != sections_.end()) {
    if (bytes != 0) std::memcpy(dst, loaded->second.data(), bytes);
    return;
  }
  const Stored& stored = stored_.at(name);
  stored.file->read(stored.offset, dst, bytes, fmt::format("section '{}'", name));
}

void CheckpointSections::write_atomically(const std::filesystem::path& file) const {
  // Every section, in memory, viewed or stored in a file, in name order.
  std::map<std::string, std::pair<View, const Stored*>> all;
  for (const auto& [name, payload] : sections_) all.emplace(name, std::pair{View{payload.data(), payload.size()}, nullptr});
  for (const auto& [name, view] : views_) all.emplace(name, std::pair{view, nullptr});
  for (const auto& [name, stored] : stored_) all.emplace(name, std::pair{View{nullptr, 0}, &stored});
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
  Bytes chunk;
  for (const auto& [name, section] : all) {
    const auto& [view, stored] = section;
    Bytes head;
    append(head, static_cast<std::uint32_t>(name.size()));
    head.insert(head.end(), name.begin(), name.end());
    append(head, static_cast<std::uint64_t>(stored ? stored->bytes : view.bytes));
    emit(head.data(), head.size());
    if (!stored) {
      emit(view.data, view.bytes);
      continue;
    }
    chunk.resize(static_cast<std::size_t>(std::min(stored->bytes, kChunkBytes)));
    for (std::uint64_t done = 0; done < stored->bytes;) {
      const std::uint64_t n = std::min(stored->bytes - done, kChunkBytes);
      stored->file->read(stored->offset + done, chunk.data(), n, fmt::format("section '{}'", name));
      emit(chunk.data(), static_cast<std::size_t>(n));
      done += n;
    }
  }
  Bytes tail;
  append(tail, checksum);
  writer.stream().write(reinterpret_cast<const char*>(tail.data()), static_cast<std::streamsize>(tail.size()));
  writer.commit();
}

CheckpointSections CheckpointSections::read(const std::filesystem::path& file) {
  const std::string name = file.string();
  std::uint64_t size = 0;
  std::shared_ptr<detail::CheckpointSource> source;
  try {
    std::error_code status_error;
    const std::filesystem::file_status status = std::filesystem::status(file, status_error);
    if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status) &&
        !std::filesystem::is_directory(status)) {
      throw sp::input_files::FileReadError(fmt::format("{}: is not a regular file; expected the checkpoint", name));
    }
    std::ifstream in = sp::input_files::open_input_file(file, "checkpoint");
    in.seekg(0, std::ios::end);
    const std::streamoff end = in.tellg();
    if (end < 0) throw sp::input_files::FileReadError(fmt::format("{}: cannot find the checkpoint's size", name));
    size = static_cast<std::uint64_t>(end);
    source = std::make_shared<detail::CheckpointSource>(std::move(in), name);
  } catch (const sp::input_files::FileReadError& e) {
    throw CheckpointError(e.what());
  }
  if (size < sizeof kMagic + 8 + 8) {
    throw CheckpointError(fmt::format("{}: truncated: {} bytes is shorter than any checkpoint", name, size));
  }
  char magic[sizeof kMagic];
  source->read(0, magic, sizeof magic, "the magic");
  if (std::memcmp(magic, kMagic, sizeof kMagic) != 0) {
    throw CheckpointError(fmt::format("{}: not an sp-train checkpoint (bad magic)", name));
  }
  // The checksum first, so that the structure below is read from the bytes that were written.
  const std::uint64_t body = size - sizeof(std::uint64_t);
  std::uint64_t checksum = sp::runtime::fnv1a64(nullptr, 0);
  {
    Bytes chunk(static_cast<std::size_t>(std::min(body, kChunkBytes)));
    for (std::uint64_t done = 0; done < body;) {
      const std::uint64_t n = std::min(body - done, kChunkBytes);
      source->read(done, chunk.data(), n, "the checkpoint");
      checksum = sp::runtime::fnv1a64(chunk.data(), static_cast<std::size_t>(n), checksum);
      done += n;
    }
  }
  std::uint64_t stored_checksum = 0;
  source->read(body, &stored_checksum, sizeof stored_checksum, "the checksum");
  if (stored_checksum != checksum) {
    throw CheckpointError(fmt::format("{}: checksum mismatch: the file is corrupt or truncated", name));
  }
  Cursor cursor(*source, body);
  cursor.skip(sizeof kMagic, "the magic");
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
    const std::string section = cursor.text(name_length, fmt::format("the name of section {}", i));
    const auto bytes = cursor.read<std::uint64_t>(fmt::format("the length of section '{}'", section));
    if (bytes > body) {
      throw CheckpointError(fmt::format("{}: section '{}' claims {} bytes, more than the file", name, section, bytes));
    }
    const std::uint64_t offset = cursor.position();
    cursor.skip(bytes, fmt::format("section '{}'", section));
    if (!sections.stored_.emplace(section, Stored{source, offset, bytes}).second) {
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
