// dropkv-cli: a small client of dropkv.v1.Inference.
//   dropkv-cli --address HOST:PORT generate --prompt TEXT --max-new-tokens N [--stream]
//   dropkv-cli chat [--system TEXT] [--message TEXT] [--tools-file F] [--kwargs JSON]
//   dropkv-cli tokenize --text TEXT | info | stats | health
// `chat` talks through the model's chat template: each stdin line is a user turn (the reply
// streams back and joins the history), or --message sends one turn and exits.
#include <condition_variable>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <CLI/CLI.hpp>

#include "dropkv/v1/inference.grpc.pb.h"
#include "server/compression_message.h"

namespace {

int Fail(const grpc::Status& st) {
  std::cerr << "error: " << st.error_code() << " " << st.error_message() << "\n";
  return 1;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const char* FinishName(dropkv::v1::FinishReason r) {
  switch (r) {
    case dropkv::v1::FINISH_REASON_STOP:
      return "stop";
    case dropkv::v1::FINISH_REASON_LENGTH:
      return "length";
    case dropkv::v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case dropkv::v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "none";
  }
}

void PrintUsage(const dropkv::v1::GenerateResponse& r) {
  std::cerr << "[finish=" << FinishName(r.finish_reason())
            << " prompt_tokens=" << r.usage().prompt_tokens()
            << " completion_tokens=" << r.usage().completion_tokens()
            << " kv_tokens_kept=" << r.usage().kv_tokens_kept()
            << " kv_bytes_saved=" << r.usage().kv_bytes_saved()
            << " ttft_ms=" << r.timings().ttft_ms() << " request_id=" << r.request_id() << "]\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dropkv-cli: client of a dropkv-server (dropkv.v1.Inference over gRPC)"};
  std::string address = "127.0.0.1:50051";
  std::string token, token_file, tls_ca;
  double timeout_s = 0;
  app.add_option("--address", address, "server HOST:PORT")->capture_default_str();
  app.add_option("--token", token, "bearer token (sent as 'authorization: Bearer <token>')");
  app.add_option("--token-file", token_file, "file holding the bearer token");
  app.add_option("--tls-ca", tls_ca, "PEM root certificate: use TLS and trust this CA");
  app.add_option("--timeout", timeout_s, "deadline of the call in seconds (0 = none)");
  app.require_subcommand(1);

  auto* gen = app.add_subcommand("generate", "generate text");
  std::string prompt;
  std::vector<int32_t> token_ids;
  int32_t max_new_tokens = 16;
  bool stream = false, ignore_eos = false, verbose = false;
  float temperature = 0, top_p = 1;
  int32_t top_k = 0;
  int64_t seed = -1;
  std::vector<std::string> stops;
  // The compression settings a request may carry, one flag per schema row with a message field
  // (the tools' spellings: --method, --keep, --window, ...); the server checks the ranges.
  dropkv::v1::CompressionSettings compression;
  gen->add_option("--prompt", prompt, "prompt text");
  gen->add_option("--token-ids", token_ids, "prompt as token ids instead of text");
  gen->add_option("--max-new-tokens", max_new_tokens, "tokens to generate")->capture_default_str();
  gen->add_flag("--stream", stream,
                "print deltas as they arrive (Generate) instead of GenerateUnary");
  gen->add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
  gen->add_option("--top-p", top_p)->capture_default_str();
  gen->add_option("--top-k", top_k)->capture_default_str();
  gen->add_option("--seed", seed, "sampling seed (-1 = random)");
  gen->add_option("--stop", stops, "stop string (repeatable)");
  gen->add_flag("--ignore-eos", ignore_eos);
  for (const dropkv::compression::CompressionField& field :
       dropkv::compression::CompressionFields()) {
    if (dropkv::CompressionMessageField(field) == nullptr) continue;
    const std::string flag = "--" + std::string(field.tool_flag);
    auto set = [&compression, &field, flag](const std::string& text) {
      if (absl::Status s = dropkv::SetCompressionMessageText(&compression, field, text); !s.ok())
        throw CLI::ValidationError(flag, std::string(s.message()));
    };
    if (field.kind == dropkv::compression::FieldKind::kBool) {
      gen->add_flag_function(
          flag, [set](int64_t n) { set(n > 0 ? "true" : "false"); }, "compression: " + field.help);
    } else {
      gen->add_option_function<std::string>(flag, set, "compression: " + field.help);
    }
  }
  gen->add_flag("-v,--verbose", verbose, "print usage and timings to stderr");

  auto* chat = app.add_subcommand("chat", "chat through the model's template (a turn per line)");
  std::string system_prompt, one_message, tools_file, template_kwargs;
  int32_t chat_max_new_tokens = 256;
  float chat_temperature = 0;
  chat->add_option("--system", system_prompt, "system message");
  chat->add_option("--message", one_message, "send this one user turn, print the reply, exit");
  chat->add_option("--tools-file", tools_file, "JSON file with a list of tool schemas");
  chat->add_option("--kwargs", template_kwargs,
                   "JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'");
  chat->add_option("--max-new-tokens", chat_max_new_tokens, "tokens per reply")
      ->capture_default_str();
  chat->add_option("--temperature", chat_temperature, "0 = greedy")->capture_default_str();

  auto* tok = app.add_subcommand("tokenize", "text -> token ids");
  std::string text;
  tok->add_option("--text", text, "text")->required();
  app.add_subcommand("info", "model info");
  app.add_subcommand("stats", "server stats (queue, KV blocks)");
  app.add_subcommand("health", "grpc.health.v1 check; exit 0 when SERVING");

  CLI11_PARSE(app, argc, argv);

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls_ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadAll(tls_ca);
    creds = grpc::SslCredentials(ssl);
  }
  if (!token_file.empty()) {
    token = ReadAll(token_file);
    while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back())))
      token.pop_back();
  }
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, creds, channel_args);
  auto stub = dropkv::v1::Inference::NewStub(channel);
  auto make_context = [&](grpc::ClientContext& ctx) {
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    if (timeout_s > 0)
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  };

  if (gen->parsed()) {
    dropkv::v1::GenerateRequest req;
    if (!token_ids.empty()) {
      for (int32_t id : token_ids) req.mutable_token_ids()->add_ids(id);
    } else {
      req.set_prompt(prompt);
    }
    req.set_max_new_tokens(max_new_tokens);
    auto* s = req.mutable_sampling();
    s->set_temperature(temperature);
    s->set_top_p(top_p);
    s->set_top_k(top_k);
    if (seed >= 0) s->set_seed(static_cast<uint64_t>(seed));
    s->set_ignore_eos(ignore_eos);
    for (const auto& stop : stops) req.add_stop(stop);
    *req.mutable_compression() = compression;
    grpc::ClientContext ctx;
    make_context(ctx);
    if (stream) {
      auto reader = stub->Generate(&ctx, req);
      dropkv::v1::GenerateResponse msg, last;
      while (reader->Read(&msg)) {
        std::cout << msg.text() << std::flush;
        last = msg;
      }
      std::cout << "\n";
      grpc::Status st = reader->Finish();
      if (!st.ok()) return Fail(st);
      if (verbose) PrintUsage(last);
      return 0;
    }
    dropkv::v1::GenerateResponse resp;
    grpc::Status st = stub->GenerateUnary(&ctx, req, &resp);
    if (!st.ok()) return Fail(st);
    std::cout << resp.text() << "\n";
    if (verbose) PrintUsage(resp);
    return 0;
  }
  if (chat->parsed()) {
    dropkv::v1::GenerateRequest req;
    req.set_max_new_tokens(chat_max_new_tokens);
    req.mutable_sampling()->set_temperature(chat_temperature);
    auto* messages = req.mutable_chat();
    if (!tools_file.empty()) messages->set_tools_json(ReadAll(tools_file));
    if (!template_kwargs.empty()) messages->set_chat_template_kwargs_json(template_kwargs);
    if (!system_prompt.empty()) {
      auto* m = messages->add_messages();
      m->set_role("system");
      m->set_content(system_prompt);
    }
    const bool interactive = one_message.empty();
    std::string line;
    while (true) {
      if (interactive) {
        std::cerr << "> " << std::flush;
        if (!std::getline(std::cin, line)) break;
        if (line.empty()) continue;
      } else {
        line = one_message;
      }
      auto* user = messages->add_messages();
      user->set_role("user");
      user->set_content(line);
      grpc::ClientContext ctx;
      make_context(ctx);
      auto reader = stub->Generate(&ctx, req);
      dropkv::v1::GenerateResponse msg;
      std::string reply;
      while (reader->Read(&msg)) {
        std::cout << msg.text() << std::flush;
        reply += msg.text();
      }
      std::cout << "\n";
      grpc::Status st = reader->Finish();
      if (!st.ok()) {
        messages->mutable_messages()->RemoveLast();  // the turn did not happen
        Fail(st);
        if (!interactive) return 1;
        continue;
      }
      if (!interactive) return 0;
      auto* assistant = messages->add_messages();
      assistant->set_role("assistant");
      assistant->set_content(reply);
    }
    return 0;
  }
  if (tok->parsed()) {
    grpc::ClientContext ctx;
    make_context(ctx);
    dropkv::v1::TokenizeRequest req;
    req.set_text(text);
    dropkv::v1::TokenizeResponse resp;
    grpc::Status st = stub->Tokenize(&ctx, req, &resp);
    if (!st.ok()) return Fail(st);
    for (int i = 0; i < resp.token_ids_size(); ++i)
      std::cout << (i ? " " : "") << resp.token_ids(i);
    std::cout << "\n";
    return 0;
  }
  if (app.got_subcommand("info") || app.got_subcommand("stats")) {
    grpc::ClientContext ctx;
    make_context(ctx);
    std::string out;
    grpc::Status st;
    if (app.got_subcommand("info")) {
      dropkv::v1::ModelInfo info;
      st = stub->GetModelInfo(&ctx, {}, &info);
      out = info.DebugString();
    } else {
      dropkv::v1::ServerStats stats;
      st = stub->GetServerStats(&ctx, {}, &stats);
      out = stats.DebugString();
    }
    if (!st.ok()) return Fail(st);
    std::cout << out;
    return 0;
  }
  // health: grpc.health.v1.Health/Check {service: ""} through the generic stub (no health stubs
  // are installed); the response {status} is 08 01 for SERVING.
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  make_context(ctx);
  if (timeout_s <= 0) ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::Slice empty("");
  grpc::ByteBuffer request_bytes(&empty, 1), response_bytes;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_bytes,
                    &response_bytes, [&](grpc::Status s) {
                      std::lock_guard<std::mutex> lock(mu);
                      status = std::move(s);
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!status.ok()) return Fail(status);
  std::vector<grpc::Slice> slices;
  (void)response_bytes.Dump(&slices);
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const bool serving = bytes == std::string("\x08\x01", 2);
  std::cout << (serving ? "SERVING" : "NOT_SERVING") << "\n";
  return serving ? 0 : 1;
}
