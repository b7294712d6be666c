// Starts the real dropkv-server binary as a child process on a free loopback port (--port 0; the
// server prints "LISTENING <port>" on stdout once healthy) and stops it with a signal.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

extern char** environ;

namespace dropkv::testing {

class ServerProcess {
 public:
  // Returns false (and a reason in error()) when the server did not report its port in time.
  bool Start(const std::string& binary, std::vector<std::string> args, int timeout_s = 60) {
    int out_pipe[2];
    if (pipe(out_pipe) != 0) return Fail("pipe failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
    posix_spawn_file_actions_addclose(&actions, out_pipe[0]);
    args.insert(args.begin(), binary);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(out_pipe[1]);
    if (rc != 0) {
      close(out_pipe[0]);
      return Fail("cannot start " + binary);
    }
    out_fd_ = out_pipe[0];
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    std::string buffer;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, 200) > 0) {
        char chunk[256];
        const ssize_t n = read(out_fd_, chunk, sizeof(chunk));
        if (n <= 0) return Fail("server exited before listening: " + buffer);
        buffer.append(chunk, static_cast<size_t>(n));
        const size_t at = buffer.find("LISTENING ");
        if (at != std::string::npos && buffer.find('\n', at) != std::string::npos) {
          port_ = std::stoi(buffer.substr(at + 10));
          return true;
        }
      }
    }
    return Fail("no LISTENING line within the timeout");
  }

  // Sends `signal` and waits for the exit; returns the exit code (or 128 + signal number).
  int Stop(int signal = SIGTERM, int timeout_s = 60) {
    if (pid_ <= 0) return -1;
    kill(pid_, signal);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    int status = 0;
    while (true) {
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      usleep(20000);
    }
    pid_ = -1;
    if (out_fd_ >= 0) close(out_fd_);
    out_fd_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  ~ServerProcess() {
    if (pid_ > 0) Stop(SIGKILL, 5);
  }

  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  const std::string& error() const { return error_; }

 private:
  bool Fail(std::string why) {
    error_ = std::move(why);
    if (pid_ > 0) Stop(SIGKILL, 5);
    return false;
  }
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int port_ = 0;
  std::string error_;
};

}  // namespace dropkv::testing
