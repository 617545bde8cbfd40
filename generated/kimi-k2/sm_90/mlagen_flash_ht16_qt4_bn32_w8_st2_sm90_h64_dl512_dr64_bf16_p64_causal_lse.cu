// mlagen generated kernel: mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse
// family flash: head-tiled split-KV on the FMA units. One block per (query tile x head tile,
// split, request) holds q_tile*head_tile = 64 query rows; each KV tile of
// 32 keys is staged once in shared memory (2-stage cp.async pipeline)
// and used by every row. Warp w owns rows [w*RPW, (w+1)*RPW): lanes take keys for the scores
// and 8-dim value chunks for the output, so a row's softmax never leaves its warp.
// With one split the block writes out/lse; otherwise partials go to the workspace and the
// combine kernel merges them.
#include <cuda_bf16.h>

#ifndef INFINITY   // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
__device__ __forceinline__ float2 to_float2(elem2_t v) { return __bfloat1622float2(v); }
__device__ __forceinline__ elem2_t from_float2(float a, float b) { return __floats2bfloat162_rn(a, b); }

namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse {

// Problem constants, derived in Python (mlagen/validate.py).
constexpr int H = 64;
constexpr int DL = 512;                 // value width (first DL dims of a KV row)
constexpr int DR = 64;                 // rope width
constexpr int D = DL + DR;
constexpr int CHUNK = 8;                                  // elements per 16-byte access
constexpr int CH = D / CHUNK;                             // 16-byte chunks per KV row
constexpr int CHV = DL / CHUNK;
constexpr int PAGE = 64;
constexpr int MASK_CAUSAL = 1;
constexpr int MASK_TREE = 0;
constexpr bool WRITE_LSE = true;
constexpr float LN2 = 0.693147180559945309f;
static_assert(D % CHUNK == 0 && DL % 256 == 0, "row widths come in whole 16-byte chunks");
static_assert((PAGE & (PAGE - 1)) == 0, "page size is a power of two");

}  // namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse

// The parameter block every kernel of this file takes by value (mlagen/params.py).
struct __align__(8) VerifyParams {
  const elem_t* q;  // (B, S, H, Dl+Dr), last dim contiguous
  const elem_t* kv;  // (num_pages, page_size, Dl+Dr), last dim contiguous
  const int* block_table;  // (B, max_pages) page ids of each request, in order
  const int* seqlens;  // (B,) valid keys per request, draft tokens included
  const unsigned char* tree_mask;  // (B or 1, S, S) bool, tree mask kind only
  elem_t* out;  // (B, S, H, Dl)
  float* lse;  // (B, H, S) fp32, natural log; written when the problem has lse
  float* part_o;  // (num_splits, B, S, H, Dl) unnormalized partial outputs
  float2* part_ml;  // (num_splits, B, S, H) partial (max, sum), log2 domain
  long long q_stride_b;  // elements between requests of q
  long long q_stride_s;  // elements between query positions of q
  long long q_stride_h;  // elements between heads of q
  long long kv_stride_page;  // elements between pages of kv
  long long kv_stride_row;  // elements between rows of a page
  long long bt_stride_b;  // elements between rows of block_table
  long long mask_stride_b;  // elements between requests of tree_mask (0: shared)
  long long mask_stride_q;  // elements between query rows of tree_mask
  long long out_stride_b;  // elements between requests of out
  long long out_stride_s;  // elements between query positions of out
  long long out_stride_h;  // elements between heads of out
  int batch;  // B
  int seqlen_q;  // S, draft tokens per request
  int max_pages;  // columns of block_table
  int num_pages;  // pages in kv; page ids outside [0, num_pages) read as zeros
  int num_splits;  // key-range splits; 1 writes out directly, no combine
  float scale_log2;  // softmax_scale * log2(e)
};

namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse {

// Keys of request b that may be read: the stored length, clamped to what block_table can
// address, so a bad length never makes a kernel read outside the cache it was given.
__device__ __forceinline__ int request_keys(const VerifyParams& p, int b) {
  const int n = p.seqlens[b];
  const long long cap = (long long)p.max_pages * PAGE;
  return n < 0 ? 0 : (n > cap ? (int)cap : n);
}

// Address of key j of request b, or nullptr when its page id is outside the cache.
__device__ __forceinline__ const elem_t* kv_row(const VerifyParams& p, int b, int j) {
  const int page = p.block_table[(long long)b * p.bt_stride_b + j / PAGE];
  if (page < 0 || page >= p.num_pages) return nullptr;
  return p.kv + (long long)page * p.kv_stride_page + (long long)(j % PAGE) * p.kv_stride_row;
}

// Draft-tree rows as bit sets: bit k of tree_bits(p, b, i) says query i sees draft token k.
__device__ __forceinline__ unsigned long long tree_bits(const VerifyParams& p, int b, int i) {
  const unsigned char* row = p.tree_mask + (long long)b * p.mask_stride_b + (long long)i * p.mask_stride_q;
  unsigned long long bits = 0;
  for (int k = 0; k < p.seqlen_q; ++k) bits |= (unsigned long long)(row[k] != 0) << k;
  return bits;
}

// Whether query i (of S) sees key j (of n keys): prefix keys always, draft keys by the mask.
// `bits` is tree_bits(...) of the row for tree masks, unused otherwise.
__device__ __forceinline__ bool key_visible(int j, int n, int i, int S, unsigned long long bits) {
  if (j >= n) return false;
  const int prefix = n - S;          // the S draft tokens sit at n-S .. n-1
  if (j < prefix) return true;
  if (MASK_CAUSAL) return j <= prefix + i;
  if (MASK_TREE) return (bits >> (j - prefix)) & 1ull;
  return true;
}

// One past the last key any query of [i0, i1) can see: causal rows stop at their own token.
__device__ __forceinline__ int key_limit(int n, int S, int i1) {
  if (!MASK_CAUSAL) return n;
  const int lim = n - S + i1;
  return lim < 0 ? 0 : (lim > n ? n : lim);
}

__device__ __forceinline__ unsigned smem_addr(const void* ptr) {
  return (unsigned)__cvta_generic_to_shared(ptr);
}

// 16-byte global->shared copy; when !valid it fills zeros and reads nothing (src must still
// be some global address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const elem2_t* h = reinterpret_cast<const elem2_t*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) { const float2 t = to_float2(h[e]); f[2 * e] = t.x; f[2 * e + 1] = t.y; }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  elem2_t* h = reinterpret_cast<elem2_t*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = from_float2(f[2 * e], f[2 * e + 1]);
  return v;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The natural-log LSE of a row from its log2-domain max m and sum l; -inf for an empty row.
__device__ __forceinline__ float row_lse(float m, float l) {
  return l > 0.f ? (m + __log2f(l)) * LN2 : -INFINITY;
}

// Writes `vals` (N = 8 or 2 consecutive dims starting at `d0`) of output row (b, i, h),
// divided by l; an empty row (l == 0) writes zeros.
template <int N>
__device__ __forceinline__ void store_out(const VerifyParams& p, int b, int i, int h, int d0,
                                          const float* vals, float l) {
  static_assert(N == 8 || N == 2, "16-byte or 4-byte stores");
  const float inv = l > 0.f ? 1.f / l : 0.f;
  elem_t* dst = p.out + (long long)b * p.out_stride_b + (long long)i * p.out_stride_s
                + (long long)h * p.out_stride_h + d0;
  if constexpr (N == 8) {
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = vals[e] * inv;
    *reinterpret_cast<uint4*>(dst) = pack8(f);
  } else {
    *reinterpret_cast<elem2_t*>(dst) = from_float2(vals[0] * inv, vals[1] * inv);
  }
}

// Index of row (split, b, i, h) in the partial-result workspace.
__device__ __forceinline__ long long part_row(const VerifyParams& p, int split, int b, int i, int h) {
  return (((long long)split * p.batch + b) * p.seqlen_q + i) * H + h;
}

// Blocks of `bn` keys of [0, limit) that split `split` of `num_splits` owns: [*begin, *end).
__device__ __forceinline__ void split_blocks(int limit, int bn, int split, int num_splits,
                                             int* begin, int* end) {
  const int blocks = (limit + bn - 1) / bn;
  const int per = (blocks + num_splits - 1) / num_splits;
  const int b0 = split * per;
  *begin = b0 < blocks ? b0 : blocks;
  *end = b0 + per < blocks ? b0 + per : blocks;
}

}  // namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse

namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse {

// Ends row (b, i, h) of one split. With one split the row is final: out = acc / l and lse.
// Otherwise acc (unnormalized) and (m, l) go to the workspace for the combine kernel.
// `acc` holds N (8 or 2) consecutive dims starting at d0; writes_stats picks one thread per row.
template <int N>
__device__ __forceinline__ void finish_row(const VerifyParams& p, int split, int b, int i, int h,
                                           int d0, const float* acc, float m, float l,
                                           bool writes_stats) {
  if (p.num_splits == 1) {
    store_out<N>(p, b, i, h, d0, acc, l);
    if (WRITE_LSE && writes_stats)
      p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
    return;
  }
  const long long row = part_row(p, split, b, i, h);
  float2* dst = reinterpret_cast<float2*>(p.part_o + row * DL + d0);
#pragma unroll
  for (int e = 0; e < N / 2; ++e) dst[e] = make_float2(acc[2 * e], acc[2 * e + 1]);
  if (writes_stats) p.part_ml[row] = make_float2(l > 0.f ? m : -INFINITY, l);
}

}  // namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse

// Merges the num_splits partial results of each row:
//   m = max_k m_k;  l = sum_k l_k 2^(m_k - m);  out = sum_k acc_k 2^(m_k - m) / l.
// grid: (ceil(B*S*H / 4),); block: 128 threads,
// one warp per row, each lane DL/128 float4s.
extern "C" __global__ void __launch_bounds__(128)
mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse_combine(const VerifyParams p) {
  using namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * 4 + warp;
  const long long rows = (long long)p.batch * p.seqlen_q * H;
  if (row >= rows) return;
  const int h = (int)(row % H);
  const int i = (int)((row / H) % p.seqlen_q);
  const int b = (int)(row / ((long long)H * p.seqlen_q));

  float m = -INFINITY;
  for (int k = 0; k < p.num_splits; ++k) m = fmaxf(m, p.part_ml[part_row(p, k, b, i, h)].x);
  constexpr int V4 = DL / 128;   // float4s per lane
  float acc[V4 * 4] = {};
  float l = 0.f;
  if (m != -INFINITY) {
    for (int k = 0; k < p.num_splits; ++k) {
      const long long r = part_row(p, k, b, i, h);
      const float2 ml = p.part_ml[r];
      if (ml.y == 0.f) continue;           // an empty split holds no keys (and maybe no acc)
      const float w = exp2f(ml.x - m);
      l += ml.y * w;
      const float4* src = reinterpret_cast<const float4*>(p.part_o + r * DL);
#pragma unroll
      for (int v = 0; v < V4; ++v) {
        const float4 x = src[lane + 32 * v];
        acc[4 * v] += w * x.x; acc[4 * v + 1] += w * x.y;
        acc[4 * v + 2] += w * x.z; acc[4 * v + 3] += w * x.w;
      }
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  elem_t* dst = p.out + (long long)b * p.out_stride_b + (long long)i * p.out_stride_s
                + (long long)h * p.out_stride_h;
#pragma unroll
  for (int v = 0; v < V4; ++v) {
    elem2_t* d2 = reinterpret_cast<elem2_t*>(dst + 4 * (lane + 32 * v));
    d2[0] = from_float2(acc[4 * v] * inv, acc[4 * v + 1] * inv);
    d2[1] = from_float2(acc[4 * v + 2] * inv, acc[4 * v + 3] * inv);
  }
  if (WRITE_LSE && lane == 0) p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
}


namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse {
constexpr int HT = 16;
constexpr int QT = 4;
constexpr int ROWS = QT * HT;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int RPW = 8;            // rows per warp
constexpr int ROWS_PAD = RPW * WARPS;
constexpr int BN = 32;
constexpr int KPL = BN / 32;                              // keys per lane
constexpr int STAGES = 2;
constexpr int RE = 584;                  // padded shared row, elements
constexpr int VCH = CHV / 32;                             // value chunks per lane
constexpr int HEAD_TILES = H / HT;
static_assert(ROWS_PAD >= ROWS && H % HT == 0 && BN % 32 == 0, "tiling");
static_assert(RE % CHUNK == 0 && (RE / CHUNK) % 2 == 1, "odd 16-byte row stride: no bank conflicts");
static_assert(ROWS_PAD * RE * 2 + STAGES * BN * RE * 2 + ROWS_PAD * BN * 4 + 64 * 8 == 158208,
              "shared-memory plan matches mlagen/validate.py");

__device__ __forceinline__ void load_kv_tile(const VerifyParams& p, elem_t* dst, int b, int kb, int n) {
  for (int c = threadIdx.x; c < BN * CH; c += THREADS) {
    const int r = c / CH, ch = c % CH;
    const int j = kb * BN + r;
    const elem_t* row = j < n ? kv_row(p, b, j) : nullptr;
    cp_async16(dst + r * RE + ch * CHUNK, row ? row + ch * CHUNK : p.kv, row != nullptr);
  }
}
}  // namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse

// grid: (ceil(S/QT) * H/HT, num_splits, B); block: 256 threads;
// dynamic shared memory 158208 bytes.
extern "C" __global__ void __launch_bounds__(256)
mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse_main(const VerifyParams p) {
  using namespace mlagen_mlagen_flash_ht16_qt4_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_causal_lse;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  elem_t* sQ = reinterpret_cast<elem_t*>(smem_raw);                    // (ROWS_PAD, RE)
  elem_t* sKV = sQ + ROWS_PAD * RE;                                    // (STAGES, BN, RE)
  float* sP = reinterpret_cast<float*>(sKV + STAGES * BN * RE);        // (ROWS_PAD, BN)
  unsigned long long* sBits = reinterpret_cast<unsigned long long*>(sP + ROWS_PAD * BN);  // (QT,)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, split = blockIdx.y;
  const int h0 = (blockIdx.x % HEAD_TILES) * HT, q0 = (blockIdx.x / HEAD_TILES) * QT;
  const int S = p.seqlen_q;
  const int n = request_keys(p, b);
  const int q_end = q0 + QT < S ? q0 + QT : S;
  int kb_begin, kb_end;
  split_blocks(key_limit(n, S, q_end), BN, split, p.num_splits, &kb_begin, &kb_end);

  for (int c = threadIdx.x; c < ROWS_PAD * CH; c += THREADS) {
    const int r = c / CH, ch = c % CH;
    const int i = q0 + r / HT, h = h0 + r % HT;
    const bool live = r < ROWS && i < S;
    const elem_t* src = live ? p.q + (long long)b * p.q_stride_b + (long long)i * p.q_stride_s
                                   + (long long)h * p.q_stride_h + ch * CHUNK
                             : p.q;
    cp_async16(sQ + r * RE + ch * CHUNK, src, live);
  }
  if (MASK_TREE && threadIdx.x < QT) sBits[threadIdx.x] = q0 + threadIdx.x < S ? tree_bits(p, b, q0 + threadIdx.x) : 0ull;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (kb_begin + s < kb_end) load_kv_tile(p, sKV + s * BN * RE, b, kb_begin + s, n);
    cp_async_commit();
  }

  float acc[RPW][VCH * CHUNK] = {};
  float m[RPW], l[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) { m[r] = -INFINITY; l[r] = 0.f; }

  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int next = kb + STAGES - 1;
    if (next < kb_end) load_kv_tile(p, sKV + ((next - kb_begin) % STAGES) * BN * RE, b, next, n);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const elem_t* tile = sKV + ((kb - kb_begin) % STAGES) * BN * RE;

    // Scores: lane's keys lane + 32t against the warp's rows.
    float s[RPW][KPL] = {};
#pragma unroll 2
    for (int c = 0; c < CH; ++c) {
      float k[KPL][CHUNK];
#pragma unroll
      for (int t = 0; t < KPL; ++t)
        unpack8(*reinterpret_cast<const uint4*>(tile + (lane + 32 * t) * RE + c * CHUNK), k[t]);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        float qv[CHUNK];
        unpack8(*reinterpret_cast<const uint4*>(sQ + (warp * RPW + r) * RE + c * CHUNK), qv);
#pragma unroll
        for (int t = 0; t < KPL; ++t)
#pragma unroll
          for (int e = 0; e < CHUNK; ++e) s[r][t] += qv[e] * k[t][e];
      }
    }

    // Online softmax in the log2 domain, one row at a time, within the warp.
    float* myP = sP + warp * RPW * BN;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = warp * RPW + r;
      const int i = q0 + row / HT;
      const bool live = row < ROWS && i < S;
      const unsigned long long bits = MASK_TREE && live ? sBits[row / HT] : 0ull;
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < KPL; ++t) {
        const int j = kb * BN + lane + 32 * t;
        s[r][t] = live && key_visible(j, n, i, S, bits) ? s[r][t] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[r][t]);
      }
      const float m_new = fmaxf(m[r], warp_max(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;   // an all-masked row stays empty
      const float alpha = exp2f(m[r] - m_use);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int t = 0; t < KPL; ++t) {
        const float pr = exp2f(s[r][t] - m_use);
        sum += pr;
        myP[r * BN + lane + 32 * t] = pr;
      }
      l[r] = l[r] * alpha + sum;   // per-lane partial sum; reduced once at the end
#pragma unroll
      for (int e = 0; e < VCH * CHUNK; ++e) acc[r][e] *= alpha;
    }
    __syncwarp();

    // Output: lane's value chunks lane + 32v, all keys of the tile.
#pragma unroll 2
    for (int j = 0; j < BN; ++j) {
      float v[VCH][CHUNK];
#pragma unroll
      for (int c = 0; c < VCH; ++c)
        unpack8(*reinterpret_cast<const uint4*>(tile + j * RE + (lane + 32 * c) * CHUNK), v[c]);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const float pr = myP[r * BN + j];
#pragma unroll
        for (int c = 0; c < VCH; ++c)
#pragma unroll
          for (int e = 0; e < CHUNK; ++e) acc[r][c * CHUNK + e] += pr * v[c][e];
      }
    }
    __syncthreads();   // the stage is refilled next iteration
  }

#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = warp * RPW + r;
    const int i = q0 + row / HT, h = h0 + row % HT;
    const float lt = warp_sum(l[r]);
    if (row >= ROWS || i >= S) continue;
#pragma unroll
    for (int c = 0; c < VCH; ++c)
      finish_row<8>(p, split, b, i, h, (lane + 32 * c) * CHUNK, acc[r] + c * CHUNK, m[r], lt, lane == 0);
  }
}
