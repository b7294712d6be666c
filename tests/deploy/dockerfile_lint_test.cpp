// docker/Dockerfile.cuda and Dockerfile.cpu pass the linter in dockerfile_lint.h, each lint rule
// fires on a Dockerfile that breaks it, and the images agree with the project (CUDA archs 80;90,
// LibTorch 2.11.0, health check on the configured port via the gRPC health service, files that
// the build copies exist).
#include "tests/deploy/dockerfile_lint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "config/server_config.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using testing::DockerFinding;
using ::testing::HasSubstr;
using testing::LintDockerfile;
using testing::ParseDockerfile;

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string Describe(const std::vector<DockerFinding>& findings) {
  std::string s;
  for (const auto& f : findings)
    s += f.rule + " line " + std::to_string(f.line) + ": " + f.message + "\n";
  return s;
}

std::vector<std::string> Rules(const std::vector<DockerFinding>& findings) {
  std::vector<std::string> rules;
  for (const auto& f : findings) rules.push_back(f.rule);
  return rules;
}

// A Dockerfile that passes every rule; each negative case breaks exactly one thing in it.
const char* kGood = R"(# syntax=docker/dockerfile:1
ARG BASE=debian:12.8
FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.11.0
FROM debian:12.8-slim
COPY --from=build /opt/x /opt/x
USER app:app
HEALTHCHECK CMD ["/opt/x/check"]
ENTRYPOINT ["/opt/x/run"]
)";

std::string Replace(std::string s, const std::string& from, const std::string& to) {
  size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) s.replace(at, from.size(), to);
  return s;
}

TEST(DockerfileLintTest, EachRuleFiresOnItsViolation) {
  EXPECT_TRUE(LintDockerfile(kGood).empty()) << Describe(LintDockerfile(kGood));
  struct Case {
    std::string rule, from, to;
  };
  const std::vector<Case> cases = {
      {"DK001", "FROM debian:12.8-slim", "FROM debian:latest"},
      {"DK001", "FROM debian:12.8-slim", "FROM debian"},
      {"DK001", "FROM debian:12.8-slim", "FROM debian:bookworm-slim"},
      {"DK001", "ARG BASE=debian:12.8", "ARG BASE"},
      {"DK002", "USER app:app\n", ""},
      {"DK002", "USER app:app", "USER root"},
      {"DK003", "HEALTHCHECK CMD [\"/opt/x/check\"]\n", ""},
      {"DK003", "HEALTHCHECK CMD [\"/opt/x/check\"]", "HEALTHCHECK NONE"},
      {"DK004", "--from=build", "--from=builder"},
      {"DK005", " && rm -rf /var/lib/apt/lists/*", ""},
      {"DK005", "--no-install-recommends ", ""},
      {"DK005", "RUN apt-get update \\\n && apt-get install", "RUN apt-get install"},
      {"DK006", "--no-cache-dir ", ""},
      {"DK007", "COPY --from=build /opt/x /opt/x",
       "COPY --from=build /opt/x /opt/x\nADD https://x/y.tgz /y"},
      {"DK008", "FROM debian:12.8-slim\nCOPY --from=build /opt/x /opt/x\n", ""},
      {"DK008", "FROM debian:12.8-slim", "FROM nvidia/cuda:13.0.1-devel-ubuntu24.04"},
      {"DK009", "ENTRYPOINT [\"/opt/x/run\"]", "ENTRYPOINT /opt/x/run"},
  };
  for (const Case& c : cases) {
    std::string text = Replace(kGood, c.from, c.to);
    auto findings = LintDockerfile(text);
    EXPECT_THAT(Rules(findings), ::testing::Contains(c.rule))
        << c.rule << " did not fire for: " << c.from << " -> " << c.to << "\n"
        << text;
  }
}

TEST(DockerfileLintTest, ParserHandlesContinuationsCommentsAndArgs) {
  auto df = ParseDockerfile(
      "ARG TAG=1.2\nFROM img:${TAG} AS one\nRUN a \\\n  # comment inside\n  && b\nFROM one\n");
  ASSERT_EQ(df.stages.size(), 2u);
  EXPECT_EQ(df.stages[0].image, "img:1.2");
  EXPECT_EQ(df.stages[0].name, "one");
  ASSERT_EQ(df.stages[0].instructions.size(), 1u);
  EXPECT_EQ(df.stages[0].instructions[0].args, "a && b");
  EXPECT_EQ(df.stages[1].image, "one");
}

class ProjectDockerfileTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ProjectDockerfileTest, PassesTheLinterAndMatchesTheProject) {
  const fs::path src = dropkv::testing::SourceDir();
  const std::string text = ReadText(src / "docker" / GetParam());
  auto findings = LintDockerfile(text);
  EXPECT_TRUE(findings.empty()) << Describe(findings);

  auto df = ParseDockerfile(text);
  std::string all;
  for (const auto& ins : df.instructions) all += ins.keyword + " " + ins.args + "\n";
  EXPECT_THAT(all, HasSubstr("TORCH_VERSION=2.11.0"));
  EXPECT_THAT(all, HasSubstr("torch==${TORCH_VERSION}"));
  if (GetParam() == "Dockerfile.cuda") {
    EXPECT_THAT(all, HasSubstr("-DCMAKE_CUDA_ARCHITECTURES=\"80;90\""));
    EXPECT_THAT(all, HasSubstr("-DDROPKV_CUDA=ON"));
  } else {
    EXPECT_THAT(all, HasSubstr("-DDROPKV_CUDA=OFF"));
  }
  // The image's config file: where DROPKV_CONFIG points, copied from docker/server.yaml.
  EXPECT_THAT(all, HasSubstr("DROPKV_CONFIG=/opt/dropkv/config/server.yaml"));
  EXPECT_THAT(all, HasSubstr("docker/server.yaml /opt/dropkv/config/"));
  auto config = ParseServerConfigYaml(ReadText(src / "docker/server.yaml"), "docker/server.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  // Health check = dropkv-cli's gRPC health call on the configured port; both ports exposed.
  const auto& final_stage = df.stages.back();
  std::string health, expose;
  for (const auto& ins : final_stage.instructions) {
    if (ins.keyword == "HEALTHCHECK") health = ins.args;
    if (ins.keyword == "EXPOSE") expose = ins.args;
  }
  EXPECT_THAT(health, HasSubstr("dropkv-cli"));
  EXPECT_THAT(health, HasSubstr("\"health\""));
  EXPECT_THAT(health, HasSubstr("127.0.0.1:" + std::to_string(config->port)));
  EXPECT_THAT(expose, HasSubstr(std::to_string(config->port)));
  EXPECT_THAT(expose, HasSubstr(std::to_string(config->metrics_port)));
  // Repository files the build uses exist.
  for (const char* path :
       {"docker/collect-runtime-libs.sh", "config/server.example.yaml", "docker/server.yaml"}) {
    EXPECT_THAT(all, HasSubstr(path));
    EXPECT_TRUE(fs::exists(src / path)) << path;
  }
  // Its .dockerignore keeps build trees out of the context.
  EXPECT_THAT(ReadText(src / "docker" / (GetParam() + ".dockerignore")), HasSubstr("build*/"));
}

INSTANTIATE_TEST_SUITE_P(Images, ProjectDockerfileTest,
                         ::testing::Values("Dockerfile.cuda", "Dockerfile.cpu"));

}  // namespace
}  // namespace dropkv
