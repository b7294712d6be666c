// llama2.c checkpoints (stories260K) to a standard Hugging Face Llama folder: config.json,
// model.safetensors, generation_config.json, tokenizer.json + tokenizer_config.json (from the
// tok512.bin tokenizer). Layout: ../shared/models/stories260K/SOURCE.md.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace dropkv {

// Converts `model_bin` (+ `tokenizer_bin`, may be empty to skip the tokenizer files) into
// `out_dir` (created). wq and wk rows are permuted from llama2.c's interleaved RoPE pairs to
// HF's rotate_half layout. Errors name the file and the tensor.
absl::Status ConvertLlama2c(const std::string& model_bin, const std::string& tokenizer_bin,
                            const std::string& out_dir);

}  // namespace dropkv
