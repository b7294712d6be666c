// deploy/ and docker/ cross-checks: the configs there load with the server's own loader, the
// Kubernetes manifests agree with that config (ports, probes, drain timing), and every metric name
// that the dashboard, alert rules and autoscaler use is one ServerMetrics really exports (names
// are taken by scraping the /metrics endpoint, not from a hand-written list).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "config/server_config.h"
#include "server/http/metrics_http_server.h"
#include "server/metrics/server_metrics.h"
#include "tests/common/http_test_util.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

fs::path Src(const std::string& rel) {
  return testing::SourceDir() / rel;
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// All documents of a multi-document YAML file.
std::vector<YAML::Node> LoadAll(const fs::path& path) {
  return YAML::LoadAllFromFile(path.string());
}

YAML::Node FindKind(const fs::path& path, const std::string& kind, const std::string& name = "") {
  for (const YAML::Node& doc : LoadAll(path)) {
    if (doc["kind"] && doc["kind"].as<std::string>() == kind &&
        (name.empty() || doc["metadata"]["name"].as<std::string>() == name)) {
      return doc;
    }
  }
  ADD_FAILURE() << "no " << kind << " " << name << " in " << path;
  return YAML::Node();
}

// Every metric name the server exports, read from a real scrape of the /metrics endpoint after
// traffic that touches every family (histograms contribute _bucket/_sum/_count).
std::set<std::string> ExportedNames() {
  ServerMetrics metrics("m");
  metrics.OnRequestAdmitted(0.1, 3);
  metrics.OnFirstToken(0.1);
  metrics.OnTokensGenerated(2);
  metrics.ObserveInterTokenLatency(0.01);
  metrics.OnRequestFinished(absl::StatusCode::kOk, 0.2);
  metrics.OnPreemption();
  metrics.SetKvBlocks(1, 2);
  metrics.OnPrefillCompressed({1, 2}, 3, 0.001);
  auto server = MetricsHttpServer::Start({}, [&] { return metrics.RenderText(); });
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return {};
  auto resp = testing::HttpGet((*server)->port(), "/metrics");
  EXPECT_TRUE(resp && resp->status == 200);
  if (!resp) return {};
  std::set<std::string> names;
  for (const auto& s : testing::ParsePrometheusText(resp->body).samples) names.insert(s.name);
  return names;
}

// dropkv_* identifiers in a text (PromQL inside JSON or YAML).
std::set<std::string> ReferencedNames(const std::string& text) {
  std::set<std::string> names;
  static const std::regex kName("dropkv_[a-z0-9_]+");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), kName);
       it != std::sregex_iterator(); ++it) {
    names.insert(it->str());
  }
  return names;
}

std::vector<std::string> Unknown(const std::set<std::string>& referenced,
                                 const std::set<std::string>& exported) {
  std::vector<std::string> out;
  for (const auto& n : referenced) {
    if (!exported.count(n)) out.push_back(n);
  }
  return out;
}

TEST(DeployTest, ConfigMapAndImageConfigsLoadWithTheServerLoader) {
  YAML::Node cm = FindKind(Src("deploy/kubernetes/configmap.yaml"), "ConfigMap");
  auto config = ParseServerConfigYaml(cm["data"]["server.yaml"].as<std::string>(), "configmap");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(ValidateServerConfig(*config).ok()) << ValidateServerConfig(*config);
  EXPECT_EQ(config->host, "0.0.0.0");  // reachable from the Service
  auto image_config = ParseServerConfigYaml(ReadText(Src("docker/server.yaml")), "docker");
  ASSERT_TRUE(image_config.ok()) << image_config.status();
  EXPECT_TRUE(ValidateServerConfig(*image_config).ok());
  EXPECT_EQ(image_config->host, "0.0.0.0");
}

TEST(DeployTest, DeploymentMatchesTheConfig) {
  YAML::Node cm = FindKind(Src("deploy/kubernetes/configmap.yaml"), "ConfigMap");
  auto config = ParseServerConfigYaml(cm["data"]["server.yaml"].as<std::string>(), "configmap");
  ASSERT_TRUE(config.ok());
  YAML::Node dep = FindKind(Src("deploy/kubernetes/deployment.yaml"), "Deployment");
  YAML::Node pod = dep["spec"]["template"]["spec"];
  YAML::Node c = pod["containers"][0];
  std::map<std::string, int> ports;
  for (const auto& p : c["ports"])
    ports[p["name"].as<std::string>()] = p["containerPort"].as<int>();
  EXPECT_EQ(ports["grpc"], config->port);
  EXPECT_EQ(ports["metrics"], config->metrics_port);
  EXPECT_EQ(ports["http"], config->http_port);
  EXPECT_GT(config->http_port, 0);
  // gRPC health probes on the server's port.
  for (const char* probe : {"readinessProbe", "livenessProbe", "startupProbe"}) {
    ASSERT_TRUE(c[probe]["grpc"]) << probe << " is not a grpc probe";
    EXPECT_EQ(c[probe]["grpc"]["port"].as<int>(), config->port) << probe;
  }
  // Drain timing: preStop sleep + drain fit in the grace period; liveness outlasts the drain.
  YAML::Node pre = c["lifecycle"]["preStop"]["exec"]["command"];
  ASSERT_TRUE(pre && pre.size() == 2 && pre[0].as<std::string>() == "/bin/sleep");
  const double pre_stop_seconds = pre[1].as<double>();
  EXPECT_GT(pod["terminationGracePeriodSeconds"].as<double>(),
            pre_stop_seconds + config->shutdown_grace_seconds);
  EXPECT_GT(c["livenessProbe"]["periodSeconds"].as<double>() *
                c["livenessProbe"]["failureThreshold"].as<double>(),
            config->shutdown_grace_seconds);
  // One GPU, non-root, config mounted where args point.
  EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"].as<int>(), 1);
  EXPECT_TRUE(pod["securityContext"]["runAsNonRoot"].as<bool>());
  EXPECT_NE(pod["securityContext"]["runAsUser"].as<int>(), 0);
  std::string args;
  for (const auto& a : c["args"]) args += a.as<std::string>() + " ";
  EXPECT_THAT(args, HasSubstr("--config /etc/dropkv/server.yaml"));
  bool config_mounted = false;
  for (const auto& m : c["volumeMounts"]) {
    config_mounted |= m["mountPath"].as<std::string>() == "/etc/dropkv";
  }
  EXPECT_TRUE(config_mounted);
}

TEST(DeployTest, ServicesAndServiceMonitorAgree) {
  YAML::Node svc = FindKind(Src("deploy/kubernetes/service.yaml"), "Service", "dropkv-server");
  YAML::Node headless =
      FindKind(Src("deploy/kubernetes/service.yaml"), "Service", "dropkv-server-headless");
  EXPECT_EQ(headless["spec"]["clusterIP"].as<std::string>(), "None");
  std::set<std::string> port_names;
  for (const auto& p : svc["spec"]["ports"]) port_names.insert(p["name"].as<std::string>());
  YAML::Node sm = FindKind(Src("deploy/kubernetes/servicemonitor.yaml"), "ServiceMonitor");
  for (const auto& e : sm["spec"]["endpoints"]) {
    EXPECT_TRUE(port_names.count(e["port"].as<std::string>())) << e["port"].as<std::string>();
  }
  // Selectors pick the Deployment's Pods.
  YAML::Node dep = FindKind(Src("deploy/kubernetes/deployment.yaml"), "Deployment");
  auto pod_labels = dep["spec"]["template"]["metadata"]["labels"];
  for (const auto& kv : svc["spec"]["selector"]) {
    EXPECT_EQ(pod_labels[kv.first.as<std::string>()].as<std::string>(),
              kv.second.as<std::string>());
  }
  // kustomization lists files that exist.
  YAML::Node k = LoadAll(Src("deploy/kubernetes/kustomization.yaml")).at(0);
  for (const auto& r : k["resources"]) {
    EXPECT_TRUE(fs::exists(Src("deploy/kubernetes/" + r.as<std::string>()))) << r.as<std::string>();
  }
}

// The tensor-parallel overlays: they patch the base Deployment's container, ask for as many GPUs
// as ranks through a setting the server reads (its environment variable and range), and give
// NCCL a memory-backed /dev/shm.
TEST(DeployTest, TensorParallelOverlaysAskForOneGpuPerRank) {
  YAML::Node base = FindKind(Src("deploy/kubernetes/deployment.yaml"), "Deployment");
  for (int gpus : {2, 4}) {
    const std::string dir = "deploy/kubernetes-tensor-parallel/" + std::to_string(gpus) + "-gpus/";
    YAML::Node k = LoadAll(Src(dir + "kustomization.yaml")).at(0);
    ASSERT_EQ(k["resources"][0].as<std::string>(), "../../kubernetes") << dir;
    YAML::Node patch = FindKind(Src(dir + k["patches"][0]["path"].as<std::string>()), "Deployment");
    EXPECT_EQ(patch["metadata"]["name"].as<std::string>(),
              base["metadata"]["name"].as<std::string>());
    YAML::Node pod = patch["spec"]["template"]["spec"];
    YAML::Node c = pod["containers"][0];
    EXPECT_EQ(c["name"].as<std::string>(),
              base["spec"]["template"]["spec"]["containers"][0]["name"].as<std::string>());
    EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"].as<int>(), gpus) << dir;
    EXPECT_EQ(c["resources"]["requests"]["nvidia.com/gpu"].as<int>(), gpus) << dir;
    std::map<std::string, std::string> env;
    for (const auto& e : c["env"]) env[e["name"].as<std::string>()] = e["value"].as<std::string>();
    const std::string tp_env = ServerConfigEnvName("tensor_parallel_size");
    ASSERT_TRUE(env.count(tp_env)) << dir << " sets no " << tp_env;
    EXPECT_EQ(env[tp_env], std::to_string(gpus));
    auto config = ParseServerConfigYaml("tensor_parallel_size: " + env[tp_env], dir);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->tensor_parallel_size, gpus);
    bool shm = false;
    for (const auto& m : c["volumeMounts"]) shm |= m["mountPath"].as<std::string>() == "/dev/shm";
    EXPECT_TRUE(shm) << dir;
    bool memory_backed = false;
    for (const auto& v : pod["volumes"])
      memory_backed |= v["emptyDir"] && v["emptyDir"]["medium"].as<std::string>() == "Memory";
    EXPECT_TRUE(memory_backed) << dir;
  }
}

TEST(DeployTest, PrometheusRuleCarriesTheSameRulesAsThePlainFile) {
  YAML::Node plain = LoadAll(Src("deploy/prometheus/dropkv-alerts.yaml")).at(0);
  YAML::Node crd = FindKind(Src("deploy/kubernetes/prometheusrule.yaml"), "PrometheusRule");
  YAML::Emitter a, b;
  a << plain["groups"];
  b << crd["spec"]["groups"];
  EXPECT_EQ(std::string(a.c_str()), std::string(b.c_str()));
}

TEST(DeployTest, DashboardAlertsAndAutoscalerUseOnlyExportedMetrics) {
  const std::set<std::string> exported = ExportedNames();
  ASSERT_GE(exported.size(), 30u);  // 6 histograms x 3 + 12 counters/gauges
  // The checker itself catches a wrong name.
  EXPECT_EQ(Unknown(ReferencedNames("rate(dropkv_made_up_total[5m])"), exported),
            std::vector<std::string>{"dropkv_made_up_total"});

  auto dashboard = nlohmann::json::parse(ReadText(Src("deploy/grafana/dropkv-dashboard.json")));
  std::string exprs;
  for (const auto& panel : dashboard["panels"]) {
    for (const auto& t : panel["targets"]) exprs += t["expr"].get<std::string>() + "\n";
  }
  for (const auto& v : dashboard["templating"]["list"]) {
    if (v.contains("definition")) exprs += v["definition"].get<std::string>() + "\n";
  }
  std::set<std::string> dash_names = ReferencedNames(exprs);
  EXPECT_THAT(Unknown(dash_names, exported), ::testing::IsEmpty()) << "dashboard";
  // The dashboard shows TTFT, ITL, throughput, KV usage, evictions and the queue.
  for (const char* needed :
       {"dropkv_time_to_first_token_seconds_bucket", "dropkv_inter_token_latency_seconds_bucket",
        "dropkv_generation_tokens_total", "dropkv_kv_usage_ratio", "dropkv_kv_tokens_evicted_total",
        "dropkv_requests_waiting"}) {
    EXPECT_TRUE(dash_names.count(needed)) << "dashboard lacks " << needed;
  }

  for (const char* file :
       {"deploy/prometheus/dropkv-alerts.yaml", "deploy/kubernetes/prometheusrule.yaml",
        "deploy/kubernetes/hpa.yaml", "deploy/kubernetes/prometheus-adapter-rules.yaml"}) {
    std::set<std::string> names = ReferencedNames(ReadText(Src(file)));
    EXPECT_FALSE(names.empty()) << file;
    EXPECT_THAT(Unknown(names, exported), ::testing::IsEmpty()) << file;
  }
}

TEST(DeployTest, ComposeWiresServerPrometheusAndGrafana) {
  YAML::Node compose = LoadAll(Src("docker/docker-compose.yaml")).at(0);
  for (const char* s : {"dropkv", "prometheus", "grafana"}) {
    ASSERT_TRUE(compose["services"][s]) << s;
    // Pinned images only.
    if (compose["services"][s]["image"]) {
      std::string image = compose["services"][s]["image"].as<std::string>();
      EXPECT_EQ(image.find(":latest"), std::string::npos) << image;
      EXPECT_NE(image.find(':'), std::string::npos) << image;
    }
  }
  // Bind-mounted files exist (paths are relative to docker/).
  for (const char* s : {"prometheus", "grafana"}) {
    for (const auto& v : compose["services"][s]["volumes"]) {
      std::string spec = v.as<std::string>();
      if (spec.rfind("./", 0) != 0 && spec.rfind("../", 0) != 0) continue;  // named volume
      std::string host = spec.substr(0, spec.find(':'));
      EXPECT_TRUE(fs::exists(Src("docker") / host)) << s << ": " << host;
    }
  }
  // Prometheus scrapes the server's metrics port.
  YAML::Node prom = LoadAll(Src("docker/prometheus/prometheus.yml")).at(0);
  auto image_config = ParseServerConfigYaml(ReadText(Src("docker/server.yaml")), "docker");
  ASSERT_TRUE(image_config.ok());
  EXPECT_EQ(prom["scrape_configs"][0]["static_configs"][0]["targets"][0].as<std::string>(),
            "dropkv:" + std::to_string(image_config->metrics_port));
  // The compose file publishes every port the image's config serves.
  std::set<std::string> published;
  for (const auto& p : compose["services"]["dropkv"]["ports"])
    published.insert(p.as<std::string>());
  for (int port : {image_config->port, image_config->metrics_port, image_config->http_port}) {
    EXPECT_TRUE(published.count(std::to_string(port) + ":" + std::to_string(port))) << port;
  }
  // docker stop waits longer than the drain.
  std::string grace = compose["services"]["dropkv"]["stop_grace_period"].as<std::string>();
  EXPECT_GT(std::stod(grace), image_config->shutdown_grace_seconds);
}

}  // namespace
}  // namespace dropkv
