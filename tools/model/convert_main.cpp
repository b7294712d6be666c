// dropkv-convert: model format conversions into standard Hugging Face folders.
//   dropkv-convert llama2c --model stories260K.bin --tokenizer tok512.bin --out DIR
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/model/llama2c.h"
#include "engine/model/log.h"

int main(int argc, char** argv) {
  CLI::App app{"dropkv-convert: convert model checkpoints into Hugging Face model folders"};
  app.require_subcommand(1);
  auto* llama2c = app.add_subcommand(
      "llama2c", "llama2.c checkpoint (e.g. stories260K.bin) + tok512.bin -> HF folder");
  std::string model, tokenizer, out;
  llama2c->add_option("--model", model, "llama2.c checkpoint (.bin)")
      ->required()
      ->check(CLI::ExistingFile);
  llama2c
      ->add_option("--tokenizer", tokenizer,
                   "llama2.c tokenizer (tok512.bin); omit to write no tokenizer files")
      ->check(CLI::ExistingFile);
  llama2c->add_option("--out", out, "output folder (created)")->required();
  CLI11_PARSE(app, argc, argv);
  dropkv::LogToStderr();
  auto st = dropkv::ConvertLlama2c(model, tokenizer, out);
  if (!st.ok()) {
    std::fprintf(stderr, "dropkv-convert: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}
