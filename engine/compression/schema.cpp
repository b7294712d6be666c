#include "engine/compression/schema.h"

#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "engine/common/text_value.h"

namespace dropkv::compression {
namespace {

using Field = CompressionField;
using P = CompressionParams;

Field NewField(std::string_view name, std::string_view tool_flag, FieldKind kind,
               std::string help) {
  Field f;
  f.name = name;
  f.tool_flag = tool_flag;
  f.kind = kind;
  f.help = std::move(help);
  return f;
}

absl::Status OutOfRange(std::string_view range, std::string_view got) {
  return absl::InvalidArgumentError(
      absl::StrCat("must be ", AbslView(range), ", got ", AbslView(got)));
}

// An integer field in [lo, hi] (odd: odd values only).
template <typename T>
Field IntRow(std::string_view name, std::string_view flag, T P::*member, int64_t lo, int64_t hi,
             std::string help, bool odd = false) {
  const std::string range = absl::StrCat(odd ? "odd and " : "", "in [", lo, ", ", hi, "]");
  auto in_range = [lo, hi, odd](int64_t v) { return v >= lo && v <= hi && (!odd || v % 2 != 0); };
  Field f = NewField(name, flag, FieldKind::kInt, absl::StrCat(help, "; ", range));
  f.set = [member, range, in_range](P& p, std::string_view text) -> absl::Status {
    absl::StatusOr<int64_t> v = ParseIntText(text);
    if (!v.ok()) return v.status();
    if (!in_range(*v)) return OutOfRange(range, absl::StrCat(*v));
    p.*member = static_cast<T>(*v);
    return absl::OkStatus();
  };
  f.get = [member](const P& p) { return absl::StrCat(p.*member); };
  f.check = [member, range, in_range](const P& p) -> absl::Status {
    if (!in_range(p.*member)) return OutOfRange(range, absl::StrCat(p.*member));
    return absl::OkStatus();
  };
  return f;
}

// A double field in (lo, hi] or [lo, hi] / [lo, hi).
struct DoubleRange {
  double lo, hi;
  bool lo_open, hi_open;
  bool contains(double v) const {
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  std::string text() const {
    return absl::StrCat("in ", lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]");
  }
};

absl::StatusOr<double> ParseInRange(std::string_view text, const DoubleRange& range) {
  absl::StatusOr<double> v = ParseDoubleText(text);
  if (!v.ok()) return v.status();
  if (!range.contains(*v)) return OutOfRange(range.text(), absl::StrCat(*v));
  return *v;
}

// A double field in `range`; the help ends with the range.
Field DoubleRow(std::string_view name, std::string_view flag, double P::*member,
                const DoubleRange& range, std::string help) {
  Field f = NewField(name, flag, FieldKind::kDouble, std::move(help));
  f.set = [member, range](P& p, std::string_view text) -> absl::Status {
    absl::StatusOr<double> v = ParseInRange(text, range);
    if (!v.ok()) return v.status();
    p.*member = *v;
    return absl::OkStatus();
  };
  f.get = [member](const P& p) { return FormatDoubleText(p.*member); };
  f.check = [member, range](const P& p) -> absl::Status {
    if (!range.contains(p.*member)) return OutOfRange(range.text(), absl::StrCat(p.*member));
    return absl::OkStatus();
  };
  return f;
}

template <typename E, size_t N>
Field EnumRow(std::string_view name, std::string_view flag, E P::*member,
              const std::array<NamedValue<E>, N>& table, std::string help) {
  Field f = NewField(name, flag, FieldKind::kEnum, absl::StrCat(help, ": ", JoinNames(table)));
  for (const NamedValue<E>& nv : table) f.names.push_back(nv.name);
  f.set = [member, &table](P& p, std::string_view text) -> absl::Status {
    absl::StatusOr<E> v = ParseName(table, text, "");
    if (!v.ok()) return v.status();
    p.*member = *v;
    return absl::OkStatus();
  };
  f.get = [member, &table](const P& p) { return std::string(NameOf(table, p.*member)); };
  return f;
}

std::vector<Field> MakeFields() {
  std::vector<Field> v;
  v.push_back(
      EnumRow("method", "method", &P::method, kScoreMethodNames, "scorer (none = full cache)"));
  {
    const DoubleRange range{0.0, 1.0, true, false};
    Field f = DoubleRow("keep_ratio", "keep", &P::keep_ratio, range,
                        absl::StrCat("fraction of the KV cache kept, ", range.text()));
    f.exclusive_group = "budget";
    v.push_back(std::move(f));
  }
  {
    // kvpress's convention, converted at the edge: keep = 1 - ratio.
    const DoubleRange range{0.0, 1.0, false, true};
    Field f = NewField(
        "compression_ratio", "compression-ratio", FieldKind::kDouble,
        absl::StrCat("fraction removed (kvpress convention: keep = 1 - ratio), ", range.text()));
    f.exclusive_group = "budget";
    f.set = [range](P& p, std::string_view text) -> absl::Status {
      absl::StatusOr<double> v = ParseInRange(text, range);
      if (!v.ok()) return v.status();
      p.keep_ratio = 1.0 - *v;
      p.budget_tokens.reset();
      return absl::OkStatus();
    };
    v.push_back(std::move(f));
  }
  {
    const std::string range = absl::StrCat("in [1, ", kMaxCompressionTokens, "]");
    Field f =
        NewField("budget_tokens", "budget-tokens", FieldKind::kInt,
                 absl::StrCat("absolute budget: tokens kept per layer on average per sequence, ",
                              range, "; wins over keep_ratio; 0 = none"));
    f.exclusive_group = "budget";
    f.set = [range](P& p, std::string_view text) -> absl::Status {
      absl::StatusOr<int64_t> v = ParseIntText(text);
      if (!v.ok()) return v.status();
      if (*v == 0) {
        p.budget_tokens.reset();
        return absl::OkStatus();
      }
      if (*v < 1 || *v > kMaxCompressionTokens) return OutOfRange(range, absl::StrCat(*v));
      p.budget_tokens = *v;
      return absl::OkStatus();
    };
    f.get = [](const P& p) { return absl::StrCat(p.budget_tokens.value_or(0)); };
    f.present = [](const P& p) { return p.budget_tokens.has_value(); };
    f.check = [range](const P& p) -> absl::Status {
      if (p.budget_tokens && (*p.budget_tokens < 1 || *p.budget_tokens > kMaxCompressionTokens))
        return OutOfRange(range, absl::StrCat(*p.budget_tokens));
      return absl::OkStatus();
    };
    v.push_back(std::move(f));
  }
  v.push_back(
      EnumRow("allocator", "allocator", &P::allocator, kBudgetAllocatorNames, "layer budgets"));
  {
    const DoubleRange range{0.0, 1.0, false, true};
    Field f = NewField("explicit_layer_prune", "explicit-prune", FieldKind::kDoubleList,
                       absl::StrCat("allocator explicit: pruned fraction rho_l per layer, each ",
                                    range.text(), ", comma-separated in flags and environment"));
    f.set = [range](P& p, std::string_view text) -> absl::Status {
      std::vector<double> values;
      absl::string_view t = absl::StripAsciiWhitespace(AbslView(text));
      if (!t.empty()) {
        for (absl::string_view part : absl::StrSplit(t, ',')) {
          absl::StatusOr<double> d =
              ParseInRange(std::string_view(part.data(), part.size()), range);
          if (!d.ok())
            return absl::InvalidArgumentError(
                absl::StrCat("element ", values.size(), ": ", d.status().message()));
          values.push_back(*d);
        }
      }
      p.explicit_layer_prune = std::move(values);
      return absl::OkStatus();
    };
    f.get = [](const P& p) {
      std::vector<std::string> parts;
      for (double d : p.explicit_layer_prune) parts.push_back(FormatDoubleText(d));
      return absl::StrJoin(parts, ",");
    };
    f.check = [range](const P& p) -> absl::Status {
      for (size_t i = 0; i < p.explicit_layer_prune.size(); ++i) {
        if (!range.contains(p.explicit_layer_prune[i]))
          return absl::InvalidArgumentError(absl::StrCat("element ", i, ": must be ", range.text(),
                                                         ", got ", p.explicit_layer_prune[i]));
      }
      return absl::OkStatus();
    };
    v.push_back(std::move(f));
  }
  {
    Field f = NewField("profile_path", "profile", FieldKind::kString,
                       "layer profile (JSON, dropkv-calibrate) read by allocators mga and mlma*");
    f.set = [](P& p, std::string_view text) {
      p.profile_path = std::string(text);
      return absl::OkStatus();
    };
    f.get = [](const P& p) { return p.profile_path; };
    v.push_back(std::move(f));
  }
  v.push_back(IntRow("window", "window", &P::window, 1, kMaxWindow,
                     "observation window W: the last W tokens score the cache and are kept"));
  v.push_back(
      EnumRow("pooling", "pooling", &P::pooling, kPoolingTypeNames, "DropKV score smoothing"));
  v.push_back(IntRow("pooling_kernel", "pooling-kernel", &P::pooling_kernel, 1, kMaxPoolingKernel,
                     "pooling kernel size", /*odd=*/true));
  v.push_back(IntRow("pooling_lookback", "pooling-lookback", &P::pooling_lookback, 0,
                     kMaxPoolingKernel,
                     "entries after a high pooled score that share it (keeps a value's "
                     "continuation); 0 = none"));
  v.push_back(EnumRow("scoring_queries", "scoring-queries", &P::scoring_queries,
                      kScoringQueriesNames,
                      "the queries that score the cache (dropkv): the prompt's last W (window) or "
                      "the prompt fed again after itself, question-independent (replay: one more "
                      "prefill of the prompt)"));
  {
    Field f = NewField("protect_sinks", "protect-sinks", FieldKind::kBool,
                       "never evict the first num_sinks tokens (StreamingLLM always keeps them)");
    f.set = [](P& p, std::string_view text) -> absl::Status {
      absl::StatusOr<bool> b = ParseBoolText(text);
      if (!b.ok()) return b.status();
      p.protect_sinks = *b;
      return absl::OkStatus();
    };
    f.get = [](const P& p) { return std::string(p.protect_sinks ? "true" : "false"); };
    v.push_back(std::move(f));
  }
  v.push_back(
      IntRow("num_sinks", "sinks", &P::num_sinks, 0, kMaxNumSinks, "attention-sink tokens"));
  v.push_back(EnumRow("chunk_policy", "chunk-policy", &P::chunk_policy, kChunkPolicyNames,
                      "chunked prefill"));
  v.push_back(IntRow("chunk_size", "chunk-size", &P::chunk_size, 0, kMaxCompressionTokens,
                     "prefill chunk tokens, 0 = one pass, else >= window"));
  v.push_back(IntRow("budget_cap_tokens", "budget-cap-tokens", &P::budget_cap_tokens, 0,
                     kMaxCompressionTokens,
                     "chunk_policy budget: compress when stored + next chunk pass this"));
  v.push_back(IntRow("decode_margin", "decode-margin", &P::decode_margin, 0, kMaxCompressionTokens,
                     "compress during decode when a layer passes its budget by this many entries "
                     "(>= window); 0 = prefill only"));
  {
    const DoubleRange range{0.0, 1.0, false, true};
    v.push_back(DoubleRow("tolerance", "tolerance", &P::tolerance, range,
                          absl::StrCat("automatic budget (dropkv): the largest estimated relative "
                                       "output shift a layer's evictions may cause, ",
                                       range.text(), "; the budget is then a ceiling; 0 = fixed")));
  }
  {
    Field f =
        NewField("random_seed", "compression-seed", FieldKind::kInt, "seed of the random scorer");
    f.set = [](P& p, std::string_view text) -> absl::Status {
      absl::StatusOr<uint64_t> s = ParseUintText(text);
      if (!s.ok()) return s.status();
      p.random_seed = *s;
      return absl::OkStatus();
    };
    f.get = [](const P& p) { return absl::StrCat(p.random_seed); };
    v.push_back(std::move(f));
  }
#ifdef DROPKV_COMPRESSION_TEST_FIELD
  // Only in schema_extension_test's build: shows that one row carries a setting everywhere.
  v.push_back(IntRow("test_field", "test-field", &P::test_field, 0, 100, "a setting of the test"));
#endif
  return v;
}

}  // namespace

std::span<const CompressionField> CompressionFields() {
  static const std::vector<Field> fields = MakeFields();
  return fields;
}

const CompressionField* FindCompressionField(std::string_view name) {
  for (const Field& f : CompressionFields()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string CompressionEnvName(const CompressionField& field) {
  std::string name = absl::StrCat("DROPKV_COMPRESSION_", AbslView(field.name));
  absl::AsciiStrToUpper(&name);
  return name;
}

absl::Status CheckCompressionRanges(const CompressionParams& params) {
  for (const Field& f : CompressionFields()) {
    if (!f.check) continue;
    if (absl::Status s = f.check(params); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(f.name), ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

// "<name>=<length>:<text>" per stored field, present ones only: lengths, so that a value may
// hold any byte.
std::string EncodeCompression(const CompressionParams& params) {
  std::string out;
  for (const Field& f : CompressionFields()) {
    if (!f.stored() || !f.is_present(params)) continue;
    const std::string text = f.get(params);
    absl::StrAppend(&out, AbslView(f.name), "=", text.size(), ":", text);
  }
  return out;
}

absl::StatusOr<CompressionParams> DecodeCompression(std::string_view bytes) {
  CompressionParams p;
  while (!bytes.empty()) {
    const size_t eq = bytes.find('=');
    const size_t colon = bytes.find(':', eq == std::string_view::npos ? 0 : eq);
    size_t length = 0;
    if (eq == std::string_view::npos || colon == std::string_view::npos ||
        !absl::SimpleAtoi(absl::string_view(bytes.data() + eq + 1, colon - eq - 1), &length) ||
        length > bytes.size() - colon - 1) {
      return absl::InvalidArgumentError("compression settings: malformed encoding");
    }
    const std::string_view name = bytes.substr(0, eq);
    const std::string_view text = bytes.substr(colon + 1, length);
    const Field* f = FindCompressionField(name);
    if (f == nullptr || !f->stored()) {
      return absl::InvalidArgumentError(
          absl::StrCat("compression settings: unknown field '", AbslView(name), "'"));
    }
    if (absl::Status s = f->set(p, text); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(name), ": ", s.message()));
    }
    bytes.remove_prefix(colon + 1 + length);
  }
  return p;
}

}  // namespace dropkv::compression
