// The compression flags of dropkv-generate and the other tools, one per schema row (schema.h):
// --method, --keep, --compression-ratio, --budget-tokens, --allocator, --explicit-prune,
// --profile, --window, --pooling, --pooling-kernel, --protect-sinks, --sinks, --chunk-policy,
// --chunk-size, --budget-cap-tokens, --decode-margin, --compression-seed. Each also reads the
// server's variable, DROPKV_COMPRESSION_<NAME> (e.g. DROPKV_COMPRESSION_KEEP_RATIO). A bad value
// fails the parse with a message naming the flag; what depends on the model's depth is
// compression::ValidateCompression's, which the caller runs after parsing.
#pragma once

#include "engine/request.h"

namespace CLI {
class App;
}

namespace dropkv::compression {

// Registers the flags on `app`; parsed values land in `*params` (which must outlive the parse).
// The budget forms (--keep, --compression-ratio, --budget-tokens) exclude each other.
void AddCompressionFlags(CLI::App& app, CompressionParams* params);

}  // namespace dropkv::compression
