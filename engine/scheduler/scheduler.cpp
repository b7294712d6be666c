#include "engine/scheduler/scheduler.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <list>
#include <optional>
#include <random>
#include <utility>

#include <ATen/ATen.h>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "allocator/prefix_cache.h"
#include "engine/common/status_macros.h"
#include "engine/compression/plan.h"
#include "engine/runner/model_runner.h"
#include "engine/sampling/sampler.h"
#include "engine/tokenizer/tokenizer.h"

namespace dropkv {
namespace {

using Clock = std::chrono::steady_clock;

double MsBetween(SteadyTime a, SteadyTime b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// U+FFFD at the end means the tokenizer decoded an incomplete UTF-8 sequence: hold it back.
bool EndsWithReplacementChar(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

}  // namespace

// One request inside the engine.
struct Sequence {
  SequenceId seq_id = -1;  // the runner's id of the current admission (new after a preemption)
  GenerationRequest request;
  std::shared_ptr<RequestChannel> channel;
  // Order of first admission (kept across preemptions): larger = newer; preemption picks the
  // largest, so a recomputed sequence never becomes the next victim again and the oldest ones
  // always make progress.
  int64_t admission_idx = -1;
  int64_t num_prefilled = 0;  // prompt tokens in the cache
  bool prefill_done = false;
  // How far the prefix cache registered this admission's blocks.
  PrefixCache::Cursor cache_cursor;
  std::vector<int32_t> generated;
  int64_t num_generated_fed = 0;  // generated tokens in the cache (the rest are replayed)
  // The prefill's chunks, what they take from the pool and the settings the runner sees; made
  // when the sequence heads the queue (again after a preemption: the replay needs decode room).
  std::optional<compression::CompressionPlan> plan;
  size_t num_chunks_done = 0;
  // The plan's choice to split a long compressed prompt, kept across preemptions: a request sees
  // the same chunks whatever the load.
  std::optional<bool> split_long_prompt;
  std::unique_ptr<SamplerState> sampler;  // RNG + history; survives preemption
  // Output state.
  size_t num_tokens_sent = 0;
  // The generated text so far, decoded token by token (the decoder holds back an incomplete
  // character); decoding the whole output at every step would cost O(n^2) per request.
  std::unique_ptr<IncrementalDecoder> decoder;
  std::string text;
  size_t num_chars_sent = 0;  // of `text`
  bool text_closed = false;   // a stop string matched: nothing after it is ever sent
  std::vector<TokenLogprobInfo> pending_logprobs;
  GenerationSummary summary;
  bool admitted_once = false;
  bool first_token_seen = false;
  SteadyTime admit_time, first_token_time;
};

// A finished compressed conversation (keep_conversation) whose runner sequence stays, for a later
// request whose prompt extends `tokens`; released least recently parked first when blocks are
// needed.
struct ParkedConversation {
  SequenceId seq_id = -1;
  std::vector<int32_t> tokens;            // what its cache represents: prompt + generated fed
  std::vector<int64_t> stored_per_layer;  // entries of each global (unbounded) layer
  int64_t num_blocks = 0;
};

struct Scheduler::Impl {
  ModelRunner& runner;
  const Tokenizer* tokenizer;
  KvBlockCountsFn kv_counts;
  SchedulerOptions options;

  mutable std::mutex mu;  // guards waiting, stats, draining; running is engine-thread only
  std::condition_variable work_cv;
  std::deque<std::unique_ptr<Sequence>> waiting;
  int64_t num_waiting_prompt_tokens = 0;
  SchedulerStats stats;
  bool draining = false;
  bool cancel_all = false;

  std::vector<std::unique_ptr<Sequence>> running;  // in admission order
  // Preempted for a waiting request while their client read none of their output (channel
  // paused); they wait again once it reads. Engine thread only.
  std::deque<std::unique_ptr<Sequence>> held;
  int64_t next_seq_id = 1;
  int64_t next_admission_idx = 0;

  std::thread engine_thread;
  std::atomic<bool> stop{false};

  std::unique_ptr<PrefixCache> prefix_cache;  // null: off
  std::list<ParkedConversation> parked;       // oldest first (least recently used)
  int64_t num_conversation_hits = 0;
  bool can_fork = false;  // parked conversations can be shared (no ring layers)

  Impl(ModelRunner& r, const Tokenizer* t, KvBlockCountsFn k, SchedulerOptions o)
      : runner(r), tokenizer(t), kv_counts(std::move(k)), options(std::move(o)) {
    BlockPool& pool = runner.pool();
    bool rings = false;
    for (int32_t l = 0; l < pool.num_layers(); ++l) rings = rings || pool.capacity(l) > 0;
    // A sliding-window layer rewrites its ring's blocks in place: nothing there can be shared.
    if (options.prefix_cache && !rings)
      prefix_cache = std::make_unique<PrefixCache>(pool, options.prefix_cache_salt);
    can_fork = !rings;
  }

  // The tokens whose K/V `seq`'s cache holds: its prompt chunks so far, or the prompt and the
  // generated tokens fed back (the last sampled one never is).
  static std::vector<int32_t> TokensInCache(const Sequence& seq) {
    const std::vector<int32_t>& prompt = seq.request.prompt_ids;
    if (!seq.prefill_done) return {prompt.begin(), prompt.begin() + seq.num_prefilled};
    std::vector<int32_t> tokens = prompt;
    tokens.insert(tokens.end(), seq.generated.begin(),
                  seq.generated.begin() + seq.num_generated_fed);
    return tokens;
  }

  static bool KeepsConversation(const Sequence& seq) {
    return seq.request.keep_conversation && seq.request.compression.method != ScoreMethod::kNone;
  }

  // A compressed request that asked to keep its conversation leaves its sequence parked.
  void ParkOrRelease(Sequence& seq) {
    if (!KeepsConversation(seq) || !seq.prefill_done) {
      ReleaseSequence(seq);
      return;
    }
    ParkedConversation p;
    p.seq_id = seq.seq_id;
    p.tokens = TokensInCache(seq);
    const SequenceCacheInfo info = runner.CacheInfo(seq.seq_id);
    for (size_t l = 0; l < info.stored_len_per_layer.size(); ++l) {
      if (runner.pool().capacity(static_cast<int32_t>(l)) == 0)
        p.stored_per_layer.push_back(info.stored_len_per_layer[l]);
    }
    p.num_blocks = info.num_blocks;
    parked.push_back(std::move(p));
  }

  // Releases the least recently parked conversation other than `keep`; false when none.
  bool ReleaseOldestParked(std::list<ParkedConversation>::iterator keep) {
    for (auto it = parked.begin(); it != parked.end(); ++it) {
      if (it == keep) continue;
      runner.Release(it->seq_id);
      parked.erase(it);
      return true;
    }
    return false;
  }

  // The parked conversation `seq` continues: the longest one whose tokens its prompt extends by
  // at least the observation window (the new part's last W queries score the whole cache). A
  // request that keeps its own conversation takes the parked one over; a compressed request that
  // does not reads a fork of it (ModelRunner::ForkSequence), leaving it parked for others (a
  // document compressed once for many questions).
  std::list<ParkedConversation>::iterator FindConversation(const Sequence& seq) {
    auto best = parked.end();
    const std::vector<int32_t>& prompt = seq.request.prompt_ids;
    if (seq.request.compression.method == ScoreMethod::kNone || !seq.generated.empty() ||
        WantsPromptLogprobs(seq))
      return best;
    if (!KeepsConversation(seq) && !can_fork) return best;
    for (auto it = parked.begin(); it != parked.end(); ++it) {
      const auto n = static_cast<int64_t>(it->tokens.size());
      if (static_cast<int64_t>(prompt.size()) - n < std::max(1, seq.request.compression.window) ||
          !std::equal(it->tokens.begin(), it->tokens.end(), prompt.begin()))
        continue;
      if (best == parked.end() || n > static_cast<int64_t>(best->tokens.size())) best = it;
    }
    return best;
  }

  // The prompt's logprobs are still to be computed: every chunk from position 0 scores its
  // tokens, so neither a cached prefix nor a parked conversation may stand in for a part of it.
  static bool WantsPromptLogprobs(const Sequence& seq) {
    return seq.request.sampling.return_prompt_logprobs && seq.generated.empty();
  }

  bool UsesPrefixCache(const Sequence& seq) const {
    return prefix_cache != nullptr && seq.request.compression.method == ScoreMethod::kNone;
  }

  // Registers what `seq` holds with the prefix cache, then releases it.
  void ReleaseSequence(Sequence& seq) {
    if (UsesPrefixCache(seq) && seq.seq_id >= 0)
      prefix_cache->Insert(seq.seq_id, TokensInCache(seq), seq.cache_cursor);
    seq.summary.num_decode_evicted_kv_tokens += runner.CacheInfo(seq.seq_id).decode_evicted_entries;
    runner.Release(seq.seq_id);
  }

  // --- finishing -----------------------------------------------------------------------------
  void Finish(Sequence& seq, FinishReason reason, absl::Status error = absl::OkStatus()) {
    GenerationEvent event;
    EmitPending(seq, event, /*final=*/true);
    event.finished = true;
    event.finish_reason = reason;
    event.error = std::move(error);
    seq.summary.num_prompt_tokens = static_cast<int32_t>(seq.request.prompt_ids.size());
    seq.summary.num_completion_tokens = static_cast<int32_t>(seq.generated.size());
    const SteadyTime now = Clock::now();
    if (seq.first_token_seen) seq.summary.decode_ms = MsBetween(seq.first_token_time, now);
    event.summary = seq.summary;
    // (ReleaseSequence adds the runner's count to seq.summary after this, for a preemption.)
    event.summary.num_decode_evicted_kv_tokens +=
        runner.CacheInfo(seq.seq_id).decode_evicted_entries;
    seq.channel->Push(std::move(event));
  }

  // Moves the tokens / text not yet sent into `event`. Text is held back while it ends in an
  // incomplete UTF-8 character or in a prefix of a stop string (unless `final`).
  void EmitPending(Sequence& seq, GenerationEvent& event, bool final) {
    event.token_ids.assign(seq.generated.begin() + seq.num_tokens_sent, seq.generated.end());
    seq.num_tokens_sent = seq.generated.size();
    event.logprobs = std::move(seq.pending_logprobs);
    seq.pending_logprobs.clear();
    if (tokenizer == nullptr || seq.text_closed) return;
    if (final && seq.decoder) seq.text += seq.decoder->Flush();
    const std::string& text = seq.text;
    size_t safe_len = text.size();
    if (!final) {
      if (EndsWithReplacementChar(text)) safe_len -= 3;
      // Longest suffix of text[0, safe_len) that is a proper prefix of a stop string.
      for (const std::string& stop : seq.request.sampling.stop_strings) {
        for (size_t k = std::min(stop.size() - 1, safe_len); k > 0; --k) {
          if (text.compare(safe_len - k, k, stop, 0, k) == 0) {
            safe_len -= k;
            break;
          }
        }
      }
    }
    if (safe_len > seq.num_chars_sent) {
      event.text = text.substr(seq.num_chars_sent, safe_len - seq.num_chars_sent);
      seq.num_chars_sent = safe_len;
    }
  }

  // After a new token: returns the finish reason, or kNone to go on. Truncates at a stop string.
  FinishReason CheckStop(Sequence& seq) {
    const SamplingParams& p = seq.request.sampling;
    // EOS (unless ignore_eos), stop token ids, max_new_tokens: engine/sampling's rules.
    const FinishReason by_token =
        dropkv::CheckStop(*seq.sampler, seq.generated.back(), options.eos_token_ids);
    if (by_token == FinishReason::kStop) return by_token;
    const bool below_min = static_cast<int32_t>(seq.generated.size()) < p.min_tokens;
    if (!p.stop_strings.empty() && tokenizer != nullptr && !below_min) {
      const std::string& text = seq.text;
      size_t cut = std::string::npos;
      for (const std::string& stop : p.stop_strings) {
        // Only text after what was already sent can hold a new match.
        const size_t from = seq.num_chars_sent > stop.size() ? seq.num_chars_sent - stop.size() : 0;
        const size_t at = text.find(stop, from);
        if (at != std::string::npos) cut = std::min(cut, at);
      }
      if (cut != std::string::npos) {
        // Send the text before the stop string now; nothing after it is ever sent.
        GenerationEvent event;
        event.token_ids.assign(seq.generated.begin() + seq.num_tokens_sent, seq.generated.end());
        seq.num_tokens_sent = seq.generated.size();
        event.logprobs = std::move(seq.pending_logprobs);
        seq.pending_logprobs.clear();
        if (cut > seq.num_chars_sent)
          event.text = text.substr(seq.num_chars_sent, cut - seq.num_chars_sent);
        seq.num_chars_sent = text.size();
        seq.text_closed = true;  // suppress the rest at Finish
        if (!event.token_ids.empty() || !event.text.empty()) seq.channel->Push(std::move(event));
        return FinishReason::kStop;
      }
    }
    if (static_cast<int32_t>(seq.generated.size()) >= p.max_new_tokens)
      return FinishReason::kLength;
    if (options.max_context_len > 0 &&
        static_cast<int64_t>(seq.request.prompt_ids.size() + seq.generated.size()) >=
            options.max_context_len)
      return FinishReason::kLength;
    return FinishReason::kNone;
  }

  // Samples one token per sequence from `logits` [n, vocab] (row i belongs to seqs[i]) with
  // engine/sampling, then handles each outcome. Returns the sequences that finished.
  std::vector<Sequence*> SampleAndEmit(const at::Tensor& logits,
                                       const std::vector<Sequence*>& seqs) {
    std::vector<SamplerState*> states;
    for (Sequence* seq : seqs) states.push_back(seq->sampler.get());
    auto sampled_or = Sampler::Sample(logits, states);
    std::vector<Sequence*> finished;
    if (!sampled_or.ok()) {
      for (Sequence* seq : seqs) {
        Finish(*seq, FinishReason::kError, sampled_or.status());
        finished.push_back(seq);
      }
      return finished;
    }
    for (size_t i = 0; i < seqs.size(); ++i)
      if (OnToken(*seqs[i], (*sampled_or)[i])) finished.push_back(seqs[i]);
    return finished;
  }

  // Records a sampled token, checks the stop rules and sends the delta. True when finished.
  bool OnToken(Sequence& seq, const SampledToken& sampled) {
    seq.generated.push_back(sampled.token_id);
    if (tokenizer != nullptr) {
      if (!seq.decoder)
        seq.decoder =
            std::make_unique<IncrementalDecoder>(*tokenizer, /*skip_special_tokens=*/true);
      seq.text += seq.decoder->Push(sampled.token_id);
    }
    if (seq.request.sampling.return_logprobs || seq.request.sampling.num_top_logprobs > 0) {
      TokenLogprobInfo info;
      info.token_id = sampled.token_id;
      info.logprob = sampled.logprob;
      for (const auto& [id, lp] : sampled.top_logprobs) info.top.push_back({id, lp});
      seq.pending_logprobs.push_back(std::move(info));
    }
    const SteadyTime now = Clock::now();
    if (!seq.first_token_seen) {
      seq.first_token_seen = true;
      seq.first_token_time = now;
      seq.summary.ttft_ms = MsBetween(seq.request.arrival_time, now);
    }
    const FinishReason reason = CheckStop(seq);
    if (reason != FinishReason::kNone) {
      Finish(seq, reason);
      return true;
    }
    GenerationEvent event;
    EmitPending(seq, event, /*final=*/false);
    seq.channel->Push(std::move(event));
    return false;
  }

  // Sends the prompt's logprobs (before the first token's event); on failure finishes `seq`
  // with the error and returns false.
  bool SendPromptLogprobs(Sequence& seq) {
    absl::StatusOr<PromptLogprobs> got = runner.TakePromptLogprobs(seq.seq_id);
    const size_t want = seq.request.prompt_ids.size() - 1;
    if (got.ok() && got->logprobs.size() != want)
      got = absl::InternalError(absl::StrCat("prompt logprobs: ", got->logprobs.size(),
                                             " for a prompt of ", want + 1, " tokens"));
    if (!got.ok()) {
      Finish(seq, FinishReason::kError, got.status());
      return false;
    }
    GenerationEvent event;
    event.prompt_logprobs.resize(want);
    for (size_t i = 0; i < want; ++i) {
      TokenLogprobInfo& info = event.prompt_logprobs[i];
      info.token_id = seq.request.prompt_ids[i + 1];
      info.logprob = got->logprobs[i];
      for (const auto& [id, lp] : got->top_logprobs[i]) info.top.push_back({id, lp});
    }
    seq.channel->Push(std::move(event));
    return true;
  }

  void RecordPrefillDone(Sequence& seq) {
    seq.prefill_done = true;
    seq.summary.prefill_ms = MsBetween(seq.admit_time, Clock::now());
    if (seq.generated.empty()) {
      const SequenceCacheInfo info = runner.CacheInfo(seq.seq_id);
      seq.summary.kv_tokens_kept_per_layer = info.stored_len_per_layer;
      if (seq.request.compression.method != ScoreMethod::kNone)
        seq.summary.scoring_ms = info.compression_seconds * 1e3;
      int64_t kept = 0;
      for (int64_t n : info.stored_len_per_layer) kept += n;
      seq.summary.num_kv_tokens_kept = kept;
      const int64_t full = static_cast<int64_t>(info.stored_len_per_layer.size()) *
                           static_cast<int64_t>(seq.request.prompt_ids.size());
      seq.summary.kv_bytes_saved =
          std::max<int64_t>(0, full - kept) * options.kv_bytes_per_token_per_layer;
    }
  }

  // --- queue order and preemption -------------------------------------------------------------
  // Where a sequence of `priority` joins the waiting queue: behind every sequence of higher
  // priority and, unless `ahead_of_equals`, of the same priority (FCFS within a priority).
  std::deque<std::unique_ptr<Sequence>>::iterator WaitingSlot(int32_t priority,
                                                              bool ahead_of_equals) {
    return std::find_if(waiting.begin(), waiting.end(), [&](const auto& s) {
      return ahead_of_equals ? s->request.priority <= priority : s->request.priority < priority;
    });
  }

  // The running sequence of lowest priority, the newest among them, of those `eligible` accepts.
  template <class Eligible>
  std::vector<std::unique_ptr<Sequence>>::iterator LastInOrder(Eligible eligible) {
    auto last = running.end();
    for (auto it = running.begin(); it != running.end(); ++it) {
      if (!eligible(**it)) continue;
      if (last == running.end() || (*it)->request.priority < (*last)->request.priority ||
          ((*it)->request.priority == (*last)->request.priority &&
           (*it)->admission_idx > (*last)->admission_idx))
        last = it;
    }
    return last;
  }

  // Releases the running sequence of lowest priority, the newest among them, and puts it back at
  // the head of its priority in the waiting queue (it was admitted before those).
  void PreemptLastInOrder(StepReport& report) {
    std::unique_ptr<Sequence> seq =
        Unadmit(LastInOrder([](const Sequence&) { return true; }), report);
    std::lock_guard<std::mutex> lock(mu);
    num_waiting_prompt_tokens += static_cast<int64_t>(seq->request.prompt_ids.size());
    const int32_t priority = seq->request.priority;
    waiting.insert(WaitingSlot(priority, /*ahead_of_equals=*/true), std::move(seq));
  }

  // Takes a running sequence out for a recompute later: its blocks return (its prompt stays
  // cached unless evicted), its generated tokens stay to be replayed.
  std::unique_ptr<Sequence> Unadmit(std::vector<std::unique_ptr<Sequence>>::iterator it,
                                    StepReport& report) {
    std::unique_ptr<Sequence> seq = std::move(*it);
    running.erase(it);
    ReleaseSequence(*seq);  // its prompt stays cached for the recompute, unless evicted
    seq->seq_id = -1;
    seq->num_prefilled = 0;
    seq->cache_cursor = {};
    seq->plan.reset();  // the replay needs decode room: planned again at admission
    seq->prefill_done = false;
    seq->num_generated_fed = 0;
    ++seq->summary.num_preemptions;
    ++report.num_preempted;
    std::lock_guard<std::mutex> lock(mu);
    ++stats.num_preemptions;
    return seq;
  }

  // A sequence whose client reads none of its output gives its slot to a waiting request (the
  // slot would only fill buffers); one whose client reads again, or left, waits anew in its place.
  void HoldUnread(StepReport& report) {
    size_t num_waiting = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = held.begin(); it != held.end();) {
        if ((*it)->channel->paused() && !(*it)->channel->cancelled()) {
          ++it;
          continue;
        }
        num_waiting_prompt_tokens += static_cast<int64_t>((*it)->request.prompt_ids.size());
        const int32_t priority = (*it)->request.priority;
        waiting.insert(WaitingSlot(priority, /*ahead_of_equals=*/true), std::move(*it));
        it = held.erase(it);
      }
      for (const auto& seq : waiting) num_waiting += seq->channel->paused() ? 0 : 1;
    }
    for (; num_waiting > 0 && static_cast<int32_t>(running.size()) >= options.max_batch;
         --num_waiting) {
      auto unread = LastInOrder([](const Sequence& seq) { return seq.channel->paused(); });
      if (unread == running.end()) break;
      held.push_back(Unadmit(unread, report));
    }
  }

  // Held sequences whose client reads again or left: the engine has work.
  bool HeldReady() const {
    return std::any_of(held.begin(), held.end(), [](const auto& seq) {
      return !seq->channel->paused() || seq->channel->cancelled();
    });
  }

  // --- the step ------------------------------------------------------------------------------
  void Reap(StepReport& report) {
    const SteadyTime now = Clock::now();
    auto past_deadline = [&](const Sequence& s) {
      return s.request.deadline && *s.request.deadline <= now;
    };
    bool cancel_everyone = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      cancel_everyone = std::exchange(cancel_all, false);
    }
    auto expired = [&](const Sequence& s) {
      return cancel_everyone || s.channel->cancelled() || past_deadline(s);
    };
    std::vector<std::unique_ptr<Sequence>> gone;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = waiting.begin(); it != waiting.end();) {
        if (expired(**it)) {
          num_waiting_prompt_tokens -= static_cast<int64_t>((*it)->request.prompt_ids.size());
          gone.push_back(std::move(*it));
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto it = running.begin(); it != running.end();) {
      if (expired(**it)) {
        ReleaseSequence(**it);
        gone.push_back(std::move(*it));
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = held.begin(); it != held.end();) {  // they hold no blocks
      if (expired(**it)) {
        gone.push_back(std::move(*it));
        it = held.erase(it);
      } else {
        ++it;
      }
    }
    if (cancel_everyone) {
      while (ReleaseOldestParked(parked.end())) {
      }
    }
    for (auto& seq : gone) {
      // A deadline that passed is recorded as such (logs, metrics), not as a client's cancel;
      // gRPC cancels a call at its deadline, so a cancelled channel past it is the deadline too.
      const bool deadline = !cancel_everyone && past_deadline(*seq);
      Finish(*seq, FinishReason::kCancelled,
             deadline ? absl::DeadlineExceededError("deadline exceeded") : absl::OkStatus());
    }
    report.num_reaped += static_cast<int32_t>(gone.size());
    report.num_finished += static_cast<int32_t>(gone.size());
  }

  void Admit(StepReport& report) {
    HoldUnread(report);
    const KvBlockCounts counts = kv_counts();
    // Blocks promised to admitted sequences whose prefill has not allocated them yet.
    int64_t num_promised = 0;
    for (const auto& seq : running) {
      if (seq->prefill_done || seq->seq_id < 0) {
        if (!seq->prefill_done) num_promised += seq->plan->blocks_needed();
        continue;
      }
      num_promised += std::max<int64_t>(
          0, seq->plan->blocks_needed() - runner.CacheInfo(seq->seq_id).num_blocks);
    }
    int64_t num_available = counts.num_free - num_promised;
    while (static_cast<int32_t>(running.size()) < options.max_batch) {
      std::unique_ptr<Sequence> seq;
      absl::Status seq_error = absl::OkStatus();
      PrefixMatch match;                 // the head's cached prefix (none without the cache)
      auto conversation = parked.end();  // the parked conversation the head continues
      {
        std::lock_guard<std::mutex> lock(mu);
        if (waiting.empty()) break;
        Sequence& head = *waiting.front();
        // Recompute covers the prompt; the replayed tokens are decode room it needs at once, on
        // top of the usual reserve for what is still to come.
        const int64_t num_replay = static_cast<int64_t>(head.generated.size());
        const int64_t reserve =
            num_replay +
            std::min<int64_t>(
                options.decode_reserve_tokens,
                std::max<int64_t>(0, head.request.sampling.max_new_tokens - num_replay));
        const int64_t prompt_len = static_cast<int64_t>(head.request.prompt_ids.size());
        // What the caches hold changes while the head waits: look again, plan again on change.
        conversation = FindConversation(head);
        if (conversation != parked.end()) {
          head.plan.reset();
        } else if (UsesPrefixCache(head) && prompt_len > 1 && !WantsPromptLogprobs(head)) {
          match = prefix_cache->Match(head.request.prompt_ids, prompt_len - 1);
          if (head.plan && head.plan->chunks().front().begin != match.num_tokens) head.plan.reset();
        }
        absl::Status planned = absl::OkStatus();
        if (!head.plan) {
          planned = conversation != parked.end()
                        ? MakePlan(head, counts.num_total, reserve,
                                   static_cast<int64_t>(conversation->tokens.size()),
                                   conversation->stored_per_layer)
                        : MakePlan(head, counts.num_total, reserve, match.num_tokens);
        }
        // Blocks the sequence holds from the start are not taken from the free list: a parked
        // conversation's, and the matched prefix's except those only the prefix cache held
        // (they counted as free).
        int64_t num_new_blocks = 0;
        if (planned.ok()) {
          num_new_blocks = head.plan->blocks_needed();
          if (conversation != parked.end()) {
            num_new_blocks -=
                KeepsConversation(head) ? conversation->num_blocks : SharedBlocksOf(*conversation);
          } else if (match.num_tokens > 0) {
            num_new_blocks -= match.num_blocks() - prefix_cache->ReclaimableBlocksOf(match);
          }
        }
        if (!planned.ok() || head.plan->blocks_needed() > counts.num_total) {
          seq = std::move(waiting.front());
          waiting.pop_front();
          num_waiting_prompt_tokens -= static_cast<int64_t>(seq->request.prompt_ids.size());
          seq_error =
              planned.ok()
                  ? absl::ResourceExhaustedError(absl::StrCat(
                        "request ", seq->request.request_id, " needs ", seq->plan->blocks_needed(),
                        " KV blocks; the pool has ", counts.num_total))
                  : planned;
        } else if (num_new_blocks > num_available) {
          // Parked conversations give their blocks back before the head waits.
          const int64_t before = kv_counts().num_free;
          if (!ReleaseOldestParked(conversation)) break;  // FCFS: nobody overtakes the head
          num_available += kv_counts().num_free - before;
          continue;
        } else {
          seq = std::move(waiting.front());
          waiting.pop_front();
          num_waiting_prompt_tokens -= static_cast<int64_t>(seq->request.prompt_ids.size());
          num_available -= num_new_blocks;
        }
      }
      if (seq_error.ok()) {
        if (conversation != parked.end()) {
          seq_error = ContinueConversation(*seq, conversation, report);
        } else {
          seq_error = StartFromPrefix(*seq, match, next_seq_id++, report);
        }
      }
      if (!seq_error.ok()) {
        Finish(*seq, FinishReason::kError, std::move(seq_error));
        ++report.num_finished;
        continue;
      }
      seq->admit_time = Clock::now();
      if (!seq->admitted_once) {
        seq->admitted_once = true;
        seq->admission_idx = next_admission_idx++;
        seq->summary.queue_ms = MsBetween(seq->request.arrival_time, seq->admit_time);
      }
      running.push_back(std::move(seq));
      ++report.num_admitted;
    }
  }

  // The blocks a fork of `c` shares instead of allocating: every layer's full ones.
  int64_t SharedBlocksOf(const ParkedConversation& c) const {
    int64_t n = 0;
    for (int64_t stored : c.stored_per_layer) n += stored / runner.pool().block_size();
    return n;
  }

  // An admitted sequence continues the parked conversation its prompt extends, whose cache holds
  // the conversation so far; the prefill goes on from its end. With keep_conversation it takes the
  // runner sequence over (it parks its own continuation later); without, it gets a fork (full
  // blocks shared, the partial ones copied) and the conversation stays parked, now most recent.
  absl::Status ContinueConversation(Sequence& seq,
                                    std::list<ParkedConversation>::iterator conversation,
                                    StepReport& report) {
    const auto num_cached = static_cast<int64_t>(conversation->tokens.size());
    if (KeepsConversation(seq)) {
      seq.seq_id = conversation->seq_id;
      parked.erase(conversation);
    } else {
      seq.seq_id = next_seq_id++;
      RETURN_IF_ERROR(runner.ForkSequence(conversation->seq_id, seq.seq_id));
      parked.splice(parked.end(), parked, conversation);
    }
    seq.num_prefilled = num_cached;
    seq.summary.num_cached_prompt_tokens = static_cast<int32_t>(num_cached);
    report.num_cached_prompt_tokens += num_cached;
    ++num_conversation_hits;
    return absl::OkStatus();
  }

  // Gives an admitted sequence its runner id and, on a prefix-cache hit, the cached blocks.
  absl::Status StartFromPrefix(Sequence& seq, const PrefixMatch& match, SequenceId seq_id,
                               StepReport& report) {
    seq.seq_id = seq_id;
    if (!UsesPrefixCache(seq)) return absl::OkStatus();
    const int64_t prompt_len = static_cast<int64_t>(seq.request.prompt_ids.size());
    prefix_cache->RecordLookup(prompt_len, match.num_tokens);
    seq.summary.num_cached_prompt_tokens = static_cast<int32_t>(match.num_tokens);
    if (match.num_tokens == 0) return absl::OkStatus();
    RETURN_IF_ERROR(runner.AdoptPrefix(
        seq_id, std::span(seq.request.prompt_ids.data(), match.num_tokens), match.layer_blocks));
    seq.num_prefilled = match.num_tokens;
    seq.cache_cursor = PrefixCache::CursorAfter(match);
    report.num_cached_prompt_tokens += match.num_tokens;
    return absl::OkStatus();
  }

  // The sequence's plan for `reserve` tokens of decode room (compression/plan.h: chunks, blocks),
  // its prompt's first `cached` tokens already in the cache (a continued conversation: its global
  // layers holding `cached_stored_per_layer` entries).
  absl::Status MakePlan(Sequence& seq, int64_t pool_blocks, int64_t reserve, int64_t cached,
                        std::vector<int64_t> cached_stored_per_layer = {}) const {
    compression::PlanOptions po;
    po.step_tokens = options.max_prefill_tokens_per_step;
    po.pool_blocks = pool_blocks;
    po.decode_reserve_tokens = reserve;
    po.cached_prefix_tokens = cached;
    po.cached_stored_per_layer = std::move(cached_stored_per_layer);
    po.split_long_prompt = seq.split_long_prompt;
    absl::StatusOr<compression::CompressionPlan> plan = compression::CompressionPlan::Create(
        seq.request.compression, static_cast<int64_t>(seq.request.prompt_ids.size()),
        runner.cache_geometry(), options.compression_profile.get(), po);
    if (!plan.ok()) return plan.status();
    seq.split_long_prompt = plan->split_long_prompt();
    seq.plan = std::move(*plan);
    seq.num_chunks_done = 0;
    return absl::OkStatus();
  }

  // --- the step's one forward ------------------------------------------------------------------
  // What one forward runs: a decode row for every running sequence whose prefill is done, and the
  // next chunk of prefilling ones, oldest first, up to the step's prompt-token budget (one chunk
  // per sequence).
  struct Batch {
    std::vector<Sequence*> decode;
    std::vector<Sequence*> prefill;
    size_t num_parts() const { return (decode.empty() ? 0 : 1) + prefill.size(); }
  };

  const compression::PlannedChunk& NextChunk(const Sequence& seq) const {
    return seq.plan->chunks()[seq.num_chunks_done];
  }

  // The step's batch, admitted against the pool before the forward: the decode rows' blocks
  // first, then each chunk's (its plan's count); when they do not fit, the last running sequence
  // in scheduling order (lowest priority, newest) goes back to waiting and the batch is made
  // again. A lone sequence runs anyway: its forward says
  // whether the pool holds it.
  Batch MakeBatch(StepReport& report) {
    while (true) {
      Batch batch;
      std::vector<SequenceId> ids;
      for (auto& seq : running) {
        if (!seq->prefill_done) continue;
        batch.decode.push_back(seq.get());
        ids.push_back(seq->seq_id);
      }
      int64_t num_free = kv_counts().num_free;
      if (!ids.empty()) {
        const int64_t needed = runner.BlocksToDecode(ids);
        if (needed > num_free && ReleaseOldestParked(parked.end())) continue;
        if (needed > num_free && running.size() > 1) {
          PreemptLastInOrder(report);
          continue;
        }
        num_free -= needed;
      }
      int64_t budget = options.max_prefill_tokens_per_step;
      bool preempted = false;
      for (auto& seq : running) {
        if (seq->prefill_done) continue;
        const compression::PlannedChunk& chunk = NextChunk(*seq);
        const int64_t len = chunk.end - chunk.begin;
        // A chunk larger than what is left of the budget waits for a step it is the first of.
        if (len > budget && !batch.prefill.empty()) break;
        if (chunk.new_blocks > num_free && ReleaseOldestParked(parked.end())) {
          preempted = true;  // made room: make the batch again
          break;
        }
        if (chunk.new_blocks > num_free && running.size() > 1) {
          PreemptLastInOrder(report);  // that may be this one, or a decoding one
          preempted = true;
          break;
        }
        batch.prefill.push_back(seq.get());
        num_free -= chunk.new_blocks;
        budget -= len;
        if (budget <= 0) break;
      }
      if (!preempted) return batch;
    }
  }

  // Runs `batch` as one forward, then samples and sends what it produced. A failed forward
  // changed nothing: its status is returned.
  absl::Status Execute(const Batch& batch, StepReport& report) {
    std::vector<SequenceId> decode_ids;
    std::vector<int32_t> decode_tokens;
    for (Sequence* seq : batch.decode) {
      decode_ids.push_back(seq->seq_id);
      decode_tokens.push_back(seq->generated[seq->num_generated_fed]);
    }
    std::vector<PrefillChunk> chunks;
    for (Sequence* seq : batch.prefill) {
      const compression::PlannedChunk& c = NextChunk(*seq);
      chunks.push_back({.seq = seq->seq_id,
                        .tokens = std::span<const int32_t>(seq->request.prompt_ids.data() + c.begin,
                                                           c.end - c.begin),
                        .is_last_chunk = seq->num_chunks_done + 1 == seq->plan->chunks().size(),
                        .compression = &seq->plan->params(),
                        .return_prompt_logprobs = WantsPromptLogprobs(*seq),
                        .num_top_logprobs = seq->request.sampling.num_top_logprobs});
    }
    const SteadyTime start = Clock::now();
    absl::StatusOr<at::Tensor> logits = runner.Step(decode_ids, decode_tokens, chunks);
    if (!logits.ok()) return logits.status();
    // Rows: the decode rows, then one per last chunk. Replayed rows (a recompute after a
    // preemption feeding its generated tokens again) and non-last chunks are not sampled.
    std::vector<Sequence*> to_sample;
    std::vector<Sequence*> failed;  // finished with an error instead
    std::vector<int64_t> rows;
    int64_t row = 0;
    for (Sequence* seq : batch.decode) {
      ++seq->num_generated_fed;
      if (seq->num_generated_fed == static_cast<int64_t>(seq->generated.size())) {
        to_sample.push_back(seq);
        rows.push_back(row);
      }
      ++row;
    }
    for (size_t i = 0; i < batch.prefill.size(); ++i) {
      Sequence& seq = *batch.prefill[i];
      const int64_t len = static_cast<int64_t>(chunks[i].tokens.size());
      seq.num_prefilled += len;
      ++seq.num_chunks_done;
      report.num_prefill_tokens += len;
      if (UsesPrefixCache(seq)) {
        prefix_cache->Insert(seq.seq_id,
                             std::span(seq.request.prompt_ids.data(), seq.num_prefilled),
                             seq.cache_cursor);
      }
      if (!chunks[i].is_last_chunk) continue;
      const int64_t chunk_row = row++;
      RecordPrefillDone(seq);
      if (!seq.generated.empty()) continue;  // recompute: replays its tokens through decode rows
      if (chunks[i].return_prompt_logprobs && !SendPromptLogprobs(seq)) {
        failed.push_back(&seq);
        continue;
      }
      to_sample.push_back(&seq);
      rows.push_back(chunk_row);
    }
    report.num_decoded += static_cast<int32_t>(batch.decode.size());
    if (chunks.empty()) {
      const ModelRunner::DecodeHostTimes host = runner.last_decode_host_times();
      report.decode_host_seconds =
          (host.prepare_us + host.fill_us + host.upload_us + host.launch_us) * 1e-6;
    }
    std::vector<Sequence*> finished;
    if (!to_sample.empty()) {
      at::Tensor sampled_rows =
          static_cast<int64_t>(rows.size()) == logits->size(0)
              ? *logits
              : logits->index_select(0, at::tensor(rows, at::kLong).to(logits->device()));
      finished = SampleAndEmit(sampled_rows, to_sample);  // [n, vocab]
    }
    finished.insert(finished.end(), failed.begin(), failed.end());
    if (!batch.decode.empty()) report.decode_seconds = MsBetween(start, Clock::now()) / 1e3;
    for (Sequence* seq : finished) ParkOrRelease(*seq);
    std::erase_if(running, [&](const auto& s) {
      return std::find(finished.begin(), finished.end(), s.get()) != finished.end();
    });
    report.num_finished += static_cast<int32_t>(finished.size());
    return absl::OkStatus();
  }

  // The sequences of a forward that failed on its own end with its error.
  void FailBatch(const Batch& batch, const absl::Status& error, StepReport& report) {
    std::vector<Sequence*> failed = batch.decode;
    failed.insert(failed.end(), batch.prefill.begin(), batch.prefill.end());
    for (Sequence* seq : failed) {
      // spdlog clashes with torch's bundled fmt in this TU; the status reaches the client.
      std::fprintf(stderr, "step failed for request %s: %s\n", seq->request.request_id.c_str(),
                   error.ToString().c_str());
      runner.Release(seq->seq_id);
      Finish(*seq, FinishReason::kError, error);
    }
    std::erase_if(running, [&](const auto& s) {
      return std::find(failed.begin(), failed.end(), s.get()) != failed.end();
    });
    report.num_finished += static_cast<int32_t>(failed.size());
  }

  void RunStep(StepReport& report) {
    Batch batch = MakeBatch(report);
    if (batch.num_parts() == 0) return;
    // A compressed prompt's chunks run in a forward of their own, as when it runs alone: its
    // press selects among scores with exact ties (max-pooling makes plateaus), so the last-bit
    // differences a shared GEMM of another row count brings would change what it keeps, and a
    // request must get the same output whatever the load (the soak test checks it).
    std::vector<Sequence*> compressed;
    std::erase_if(batch.prefill, [&](Sequence* seq) {
      if (seq->plan->params().method == ScoreMethod::kNone) return false;
      compressed.push_back(seq);
      return true;
    });
    for (Sequence* seq : compressed) RunBatch({.decode = {}, .prefill = {seq}}, report);
    if (batch.num_parts() > 0) RunBatch(batch, report);
  }

  void RunBatch(const Batch& batch, StepReport& report) {
    const absl::Status status = Execute(batch, report);
    if (status.ok()) return;
    if (batch.num_parts() == 1) {
      FailBatch(batch, status, report);
      return;
    }
    // Which part failed: each alone (the failed forward changed nothing), so that one bad
    // sequence does not end the others.
    std::vector<Batch> parts;
    if (!batch.decode.empty()) parts.push_back({.decode = batch.decode, .prefill = {}});
    for (Sequence* seq : batch.prefill) parts.push_back({.decode = {}, .prefill = {seq}});
    for (const Batch& part : parts) {
      if (absl::Status st = Execute(part, report); !st.ok()) FailBatch(part, st, report);
    }
  }

  StepReport Step() {
    StepReport report;
    Reap(report);
    Admit(report);
    RunStep(report);
    const KvBlockCounts counts = kv_counts();
    std::lock_guard<std::mutex> lock(mu);
    stats.num_waiting = static_cast<int32_t>(waiting.size() + held.size());
    stats.num_running = static_cast<int32_t>(running.size());
    stats.num_waiting_prompt_tokens = num_waiting_prompt_tokens;
    stats.kv_blocks_total = counts.num_total;
    stats.kv_blocks_free = counts.num_free;
    stats.num_finished += report.num_finished;
    stats.num_conversation_hits = num_conversation_hits;
    const DecodeCompressionStats dc = runner.decode_compression_stats();
    stats.num_decode_evictions = dc.num_evictions;
    stats.num_decode_evicted_entries = dc.num_evicted_entries;
    stats.num_parked_conversations = static_cast<int64_t>(parked.size());
    if (prefix_cache) {
      const PrefixCacheStats& pc = prefix_cache->stats();
      stats.prefix_cache_enabled = true;
      stats.prefix_cache_query_tokens = pc.num_query_tokens;
      stats.prefix_cache_hit_tokens = pc.num_hit_tokens;
      stats.prefix_cache_blocks = runner.pool().num_cached_blocks();
      stats.prefix_cache_evicted_entries = pc.num_evicted_entries;
    }
    if (report.num_decoded > 0) {
      ++stats.num_decode_steps;
      stats.num_decode_rows += report.num_decoded;
      stats.decode_seconds += report.decode_seconds;
      stats.decode_host_seconds += report.decode_host_seconds;
    }
    report.num_running_after = stats.num_running;
    report.num_waiting_after = stats.num_waiting;
    return report;
  }

  void Loop() {
    while (!stop.load()) {
      {
        std::unique_lock<std::mutex> lock(mu);
        work_cv.wait_for(lock, std::chrono::milliseconds(50), [&] {
          return stop.load() || !waiting.empty() || !running.empty() || cancel_all || HeldReady();
        });
      }
      if (stop.load()) break;
      bool has_work;
      {
        std::lock_guard<std::mutex> lock(mu);
        has_work = !waiting.empty() || !running.empty() || cancel_all || HeldReady();
      }
      if (!has_work) continue;
      const StepReport report = Step();
      // Waiting for blocks that nobody is about to free: do not spin.
      if (report.num_admitted == 0 && report.num_prefill_tokens == 0 && report.num_decoded == 0 &&
          report.num_finished == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
};

Scheduler::Scheduler(ModelRunner& runner, const Tokenizer* tokenizer, KvBlockCountsFn kv_counts,
                     SchedulerOptions options)
    : impl_(std::make_unique<Impl>(runner, tokenizer, std::move(kv_counts), std::move(options))) {
  const KvBlockCounts counts = impl_->kv_counts();
  impl_->stats.kv_blocks_total = counts.num_total;
  impl_->stats.kv_blocks_free = counts.num_free;
}

Scheduler::~Scheduler() {
  Stop();
}

absl::Status Scheduler::Submit(GenerationRequest request, std::shared_ptr<RequestChannel> channel) {
  auto seq = std::make_unique<Sequence>();
  const int64_t prompt_len = static_cast<int64_t>(request.prompt_ids.size());
  seq->sampler = std::make_unique<SamplerState>(request.sampling, request.prompt_ids,
                                                impl_->options.eos_token_ids);
  seq->request = std::move(request);
  seq->channel = std::move(channel);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->draining) {
      ++impl_->stats.num_rejected;
      return absl::UnavailableError("server is shutting down");
    }
    const SchedulerOptions& o = impl_->options;
    if (static_cast<int32_t>(impl_->waiting.size()) >= o.max_waiting_requests) {
      ++impl_->stats.num_rejected;
      return absl::ResourceExhaustedError(
          absl::StrCat("waiting queue full: ", impl_->waiting.size(), " requests (limit ",
                       o.max_waiting_requests, ")"));
    }
    if (impl_->num_waiting_prompt_tokens + prompt_len > o.max_waiting_prompt_tokens) {
      ++impl_->stats.num_rejected;
      return absl::ResourceExhaustedError(absl::StrCat(
          "waiting queue full: ", impl_->num_waiting_prompt_tokens, " prompt tokens queued + ",
          prompt_len, " > limit ", o.max_waiting_prompt_tokens));
    }
    impl_->num_waiting_prompt_tokens += prompt_len;
    const int32_t priority = seq->request.priority;
    impl_->waiting.insert(impl_->WaitingSlot(priority, /*ahead_of_equals=*/false), std::move(seq));
    impl_->stats.num_waiting = static_cast<int32_t>(impl_->waiting.size());
    impl_->stats.num_waiting_prompt_tokens = impl_->num_waiting_prompt_tokens;
  }
  impl_->work_cv.notify_one();
  return absl::OkStatus();
}

StepReport Scheduler::Step() {
  return impl_->Step();
}

bool Scheduler::HasWork() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->waiting.empty() || !impl_->running.empty() || impl_->HeldReady();
}

void Scheduler::Start() {
  impl_->stop = false;
  impl_->engine_thread = std::thread([this] { impl_->Loop(); });
}

void Scheduler::Stop() {
  impl_->stop = true;
  impl_->work_cv.notify_all();
  if (impl_->engine_thread.joinable()) impl_->engine_thread.join();
}

void Scheduler::BeginDrain() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->draining = true;
  impl_->stats.draining = true;
}

void Scheduler::CancelAll() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->cancel_all = true;
  }
  impl_->work_cv.notify_all();
}

SchedulerStats Scheduler::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  SchedulerStats s = impl_->stats;
  return s;
}

}  // namespace dropkv
