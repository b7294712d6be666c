#include "engine/parallel/gloo_communicator.h"

#include <dlfcn.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <ATen/ATen.h>

#include <exception>
#include <filesystem>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dropkv {
namespace {

// libtorch_cpu carries its own, newer copy of gloo and exports its symbols. Whichever library
// comes first in the process's lookup order serves every gloo call, Debian libgloo's own calls
// into itself included; if that is torch's copy, the class layouts differ and the first
// collective corrupts memory. The build links libgloo before LibTorch; this checks it did.
absl::Status CheckGlooSymbolsResolveToLibgloo() {
  void* sym = dlsym(RTLD_DEFAULT, "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE");
  Dl_info info{};
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr) {
    return absl::FailedPreconditionError("tensor parallelism: gloo::allreduce is not loaded");
  }
  if (!absl::StrContains(info.dli_fname, "libgloo")) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor parallelism: gloo's symbols resolve to ", info.dli_fname,
                     " instead of libgloo (link libgloo before LibTorch)"));
  }
  return absl::OkStatus();
}

absl::Status ErrorFrom(const char* what, const std::exception& e) {
  return absl::UnavailableError(absl::StrCat("tensor parallelism: ", what, " failed: ", e.what()));
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
      : context_(std::move(context)), timeout_(timeout) {}

  int32_t rank() const override { return context_->rank; }
  int32_t size() const override { return context_->size; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  absl::Status AllReduceSum(at::Tensor& t) override {
    if (absl::Status s = CheckHostContiguous(t); !s.ok()) return s;
    try {
      // Gloo sums float and double; a 16-bit tensor goes through fp32.
      at::Tensor buf = t.scalar_type() == at::kDouble ? t : t.to(at::kFloat).contiguous();
      gloo::AllreduceOptions opts(context_);
      opts.setTimeout(timeout_);
      if (buf.scalar_type() == at::kDouble) {
        opts.setOutput(buf.data_ptr<double>(), static_cast<size_t>(buf.numel()));
        opts.setReduceFunction(
            [](void* c, const void* a, const void* b, size_t n) { gloo::sum<double>(c, a, b, n); });
      } else {
        opts.setOutput(buf.data_ptr<float>(), static_cast<size_t>(buf.numel()));
        opts.setReduceFunction(
            [](void* c, const void* a, const void* b, size_t n) { gloo::sum<float>(c, a, b, n); });
      }
      gloo::allreduce(opts);
      if (!buf.is_same(t)) t.copy_(buf);
    } catch (const std::exception& e) {
      return ErrorFrom("all-reduce", e);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<at::Tensor> AllGather(const at::Tensor& t) override {
    at::Tensor in = t.contiguous();
    if (absl::Status s = CheckHostContiguous(in); !s.ok()) return s;
    std::vector<int64_t> shape = {size()};
    shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
    at::Tensor out = at::empty(shape, in.options());
    try {
      const size_t bytes = in.numel() * in.element_size();
      gloo::AllgatherOptions opts(context_);
      opts.setTimeout(timeout_);
      opts.setInput(static_cast<uint8_t*>(in.data_ptr()), bytes);
      opts.setOutput(static_cast<uint8_t*>(out.data_ptr()), bytes * size());
      gloo::allgather(opts);
    } catch (const std::exception& e) {
      return ErrorFrom("all-gather", e);
    }
    return out;
  }

  absl::Status Broadcast(at::Tensor& t, int32_t root) override {
    if (absl::Status s = CheckHostContiguous(t); !s.ok()) return s;
    try {
      gloo::BroadcastOptions opts(context_);
      opts.setTimeout(timeout_);
      opts.setRoot(root);
      opts.setOutput(static_cast<uint8_t*>(t.data_ptr()), t.numel() * t.element_size());
      gloo::broadcast(opts);
    } catch (const std::exception& e) {
      return ErrorFrom("broadcast", e);
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status CheckHostContiguous(const at::Tensor& t) {
    if (!t.defined() || !t.is_cpu() || !t.is_contiguous()) {
      return absl::InvalidArgumentError(
          "tensor parallelism: Gloo collectives take contiguous CPU tensors");
    }
    return absl::OkStatus();
  }

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

// Debian's gloo takes a timeout of 0 literally (no "no timeout" value): a year stands for it.
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365);

absl::StatusOr<std::unique_ptr<Communicator>> ConnectGloo(int32_t rank, int32_t size,
                                                          const RendezvousOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallelism: rank ", rank, " out of a group of ", size));
  }
  if (absl::Status s = CheckGlooSymbolsResolveToLibgloo(); !s.ok()) return s;
  try {
    std::filesystem::create_directories(options.store_dir);
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";  // ranks are processes of one host
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore files(options.store_dir);
    gloo::rendezvous::PrefixStore store(options.store_prefix, files);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(options.timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<Communicator>(new GlooCommunicator(
        context, options.collectives_wait_forever ? kForever : options.timeout));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("tensor parallelism: rank ", rank, " of ", size,
                                               " could not join the group at ", options.store_dir,
                                               ": ", e.what()));
  }
}

}  // namespace dropkv
