// End to end: the real dropkv-server binary on a loopback port serving
// stories260K (converted by the e2e fixture), driven by the generated C++ client. References:
// dropkv-generate (the model runtime's own single-request path) and each request run alone.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "dropkv/v1/inference.grpc.pb.h"
#include "tests/common/test_env.h"
#include "tests/e2e/server_process.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using testing::ServerProcess;

fs::path ModelDir() {
  return testing::BuildDir() / "test-scratch" / "e2e" / "stories260K";
}
std::string Bin(const std::string& name) {
  return (testing::BuildDir() / "bin" / name).string();
}

struct Result {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::GenerateResponse last;
  int num_messages = 0;
};

class Client {
 public:
  explicit Client(const std::string& address)
      : stub_(v1::Inference::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

  Result Stream(const v1::GenerateRequest& req, int cancel_after = -1,
                std::chrono::milliseconds deadline = std::chrono::milliseconds(0)) {
    grpc::ClientContext ctx;
    if (deadline.count() > 0)
      ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    else
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    Result out;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
      ++out.num_messages;
      out.tokens.insert(out.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      out.text += msg.text();
      out.last = msg;
      if (out.num_messages == cancel_after) ctx.TryCancel();
    }
    out.status = reader->Finish();
    return out;
  }
  Result Unary(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::GenerateResponse resp;
    Result out;
    out.status = stub_->GenerateUnary(&ctx, req, &resp);
    out.tokens.assign(resp.token_ids().begin(), resp.token_ids().end());
    out.text = resp.text();
    out.last = resp;
    return out;
  }
  v1::ServerStats Stats() {
    grpc::ClientContext ctx;
    v1::ServerStats s;
    EXPECT_TRUE(stub_->GetServerStats(&ctx, {}, &s).ok());
    return s;
  }
  // Polls until the pool is all free and nothing runs or waits.
  bool WaitIdle(int timeout_ms = 10000) {
    for (int waited = 0; waited < timeout_ms; waited += 20) {
      v1::ServerStats s = Stats();
      if (s.kv_blocks_used() == 0 && s.num_running() == 0 && s.num_waiting() == 0 &&
          s.kv_blocks_free() == s.kv_blocks_total())
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

 private:
  std::unique_ptr<v1::Inference::Stub> stub_;
};

v1::GenerateRequest Greedy(const std::string& prompt, int max_new_tokens) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

const std::vector<std::string>& Prompts() {
  static const std::vector<std::string> p = {
      "Once upon a time",
      "Lily and Tom went to the park. They saw a big dog",
      "The little bird",
      "One day, a girl named Sue found a shiny red ball in the garden. She wanted to show it to "
      "her "
      "mom, so she ran into the house and",
      "Tim had a toy car",
      "The sun was hot and the children wanted to play in the water. Mom said they could go to the "
      "lake if they were good. They packed a bag with food and",
      "Ben liked to read books",
      "There was a big tree"};
  return p;
}

class E2E : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(ModelDir() / "config.json"))
      GTEST_FAIL() << "model not converted: " << ModelDir() << " (fixture e2e_convert_stories)";
  }
  void StartServer(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "--model", ModelDir().string(), "--port", "0", "--metrics-port",
        "0",       "--kv-memory",       "64MiB"};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_TRUE(server_.Start(Bin("dropkv-server"), args)) << server_.error();
    client_ = std::make_unique<Client>(server_.address());
  }
  void TearDown() override {
    if (server_.running()) EXPECT_EQ(server_.Stop(SIGTERM), 0);
  }
  ServerProcess server_;
  std::unique_ptr<Client> client_;
};

// Streaming text == unary text == dropkv-generate for the same greedy request.
TEST_F(E2E, StreamingEqualsUnaryEqualsDropkvGenerate) {
  StartServer();
  const std::string prompt = "Once upon a time";
  Result s = client_->Stream(Greedy(prompt, 60));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  Result u = client_->Unary(Greedy(prompt, 60));
  ASSERT_TRUE(u.status.ok()) << u.status.error_message();
  EXPECT_EQ(s.tokens, u.tokens);
  EXPECT_EQ(s.text, u.text);
  EXPECT_GT(s.num_messages, 1);
  EXPECT_EQ(s.last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(s.tokens.size(), 60u);

  const std::string cmd = Bin("dropkv-generate") + " --model " + ModelDir().string() +
                          " --prompt '" + prompt + "' --max-new-tokens 60 --ignore-eos --json";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) out.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << out;
  const auto brace = out.rfind("\n{");
  const auto json = nlohmann::json::parse(brace == std::string::npos ? out : out.substr(brace + 1));
  EXPECT_EQ(json.at("token_ids").get<std::vector<int32_t>>(), s.tokens);
  EXPECT_EQ(json.at("text").get<std::string>(), s.text);
  EXPECT_NE(s.text.find("Lily"), std::string::npos) << s.text;  // the golden story's girl
}

// 32 concurrent greedy requests, mixed lengths and compression, each equal to itself alone.
TEST_F(E2E, BatchingInvarianceWithMixedCompression) {
  StartServer({"--max-batch", "32"});
  const char* methods[] = {"none", "dropkv", "snapkv", "streaming_llm"};
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 32; ++i) {
    v1::GenerateRequest r = Greedy(Prompts()[i % 8], 8 + (i * 13) % 57);
    r.mutable_compression()->set_method(methods[i % 4]);
    if (i % 4 != 0) {
      r.mutable_compression()->set_keep_ratio(0.5);
      r.mutable_compression()->set_window(4);
    }
    reqs.push_back(r);
  }
  std::vector<Result> alone;
  for (const auto& r : reqs) {
    alone.push_back(client_->Unary(r));
    ASSERT_TRUE(alone.back().status.ok()) << alone.back().status.error_message();
  }
  std::vector<Result> together(32);
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i)
    threads.emplace_back([&, i] { together[i] = client_->Stream(reqs[i]); });
  for (auto& t : threads) t.join();
  int num_compressed = 0;
  for (int i = 0; i < 32; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, alone[i].tokens)
        << "request " << i << " (" << methods[i % 4] << ")";
    EXPECT_EQ(together[i].text, alone[i].text) << i;
    const auto& usage = together[i].last.usage();
    const int64_t full = int64_t{usage.kv_tokens_kept_per_layer_size()} * usage.prompt_tokens();
    if (usage.kv_tokens_kept() < full) ++num_compressed;
  }
  EXPECT_GE(num_compressed, 12);  // the long prompts under dropkv/snapkv/streaming_llm
  EXPECT_TRUE(client_->WaitIdle());
}

// Cancel half of 64 streams at random points, let a quarter hit deadlines; the rest complete
// correctly and the KV pool ends all free.
TEST_F(E2E, CancellationAndDeadlinesReturnEveryBlock) {
  StartServer({"--max-batch", "16"});
  std::vector<Result> reference;
  for (int p = 0; p < 8; ++p) reference.push_back(client_->Unary(Greedy(Prompts()[p], 80)));
  std::mt19937 rng(7);
  std::vector<int> cancel_at(64, -1), deadline_ms(64, 0);
  for (int i = 0; i < 64; ++i) {
    if (i % 2 == 0)
      cancel_at[i] = 1 + static_cast<int>(rng() % 20);
    else if (i % 4 == 1)
      deadline_ms[i] = 20 + static_cast<int>(rng() % 200);
  }
  std::vector<Result> results(64);
  std::vector<std::thread> threads;
  for (int i = 0; i < 64; ++i) {
    threads.emplace_back([&, i] {
      results[i] = client_->Stream(Greedy(Prompts()[i % 8], 80), cancel_at[i],
                                   std::chrono::milliseconds(deadline_ms[i]));
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 64; ++i) {
    const Result& r = results[i];
    const auto& ref = reference[i % 8].tokens;
    ASSERT_LE(r.tokens.size(), ref.size());
    EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), ref.begin())) << i;
    if (cancel_at[i] > 0) {
      EXPECT_TRUE(r.status.error_code() == grpc::StatusCode::CANCELLED || r.status.ok()) << i;
    } else if (deadline_ms[i] > 0) {
      if (!r.status.ok()) {
        EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << i;
      }
    } else {
      ASSERT_TRUE(r.status.ok()) << i << ": " << r.status.error_message();
      EXPECT_EQ(r.tokens, ref) << i;
      EXPECT_EQ(r.text, reference[i % 8].text) << i;
    }
  }
  EXPECT_TRUE(client_->WaitIdle());
}

// Flood past the queue bound: the excess is refused at once, the accepted complete correctly.
TEST_F(E2E, QueueBoundRefusesExcessImmediately) {
  StartServer({"--max-batch", "1", "--max-queue-requests", "3"});
  const Result ref = client_->Unary(Greedy(Prompts()[0], 120));
  std::vector<Result> results(16);
  std::vector<double> elapsed_ms(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      const auto t0 = std::chrono::steady_clock::now();
      results[i] = client_->Stream(Greedy(Prompts()[0], 120));
      elapsed_ms[i] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  int num_refused = 0, num_ok = 0;
  for (int i = 0; i < 16; ++i) {
    if (results[i].status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++num_refused;
      EXPECT_EQ(results[i].num_messages, 0);
      EXPECT_LT(elapsed_ms[i], 1000.0) << "refusal was not immediate";
    } else {
      ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
      EXPECT_EQ(results[i].tokens, ref.tokens);
      ++num_ok;
    }
  }
  EXPECT_GE(num_refused, 1);
  EXPECT_GE(num_ok, 3);  // the three queue slots at least (plus any admitted before the flood)
  EXPECT_EQ(num_ok + num_refused, 16);
  EXPECT_GE(client_->Stats().num_requests_rejected(), num_refused);
}

// A tiny KV pool forces preemption; every request still completes with its exact output.
TEST_F(E2E, PreemptionUnderTinyPoolKeepsOutputsExact) {
  // stories260K: 5 layers, block 16. 40 blocks hold one 150-token sequence (5 x 10 blocks) plus
  // a few starts; eight growing sequences must preempt.
  StartServer({"--max-batch", "8", "--kv-blocks", "60"});
  std::vector<Result> alone;
  for (int i = 0; i < 8; ++i) alone.push_back(client_->Unary(Greedy(Prompts()[i], 100)));
  std::vector<Result> together(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] { together[i] = client_->Stream(Greedy(Prompts()[i], 100)); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(alone[i].status.ok()) << alone[i].status.error_message();
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << i;
  }
  EXPECT_GT(client_->Stats().num_preemptions(), 0);
  EXPECT_TRUE(client_->WaitIdle());
}

// SIGTERM under load: every in-flight call ends with a clean status and the server exits 0.
TEST_F(E2E, SigtermDuringLoadExitsCleanly) {
  StartServer({"--shutdown-grace-seconds", "1"});
  std::vector<Result> results(12);
  std::vector<std::thread> threads;
  for (int i = 0; i < 12; ++i)
    threads.emplace_back([&, i] { results[i] = client_->Stream(Greedy(Prompts()[i % 8], 400)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int exit_code = server_.Stop(SIGTERM);
  for (auto& t : threads) t.join();
  EXPECT_EQ(exit_code, 0);
  for (int i = 0; i < 12; ++i) {
    const auto code = results[i].status.error_code();
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::UNAVAILABLE ||
                code == grpc::StatusCode::CANCELLED)
        << i << ": " << code << " " << results[i].status.error_message();
    if (code == grpc::StatusCode::OK)
      EXPECT_NE(results[i].last.finish_reason(), v1::FINISH_REASON_UNSPECIFIED) << i;
  }
}

}  // namespace
}  // namespace dropkv
