// Test helpers for HTTP endpoints on loopback (the metrics, HTTP and deploy tests): a GET, a
// Prometheus text-format parser, a child process (for the real Prometheus server) and a free-port
// picker. Header-only, no LibTorch.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dropkv::testing {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://127.0.0.1:port/target (HTTP/1.0, whole body until close). nullopt = no connection.
inline std::optional<HttpResponse> HttpGet(int port, const std::string& target) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  std::string req = "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return std::nullopt;
  }
  std::string raw;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) raw.append(buf, static_cast<size_t>(n));
  ::close(fd);
  HttpResponse resp;
  size_t sp = raw.find(' ');
  if (sp == std::string::npos) return std::nullopt;
  resp.status = std::atoi(raw.c_str() + sp + 1);
  size_t body = raw.find("\r\n\r\n");
  if (body != std::string::npos) resp.body = raw.substr(body + 4);
  return resp;
}

inline std::string UrlEncode(const std::string& s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

// One sample line of the text format: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct ParsedMetrics {
  std::map<std::string, std::string> types;  // family name -> counter|gauge|histogram|...
  std::map<std::string, std::string> helps;
  std::vector<Sample> samples;
  std::vector<std::string> errors;  // lines that did not parse

  // The value of the one sample with this name whose labels include `match`; nullopt if none.
  std::optional<double> Value(const std::string& name,
                              const std::map<std::string, std::string>& match = {}) const {
    std::optional<double> found;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool ok = true;
      for (const auto& [k, v] : match) {
        auto it = s.labels.find(k);
        if (it == s.labels.end() || it->second != v) ok = false;
      }
      if (ok) found = s.value;
    }
    return found;
  }
};

// Parses the Prometheus text exposition format (0.0.4) strictly enough to catch broken output.
inline ParsedMetrics ParsePrometheusText(const std::string& text) {
  ParsedMetrics out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0 || line.rfind("# HELP ", 0) == 0) {
      std::string rest = line.substr(7);
      size_t sp = rest.find(' ');
      if (sp == std::string::npos) {
        out.errors.push_back(line);
        continue;
      }
      (line[2] == 'T' ? out.types : out.helps)[rest.substr(0, sp)] = rest.substr(sp + 1);
      continue;
    }
    if (line[0] == '#') continue;
    Sample s;
    size_t i = 0;
    while (i < line.size() && (std::isalnum(static_cast<unsigned char>(line[i])) ||
                               line[i] == '_' || line[i] == ':')) {
      ++i;
    }
    s.name = line.substr(0, i);
    bool bad = s.name.empty();
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (!bad && i < line.size() && line[i] != '}') {
        size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          bad = true;
          break;
        }
        std::string key = line.substr(i, eq - i);
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) ++j;
          value += line[j];
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // '}'
    }
    if (bad || i >= line.size() || line[i] != ' ') {
      out.errors.push_back(line);
      continue;
    }
    std::string value = line.substr(i + 1);
    value = value.substr(0, value.find(' '));  // drop an optional timestamp
    char* end = nullptr;
    s.value = std::strtod(value.c_str(), &end);
    if (end == value.c_str()) {
      out.errors.push_back(line);
      continue;
    }
    out.samples.push_back(std::move(s));
  }
  return out;
}

// A TCP port that was free a moment ago on 127.0.0.1 (for programs that need a port number).
inline int PickFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// A child process, SIGTERM'd and reaped when this goes out of scope.
class ChildProcess {
 public:
  ChildProcess() = default;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess() { Stop(); }

  // argv[0] is the program (PATH is searched); stdout/stderr go to log_path.
  bool Start(const std::vector<std::string>& argv, const std::string& log_path) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int rc = ::posix_spawnp(&pid_, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) pid_ = -1;
    return rc == 0;
  }
  bool Running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Waits for the process to exit; its exit code, or -1 (killed after `timeout`).
  int Wait(std::chrono::seconds timeout) {
    if (pid_ <= 0) return -1;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Stop();
    return -1;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

}  // namespace dropkv::testing
