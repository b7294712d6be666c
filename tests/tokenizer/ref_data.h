// Shared helpers of the tokenizer tests: the reference data the `tokenizer_reference` fixture
// (make_reference.py) writes, tokenizers loaded once per process, and readable mismatch reports.
#pragma once

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/tokenizer/tokenizer.h"
#include "tests/common/test_env.h"

namespace dropkv::testing {

inline std::filesystem::path RefDir() {
  return BuildDir() / "test-scratch" / "tokenizer-ref";
}

inline nlohmann::json ReadJson(const std::filesystem::path& p) {
  std::ifstream f(p);
  if (!f) {
    ADD_FAILURE() << "missing " << p << " (the tokenizer_reference fixture writes it)";
    return nlohmann::json::object();
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

inline const nlohmann::json& Corpus() {
  static const nlohmann::json corpus = ReadJson(RefDir() / "corpus.json")["strings"];
  return corpus;
}

// A family's tokenizer (llama3 / qwen3 / gemma3), loaded once.
inline const Tokenizer* LoadFamily(const std::string& family) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto it = cache.find(family);
  if (it != cache.end()) return it->second.get();
  auto tok = Tokenizer::FromDirectory((RefDir() / "tokenizers" / family).string());
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!tok.ok()) return nullptr;
  return cache.emplace(family, std::move(*tok)).first->second.get();
}

// A string with escapes for everything outside printable ASCII, for failure messages.
inline std::string Repr(const std::string& s, size_t max_len = 200) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < max_len; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\\' || c == '"') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > max_len) out += "...";
  return out + "\"";
}

template <typename T>
std::string Join(const std::vector<T>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? "," : "") << v[i];
  return os.str() + "]";
}

}  // namespace dropkv::testing
