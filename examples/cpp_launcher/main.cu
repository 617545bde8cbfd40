// Runs an mlagen kernel from C++ through its generated launcher and checks it on the CPU.
//
// A small paged batch (requests of different lengths, one empty, pages shuffled) with random
// bf16 inputs; the GPU result for num_splits = 1, the default split and a forced split is
// compared with a double-precision CPU computation of the same causal verify attention. Each
// run launches twice back to back on one stream, sharing the workspace and the counters; where
// the arch allows (kProgrammaticLaunch) the second launch is a programmatic dependent launch,
// so its blocks start while the first drains and must wait for it before touching either.
// Exit status 0 when every run matches.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "variant.h"   // the launcher header, as namespace `kernel`, and kSeqlenQ

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    const cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

constexpr int H = kernel::kHeads, D = kernel::kHeadDim, DV = kernel::kHeadDimV;
constexpr int PAGE = kernel::kPageSize, S = kSeqlenQ;

struct Batch {
  std::vector<int> lengths;            // keys per request, the S draft tokens included
  int max_pages = 0, num_pages = 0;
  std::vector<int> block_table;        // [B, max_pages]
  std::vector<__nv_bfloat16> q, kv;    // [B, S, H, D], [num_pages, PAGE, D]
  int batch() const { return (int)lengths.size(); }
};

Batch make_batch(std::mt19937& rng) {
  Batch b;
  b.lengths = {37 + S, 300 + S, S, 0};   // the last request is empty: out 0, lse -inf
  for (int n : b.lengths) b.max_pages = std::max(b.max_pages, (n + PAGE - 1) / PAGE);
  b.num_pages = b.batch() * b.max_pages;
  std::vector<int> pages(b.num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);   // a request's pages lie anywhere in the cache
  b.block_table.assign(pages.begin(), pages.end());
  std::normal_distribution<float> normal;
  b.q.resize((size_t)b.batch() * S * H * D);
  b.kv.resize((size_t)b.num_pages * PAGE * D);
  for (auto& x : b.q) x = __float2bfloat16(normal(rng));
  for (auto& x : b.kv) x = __float2bfloat16(normal(rng));
  return b;
}

// Causal verify attention in double precision: query i of request r sees keys 0 .. n-S+i.
void reference(const Batch& b, float scale, std::vector<float>& out, std::vector<float>& lse) {
  out.assign((size_t)b.batch() * S * H * DV, 0.f);
  lse.assign((size_t)b.batch() * H * S, -INFINITY);
  for (int r = 0; r < b.batch(); ++r) {
    const int n = b.lengths[r];
    for (int i = 0; i < S; ++i) {
      const int visible = std::min(n, n - S + i + 1);
      for (int h = 0; h < H; ++h) {
        if (visible <= 0) continue;
        const __nv_bfloat16* qrow = &b.q[(((size_t)r * S + i) * H + h) * D];
        std::vector<double> s(visible);
        double mx = -INFINITY;
        for (int j = 0; j < visible; ++j) {
          const int page = b.block_table[r * b.max_pages + j / PAGE];
          const __nv_bfloat16* k = &b.kv[((size_t)page * PAGE + j % PAGE) * D];
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += (double)__bfloat162float(qrow[d]) * __bfloat162float(k[d]);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        std::vector<double> acc(DV, 0.0);
        for (int j = 0; j < visible; ++j) {
          const double p = std::exp(s[j] - mx);
          sum += p;
          const int page = b.block_table[r * b.max_pages + j / PAGE];
          const __nv_bfloat16* v = &b.kv[((size_t)page * PAGE + j % PAGE) * D];
          for (int d = 0; d < DV; ++d) acc[d] += p * __bfloat162float(v[d]);
        }
        float* o = &out[(((size_t)r * S + i) * H + h) * DV];
        for (int d = 0; d < DV; ++d) o[d] = (float)(acc[d] / sum);
        lse[((size_t)r * H + h) * S + i] = (float)(mx + std::log(sum));
      }
    }
  }
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* ptr = nullptr;
  CHECK_CUDA(cudaMalloc(&ptr, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return ptr;
}

// Launches with `num_splits` and compares with the reference; true when it matches.
bool run(const Batch& b, int num_splits, float scale, const std::vector<float>& ref_out,
         const std::vector<float>& ref_lse, cudaStream_t stream) {
  const int B = b.batch();
  __nv_bfloat16* q = to_device(b.q);
  __nv_bfloat16* kv = to_device(b.kv);
  int* table = to_device(b.block_table);
  int* lengths = to_device(b.lengths);
  __nv_bfloat16* out = nullptr;
  float* lse = nullptr;
  void* workspace = nullptr;
  unsigned int* counters = nullptr;
  CHECK_CUDA(cudaMalloc(&out, (size_t)B * S * H * DV * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&lse, (size_t)B * H * S * sizeof(float)));
  const size_t ws = kernel::workspace_bytes(B, S, num_splits);
  if (ws) CHECK_CUDA(cudaMalloc(&workspace, ws));
  // Zeroed once; every launch leaves them zero, so an engine keeps them per stream.
  const size_t cs = kernel::counters_bytes(B, S, num_splits);
  if (cs) {
    CHECK_CUDA(cudaMalloc(&counters, cs));
    CHECK_CUDA(cudaMemsetAsync(counters, 0, cs, stream));
  }

  // The cache's tensor map (TMA kernels; for others make_kv_map does nothing): made once per
  // cache, outside any graph capture, and kept while launches read the cache.
  void* kv_map = nullptr;
  if (kernel::kUsesTma) CHECK_CUDA(cudaMalloc(&kv_map, kernel::kKvMapBytes));
  CHECK_CUDA(kernel::make_kv_map(kv, (long long)PAGE * D, D, b.num_pages, kv_map));

  for (const bool programmatic : {false, kernel::kProgrammaticLaunch})
    CHECK_CUDA(kernel::launch(q, (long long)S * H * D, (long long)H * D, D,
                              kv, (long long)PAGE * D, D, b.num_pages,
                              table, b.max_pages, b.max_pages,
                              lengths,
                              nullptr, 0, 0,   // causal kernel: no tree mask
                              out, (long long)S * H * DV, (long long)H * DV, DV,
                              lse, B, S, scale, num_splits, workspace, counters, stream, programmatic, kv_map));
  CHECK_CUDA(cudaStreamSynchronize(stream));

  std::vector<__nv_bfloat16> got((size_t)B * S * H * DV);
  std::vector<float> got_lse((size_t)B * H * S);
  CHECK_CUDA(cudaMemcpy(got.data(), out, got.size() * sizeof(got[0]), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0, norm = 0, lse_err = 0;
  bool lse_inf_ok = true;
  for (size_t k = 0; k < got.size(); ++k) {
    const double d = (double)__bfloat162float(got[k]) - ref_out[k];
    err += d * d;
    norm += (double)ref_out[k] * ref_out[k];
  }
  for (size_t k = 0; k < got_lse.size(); ++k) {
    if (std::isinf(ref_lse[k])) lse_inf_ok &= std::isinf(got_lse[k]) && got_lse[k] < 0;
    else lse_err = std::max(lse_err, (double)std::fabs(got_lse[k] - ref_lse[k]));
  }
  const double rel = std::sqrt(err / norm);
  const bool ok = rel < 1e-2 && lse_err < 1e-2 && lse_inf_ok;
  std::printf("num_splits=%-3d relative error %.2e, max lse error %.2e, empty rows %s: %s\n",
              num_splits, rel, lse_err, lse_inf_ok ? "ok" : "WRONG", ok ? "ok" : "FAILED");
  for (void* p : {(void*)q, (void*)kv, (void*)table, (void*)lengths, (void*)out, (void*)lse, workspace,
                  (void*)counters, kv_map})
    CHECK_CUDA(cudaFree(p));
  return ok;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  const Batch b = make_batch(rng);
  const float scale = 1.0f / std::sqrt((float)D);
  std::vector<float> ref_out, ref_lse;
  reference(b, scale, ref_out, ref_lse);

  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  std::vector<int> splits = {1};
  if (kernel::kUsesSplit) {
    int blocks_per_sm = 1;
    CHECK_CUDA(kernel::occupancy(&blocks_per_sm));
    splits.push_back(kernel::default_num_splits(b.batch(), S, b.max_pages, sms, blocks_per_sm));
    splits.push_back(3);
  }
  bool ok = true;
  for (int n : splits) ok &= run(b, n, scale, ref_out, ref_lse, stream);
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
