// Reads the reference tensors the Python fixtures write: raw C-order .bin files described by
// {"file": name, "shape": [...]} entries of a manifest.json.
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace dropkv::testing {

inline at::Tensor LoadBin(const std::filesystem::path& dir, const nlohmann::json& entry,
                          at::ScalarType dtype) {
  std::vector<int64_t> shape = entry.at("shape").get<std::vector<int64_t>>();
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  const auto path = dir / entry.at("file").get<std::string>();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  in.read(reinterpret_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (in.gcount() != static_cast<std::streamsize>(t.nbytes())) {
    throw std::runtime_error("short read " + path.string());
  }
  return t;
}

inline nlohmann::json LoadManifest(const std::filesystem::path& dir) {
  std::ifstream in(dir / "manifest.json");
  if (!in) throw std::runtime_error("no manifest.json in " + dir.string());
  return nlohmann::json::parse(in);
}

}  // namespace dropkv::testing
