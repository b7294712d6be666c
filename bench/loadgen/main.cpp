// dropkv-loadgen: load against a loopback dropkv-server (closed or open loop), latency and
// throughput report in Markdown or JSON, optional /metrics deltas, sweeps with a gnuplot PNG.
//   dropkv-loadgen --address 127.0.0.1:50051 --concurrency 8 --duration 30
//   dropkv-loadgen --address 127.0.0.1:50051 --rate 4 --concurrency 64 --duration 60 --json
//   dropkv-loadgen --address ... --sweep 1,2,4,8,16 --plot sweep.png --out-json sweep.json
//   dropkv-loadgen --address http://127.0.0.1:8000 --concurrency 8 --duration 30   (HTTP API)
//   dropkv-loadgen --address ... --turns 8 --turn-growth fixed:2048 --output-len fixed:128
//     (multi-turn chat: each prompt extends the previous prompt and answer; TTFT per turn)
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/loadgen/loadgen.h"

namespace {

using dropkv::loadgen::RunResult;

// Writes the data file and gnuplot script next to `png`, runs gnuplot. Offered load on x: the
// concurrency (closed loop) or the arrival rate (open loop).
bool Plot(const std::vector<RunResult>& results, const std::string& png, bool open_loop) {
  const std::string dat = png + ".dat", gp = png + ".gp";
  std::ofstream d(dat);
  d << "# load ttft_p50 ttft_p90 ttft_p99 e2e_p50 e2e_p99 itl_p99 req_per_s\n";
  for (const RunResult& r : results) {
    d << (open_loop ? r.options.rate : r.options.concurrency) << " " << r.ttft_ms.p50 << " "
      << r.ttft_ms.p90 << " " << r.ttft_ms.p99 << " " << r.e2e_ms.p50 << " " << r.e2e_ms.p99 << " "
      << r.itl_ms.p99 << " " << r.requests_per_s() << "\n";
  }
  d.close();
  std::ofstream g(gp);
  g << "set terminal pngcairo size 900,560\nset output '" << png << "'\n"
    << "set title 'dropkv-server latency percentiles vs offered load'\n"
    << "set xlabel '" << (open_loop ? "offered rate (requests/s)" : "concurrency (streams)")
    << "'\nset ylabel 'latency (ms)'\nset logscale y\nset grid\nset key left top\n"
    << (open_loop ? "" : "set logscale x 2\n") << "plot '" << dat
    << "' u 1:2 w lp t 'TTFT p50', '' u 1:3 w lp t 'TTFT p90', "
    << "'' u 1:4 w lp t 'TTFT p99', '' u 1:5 w lp t 'E2E p50', '' u 1:6 w lp t 'E2E p99', "
    << "'' u 1:7 w lp t 'ITL p99'\n";
  g.close();
  const std::string cmd = absl::StrCat("gnuplot '", gp, "'");
  return std::system(cmd.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dropkv::loadgen;
  CLI::App app{
      "dropkv-loadgen: closed-loop (N streams) or open-loop (Poisson, --rate) load against a "
      "loopback dropkv-server. Reports TTFT, inter-token and end-to-end latency "
      "(p50/p90/p99/max), request and token throughput, errors by gRPC status and the server's "
      "/metrics deltas. Bounded: --duration (and --requests), every request has a deadline."};
  LoadOptions o;
  std::string prompt_spec = "uniform:16:128", output_spec = "fixed:32", growth_spec = "fixed:2048";
  std::vector<std::string> compression_specs;
  std::string metrics_url, out_json, out_md, plot_png, sweep;
  bool json = false, no_progress = false;
  app.add_option("--address", o.address,
                 "server HOST:PORT for gRPC, http://HOST:PORT for the OpenAI-compatible HTTP API "
                 "(loopback only)")
      ->required();
  app.add_option("--concurrency", o.concurrency,
                 "closed loop: concurrent streams; open loop: most requests in flight")
      ->capture_default_str();
  app.add_option("--duration", o.duration_s, "measured seconds (after --warmup), <= 3600")
      ->capture_default_str();
  app.add_option("--rate", o.rate, "open loop: Poisson arrivals per second (0 = closed loop)");
  app.add_option("--warmup", o.warmup_s, "seconds of load before measuring")->capture_default_str();
  app.add_option("--requests", o.max_requests, "stop after this many measured requests (0 = none)");
  app.add_flag("--steady", o.steady,
               "measure inside the window: tokens streamed in it, requests completing in it; "
               "cancel what is in flight when it closes (long requests at high concurrency)");
  app.add_option("--timeout", o.request_timeout_s, "per-request deadline, seconds")
      ->capture_default_str();
  app.add_option("--prompt-len", prompt_spec, "fixed:N | uniform:A:B | file:PATH")
      ->capture_default_str();
  app.add_option("--output-len", output_spec, "fixed:N | uniform:A:B | file:PATH (ignore_eos)")
      ->capture_default_str();
  app.add_option("--turns", o.num_turns,
                 "closed loop: conversations of N turns per stream; turn k's prompt = turn k-1's "
                 "prompt + its streamed answer + --turn-growth new tokens (a prefix cache's load)")
      ->capture_default_str();
  app.add_option("--turn-growth", growth_spec,
                 "with --turns: new user tokens per turn, fixed:N | uniform:A:B | file:PATH")
      ->capture_default_str();
  app.add_option("--compression", compression_specs,
                 "METHOD[:KEEP_RATIO], repeatable: a mix drawn per request (default: server's)");
  app.add_option("--seed", o.seed, "seed of lengths, tokens and arrivals")->capture_default_str();
  app.add_option("--metrics-url", metrics_url, "http://127.0.0.1:PORT/metrics: report deltas");
  app.add_option("--sweep", sweep,
                 "comma list: concurrencies (closed loop) or rates (with --rate), one run each");
  app.add_option("--plot", plot_png, "with --sweep: PNG of latency percentiles vs offered load");
  app.add_flag("--json", json, "print JSON on stdout instead of Markdown");
  app.add_option("--out-json", out_json, "also write the JSON report here");
  app.add_option("--out-md", out_md, "also write the Markdown report here");
  app.add_flag("--no-progress", no_progress, "no progress line on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.progress = !no_progress;
  auto fail = [](const std::string& msg) {
    std::cerr << "dropkv-loadgen: " << msg << "\n";
    return 2;
  };
  if (!IsLoopbackAddress(o.address))
    return fail(
        absl::StrCat("--address '", o.address,
                     "' is not a loopback address; dropkv-loadgen only loads local servers"));
  auto prompt = ParseLengthDist(prompt_spec, "--prompt-len");
  if (!prompt.ok()) return fail(std::string(prompt.status().message()));
  auto output = ParseLengthDist(output_spec, "--output-len");
  if (!output.ok()) return fail(std::string(output.status().message()));
  o.prompt_len = *prompt;
  o.output_len = *output;
  auto growth = ParseLengthDist(growth_spec, "--turn-growth");
  if (!growth.ok()) return fail(std::string(growth.status().message()));
  o.turn_growth = *growth;
  for (const auto& spec : compression_specs) {
    auto c = ParseCompressionChoice(spec);
    if (!c.ok()) return fail(std::string(c.status().message()));
    o.compression.push_back(*c);
  }
  std::vector<double> points;
  if (!sweep.empty()) {
    for (auto part : absl::StrSplit(sweep, ',')) {
      double v = 0;
      if (!absl::SimpleAtod(part, &v) || v <= 0)
        return fail(absl::StrCat("--sweep: '", part, "' is not a positive number"));
      points.push_back(v);
    }
    if (points.size() > 32) return fail("--sweep: at most 32 points");
  }
  if (!plot_png.empty() && points.empty()) return fail("--plot needs --sweep");
  const bool open_loop = o.rate > 0;
  if (points.empty()) points.push_back(open_loop ? o.rate : o.concurrency);

  std::vector<RunResult> results;
  for (double p : points) {
    LoadOptions run = o;
    if (open_loop)
      run.rate = p;
    else
      run.concurrency = static_cast<int>(p);
    std::map<std::string, double> before;
    if (!metrics_url.empty()) {
      auto m = FetchMetrics(metrics_url);
      if (!m.ok()) return fail(std::string(m.status().message()));
      before = *m;
    }
    if (points.size() > 1)
      std::cerr << "== " << (open_loop ? "rate " : "concurrency ") << p << "\n";
    auto r = RunLoad(run);
    if (!r.ok()) return fail(std::string(r.status().message()));
    if (!metrics_url.empty()) {
      auto m = FetchMetrics(metrics_url);
      if (!m.ok()) return fail(std::string(m.status().message()));
      r->metrics_delta = MetricDeltas(before, *m);
    }
    results.push_back(std::move(*r));
  }

  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : results) j.push_back(ResultToJson(r));
  if (results.size() == 1) j = j[0];
  std::string md = ResultsToMarkdown(results);
  if (const std::string turns = TurnsToMarkdown(results); !turns.empty())
    md += "\nPer turn (turn k's prompt extends turn k-1's prompt and answer):\n\n" + turns;
  if (!metrics_url.empty()) {
    md += "\nServer /metrics deltas:\n\n| run | sample | delta |\n|---:|---|---:|\n";
    for (size_t i = 0; i < results.size(); ++i)
      for (const auto& [k, v] : results[i].metrics_delta)
        md += absl::StrCat("| ", i + 1, " | `", k, "` | ", v, " |\n");
  }
  if (json)
    std::cout << j.dump(2) << "\n";
  else
    std::cout << md;
  if (!out_json.empty()) std::ofstream(out_json) << j.dump(2) << "\n";
  if (!out_md.empty()) std::ofstream(out_md) << md;
  if (!plot_png.empty() && !Plot(results, plot_png, open_loop))
    return fail(absl::StrCat("gnuplot failed to write ", plot_png));
  return 0;
}
