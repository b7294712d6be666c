#include "engine/parallel/group.h"

#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#if DROPKV_PARALLEL_GLOO
#include "engine/parallel/gloo_communicator.h"
#endif
#if DROPKV_PARALLEL_NCCL
#include "engine/parallel/nccl_communicator.h"
#endif

extern char** environ;

namespace dropkv {

absl::StatusOr<std::string> RankDevice(const std::string& device, int32_t rank) {
  if (device == "cpu") return device;
  int first = 0;
  if (device != "cuda" && !(absl::StartsWith(device, "cuda:") &&
                            absl::SimpleAtoi(device.substr(5), &first) && first >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", device, "' is not cpu or cuda[:N]"));
  }
  return absl::StrCat("cuda:", first + rank);
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGroup(int32_t rank, int32_t size,
                                                           const std::string& device,
                                                           const std::string& store_dir) {
  RendezvousOptions options;
  options.store_dir = store_dir;
  auto rank_device = RankDevice(device, rank);
  if (!rank_device.ok()) return rank_device.status();
  if (*rank_device == "cpu") {
#if DROPKV_PARALLEL_GLOO
    return ConnectGloo(rank, size, options);
#else
    return absl::UnimplementedError(
        "tensor_parallel_size > 1 on the CPU: this build has no Gloo (install libgloo-dev)");
#endif
  }
#if DROPKV_PARALLEL_NCCL
  return ConnectNccl(rank, size, std::atoi(rank_device->c_str() + 5), options);
#else
  return absl::UnimplementedError(
      "tensor_parallel_size > 1 on CUDA: this build has no NCCL (a CUDA build finds it beside the "
      "torch wheel)");
#endif
}

absl::StatusOr<std::unique_ptr<Communicator>> ConnectControlGroup(int32_t rank, int32_t size,
                                                                  const std::string& store_dir) {
#if DROPKV_PARALLEL_GLOO
  RendezvousOptions options;
  options.store_dir = store_dir;
  options.store_prefix = "control";
  options.collectives_wait_forever = true;
  return ConnectGloo(rank, size, options);
#else
  return absl::UnimplementedError(
      "tensor_parallel_size > 1: this build has no Gloo for the ranks' control channel (install "
      "libgloo-dev)");
#endif
}

absl::StatusOr<std::unique_ptr<RankProcesses>> RankProcesses::Start(
    const std::vector<std::string>& argv, int32_t size) {
  std::unique_ptr<RankProcesses> group(new RankProcesses());
  std::string pattern = (std::filesystem::temp_directory_path() / "dropkv-tp-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr)
    return absl::InternalError(absl::StrCat("tensor parallelism: cannot create ", pattern));
  group->store_dir_ = pattern;
  const pid_t parent = getpid();
  for (int32_t r = 1; r < size; ++r) {
    std::vector<std::string> args = argv;
    args.insert(args.end(), {"--tp-rank", std::to_string(r), "--tp-store", group->store_dir_});
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    // fork + exec rather than posix_spawn: the child asks to die with its parent first.
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("tensor parallelism: fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // the parent died before prctl
      // Not the parent's sockets (a server's listening ports) or files: only stdio.
      close_range(3, ~0U, 0);
      execve("/proc/self/exe", cargs.data(), environ);
      std::fprintf(stderr, "tensor parallelism: cannot start rank %d\n", r);
      _exit(127);
    }
    group->pids_.push_back(pid);
    group->exit_codes_.push_back(-1);
  }
  group->watcher_ = std::thread([g = group.get()] { g->Watch(); });
  return group;
}

void RankProcesses::Watch() {
  while (!stop_.load()) {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (exit_codes_[i] != -1) continue;
      int status = 0;
      if (waitpid(pids_[i], &status, WNOHANG) != pids_[i]) continue;
      exit_codes_[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (exit_codes_[i] != 0 && !joining_.load()) {
        std::fprintf(stderr,
                     "tensor parallelism: rank %zu exited with code %d; stopping the group\n",
                     i + 1, exit_codes_[i]);
        std::fflush(stderr);
        _exit(1);  // the other ranks die with this process
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

absl::Status RankProcesses::Join() {
  joining_ = true;
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (exit_codes_[i] != -1) continue;
    int status = 0;
    waitpid(pids_[i], &status, 0);
    exit_codes_[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  for (size_t i = 0; i < exit_codes_.size(); ++i) {
    if (exit_codes_[i] != 0) {
      return absl::InternalError(
          absl::StrCat("tensor parallelism: rank ", i + 1, " exited with code ", exit_codes_[i]));
    }
  }
  return absl::OkStatus();
}

RankProcesses::~RankProcesses() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (exit_codes_[i] == -1) {
      kill(pids_[i], SIGKILL);
      waitpid(pids_[i], nullptr, 0);
    }
  }
  RemoveFlatFolder(store_dir_);  // the rendezvous files
}

}  // namespace dropkv
