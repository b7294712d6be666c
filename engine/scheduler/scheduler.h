// Continuous batching (DESIGN.md decision 7). One engine thread owns the ModelRunner and
// calls Step() in a loop; server threads only Submit() requests and read their RequestChannel.
//
// One Step():
//   1. reap      - cancelled or past-deadline sequences leave (waiting or running); blocks return.
//   2. admit     - a running sequence whose client reads none of its output (channel paused)
//                  first gives its batch slot to a waiting request: held, without blocks, until
//                  its client reads again, then queued and recomputed like a preempted one. Then
//                  in queue order (higher `priority` first, FCFS within a priority) while the
//                  pool has room for the head's peak:
//                  its compression plan (engine/compression/plan.h: chunks, kept tokens per
//                  layer) + decode reserve, and the batch has a slot.
//   3. forward   - ONE forward (ModelRunner::Step) over a ragged batch: a decode row for every
//                  sequence whose prefill is done, then the next prompt chunk of prefilling
//                  sequences, oldest first, up to `max_prefill_tokens_per_step` prompt tokens
//                  (one chunk per sequence), so decode rows ride on the prefill's weight reads
//                  and no chunk stalls the running decodes by a forward of its own. The batch's
//                  blocks (decode rows, then each chunk's per its compression plan) are checked
//                  against the pool first: out of blocks, the last running sequence in that
//                  order (lowest priority, newest) goes back to waiting (recomputed later) and
//                  the batch is made again. Pure-decode steps keep
//                  CUDA graphs. A compressed prompt's chunks run in a forward of their own
//                  (its press selects among exact score ties: a shared GEMM's last-bit
//                  differences would change what it keeps under load). A failed forward changed
//                  nothing; its parts are retried alone so that only the failing sequence ends.
//   4. sample    - one token per decode row and per finished prompt; stop checks (EOS, stop
//                  ids, stop strings, max_new_tokens, context); one event per sequence pushed to
//                  its channel.
// Compressed conversations: a compressed request with keep_conversation leaves its runner
// sequence parked when it finishes (prompt + generated tokens, as compressed); a later such
// request whose prompt extends those tokens by at least the observation window takes it over and
// prefills only the rest, compressing at its end under its own budgets (docs/compression.md).
// Parked sequences are released, oldest first, before a request waits or a sequence is
// preempted for blocks, and by CancelAll.
// Prefix cache (allocator/prefix_cache.h, on unless a layer is a sliding-window ring): an
// uncompressed prompt starts from the longest cached prefix of whole blocks (at least one token
// is left to prefill, for the first token's logits) and prefills only the rest; its blocks are
// registered as each chunk commits and, with the generated tokens, when it finishes or is
// preempted. Cached blocks nobody holds count as free and are evicted LRU when a step needs them.
// A preempted sequence is recomputed by prefilling its prompt again and replaying its generated
// tokens through decode steps (teacher forcing), so its output is what it would have been.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "engine/scheduler/generation.h"

namespace dropkv::compression {
struct LayerProfile;
}

namespace dropkv {

class ModelRunner;
class Tokenizer;

struct SchedulerOptions {
  int32_t max_batch = 32;                       // running sequences (prefilling + decoding)
  int64_t max_prefill_tokens_per_step = 512;    // prompt tokens prefilled per Step()
  int32_t max_waiting_requests = 256;           // beyond: RESOURCE_EXHAUSTED at Submit()
  int64_t max_waiting_prompt_tokens = 1 << 20;  // beyond: RESOURCE_EXHAUSTED at Submit()
  int64_t decode_reserve_tokens = 16;           // per layer, capped by the request's max_new_tokens
  int64_t max_context_len = 0;                  // prompt + generated; 0 = unlimited
  std::vector<int32_t> eos_token_ids;
  int32_t num_layers = 0;                    // for usage (kv bytes saved)
  int64_t kv_bytes_per_token_per_layer = 0;  // K + V of one token of one layer, all KV heads
  // The server's MGA / MLMA layer profile (loaded once at start-up), for the compression plans.
  std::shared_ptr<const compression::LayerProfile> compression_profile;
  // Reuse the KV blocks of uncompressed prompts' prefixes (ignored when a layer is a ring).
  bool prefix_cache = true;
  std::string prefix_cache_salt;  // the model and its dtype: part of every cache key
};

struct KvBlockCounts {
  int64_t num_total = 0;
  int64_t num_free = 0;
};
// Reads the runner's block pool; called on the engine thread only.
using KvBlockCountsFn = std::function<KvBlockCounts()>;

struct SchedulerStats {
  int32_t num_waiting = 0;  // queued, and held while their client reads none of their output
  int32_t num_running = 0;
  int64_t num_waiting_prompt_tokens = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t num_preemptions = 0;
  int64_t num_finished = 0;
  int64_t num_rejected = 0;
  bool draining = false;
  // Decode steps that produced logits, the batch rows they ran, and their time on the engine
  // thread (the runner's Decode and the sampling), of which the runner's host work before the
  // step's kernels were queued (ModelRunner::last_decode_host_times: prepare + fill + upload +
  // launch; the device waits for it; 0 where the runner does not measure it). Cumulative.
  int64_t num_decode_steps = 0;
  int64_t num_decode_rows = 0;
  double decode_seconds = 0;
  double decode_host_seconds = 0;
  // Prefix cache (all zero without one): prompt tokens looked up at admission and found cached
  // (cumulative), blocks it pins now, entries it evicted (cumulative).
  bool prefix_cache_enabled = false;
  int64_t prefix_cache_query_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t prefix_cache_blocks = 0;
  int64_t prefix_cache_evicted_entries = 0;
  // Compressed conversations kept (keep_conversation): requests that continued one
  // (cumulative), and how many are parked now (their blocks count as used until released).
  int64_t num_conversation_hits = 0;
  int64_t num_parked_conversations = 0;
  // Compression during decode (cumulative): layers compacted, KV entries (token x layer) evicted.
  int64_t num_decode_evictions = 0;
  int64_t num_decode_evicted_entries = 0;
};

// What one Step() did (tests script iterations against it).
struct StepReport {
  int32_t num_reaped = 0;
  int32_t num_admitted = 0;
  int64_t num_prefill_tokens = 0;
  int64_t num_cached_prompt_tokens = 0;  // of the sequences admitted, found in the prefix cache
  int32_t num_decoded = 0;               // rows of the decode batch
  double decode_seconds = 0;             // the decode step's engine-thread time (SchedulerStats)
  double decode_host_seconds = 0;        // of which the runner's host work before its kernels
  int32_t num_preempted = 0;
  int32_t num_finished = 0;
  int32_t num_running_after = 0;
  int32_t num_waiting_after = 0;
};

class Scheduler {
 public:
  // `tokenizer` may be null: then events carry no text and stop strings are not supported.
  Scheduler(ModelRunner& runner, const Tokenizer* tokenizer, KvBlockCountsFn kv_counts,
            SchedulerOptions options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Thread-safe. Queues the request (FCFS). RESOURCE_EXHAUSTED when the waiting queue is full (by
  // requests or prompt tokens), UNAVAILABLE while draining. On error nothing is queued and the
  // channel receives nothing.
  absl::Status Submit(GenerationRequest request, std::shared_ptr<RequestChannel> channel);

  // Engine thread only (or the test thread when no engine thread is started).
  StepReport Step();
  bool HasWork() const;  // a sequence held for its client (paused channel) is no work until resumed

  // Runs Step() on an own engine thread until Stop(). The runner must not be used elsewhere then.
  void Start();
  void Stop();  // finishes the current step, joins; unfinished requests stay where they are

  // Draining: Submit() answers UNAVAILABLE from now on.
  void BeginDrain();
  // Cancels every waiting and running request (each gets a final kCancelled event).
  void CancelAll();

  // Thread-safe snapshot (KV counts as of the end of the last step).
  SchedulerStats Stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dropkv
