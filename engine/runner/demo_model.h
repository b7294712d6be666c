// The built-in demo model: a small Llama-architecture model with deterministic random weights
// and a byte-level tokenizer (256 byte tokens + <s> + </s>), written by our own code on first
// start so that the server runs with nothing downloaded. It produces gibberish by design.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace dropkv {

// <temp dir>/dropkv-demo-model: the folder when the caller names none (the server names its
// cache folder: config's DemoModelDir).
std::string DefaultDemoModelDir();
// `requested`, or DefaultDemoModelDir() when it is empty.
std::string DemoModelDir(const std::string& requested);

// Writes the demo model folder into `dir` unless it is already complete; returns `dir`.
// The same bytes on every machine (weights from a fixed-seed CPU generator).
absl::StatusOr<std::string> EnsureDemoModel(const std::string& dir);

// The demo's tokenizer.json text (GPT-2 style byte-level BPE with no merges).
std::string DemoTokenizerJson();

}  // namespace dropkv
