// The compression flags of dropkv-generate and friends, defined once: --method, --keep,
// --compression-ratio, --budget-tokens, --allocator, --profile, --explicit-prune, --window,
// --pooling, --pooling-kernel, --sinks, --protect-sinks, --chunk-policy, --chunk-size,
// --budget-cap-tokens, --compression-seed. Each also reads DROPKV_<NAME> from the environment
// (e.g. DROPKV_METHOD). Unknown names fail the parse with a message naming the flag; ranges are
// compression::ValidateCompression's (the one validator), which the caller runs after parsing.
#pragma once

#include "engine/request.h"

namespace CLI {
class App;
}

namespace dropkv::compression {

// Registers the flags on `app`; parsed values land in `*params` (which must outlive the parse).
// --keep, --compression-ratio and --budget-tokens exclude each other. Call ValidateCompression
// after parsing (it needs the model's depth).
void AddCompressionFlags(CLI::App& app, CompressionParams* params);

}  // namespace dropkv::compression
