// Tensor parallelism on the CPU: groups of tp_rank processes (Gloo over loopback) on the trained
// SmolLM2 (3 ranks: 9 query heads, 3 KV heads) and on the test-built Llama, Qwen2, Gemma 2 and
// Gemma 3 folders (2 and 4 ranks, KV heads split or copied), each rank checking its run against
// the whole model (tp_rank_main.cpp); and a rank that dies mid-request ending the others with an
// error instead of a hang.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/test_env.h"

extern char** environ;

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using testing::BuildDir;
using testing::ScratchDir;

struct RankResult {
  int exit_code = -1;  // -1: killed after the deadline (a hang)
  std::string output;  // stdout + stderr
};

// Starts `size` ranks of tp_rank on `model` (rank `dying` with --exit-at-step `step`), waits up
// to `deadline` for all of them and returns what each printed and how it ended.
std::vector<RankResult> RunGroup(const std::string& name, const std::string& model, int size,
                                 std::chrono::seconds deadline, int dying = -1, int step = -1,
                                 const std::vector<std::string>& extra_args = {}) {
  const fs::path dir = ScratchDir("tensor_parallel") / name;
  fs::remove_all(dir);
  fs::create_directories(dir / "store");
  const std::string exe = (BuildDir() / "tests" / "tp_rank").string();
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> args = {exe,
                                     "--rank",
                                     std::to_string(r),
                                     "--size",
                                     std::to_string(size),
                                     "--store",
                                     (dir / "store").string(),
                                     "--model",
                                     model};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    if (r == dying) {
      args.push_back("--exit-at-step");
      args.push_back(std::to_string(step));
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = (dir / ("rank" + std::to_string(r) + ".log")).string();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    EXPECT_EQ(posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), environ), 0) << exe;
    posix_spawn_file_actions_destroy(&fa);
    pids.push_back(pid);
  }
  std::vector<RankResult> results(size);
  std::vector<bool> done(size, false);
  const auto end = std::chrono::steady_clock::now() + deadline;
  int remaining = size;
  while (remaining > 0 && std::chrono::steady_clock::now() < end) {
    for (int r = 0; r < size; ++r) {
      int status = 0;
      if (done[r] || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      done[r] = true;
      --remaining;
      results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int r = 0; r < size; ++r) {
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
    }
    std::ifstream in(dir / ("rank" + std::to_string(r) + ".log"));
    std::stringstream ss;
    ss << in.rdbuf();
    results[r].output = ss.str();
  }
  return results;
}

void ExpectAllMatch(const std::vector<RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    // The rank's summary line, for the log.
    const auto at = results[r].output.find("rank " + std::to_string(r) + " of " +
                                           std::to_string(results.size()) + ": ");
    if (at != std::string::npos)
      std::cout << results[r].output.substr(at, results[r].output.find('\n', at) - at) << "\n";
  }
}

fs::path ParityModel(const std::string& family) {
  return BuildDir() / "test-scratch" / "model_parity" / family;
}

TEST(TensorParallelTest, SmolLm2OverThreeRanksMatchesTheWholeModel) {
  const fs::path model = testing::SmolLm2Dir();
  if (!fs::exists(model / "config.json")) GTEST_SKIP() << "no " << model;
  ExpectAllMatch(RunGroup("smollm2", model.string(), 3, std::chrono::seconds(600)));
}

TEST(TensorParallelTest, TestBuiltFamiliesMatchTheWholeModel) {
  // llama: 8 query / 2 KV heads (2 ranks: split; 4 ranks: each KV head on two ranks); qwen2:
  // biases, a sharded checkpoint; gemma2 / gemma3: one KV head copied on both ranks, soft caps,
  // sliding layers, q/k norms.
  const std::vector<std::pair<std::string, int>> groups = {
      {"llama", 2}, {"llama", 4}, {"qwen2", 2}, {"gemma2", 2}, {"gemma3", 2}};
  for (const auto& [family, size] : groups) {
    SCOPED_TRACE(family + " over " + std::to_string(size) + " ranks");
    ASSERT_TRUE(fs::exists(ParityModel(family) / "config.json")) << ParityModel(family);
    ExpectAllMatch(RunGroup(family + std::to_string(size), ParityModel(family).string(), size,
                            std::chrono::seconds(300)));
  }
}

TEST(TensorParallelTest, RandomWeightsShardTheOneRankModel) {
  // Benchmarks draw weights from a config.json alone: each rank draws every tensor whole (same
  // seed) and keeps its shard, so the group is the one-rank model.
  ExpectAllMatch(RunGroup("random", ParityModel("llama").string(), 2, std::chrono::seconds(300), -1,
                          -1, {"--random-weights", "1"}));
}

// dropkv-generate's output (stdout) with `args`; empty on failure.
std::string Generate(const std::string& args) {
  const std::string cmd =
      (BuildDir() / "bin" / "dropkv-generate").string() + " " + args + " --json 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return "";
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  return pclose(p) == 0 ? out : "";
}

TEST(TensorParallelTest, GenerateStartsItsRanksAndSamplesWhatOneProcessSamples) {
  const fs::path model = testing::SmolLm2Dir();
  if (!fs::exists(model / "config.json")) GTEST_SKIP() << "no " << model;
  const std::string common =
      "--model " + model.string() +
      " --prompt 'The capital of France is Paris. The capital of Italy is Rome. The capital of "
      "Spain is' --max-new-tokens 24 --temperature 0.8 --seed 7 --method dropkv --keep 0.5";
  const std::string one = Generate(common);
  ASSERT_NE(one.find("token_ids"), std::string::npos) << one;
  EXPECT_EQ(Generate(common + " --tensor-parallel-size 3"), one);
  // A size that does not divide the heads is refused, naming the setting.
  const std::string cmd = (BuildDir() / "bin" / "dropkv-generate").string() + " --model " +
                          model.string() + " --tensor-parallel-size 2 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string err;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) err.append(buf, n);
  EXPECT_NE(pclose(p), 0);
  EXPECT_NE(err.find("tensor_parallel_size: 2 does not divide"), std::string::npos) << err;
}

TEST(TensorParallelTest, ARankThatDiesEndsTheOthersWithAnError) {
  const auto results = RunGroup("dying", ParityModel("llama").string(), 4,
                                std::chrono::seconds(120), /*dying=*/1, /*step=*/4);
  ASSERT_EQ(results.size(), 4u);
  EXPECT_EQ(results[1].exit_code, 3) << results[1].output;
  for (int r : {0, 2, 3}) {
    // Not a hang (-1 after the deadline), not a crash: the error exit with the reason.
    EXPECT_EQ(results[r].exit_code, 2) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("tensor parallelism"), std::string::npos) << results[r].output;
  }
}

}  // namespace
}  // namespace dropkv
