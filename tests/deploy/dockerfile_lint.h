// A small Dockerfile linter (hadolint-like rules we need; no Docker engine runs on the build
// machines). Parses instructions (continuations, comments, global ARGs, stages) and reports
// findings with the rule id and line. Used by dockerfile_lint_test.cpp on docker/Dockerfile.*.
#pragma once

#include <algorithm>
#include <cctype>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace dropkv::testing {

struct DockerInstruction {
  int line = 0;         // 1-based line of the instruction's first line
  std::string keyword;  // upper case: FROM, RUN, ...
  std::string args;     // continuation lines joined with a space
};

struct DockerStage {
  std::string image;  // after global ARG substitution
  std::string name;   // "AS name", lower case; "" when unnamed
  int line = 0;
  std::vector<DockerInstruction> instructions;  // after FROM
};

struct DockerFinding {
  std::string rule;  // DKnnn
  int line = 0;
  std::string message;
};

struct ParsedDockerfile {
  std::vector<DockerInstruction> instructions;
  std::vector<DockerStage> stages;
};

inline std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  size_t e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

inline std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// ${VAR}, ${VAR:-default} and $VAR from `vars`; unknown ones stay as written.
inline std::string Substitute(const std::string& s,
                              const std::map<std::string, std::string>& vars) {
  static const std::regex kVar(
      R"(\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*))");
  std::string out;
  auto begin = std::sregex_iterator(s.begin(), s.end(), kVar);
  size_t last = 0;
  for (auto it = begin; it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    out += s.substr(last, m.position() - last);
    std::string name = m[1].matched ? m[1].str() : m[4].str();
    auto v = vars.find(name);
    if (v != vars.end() && !v->second.empty()) {
      out += v->second;
    } else if (m[3].matched) {
      out += m[3].str();
    } else {
      out += m.str();
    }
    last = m.position() + m.length();
  }
  return out + s.substr(last);
}

inline ParsedDockerfile ParseDockerfile(const std::string& text) {
  ParsedDockerfile out;
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  DockerInstruction cur;
  bool continuing = false;
  while (std::getline(in, raw)) {
    ++line_no;
    std::string line = Trim(raw);
    if (line.empty() || line[0] == '#') continue;  // comments end nothing, even mid-RUN
    bool cont = !line.empty() && line.back() == '\\';
    if (cont) line = Trim(line.substr(0, line.size() - 1));
    if (!continuing) {
      cur = DockerInstruction{};
      cur.line = line_no;
      size_t sp = line.find_first_of(" \t");
      cur.keyword = Upper(line.substr(0, sp));
      cur.args = sp == std::string::npos ? "" : Trim(line.substr(sp));
    } else {
      cur.args += (cur.args.empty() ? "" : " ") + line;
    }
    continuing = cont;
    if (!continuing) out.instructions.push_back(cur);
  }
  if (continuing) out.instructions.push_back(cur);

  std::map<std::string, std::string> global_args;
  for (const DockerInstruction& ins : out.instructions) {
    if (ins.keyword == "FROM") {
      std::istringstream words(ins.args);
      std::vector<std::string> w;
      for (std::string x; words >> x;) {
        if (x.rfind("--", 0) != 0) w.push_back(x);  // --platform=...
      }
      DockerStage stage;
      stage.line = ins.line;
      stage.image = w.empty() ? "" : Substitute(w[0], global_args);
      if (w.size() >= 3 && Upper(w[1]) == "AS") {
        stage.name = w[2];
        std::transform(stage.name.begin(), stage.name.end(), stage.name.begin(), ::tolower);
      }
      out.stages.push_back(stage);
    } else if (out.stages.empty()) {
      if (ins.keyword == "ARG") {
        std::string a = ins.args;
        size_t eq = a.find('=');
        global_args[Trim(a.substr(0, eq))] = eq == std::string::npos ? "" : Trim(a.substr(eq + 1));
      }
    } else {
      out.stages.back().instructions.push_back(ins);
    }
  }
  return out;
}

inline bool Contains(const std::string& s, const std::string& what) {
  return s.find(what) != std::string::npos;
}

inline std::vector<DockerFinding> LintDockerfile(const std::string& text) {
  std::vector<DockerFinding> f;
  ParsedDockerfile df = ParseDockerfile(text);
  if (df.stages.empty()) {
    f.push_back({"DK000", 1, "no FROM instruction"});
    return f;
  }
  if (df.stages.size() < 2) {
    f.push_back(
        {"DK008", df.stages[0].line, "not multi-stage: build and runtime must be separate"});
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < df.stages.size(); ++i) {
    const DockerStage& st = df.stages[i];
    // DK001: pinned base images.
    const bool is_stage_ref = std::find(names.begin(), names.end(), st.image) != names.end();
    if (!is_stage_ref) {
      const size_t slash = st.image.rfind('/');
      const std::string last = slash == std::string::npos ? st.image : st.image.substr(slash + 1);
      const size_t colon = last.find(':');
      const std::string tag = colon == std::string::npos ? "" : last.substr(colon + 1);
      const bool digest = Contains(st.image, "@sha256:");
      if (Contains(st.image, "$")) {
        f.push_back({"DK001", st.line, "base image has an unresolved variable: " + st.image});
      } else if (!digest && (tag.empty() || tag == "latest" ||
                             tag.find_first_of("0123456789") == std::string::npos)) {
        f.push_back({"DK001", st.line, "base image not pinned to a version: " + st.image});
      }
    }
    for (const DockerInstruction& ins : st.instructions) {
      // DK004: COPY --from must name an earlier stage (or its index).
      if (ins.keyword == "COPY") {
        static const std::regex kFrom(R"(--from=(\S+))");
        std::smatch m;
        if (std::regex_search(ins.args, m, kFrom)) {
          std::string ref = m[1].str();
          std::transform(ref.begin(), ref.end(), ref.begin(), ::tolower);
          bool ok = std::find(names.begin(), names.end(), ref) != names.end();
          if (!ok && std::all_of(ref.begin(), ref.end(), ::isdigit)) {
            ok = std::stoul(ref) < i;
          }
          if (!ok) f.push_back({"DK004", ins.line, "COPY --from=" + ref + " is no earlier stage"});
        }
      }
      if (ins.keyword == "RUN") {
        // DK005: apt hygiene in the same layer.
        if (Contains(ins.args, "apt-get install")) {
          if (!Contains(ins.args, "apt-get update")) {
            f.push_back(
                {"DK005", ins.line, "apt-get install without apt-get update in the same RUN"});
          }
          if (!Contains(ins.args, "--no-install-recommends")) {
            f.push_back({"DK005", ins.line, "apt-get install without --no-install-recommends"});
          }
          if (!Contains(ins.args, "rm -rf /var/lib/apt/lists/*")) {
            f.push_back({"DK005", ins.line, "apt lists not removed (rm -rf /var/lib/apt/lists/*)"});
          }
        }
        // DK006: no pip cache in layers.
        if (Contains(ins.args, "pip install") && !Contains(ins.args, "--no-cache-dir")) {
          f.push_back({"DK006", ins.line, "pip install without --no-cache-dir"});
        }
        if (Contains(ins.args, "sudo ")) f.push_back({"DK010", ins.line, "sudo in RUN"});
      }
      if (ins.keyword == "ADD") {
        f.push_back({"DK007", ins.line, "ADD: use COPY (and curl with a checksum for URLs)"});
      }
      if ((ins.keyword == "ENTRYPOINT" || ins.keyword == "CMD") && ins.args.rfind("[", 0) != 0) {
        f.push_back({"DK009", ins.line, ins.keyword + " not in exec (JSON array) form"});
      }
      if (ins.keyword == "WORKDIR" && ins.args.rfind("/", 0) != 0) {
        f.push_back({"DK011", ins.line, "WORKDIR not absolute: " + ins.args});
      }
    }
    names.push_back(st.name.empty() ? std::to_string(i) : st.name);
  }

  // Final stage rules.
  const DockerStage& final_stage = df.stages.back();
  std::string user;
  const DockerInstruction* health = nullptr;
  for (const DockerInstruction& ins : final_stage.instructions) {
    if (ins.keyword == "USER") user = ins.args.substr(0, ins.args.find(':'));
    if (ins.keyword == "HEALTHCHECK") health = &ins;
    if (ins.keyword == "RUN" &&
        std::regex_search(ins.args,
                          std::regex(R"(\b(build-essential|g\+\+|gcc|cmake|ninja-build)\b)"))) {
      f.push_back({"DK008", ins.line, "final stage installs build tools"});
    }
  }
  if (df.stages.size() >= 2 && Contains(final_stage.image, "devel")) {
    f.push_back({"DK008", final_stage.line, "final stage is a devel image: " + final_stage.image});
  }
  if (user.empty() || user == "root" || user == "0") {
    f.push_back({"DK002", final_stage.line, "final stage runs as root (no USER or USER root)"});
  }
  if (health == nullptr) {
    f.push_back({"DK003", final_stage.line, "no HEALTHCHECK in the final stage"});
  } else if (Contains(Upper(health->args), "NONE") || !Contains(health->args, "CMD")) {
    f.push_back({"DK003", health->line, "HEALTHCHECK disabled or without CMD"});
  }
  return f;
}

}  // namespace dropkv::testing
