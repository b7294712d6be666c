// llama2c_tokenizer.h: the tokenizer.json derived from tok512.bin encodes the corpus exactly as
// llama2.c run.c's encode rule does (Python re-implementation in make_reference.py), and HF
// `tokenizers` loading that same json agrees with our C++ reader (encode and decode).
#include "engine/tokenizer/llama2c_tokenizer.h"

#include <cstdlib>

#include <gtest/gtest.h>

#include "tests/tokenizer/ref_data.h"

namespace dropkv {
namespace {

using testing::Join;
using testing::ReadJson;
using testing::RefDir;
using testing::Repr;

std::string Tok512Path() {
  return (testing::SharedDir() / "models/stories260K/tok512.bin").string();
}

// Strings where the SentencePiece pipeline and run.c part ways on purpose: a literal U+2581 is
// SentencePiece's space symbol (run.c byte-encodes it), and "<unk>"/"<s>"/"</s>" in the text are
// special tokens (run.c spells them out; HF also prepends '▁' to the text after them again).
bool Tok512Differs(const std::string& s) {
  return s.find("\xE2\x96\x81") != std::string::npos || s.find("<unk>") != std::string::npos ||
         s.find("<s>") != std::string::npos || s.find("</s>") != std::string::npos;
}

class Tok512Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(testing::ScratchDir("tokenizer-tok512"));
    auto json = Tok512ToTokenizerJson(Tok512Path(), 512);
    ASSERT_TRUE(json.ok()) << json.status();
    std::ofstream(*dir_ / "tokenizer.json") << *json;
    std::ofstream(*dir_ / "tokenizer_config.json") << Tok512TokenizerConfigJson();
  }
  static std::filesystem::path* dir_;
};
std::filesystem::path* Tok512Test::dir_ = nullptr;

TEST_F(Tok512Test, EncodesLikeLlama2cRunC) {
  auto tok = Tokenizer::FromDirectory(dir_->string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 512);
  EXPECT_EQ((*tok)->bos_token_id(), 1);
  EXPECT_EQ((*tok)->eos_token_ids(), std::vector<int32_t>{2});
  const auto ref = ReadJson(RefDir() / "runc_tok512.json");
  const auto& corpus = testing::Corpus();
  int mismatches = 0;
  size_t excluded = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string s = corpus[i].get<std::string>();
    if (Tok512Differs(s)) {
      ++excluded;
      continue;
    }
    auto ids = (*tok)->Encode(s, true);
    ASSERT_TRUE(ids.ok());
    const auto want = ref["with_special"][i].get<std::vector<int32_t>>();
    if (*ids != want && ++mismatches <= 10) {
      ADD_FAILURE() << Repr(s) << "\n  ours " << Join(*ids) << "\n  runc " << Join(want);
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_LT(excluded, corpus.size() / 10);
}

// HF `tokenizers` loading DIR/tokenizer.json vs our reader: encode (with / without specials) and
// decode over the corpus; `round_trip`: decode(encode(s)) == s where the pipeline is lossless.
void ExpectHfParity(const std::filesystem::path& dir, bool round_trip) {
  const auto out = dir / "hf.json";
  const std::string cmd = testing::ReferencePython() + " " +
                          (testing::SourceDir() / "tests/tokenizer/hf_encode.py").string() + " " +
                          dir.string() + " " + (RefDir() / "corpus.json").string() + " " +
                          out.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto ref = ReadJson(out);
  auto tok = Tokenizer::FromDirectory(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const auto& corpus = testing::Corpus();
  int mismatches = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string s = corpus[i].get<std::string>();
    for (bool special : {true, false}) {
      auto ids = (*tok)->Encode(s, special);
      ASSERT_TRUE(ids.ok());
      const auto want = ref[special ? "with_special" : "no_special"][i].get<std::vector<int32_t>>();
      if (*ids != want && ++mismatches <= 10) {
        ADD_FAILURE() << Repr(s) << "\n  ours " << Join(*ids) << "\n  hf   " << Join(want);
      }
    }
    const auto ids = ref["with_special"][i].get<std::vector<int32_t>>();
    auto text = (*tok)->Decode(ids, false);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(*text, ref["decoded"][i].get<std::string>()) << Repr(s);
    text = (*tok)->Decode(ids, true);
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(*text, ref["decoded_skip"][i].get<std::string>()) << Repr(s);
    // SentencePiece with byte fallback is lossless except for a literal U+2581 in the input.
    if (round_trip && !Tok512Differs(s)) {  // lossless otherwise
      auto plain = (*tok)->Encode(s, false);
      ASSERT_TRUE(plain.ok());
      auto round_trip = (*tok)->Decode(*plain, false);
      ASSERT_TRUE(round_trip.ok());
      EXPECT_EQ(*round_trip, s);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(Tok512Test, HfTokenizersAgreesOnOurJson) {
  ExpectHfParity(*dir_, true);
}

// The same vocab in the Metaspace form transformers 5 writes when it saves a LlamaTokenizer
// (pre_tokenizer Metaspace prepend_scheme "first", split false, no normalizer), and the older
// form (Metaspace "always" + split, Metaspace decoder).
TEST_F(Tok512Test, MetaspaceVariantsAgreeWithHf) {
  auto base = nlohmann::json::parse(std::ifstream(*dir_ / "tokenizer.json"));
  const std::string space = "\xE2\x96\x81";
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(variant);
    nlohmann::json j = base;
    j["normalizer"] = nullptr;
    if (variant == 0) {
      j["pre_tokenizer"] = {{"type", "Metaspace"},
                            {"replacement", space},
                            {"prepend_scheme", "first"},
                            {"split", false}};
    } else {
      j["pre_tokenizer"] = {{"type", "Metaspace"},
                            {"replacement", space},
                            {"prepend_scheme", "always"},
                            {"split", true}};
      j["decoder"] = {{"type", "Sequence"},
                      {"decoders",
                       {{{"type", "ByteFallback"}},
                        {{"type", "Metaspace"},
                         {"replacement", space},
                         {"prepend_scheme", "always"},
                         {"split", true}}}}};
    }
    const auto dir = testing::ScratchDir("tokenizer-tok512-metaspace" + std::to_string(variant));
    std::ofstream(dir / "tokenizer.json") << j.dump();
    std::ofstream(dir / "tokenizer_config.json") << Tok512TokenizerConfigJson();
    ExpectHfParity(dir, false);
  }
}

TEST(Tok512Errors, BadInputsNameTheFile) {
  for (int32_t vocab : {100, 511, 513}) {
    auto json = Tok512ToTokenizerJson(Tok512Path(), vocab);
    ASSERT_FALSE(json.ok()) << vocab;
    EXPECT_NE(std::string(json.status().message()).find("tok512.bin"), std::string::npos);
  }
  EXPECT_FALSE(Tok512ToTokenizerJson("/nonexistent/tok512.bin", 512).ok());
  const auto junk = testing::ScratchDir("tokenizer-tok512-junk") / "tok.bin";
  std::ofstream(junk) << std::string(300, '\xff');
  EXPECT_FALSE(Tok512ToTokenizerJson(junk.string(), 512).ok());
}

}  // namespace
}  // namespace dropkv
