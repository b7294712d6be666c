// Chat templates: built-in renderers for the template families we serve, selected by the
// fingerprint (FNV-1a 64 of the exact template text) of the model's tokenizer_config.json
// `chat_template`. Each renderer reproduces what HF apply_chat_template(messages,
// add_generation_prompt=...) renders for plain-text system/user/assistant(/tool) messages
// without `tools`. An unknown template is kNone: the server warns at start-up and chat requests
// fail with FAILED_PRECONDITION rather than being rendered wrongly.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {

enum class ChatTemplateKind { kNone, kLlama3, kQwen3, kGemma3 };

uint64_t ChatTemplateFingerprint(std::string_view chat_template);
ChatTemplateKind IdentifyChatTemplate(std::string_view chat_template);
const char* ChatTemplateKindName(ChatTemplateKind kind);

// `bos_token` is the template variable of the same name. Errors the template itself raises (Gemma:
// roles must alternate) are INVALID_ARGUMENT; kNone is FAILED_PRECONDITION.
absl::StatusOr<std::string> RenderChatTemplate(ChatTemplateKind kind,
                                               const std::vector<ChatMessage>& messages,
                                               bool add_generation_prompt,
                                               std::string_view bos_token);

}  // namespace dropkv
