// A tensor-parallel group of processes, one per rank: rank 0 starts the others as copies of its
// own executable, each connects to the group's communicator for its device.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/parallel/communicator.h"

namespace dropkv {

// The device rank `rank` runs on: "cuda:I" -> "cuda:(I + rank)" (one GPU per rank); "cpu" as is.
absl::StatusOr<std::string> RankDevice(const std::string& device, int32_t rank);

// Connects this process as rank `rank` of `size` at the rendezvous folder `store_dir`: Gloo for
// "cpu", NCCL for "cuda[:I]" (RankDevice's GPU). UNIMPLEMENTED when this build has neither.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectGroup(int32_t rank, int32_t size,
                                                           const std::string& device,
                                                           const std::string& store_dir);

// The same ranks' control channel: Gloo over loopback whatever the device (rank 0's messages to
// the others; they wait for the next one without a time limit). UNIMPLEMENTED without Gloo.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectControlGroup(int32_t rank, int32_t size,
                                                                  const std::string& store_dir);

// Ranks 1..size-1 as child processes running `argv` (this executable and its arguments) plus
// "--tp-rank R --tp-store DIR" (a fresh folder under $TMPDIR). They are killed when this process
// dies (PR_SET_PDEATHSIG). A thread watches them: a rank that ends with an error before Join ends
// this process too, with a message naming it (a collective would otherwise wait for it forever:
// NCCL has no timeout here).
class RankProcesses {
 public:
  static absl::StatusOr<std::unique_ptr<RankProcesses>> Start(const std::vector<std::string>& argv,
                                                              int32_t size);
  ~RankProcesses();  // kills the ranks still running
  const std::string& store_dir() const { return store_dir_; }
  // Waits for every rank to end; an error names the first that failed.
  absl::Status Join();

 private:
  RankProcesses() = default;
  void Watch();

  std::string store_dir_;
  std::vector<pid_t> pids_;
  std::vector<int> exit_codes_;  // -1 while running; the watcher's until Join stops it
  std::atomic<bool> joining_{false};
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace dropkv
