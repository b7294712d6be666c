// server/service.h + server/grpc_server.h in process: a real gRPC server on a loopback port over
// the real Scheduler, the FakeRunner (real BlockPool) and the FakeTokenizer; the generated C++
// client. Outputs are compared with FakeRunner::Greedy, the single-request reference.
#include "server/service.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <thread>

#include "engine/scheduler/scheduler.h"
#include "server/grpc_server.h"
#include "tests/scheduler/fake_runner.h"
#include "tests/scheduler/fake_tokenizer.h"

namespace dropkv {
namespace {

using testing::FakeRunner;
using testing::FakeTokenizer;

struct Harness {
  Harness(SchedulerOptions sched_options, std::string auth_token = "", bool start_engine = true,
          int64_t num_blocks = 4096,
          const std::function<void(ServiceOptions&)>& configure = nullptr) {
    runner = std::make_unique<FakeRunner>(num_blocks, 16);
    sched_options.eos_token_ids = {2};
    scheduler = std::make_unique<Scheduler>(
        *runner, &tokenizer,
        [r = runner.get()] {
          return KvBlockCounts{r->pool().num_blocks(), r->pool().num_free_blocks()};
        },
        sched_options);
    ServiceOptions o;
    o.limits.vocab_size = FakeRunner::kVocab;
    o.limits.max_context_len = 100000;
    o.limits.max_new_tokens_limit = 100000;
    o.auth_token = std::move(auth_token);
    o.model_info.set_num_layers(FakeRunner::kNumLayers);
    o.model_info.set_vocab_size(FakeRunner::kVocab);
    if (configure) configure(o);
    service = std::make_unique<InferenceService>(*scheduler, &tokenizer, o);
    GrpcServerOptions g;
    g.port = 0;
    server = std::move(*GrpcServer::Start(g, *service));
    server->SetServing(true);
    if (start_engine) scheduler->Start();
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                  grpc::InsecureChannelCredentials());
    stub = v1::Inference::NewStub(channel);
  }
  ~Harness() {
    server.reset();
    scheduler->Stop();
  }
  v1::ServerStats Stats() {
    grpc::ClientContext ctx;
    v1::ServerStats stats;
    EXPECT_TRUE(stub->GetServerStats(&ctx, {}, &stats).ok());
    return stats;
  }
  // Waits until every KV block is free again (the engine frees at its next step).
  bool WaitAllFree() {
    for (int i = 0; i < 200; ++i) {
      v1::ServerStats s = Stats();
      if (s.kv_blocks_used() == 0 && s.num_running() == 0 && s.num_waiting() == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  FakeTokenizer tokenizer;
  std::unique_ptr<FakeRunner> runner;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<InferenceService> service;
  std::unique_ptr<GrpcServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Inference::Stub> stub;
};

v1::GenerateRequest TextRequest(const std::string& prompt, int max_new_tokens) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

std::vector<int32_t> Reference(const std::string& prompt, int n) {
  return FakeRunner::Greedy(*FakeTokenizer().Encode(prompt, true), n);
}
std::string TextOf(const std::vector<int32_t>& ids) {
  return *FakeTokenizer().Decode(ids, true);
}

struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  int num_messages = 0;
  v1::GenerateResponse last;
};

StreamResult Stream(v1::Inference::Stub& stub, const v1::GenerateRequest& request,
                    grpc::ClientContext* ctx, int cancel_after = -1) {
  StreamResult out;
  auto reader = stub.Generate(ctx, request);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    ++out.num_messages;
    out.tokens.insert(out.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    out.text += msg.text();
    out.last = msg;
    if (out.num_messages == cancel_after) ctx->TryCancel();
  }
  out.status = reader->Finish();
  return out;
}

TEST(ServiceTest, StreamingEqualsUnaryEqualsReference) {
  Harness h({});
  const auto ref = Reference("hello", 40);
  grpc::ClientContext c1;
  StreamResult s = Stream(*h.stub, TextRequest("hello", 40), &c1);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.tokens, ref);
  EXPECT_EQ(s.text, TextOf(ref));
  EXPECT_EQ(s.last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(s.last.usage().prompt_tokens(), 6);
  EXPECT_EQ(s.last.usage().completion_tokens(), 40);
  EXPECT_EQ(s.last.usage().kv_tokens_kept(), 2 * 6);
  EXPECT_FALSE(s.last.request_id().empty());
  EXPECT_GE(s.last.timings().ttft_ms(), 0.0);

  grpc::ClientContext c2;
  v1::GenerateResponse unary;
  v1::GenerateRequest req = TextRequest("hello", 40);
  req.set_request_id("abc-1");
  ASSERT_TRUE(h.stub->GenerateUnary(&c2, req, &unary).ok());
  EXPECT_EQ(std::vector<int32_t>(unary.token_ids().begin(), unary.token_ids().end()), ref);
  EXPECT_EQ(unary.text(), s.text);
  EXPECT_EQ(unary.request_id(), "abc-1");
  EXPECT_EQ(unary.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_TRUE(h.WaitAllFree());
}

TEST(ServiceTest, ConcurrentClientsGetTheirOwnOutputs) {
  SchedulerOptions o;
  o.max_batch = 8;
  Harness h(o);
  std::vector<std::thread> threads;
  std::vector<StreamResult> results(16);
  std::vector<std::string> prompts;
  for (int i = 0; i < 16; ++i)
    prompts.push_back(std::string(1 + i % 5, static_cast<char>('a' + i % 12)));
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      results[i] = Stream(*h.stub, TextRequest(prompts[i], 5 + 3 * i), &ctx);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, Reference(prompts[i], 5 + 3 * i)) << i;
  }
  EXPECT_TRUE(h.WaitAllFree());
}

TEST(ServiceTest, InvalidRequestNamesTheField) {
  Harness h({});
  grpc::ClientContext ctx;
  v1::GenerateRequest r = TextRequest("abc", 4);
  r.mutable_sampling()->set_top_p(2.0f);
  v1::GenerateResponse resp;
  grpc::Status st = h.stub->GenerateUnary(&ctx, r, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message().rfind("sampling.top_p: ", 0), 0u) << st.error_message();
  grpc::ClientContext ctx2;
  r = TextRequest("abc", 0);
  StreamResult s = Stream(*h.stub, r, &ctx2);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.num_messages, 0);
}

TEST(ServiceTest, BearerTokenIsChecked) {
  Harness h({}, "s3cret");
  {
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    EXPECT_EQ(h.stub->GenerateUnary(&ctx, TextRequest("abc", 2), &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer wrong");
    v1::ServerStats stats;
    EXPECT_EQ(h.stub->GetServerStats(&ctx, {}, &stats).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer s3cret");
    v1::GenerateResponse resp;
    ASSERT_TRUE(h.stub->GenerateUnary(&ctx, TextRequest("abc", 2), &resp).ok());
    EXPECT_EQ(std::vector<int32_t>(resp.token_ids().begin(), resp.token_ids().end()),
              Reference("abc", 2));
  }
}

TEST(ServiceTest, CancelAndDeadlineFreeTheirBlocks) {
  Harness h({});
  grpc::ClientContext c1;
  StreamResult cancelled = Stream(*h.stub, TextRequest("abc", 20000), &c1, /*cancel_after=*/2);
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  const auto ref = Reference("abc", 20000);
  ASSERT_LE(cancelled.tokens.size(), ref.size());
  EXPECT_TRUE(std::equal(cancelled.tokens.begin(), cancelled.tokens.end(), ref.begin()));

  grpc::ClientContext c2;
  c2.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  StreamResult expired = Stream(*h.stub, TextRequest("abd", 20000), &c2);
  EXPECT_EQ(expired.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(h.WaitAllFree());

  // The server is still fine afterwards.
  grpc::ClientContext c3;
  StreamResult ok = Stream(*h.stub, TextRequest("abc", 5), &c3);
  EXPECT_TRUE(ok.status.ok());
  EXPECT_EQ(ok.tokens, Reference("abc", 5));
}

TEST(ServiceTest, QueueBoundAnswersResourceExhaustedAtOnce) {
  SchedulerOptions o;
  o.max_waiting_requests = 2;
  Harness h(o, "", /*start_engine=*/false);
  std::vector<std::thread> accepted;
  std::vector<StreamResult> results(2);
  for (int i = 0; i < 2; ++i) {
    accepted.emplace_back([&, i] {
      grpc::ClientContext ctx;
      results[i] = Stream(*h.stub, TextRequest("ab", 3 + i), &ctx);
    });
  }
  for (int i = 0; i < 200 && h.scheduler->Stats().num_waiting < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(h.scheduler->Stats().num_waiting, 2);
  const auto t0 = std::chrono::steady_clock::now();
  grpc::ClientContext ctx;
  StreamResult refused = Stream(*h.stub, TextRequest("ab", 3), &ctx);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  h.scheduler->Start();
  for (auto& t : accepted) t.join();
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(results[i].status.ok());
    EXPECT_EQ(results[i].tokens, Reference("ab", 3 + i));
  }
  EXPECT_EQ(h.Stats().num_requests_rejected(), 1);
}

TEST(ServiceTest, TokenizeDetokenizeInfoAndHealth) {
  Harness h({});
  grpc::ClientContext c1;
  v1::TokenizeRequest tr;
  tr.set_text("abc");
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(h.stub->Tokenize(&c1, tr, &tresp).ok());
  EXPECT_EQ(std::vector<int32_t>(tresp.token_ids().begin(), tresp.token_ids().end()),
            *FakeTokenizer().Encode("abc", true));
  grpc::ClientContext c2;
  v1::DetokenizeRequest dr;
  for (int32_t id : tresp.token_ids()) dr.add_token_ids(id);
  dr.set_skip_special_tokens(true);
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(h.stub->Detokenize(&c2, dr, &dresp).ok());
  EXPECT_EQ(dresp.text(), "abc");
  grpc::ClientContext c3;
  dr.add_token_ids(999);
  EXPECT_EQ(h.stub->Detokenize(&c3, dr, &dresp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext c4;
  v1::ModelInfo info;
  ASSERT_TRUE(h.stub->GetModelInfo(&c4, {}, &info).ok());
  EXPECT_EQ(info.num_layers(), FakeRunner::kNumLayers);

  // grpc.health.v1.Health/Check through the generic stub: request {} (empty bytes), response
  // {status: SERVING=1 | NOT_SERVING=2} = bytes 08 01 / 08 02.
  auto check = [&]() -> std::string {
    grpc::GenericStub generic(h.channel);
    grpc::ClientContext ctx;
    grpc::ByteBuffer request_bytes, response_bytes;
    grpc::Slice empty("");
    request_bytes = grpc::ByteBuffer(&empty, 1);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_bytes,
                      &response_bytes, [&](grpc::Status s) {
                        std::lock_guard<std::mutex> lock(mu);
                        status = s;
                        done = true;
                        cv.notify_one();
                      });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<grpc::Slice> slices;
    (void)response_bytes.Dump(&slices);
    std::string out;
    for (auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    return out;
  };
  EXPECT_EQ(check(), std::string("\x08\x01", 2));
  h.server->SetServing(false);
  EXPECT_EQ(check(), std::string("\x08\x02", 2));
}

// A call exists before its request reaches the scheduler: a test that drains or shuts down while a
// request runs waits for the scheduler to hold it first.
bool WaitUntilScheduled(const Scheduler& scheduler) {
  auto scheduled = [&] {
    const SchedulerStats stats = scheduler.Stats();
    return stats.num_waiting + stats.num_running + stats.num_finished > 0;
  };
  for (int i = 0; i < 400 && !scheduled(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return scheduled();
}

TEST(ServiceTest, ShutdownRefusesNewWorkAndLetsRunningFinish) {
  Harness h({});
  StreamResult running;
  std::thread t([&] {
    grpc::ClientContext ctx;
    running = Stream(*h.stub, TextRequest("abc", 300), &ctx);
  });
  EXPECT_TRUE(WaitUntilScheduled(*h.scheduler));
  h.scheduler->BeginDrain();
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_EQ(h.stub->GenerateUnary(&ctx, TextRequest("abc", 3), &resp).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  h.server->Shutdown(*h.scheduler, /*grace_seconds=*/10.0);
  t.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens, Reference("abc", 300));
}

TEST(ServiceTest, ShutdownCancelsWhatOutlivesTheGracePeriod) {
  Harness h({});
  StreamResult running;
  std::thread t([&] {
    grpc::ClientContext ctx;
    running = Stream(*h.stub, TextRequest("abc", 90000), &ctx);
  });
  EXPECT_TRUE(WaitUntilScheduled(*h.scheduler));
  h.server->Shutdown(*h.scheduler, /*grace_seconds=*/0.05);
  t.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.last.finish_reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_LT(running.tokens.size(), 90000u);
}

// A client that reads nothing: once its HTTP/2 window is full (here: at the latest when the final
// status waits on it), the call is cut off after write_stall_seconds, the request leaves the
// scheduler and its blocks return, and what the server buffered for it is freed.
TEST(ServiceTest, ClientThatReadsNothingIsCutOffAndItsBlocksReturn) {
  Harness h({}, "", true, 4096, [](ServiceOptions& o) { o.write_stall_seconds = 0.5; });
  v1::GenerateRequest request = TextRequest("abc", 5000);
  request.mutable_sampling()->set_return_logprobs(true);
  request.mutable_sampling()->set_num_top_logprobs(20);  // ~300 bytes a token: fills any window
  grpc::ClientContext ctx;
  auto reader = h.stub->Generate(&ctx, request);  // never Read()
  EXPECT_TRUE(WaitUntilScheduled(*h.scheduler));
  const auto start = std::chrono::steady_clock::now();
  while (h.service->num_active_calls() > 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(h.service->num_active_calls(), 0);
  EXPECT_TRUE(h.WaitAllFree());
  ctx.TryCancel();
  v1::GenerateResponse ignored;
  while (reader->Read(&ignored)) {
  }
  EXPECT_FALSE(reader->Finish().ok());  // cut off: no OK status reached the client
}

TEST(ServiceTest, OpenCallsBeyondTheLimitGetResourceExhausted) {
  Harness h({}, "", true, 4096, [](ServiceOptions& o) { o.max_open_calls = 1; });
  StreamResult running;
  grpc::ClientContext running_ctx;
  std::thread t([&] { running = Stream(*h.stub, TextRequest("abc", 90000), &running_ctx); });
  EXPECT_TRUE(WaitUntilScheduled(*h.scheduler));
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  const grpc::Status refused = h.stub->GenerateUnary(&ctx, TextRequest("abc", 3), &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("max_open_calls"), std::string::npos)
      << refused.error_message();
  running_ctx.TryCancel();
  t.join();
  EXPECT_TRUE(h.WaitAllFree());
  grpc::ClientContext again;
  EXPECT_TRUE(h.stub->GenerateUnary(&again, TextRequest("abc", 3), &resp).ok());
}

// gRPC's SO_REUSEPORT would let a second server share the port and half its connections.
TEST(ServiceTest, SecondServerOnTheSamePortFailsToStart) {
  Harness h({});
  GrpcServerOptions same;
  same.port = h.server->port();
  InferenceService other(*h.scheduler, &h.tokenizer, {});
  auto second = GrpcServer::Start(same, other);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot listen"), std::string::npos) << second.status();
}

}  // namespace
}  // namespace dropkv
