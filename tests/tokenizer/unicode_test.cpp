// unicode.h against Python: lossy UTF-8 decoding (U+FFFD per maximal invalid subpart) and NFC.
#include "engine/tokenizer/unicode.h"

#include <gtest/gtest.h>

#include "tests/tokenizer/ref_data.h"

namespace dropkv {
namespace {

using testing::ReadJson;
using testing::RefDir;
using testing::Repr;

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

TEST(Unicode, LossyDecodingMatchesPython) {
  const auto ref = ReadJson(RefDir() / "unicode.json");
  ASSERT_GT(ref["bytes_hex"].size(), 1000u);
  int failures = 0;
  for (size_t i = 0; i < ref["bytes_hex"].size(); ++i) {
    const std::string bytes = FromHex(ref["bytes_hex"][i].get<std::string>());
    const std::string want = ref["lossy"][i].get<std::string>();
    const std::string got = unicode::Utf8Lossy(bytes);
    EXPECT_EQ(unicode::IsValidUtf8(bytes), got == bytes && want == bytes) << Repr(bytes);
    if (got != want && ++failures < 10) {
      ADD_FAILURE() << Repr(bytes) << " -> " << Repr(got) << ", python " << Repr(want);
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Unicode, NfcMatchesPython) {
  const auto ref = ReadJson(RefDir() / "unicode.json");
  const auto& corpus = testing::Corpus();
  ASSERT_EQ(ref["nfc"].size(), corpus.size());
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(unicode::Nfc(corpus[i].get<std::string>()), ref["nfc"][i].get<std::string>())
        << Repr(corpus[i].get<std::string>());
  }
}

TEST(Unicode, ByteLevelAlphabetIsABijection) {
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(unicode::CodePointToByte(unicode::ByteToCodePoint()[b]), b);
  }
  EXPECT_EQ(unicode::ByteToCodePoint()[' '], U'\u0120');   // 'Ġ', as in GPT-2
  EXPECT_EQ(unicode::ByteToCodePoint()['\n'], U'\u010A');  // 'Ċ'
}

}  // namespace
}  // namespace dropkv
