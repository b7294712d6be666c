// Converts the llama2.c tokenizer file (tok512.bin, stories260K) into a Hugging Face tokenizer.json
// so that the rest of the engine only ever reads tokenizer.json. Layout: see
// ../shared/models/stories260K/SOURCE.md.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace dropkv {

// tokenizer.json text for a SentencePiece-style BPE (Llama-2 pipeline): Prepend/Replace '▁'
// normalizer, byte fallback, merges derived from the piece scores, Replace+ByteFallback+Fuse+Strip
// decoder, BOS post-processor. `vocab_size` comes from the model header (the file does not store
// it). Errors name the file and the record.
absl::StatusOr<std::string> Tok512ToTokenizerJson(const std::string& tok512_path,
                                                  int32_t vocab_size);

// tokenizer_config.json text that goes with it (add_bos_token, bos/eos/unk names, no chat
// template).
std::string Tok512TokenizerConfigJson();

}  // namespace dropkv
