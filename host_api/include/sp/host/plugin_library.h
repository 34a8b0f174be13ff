// Loading one policy plugin .so: trust check, private copy, version negotiation and
// table validation. Unloading it again, with proof that the library left the process.
#ifndef SP_HOST_PLUGIN_LIBRARY_H
#define SP_HOST_PLUGIN_LIBRARY_H

#include <sp/error.h>
#include <sp/plugin_abi_v1.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace sp::host {

/// Any failure to load, validate or instantiate a plugin. The message names the file
/// (and the configuration source where one is involved) and says what was expected.
class PluginError : public ErrorAs<std::runtime_error> {
 public:
  explicit PluginError(const std::string& what) : ErrorAs(ErrorKind::plugin, what) {}
};

/// Refuses a plugin file that someone other than its owner could have replaced, as
/// ssh's StrictModes does for key files: its directory must not be world-writable, and
/// the file must be a regular file owned by the current user or root and writable by
/// neither group nor others. Throws PluginError naming the path and the reason.
void check_plugin_file_is_trusted(const std::filesystem::path& file);

/// What unloading a library achieved. `unloaded` is false when the dynamic loader
/// still holds the library after dlclose (for example because of a GNU-unique symbol or
/// a thread_local destructor in the plugin); `detail` then says so.
struct UnloadReport {
  bool unloaded = true;
  std::string detail;
};

/// One loaded plugin library.
///
/// dlopen returns the already-loaded handle for a path it has seen, so a new version
/// at the same path would silently resolve to the old code. Every load therefore copies
/// the file into its own private directory (mkdtemp, mode 0700, under $TMPDIR or /tmp)
/// and opens that copy with RTLD_NOW | RTLD_LOCAL. The copy is removed on unload.
///
/// Move-only. Destroying a loaded library unloads it; every context created from its
/// table must have been destroyed before.
class PluginLibrary {
 public:
  /// Checks trust, copies, loads, resolves `sp_policy_plugin_v1` on this handle,
  /// negotiates the ABI version and validates the table for the minor it reports: a 1.0
  /// table needs struct_size >= SP_PLUGIN_TABLE_V1_0_SIZE and ten non-NULL functions, a
  /// 1.1 table also covers and sets set_transfer_bytes and set_precision_calibration_errors.
  /// Throws PluginError naming the file and what is missing.
  static PluginLibrary load(const std::filesystem::path& file);

  PluginLibrary(PluginLibrary&&) noexcept;
  PluginLibrary& operator=(PluginLibrary&&) noexcept;
  PluginLibrary(const PluginLibrary&) = delete;
  PluginLibrary& operator=(const PluginLibrary&) = delete;
  ~PluginLibrary();

  /// The validated function table; borrowed, valid until unload().
  const sp_policy_plugin_v1_table& table() const;
  /// The file the caller named.
  const std::filesystem::path& source_path() const;
  /// The private copy the loader actually opened. It is unlinked once loaded (the mapping
  /// keeps it alive), so the path names a file that no longer exists on disk.
  const std::filesystem::path& loaded_path() const;
  std::string_view plugin_name() const;
  std::string_view plugin_version() const;
  /// The ABI minor the plugin's table reports (0 for a 1.0 plugin). The table's fields of
  /// later minors are absent for it: the validated table is only read up to its minor.
  std::uint32_t abi_minor() const;
  bool is_loaded() const;

  /// Closes the handle, checks with dlopen(RTLD_NOLOAD) that the library is gone and
  /// removes the private copy. Calling it again is a no-op that reports success.
  UnloadReport unload();

 private:
  struct State;
  explicit PluginLibrary(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace sp::host

#endif  // SP_HOST_PLUGIN_LIBRARY_H
