#include "engine/compression/cli_flags.h"

#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/compression/schema.h"

namespace dropkv::compression {

void AddCompressionFlags(CLI::App& app, CompressionParams* p) {
  const CompressionParams defaults;
  std::map<std::string_view, std::vector<CLI::Option*>> groups;
  for (const CompressionField& field : CompressionFields()) {
    const std::string flag = "--" + std::string(field.tool_flag);
    std::string help = field.help;
    if (field.stored()) help += " (default " + field.get(defaults) + ")";
    CLI::Option* option = nullptr;
    if (field.kind == FieldKind::kBool) {
      option = app.add_flag_function(
          flag, [p, &field](int64_t count) { (void)field.set(*p, count > 0 ? "true" : "false"); },
          help);
    } else {
      option = app.add_option_function<std::string>(
          flag,
          [p, &field, flag](const std::string& text) {
            if (absl::Status s = field.set(*p, text); !s.ok())
              throw CLI::ValidationError(flag, std::string(s.message()));
          },
          help);
    }
    option->envname(CompressionEnvName(field));
    if (!field.exclusive_group.empty()) {
      for (CLI::Option* other : groups[field.exclusive_group]) option->excludes(other);
      groups[field.exclusive_group].push_back(option);
    }
  }
}

}  // namespace dropkv::compression
