#include <sp/host/plugin_library.h>

#include "abi_minor.h"
#include "elf_image.h"
#include "file_descriptor.h"

#include <boost/dll/shared_library.hpp>
#include <fmt/format.h>
#include <fmt/std.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <utility>

namespace sp::host {
namespace {

using Table = sp_policy_plugin_v1_table;

// The host reads struct_size, abi_major and abi_minor before it knows the layout.
constexpr std::size_t kVersionFieldsEnd = offsetof(Table, abi_minor) + sizeof(Table::abi_minor);

std::string errno_text(int error) { return std::generic_category().message(error); }

std::string mode_text(mode_t mode) { return fmt::format("{:04o}", mode & 07777); }

bool owned_by_user_or_root(uid_t owner) { return owner == 0 || owner == geteuid(); }

void check_trusted_directory(const std::filesystem::path& file, const std::filesystem::path& dir) {
  struct stat dir_stat {};
  if (::stat(dir.c_str(), &dir_stat) != 0) {
    throw PluginError(fmt::format("refusing to load policy plugin {}: cannot stat its directory {}: {}", file, dir,
                                  errno_text(errno)));
  }
  if ((dir_stat.st_mode & S_IWOTH) != 0) {
    throw PluginError(
        fmt::format("refusing to load policy plugin {}: its directory {} is world-writable (mode {}), so anyone "
                    "could replace the plugin; remove write permission for others (chmod o-w {})",
                    file, dir, mode_text(dir_stat.st_mode), dir));
  }
  if (!owned_by_user_or_root(dir_stat.st_uid)) {
    throw PluginError(
        fmt::format("refusing to load policy plugin {}: its directory {} is owned by uid {}, which is neither "
                    "the current user (uid {}) nor root",
                    file, dir, dir_stat.st_uid, geteuid()));
  }
  // Whoever can rename an entry of an ancestor can swap the whole directory for theirs. A
  // world-writable directory with the sticky bit (/tmp) lets others add entries but not
  // rename ours, unless they own it.
  for (std::filesystem::path ancestor = dir.parent_path(); !ancestor.empty(); ancestor = ancestor.parent_path()) {
    struct stat ancestor_stat {};
    if (::stat(ancestor.c_str(), &ancestor_stat) == 0 && (ancestor_stat.st_mode & S_IWOTH) != 0 &&
        ((ancestor_stat.st_mode & S_ISVTX) == 0 || !owned_by_user_or_root(ancestor_stat.st_uid))) {
      const bool sticky = (ancestor_stat.st_mode & S_ISVTX) != 0;
      throw PluginError(fmt::format(
          "refusing to load policy plugin {}: the directory {} above it is world-writable {} (mode {}), so {} "
          "could put another plugin directory in place of {}",
          file, ancestor,
          sticky ? fmt::format("and owned by uid {}, neither the current user nor root", ancestor_stat.st_uid)
                 : std::string("without the sticky bit"),
          mode_text(ancestor_stat.st_mode), sticky ? "its owner" : "anyone", dir));
    }
    if (ancestor == ancestor.root_path()) break;
  }
}

void check_trusted_file(const std::filesystem::path& file, const struct stat& file_stat) {
  if (!S_ISREG(file_stat.st_mode)) {
    throw PluginError(fmt::format("refusing to load policy plugin {}: it is not a regular file", file));
  }
  if (!owned_by_user_or_root(file_stat.st_uid)) {
    throw PluginError(
        fmt::format("refusing to load policy plugin {}: it is owned by uid {}, which is neither the current "
                    "user (uid {}) nor root",
                    file, file_stat.st_uid, geteuid()));
  }
  if ((file_stat.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    throw PluginError(fmt::format(
        "refusing to load policy plugin {}: it is writable by {} (mode {}); remove that permission "
        "(chmod go-w {})",
        file, (file_stat.st_mode & S_IWOTH) != 0 ? "others" : "its group", mode_text(file_stat.st_mode), file));
  }
}

std::filesystem::path resolve_plugin_path(const std::filesystem::path& file) {
  if (file.empty()) {
    throw PluginError(
        "cannot load the policy plugin: its file is unset (an empty path; StreamedModelOptions::plugin_file, or "
        "the host's plugin option, names the shared library)");
  }
  std::error_code error;
  std::filesystem::path resolved = std::filesystem::canonical(file, error);
  if (error) {
    throw PluginError(fmt::format("cannot load policy plugin {}: {}", file, error.message()));
  }
  return resolved;
}

// The private copy of a plugin file: a fresh mkdtemp directory (0700) holding one file.
class PrivateCopy {
 public:
  PrivateCopy() = default;
  PrivateCopy(PrivateCopy&& other) noexcept
      : dir_(std::move(other.dir_)), file_(std::move(other.file_)), on_disk_(std::exchange(other.on_disk_, false)) {}
  PrivateCopy& operator=(PrivateCopy&&) = delete;
  PrivateCopy(const PrivateCopy&) = delete;
  PrivateCopy& operator=(const PrivateCopy&) = delete;
  ~PrivateCopy() { remove(); }

  // Copies from an already opened and checked descriptor, so the bytes loaded are the
  // bytes whose owner and mode were checked.
  static PrivateCopy make(const std::filesystem::path& source, int source_fd, off_t size) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string dir_template =
        (std::filesystem::path(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") / "sp-plugin-XXXXXX").string();
    if (::mkdtemp(dir_template.data()) == nullptr) {
      throw PluginError(fmt::format("cannot load policy plugin {}: cannot create a private directory {}: {}", source,
                                    dir_template, errno_text(errno)));
    }
    PrivateCopy copy;
    copy.dir_ = dir_template;
    copy.on_disk_ = true;
    copy.file_ = copy.dir_ / source.filename();
    FileDescriptor out(::open(copy.file_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0700));
    if (out.get() < 0) {
      throw PluginError(fmt::format("cannot load policy plugin {}: cannot create its private copy {}: {}", source,
                                    copy.file_, errno_text(errno)));
    }
    off_t offset = 0;
    while (offset < size) {
      const ssize_t sent = ::sendfile(out.get(), source_fd, &offset, static_cast<std::size_t>(size - offset));
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) {
        throw PluginError(fmt::format("cannot load policy plugin {}: copying it to {} failed: {}", source, copy.file_,
                                      sent < 0 ? errno_text(errno) : "the file shrank"));
      }
    }
    return copy;
  }

  // Still names the copy after remove(): the loader knows the library by this path.
  const std::filesystem::path& file() const { return file_; }

  void remove() {
    if (!on_disk_) return;
    std::error_code ignored;
    std::filesystem::remove(file_, ignored);
    std::filesystem::remove(dir_, ignored);
    on_disk_ = false;
  }

 private:
  std::filesystem::path dir_;
  std::filesystem::path file_;
  bool on_disk_ = false;
};

void validate_table(const std::filesystem::path& file, const Table* table) {
  if (table == nullptr) {
    throw PluginError(fmt::format("policy plugin {}: {}() returned NULL instead of its function table", file,
                                  SP_PLUGIN_ENTRY_SYMBOL_V1));
  }
  if (table->struct_size < kVersionFieldsEnd) {
    throw PluginError(
        fmt::format("policy plugin {}: its function table says struct_size = {}, too small to hold even "
                    "struct_size, abi_major and abi_minor ({} bytes)",
                    file, table->struct_size, kVersionFieldsEnd));
  }
  if (table->abi_major != SP_PLUGIN_ABI_MAJOR) {
    throw PluginError(
        fmt::format("policy plugin {} was built for plugin ABI {}.{}, but this host implements ABI {}.{}; the "
                    "major versions must be equal",
                    file, table->abi_major, table->abi_minor, SP_PLUGIN_ABI_MAJOR, SP_PLUGIN_ABI_MINOR));
  }
  if (table->abi_minor > SP_PLUGIN_ABI_MINOR) {
    throw PluginError(
        fmt::format("policy plugin {} was built for plugin ABI {}.{}, newer than this host's ABI {}.{}; the host's "
                    "minor version must be >= the plugin's, so update the host",
                    file, table->abi_major, table->abi_minor, SP_PLUGIN_ABI_MAJOR, SP_PLUGIN_ABI_MINOR));
  }
  // Only the fields of the plugin's own minor are read: a 1.0 table ends at last_error, and
  // whatever lies behind it in the plugin's memory is not the host's to look at.
  const detail::AbiMinorLayout& layout = detail::abi_minor_layout(table->abi_minor);
  const std::size_t needed = layout.table_size;
  if (table->struct_size < needed) {
    // What the table lacks: the fields of the first minor whose table it does not cover.
    std::uint32_t short_of = 0;
    while (table->struct_size >= detail::abi_minor_layout(short_of).table_size) ++short_of;
    const std::string missing = detail::abi_minor_layout(short_of).table_adds;
    throw PluginError(
        fmt::format("policy plugin {}: its function table says struct_size = {}, but ABI {}.{} needs at least {} "
                    "bytes ({}); is the table filled in for the minor it claims?",
                    file, table->struct_size, table->abi_major, table->abi_minor, needed, missing));
  }
  const std::pair<const char*, bool> required[] = {
      {"plugin_name", table->plugin_name != nullptr},
      {"plugin_version", table->plugin_version != nullptr},
      {"create", table->create != nullptr},
      {"destroy", table->destroy != nullptr},
      {"begin_step", table->begin_step != nullptr},
      {"post_backward", table->post_backward != nullptr},
      {"compute_hints", table->compute_hints != nullptr},
      {"end_step", table->end_step != nullptr},
      {"set_calibration_errors", table->set_calibration_errors != nullptr},
      {"export_state", table->export_state != nullptr},
      {"import_state", table->import_state != nullptr},
      {"last_error", table->last_error != nullptr},
  };
  for (const auto& [field, present] : required) {
    if (!present) {
      throw PluginError(fmt::format("policy plugin {}: field {} of its function table is NULL; every field is required",
                                    file, field));
    }
  }
  // The functions each later minor appended, and the minor a plugin that lacks them reports.
  const auto require_minor = [&](std::uint32_t minor, std::initializer_list<std::pair<const char*, bool>> fields) {
    for (const auto& [field, present] : fields) {
      if (!present) {
        throw PluginError(fmt::format(
            "policy plugin {}: field {} of its function table is NULL; an ABI 1.{} plugin must set every field "
            "of ABI 1.{} (a plugin that does not implement it reports abi_minor {}: define "
            "SP_PLUGIN_ABI_TARGET_MINOR {} before including sp/plugin_abi_v1.h)",
            file, field, table->abi_minor, minor, minor - 1, minor - 1));
      }
    }
  };
  if (layout.has_precision_routes) {
    require_minor(1, {{"set_transfer_bytes", table->set_transfer_bytes != nullptr},
                      {"set_precision_calibration_errors", table->set_precision_calibration_errors != nullptr}});
  }
  if (layout.has_unit_signals) {
    require_minor(2, {{"set_unit_signals", table->set_unit_signals != nullptr},
                      {"get_unit_costs", table->get_unit_costs != nullptr},
                      {"get_budget_status", table->get_budget_status != nullptr}});
  }
  if (layout.has_initial_hints) require_minor(3, {{"initial_hints", table->initial_hints != nullptr}});
  if (layout.has_allocation_measurements) {
    require_minor(4, {{"propose_allocations", table->propose_allocations != nullptr},
                      {"set_allocation_measurements", table->set_allocation_measurements != nullptr}});
  }
}

}  // namespace

void check_plugin_file_is_trusted(const std::filesystem::path& file) {
  const std::filesystem::path resolved = resolve_plugin_path(file);
  check_trusted_directory(resolved, resolved.parent_path());
  struct stat file_stat {};
  if (::stat(resolved.c_str(), &file_stat) != 0) {
    throw PluginError(fmt::format("cannot load policy plugin {}: {}", resolved, errno_text(errno)));
  }
  check_trusted_file(resolved, file_stat);
}

struct PluginLibrary::State {
  State(std::filesystem::path source_file, PrivateCopy private_copy)
      : source(std::move(source_file)), copy(std::move(private_copy)) {}

  std::filesystem::path source;
  PrivateCopy copy;
  // Declared after the copy so that it closes before the copy is removed.
  boost::dll::shared_library library;
  const Table* table = nullptr;
  // Copies: the plugin's own strings vanish with it, and messages outlive the unload.
  std::string name;
  std::string version;
  // The minor the plugin's table reports: the host hands it nothing newer.
  std::uint32_t abi_minor = 0;
};

PluginLibrary PluginLibrary::load(const std::filesystem::path& file) {
  const std::filesystem::path resolved = resolve_plugin_path(file);
  check_trusted_directory(resolved, resolved.parent_path());
  // O_NONBLOCK: opening a FIFO put where the plugin should be would otherwise wait forever;
  // the regular-file check below then refuses it.
  FileDescriptor source(::open(resolved.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (source.get() < 0) {
    throw PluginError(fmt::format("cannot load policy plugin {}: {}", resolved, errno_text(errno)));
  }
  struct stat file_stat {};
  if (::fstat(source.get(), &file_stat) != 0) {
    throw PluginError(fmt::format("cannot load policy plugin {}: {}", resolved, errno_text(errno)));
  }
  check_trusted_file(resolved, file_stat);

  auto state = std::make_unique<State>(file, PrivateCopy::make(resolved, source.get(), file_stat.st_size));
  check_elf_image(resolved, state->copy.file());
  std::error_code error;
  state->library.load(state->copy.file(), boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, error);
  if (error) {
    const char* loader_message = ::dlerror();
    throw PluginError(fmt::format("cannot load policy plugin {}: the dynamic loader failed: {}", resolved,
                                  loader_message != nullptr ? loader_message : error.message()));
  }
  if (!state->library.has(SP_PLUGIN_ENTRY_SYMBOL_V1)) {
    throw PluginError(
        fmt::format("policy plugin {} does not export the entry symbol {}; a v1 plugin must define it (see "
                    "docs/plugin-abi.md)",
                    resolved, SP_PLUGIN_ENTRY_SYMBOL_V1));
  }
  auto& entry = state->library.get<const Table*()>(SP_PLUGIN_ENTRY_SYMBOL_V1);
  state->table = entry();
  validate_table(resolved, state->table);
  state->name = state->table->plugin_name;
  state->version = state->table->plugin_version;
  state->abi_minor = state->table->abi_minor;
  // The mapping keeps the unlinked file alive, so the copy can go now: a process that is
  // killed or never unloads leaves nothing behind in TMPDIR.
  state->copy.remove();
  return PluginLibrary(std::move(state));
}

PluginLibrary::PluginLibrary(std::unique_ptr<State> state) : state_(std::move(state)) {}
PluginLibrary::PluginLibrary(PluginLibrary&&) noexcept = default;

PluginLibrary& PluginLibrary::operator=(PluginLibrary&& other) noexcept {
  if (this != &other) {
    unload();
    state_ = std::move(other.state_);
  }
  return *this;
}

PluginLibrary::~PluginLibrary() { unload(); }

const sp_policy_plugin_v1_table& PluginLibrary::table() const { return *state_->table; }
const std::filesystem::path& PluginLibrary::source_path() const { return state_->source; }
const std::filesystem::path& PluginLibrary::loaded_path() const { return state_->copy.file(); }
std::string_view PluginLibrary::plugin_name() const { return state_->name; }
std::string_view PluginLibrary::plugin_version() const { return state_->version; }
std::uint32_t PluginLibrary::abi_minor() const { return state_->abi_minor; }
bool PluginLibrary::is_loaded() const { return state_ != nullptr && state_->library.is_loaded(); }

UnloadReport PluginLibrary::unload() {
  UnloadReport report;
  if (!is_loaded()) return report;
  state_->table = nullptr;
  state_->library.unload();
  if (void* still_there = ::dlopen(state_->copy.file().c_str(), RTLD_NOW | RTLD_NOLOAD)) {
    ::dlclose(still_there);
    report.unloaded = false;
    report.detail = fmt::format(
        "policy plugin {} (loaded from {}) is still mapped after dlclose; it probably has a GNU-unique "
        "symbol or a thread_local with a destructor (check with: nm -C --defined-only {} | grep ' u ')",
        state_->source, state_->copy.file(), state_->source);
  }
  return report;
}

}  // namespace sp::host
