// Where tests find ../shared, the reference Python venvs and scratch space. CTest sets the
// variables (cmake/DropkvHelpers.cmake); the fallbacks let a test binary run by hand too.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace dropkv::testing {

inline std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : fallback;
}
// ../shared beside the checkout.
inline std::filesystem::path SharedDir() { return EnvOr("DROPKV_SHARED", "../shared"); }
inline std::filesystem::path SourceDir() { return EnvOr("DROPKV_SOURCE_DIR", "."); }
inline std::filesystem::path BuildDir() { return EnvOr("DROPKV_BUILD_DIR", "build"); }
// Python with torch 2.11 + transformers 5.17 + tokenizers (scripts/setup.sh's main venv).
inline std::string ReferencePython() { return EnvOr("DROPKV_PYTHON", "python3"); }
// Python with kvpress (its own venv; it pins an older transformers).
inline std::string KvpressPython() { return EnvOr("DROPKV_KVPRESS_PYTHON", ""); }
// A per-test scratch folder under the build tree, created on first use.
inline std::filesystem::path ScratchDir(const std::string& name) {
  auto dir = BuildDir() / "test-scratch" / name;
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace dropkv::testing
