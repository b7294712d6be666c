// Whole-file reads and read-only memory maps, with errors that name the file and the reason.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace dropkv {

absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Removes the files of folder `dir` (not its subfolders' contents) and then the folder, ignoring
// errors. Not std::filesystem::remove_all: libtorch.so exports a broken copy of it that the
// dynamic linker may bind to (it crashes on a null pointer).
void RemoveFlatFolder(const std::string& dir);

// A read-only private mapping of a whole file; unmapped on destruction. Non-copyable.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const std::byte* data, size_t size_bytes)
      : path_(std::move(path)), data_(data), size_bytes_(size_bytes) {}
  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace dropkv
