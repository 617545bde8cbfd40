// mlagen generated kernel: mlagen_naive_w4_sm120_h64_dl512_dr64_bf16_p64_causal_lse
// family naive: one block per (query head h, query position i, request b); the block's warps
// take keys round-robin, each with its own online softmax, then merge through shared memory.
// Its keys are the request's paged prefix and draft tokens, or with gathered keys (sparse
// verify) the cache rows the query token lists.
// Reads the whole KV once per head: the correctness baseline, slow by design.
#include <cuda_bf16.h>

#ifndef INFINITY   // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif

// Trace points: MLAGEN_TRACE(point) marks where one phase of the kernel ends. It is nothing
// unless the source defines MLAGEN_TRACE_ON and, for each point in it, MLAGEN_TRACE_<point>:
// the stamps there, which may read the variables in scope (benchmarks/trace_blocks.py,
// trace_exchange.py and trace_seesaw.py prepend those and the buffers the stamps go to).
#ifdef MLAGEN_TRACE_ON
#define MLAGEN_TRACE(point) MLAGEN_TRACE_##point
#else
#define MLAGEN_TRACE(point)
#endif

typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
__device__ __forceinline__ float2 to_float2(elem2_t v) { return __bfloat1622float2(v); }
__device__ __forceinline__ elem2_t from_float2(float a, float b) { return __floats2bfloat162_rn(a, b); }
typedef elem_t kv_t;              // the cache holds the output's dtype
typedef elem_t q_t;               // q holds the output's dtype

// The parameter block every kernel of this file takes by value (mlagen/plan/params.py).
struct __align__(8) VerifyParams {
  const q_t* q;  // (B, S, H, Dl+Dr) in the problem's q_format, last dim contiguous
  const kv_t* kv;  // (num_pages, page_size, row) cached rows in the problem's kv_format, last dim contiguous
  const void* kv_map;  // device address of kv's TMA descriptor (tma variants), else 0
  const int* block_table;  // (B, max_pages) page ids of each request, in order
  const int* seqlens;  // (B,) valid keys per request, draft tokens included
  const unsigned char* tree_mask;  // (B or 1, S, S) bool, tree mask kind only
  const int* q_counts;  // (B,) ragged rows (Variant.rows 'ragged'): request b's real query rows are its last q_counts[b], the rows before them padding; null: all S rows are real
  elem_t* out;  // (B, S, H, Dl)
  float* lse;  // (B, H, S) fp32, natural log; written when the problem has lse
  void* part_o;  // (num_splits, B, S, H, Dl) partial outputs: fp32 unnormalized, or normalized in elem_t (part16)
  float2* part_ml;  // (num_splits, B, S, H) partial (max, sum), log2 domain
  unsigned int* counters;  // (row groups,) finished splits per row group; zero between calls
  const float* kv_scale_ptr;  // e4m3 caches: the one fp32 kv_scale on the device, or null for the kv_scale field
  const float* q_scale_ptr;  // e4m3 queries: the one fp32 q_scale on the device, or null (a host q_scale is folded into scale_log2)
  const int* indices;  // (B, S, topk) gathered keys (Problem.keys 'gathered'): the flat cache row ids, page x page_size + offset, each query token attends to; -1 an unused slot
  const int* topk_length;  // (B,) gathered keys: request b's tokens use their first topk_length[b] slots; null: all topk
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
  long long idx_stride_b;  // elements between requests of indices
  long long idx_stride_s;  // elements between query tokens of indices
  int batch;  // B
  int seqlen_q;  // S, draft tokens per request
  int max_pages;  // columns of block_table
  int num_pages;  // pages in kv; page ids outside [0, num_pages) read as zeros
  int num_splits;  // key-range splits; 1 writes out directly, no merge blocks
  int merge_blocks;  // merge blocks per row group (num_splits > 1), in z slabs >= batch
  int split_keys_log2;  // batch-invariant mode (fixed and adaptive splits): a row group's keys go to the fewest of its num_splits splits that hold at most 2^split_keys_log2 keys each, counted from its own length; 0: all num_splits
  float scale_log2;  // softmax_scale * log2(e)
  float kv_scale;  // e4m3 caches: real value = stored value * kv_scale (when kv_scale_ptr is null)
  int dependent;  // 1: launched as a programmatic dependent (the P exchange then prefetches before its griddepcontrol.wait), 0: plainly
  long long topk;  // slots per query token in indices (gathered keys), else 0
};

// The kernel's namespace, opened once here and closed by the kernel's template before its
// __global__ function: the traits block first, then every fragment.
namespace mlagen_naive_w4_sm120_h64_dl512_dr64_bf16_p64_causal_lse {

// Problem constants, derived in Python (mlagen/plan/validate.py).
constexpr int H = 64;
constexpr int DL = 512;                 // value width (first DL dims of a KV row)
constexpr int DR = 64;                 // rope width
constexpr int D = DL + DR;
constexpr int CHUNK = 8;                 // elements per 16-byte access
constexpr int CH = D / CHUNK;                             // 16-byte chunks per KV row
constexpr int CHV = DL / CHUNK;
constexpr int PAGE = 64;
constexpr int MASK_CAUSAL = 1;
constexpr int MASK_TREE = 0;
constexpr bool WRITE_LSE = true;
constexpr int TREE_ROWS = 64;           // tree-mask rows in shared memory, 64-bit each
constexpr bool FP16 = false;   // elem_t: __half (else __nv_bfloat16)
constexpr float LN2 = 0.693147180559945309f;
static_assert(D % CHUNK == 0 && DL % 256 == 0, "row widths come in whole 16-byte chunks");
static_assert((PAGE & (PAGE - 1)) == 0, "page size is a power of two");

// Kernel shape, derived in Python (mlagen/plan/validate.py).
constexpr int WARPS = 4;
constexpr int THREADS = 128;                   // the threads that compute
static_assert(THREADS == WARPS * 32, "whole warps");
// A producer warpgroup's threads, launched after THREADS (TileSchedule.producer_warps): it loads
// the KV tiles and widens an FP8 cache's bytes; 0 where the computing threads load.
constexpr int PRODUCER_THREADS = 0;
constexpr int HT = 1;                  // heads per block
constexpr int QT = 1;                     // query positions per block
constexpr int ROWS = QT * HT;                             // query rows of a row group
constexpr int HEAD_TILES = H / HT;
static_assert(H % HT == 0, "head tiles cover the heads");

// The kernel's own constants (naive.cu.j2).
constexpr int QCH = (CH + 31) / 32;    // q/kv chunks per lane
constexpr int VCH = CHV / 32;          // value chunks per lane (lane, lane+32, ...)
static_assert(CHV % 32 == 0, "each lane owns whole value chunks");
// The block's dynamic shared memory.
struct SharedMemory {
  float q[D];                                // the query row, fp32
  float red[WARPS * (DL + 2)];               // (WARPS, DL + 2) each warp's acc, m, l
};
static_assert(sizeof(SharedMemory) == 10528, "shared-memory plan matches mlagen/plan/families.py");


// A barrier over the THREADS threads that compute: __syncthreads, or with a producer warpgroup
// barrier 0 counted for them alone. The producer keeps barriers of its own: where it walks code
// that the computing threads share (a balanced range's loop), it steps over this one.
__device__ __forceinline__ void block_sync() {
  if constexpr (PRODUCER_THREADS == 0) {
    __syncthreads();
  } else if (threadIdx.x < THREADS) {               // warp-uniform: whole warpgroups either way
    asm volatile("bar.sync 0, %0;\n" :: "n"(THREADS) : "memory");
  }
}
// Programmatic dependent launch, the first thing every kernel does (sm_90 and newer; no-ops for
// a launch that did not ask for it): the next kernel on the stream may be scheduled once every
// block of this one has started, and nothing here is read before the previous kernel's writes
// are visible. A launch of this kernel therefore only overlaps with its neighbours' block
// scheduling and tails, never with their memory traffic.
__device__ __forceinline__ void pdl_prologue() {
  asm volatile("griddepcontrol.launch_dependents;\n"
               "griddepcontrol.wait;\n" ::: "memory");
}

// pdl_prologue in two steps, for kernels that prefetch between them while the previous grid
// drains (only when launched as a dependent: VerifyParams.dependent).
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Pulls the 128-byte line holding `src` into L2; no thread waits for it. (A per-thread hint:
// the bulk prefetch takes a uniform address, so ptxas loops over a warp's lanes for it.)
__device__ __forceinline__ void prefetch_l2(const void* src) {
  asm volatile("prefetch.global.L2 [%0];\n" :: "l"(src));
}

// A quarter of a Q row and of a KV row (D elements each; nullptr: none) into L2: thread
// `quarter` (0-3) of the row's four takes every fourth 128-byte line.
__device__ __forceinline__ void prefetch_row_quarters(const elem_t* q_row, const elem_t* k_row, int quarter) {
  const char* q = reinterpret_cast<const char*>(q_row);
  const char* k = reinterpret_cast<const char*>(k_row);
#pragma unroll
  for (int c = quarter; c < CH / 8; c += 4) {
    if (q) prefetch_l2(q + c * 128);
    if (k) prefetch_l2(k + c * 128);
  }
}

// Keys block_table can address: every key below has an entry in a request's row.
__device__ __forceinline__ long long key_capacity(const VerifyParams& p) {
  return (long long)p.max_pages * PAGE;
}
// Keys of request b that may be read: the stored length, clamped to what block_table can
// address, so a bad length never makes a kernel read outside the cache it was given.
__device__ __forceinline__ int request_keys(const VerifyParams& p, int b) {
  const int n = p.seqlens[b];
  const long long cap = key_capacity(p);
  return n < 0 ? 0 : (n > cap ? (int)cap : n);
}

// Address of key j in page `page`, or nullptr when the page id is outside the cache.
__device__ __forceinline__ const kv_t* kv_row_in(const VerifyParams& p, int page, int j) {
  if (page < 0 || page >= p.num_pages) return nullptr;
  return p.kv + (long long)page * p.kv_stride_page + (long long)(j % PAGE) * p.kv_stride_row;
}

// Page id of key j of request b, as block_table stores it (checked by kv_row_in).
__device__ __forceinline__ int kv_page(const VerifyParams& p, int b, int j) {
  return p.block_table[(long long)b * p.bt_stride_b + j / PAGE];
}

// Address of key j of request b, or nullptr when its page id is outside the cache.
__device__ __forceinline__ const kv_t* kv_row(const VerifyParams& p, int b, int j) {
  return kv_row_in(p, kv_page(p, b, j), j);
}

// Draft-tree rows as bit sets: bit k of tree_bits(p, b, i, lane) says query i sees draft token k.
// A whole warp reads a row: lane k reads bytes k and k + 32 and two ballots gather them
// (tree_row_bits), one round trip to memory where a loop over the row's bytes pays one per byte,
// on every work item of a persistent block (docs/performance.md, "Tree masks").
struct TreeRowBytes {
  unsigned lo, hi;   // bytes lane and lane + 32 of the row, 0 past S
};
__device__ __forceinline__ unsigned long long tree_row_bits(TreeRowBytes r) {
  return (unsigned long long)__ballot_sync(0xffffffffu, r.lo != 0) | (unsigned long long)__ballot_sync(0xffffffffu, r.hi != 0) << 32;
}
__device__ __forceinline__ const unsigned char* tree_row(const VerifyParams& p, int b, int i) {
  return p.tree_mask + (long long)b * p.mask_stride_b + (long long)i * p.mask_stride_q;
}
__device__ __forceinline__ unsigned long long tree_bits(const VerifyParams& p, int b, int i, int lane) {
  const unsigned char* row = tree_row(p, b, i);
  return tree_row_bits({lane < p.seqlen_q ? row[lane] : 0u, lane + 32 < p.seqlen_q ? row[lane + 32] : 0u});
}
// The same bytes, read where the call stands (PTX loads, which the compiler keeps in order with
// the other asm statements): a kernel that runs one tile a block issues them before its KV
// copies and gathers the bits after, so their round trip overlaps the copies'. Written in C++,
// the loads sink to the ballots, after the copies (docs/performance.md, "Tree masks").
__device__ __forceinline__ TreeRowBytes fetch_tree_row(const VerifyParams& p, int b, int i, int lane, bool live) {
  const unsigned char* row = tree_row(p, b, i);
  TreeRowBytes r = {0u, 0u};
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.u8 %0, [%3];\n"
               " setp.ne.b32 p, %4, 0;\n @p ld.global.u8 %1, [%5];\n}\n"
               : "+r"(r.lo), "+r"(r.hi)
               : "r"((int)(live && lane < p.seqlen_q)), "l"(row + lane), "r"((int)(live && lane + 32 < p.seqlen_q)), "l"(row + lane + 32));
  return r;
}

// Lane 0 stores a row's bits to shared memory. The store is PTX: written in C++, it makes ptxas
// keep the wgmma kernels' shared-memory descriptors in ordinary registers, and each wgmma of the
// tile loop then waits on R2UR moves (docs/performance.md, "Code layout and the compiler").
__device__ __forceinline__ void store_tree_row(unsigned long long* dst, unsigned long long row, int lane) {
  if (lane == 0) asm volatile("st.shared.u64 [%0], %1;\n" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(row) : "memory");
}

// The same rows in two steps, for a kernel that runs one tile a block: fetch (warp w takes rows
// w, w + WARPS_Q, ...) with its first loads, then store the bits once its KV copies went out.
template <int ROWS_Q, int WARPS_Q>
struct TreeRows {
  static constexpr int PER_WARP = (ROWS_Q + WARPS_Q - 1) / WARPS_Q;
  TreeRowBytes row[PER_WARP];
  __device__ __forceinline__ void fetch(const VerifyParams& p, int b, int q0, int S, int warp, int lane) {
#pragma unroll
    for (int k = 0; k < PER_WARP; ++k) {
      const int r = warp + k * WARPS_Q;
      row[k] = fetch_tree_row(p, b, q0 + r, lane, r < ROWS_Q && q0 + r < S);
    }
  }
  __device__ __forceinline__ void store(unsigned long long* bits, int warp, int lane) const {
#pragma unroll
    for (int k = 0; k < PER_WARP; ++k)
      if (warp + k * WARPS_Q < ROWS_Q) store_tree_row(bits + warp + k * WARPS_Q, tree_row_bits(row[k]), lane);
  }
};

// The tree-mask rows of queries q0 .. q0 + ROWS_Q - 1 into bits[0, ROWS_Q), 0 past S: one warp
// a row, every warp of the block calling.
template <int ROWS_Q, int WARPS_Q>
__device__ __forceinline__ void load_tree_rows(const VerifyParams& p, int b, int q0, int S, unsigned long long* bits,
                                               int warp, int lane) {
  for (int r = warp; r < ROWS_Q; r += WARPS_Q) store_tree_row(bits + r, q0 + r < S ? tree_bits(p, b, q0 + r, lane) : 0ull, lane);
}

// Whether query i (of S) sees key j (of n keys): prefix keys always, draft keys by the mask.
// `bits` is tree_bits(...) of the row for tree masks, unused otherwise. Written with `&` and
// `|`, not early returns, so that a tile's mask compiles to selects rather than a branch per key.
__device__ __forceinline__ bool key_visible(int j, int n, int i, int S, unsigned long long bits) {
  const int prefix = n - S;          // the S draft tokens sit at n-S .. n-1
  const int d = j - prefix;          // draft index of key j (negative in the prefix)
  const bool draft = MASK_CAUSAL ? d <= i : (MASK_TREE ? ((bits >> (d & 63)) & 1ull) != 0 : true);
  return (j < n) & ((d < 0) | draft);
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

// 16-byte global->shared copy to shared address `dst`; `bytes` 0 fills zeros and reads nothing
// (src must still be some global address).
__device__ __forceinline__ void cp_async16_to(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16_to(smem_addr(dst), src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// The e4m3 cache's kv_scale: the device value when given one, else the launch's.
__device__ __forceinline__ float kv_scale_of(const VerifyParams& p) {
  return p.kv_scale_ptr != nullptr ? *p.kv_scale_ptr : p.kv_scale;
}

// The e4m3 queries' q_scale on the device, or 1 when the host folded it into scale_log2.
__device__ __forceinline__ float q_scale_of(const VerifyParams& p) {
  return p.q_scale_ptr != nullptr ? *p.q_scale_ptr : 1.f;
}

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const elem2_t* h = reinterpret_cast<const elem2_t*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) { const float2 t = to_float2(h[e]); f[2 * e] = t.x; f[2 * e + 1] = t.y; }
}

// Chunk c (dims 8c .. 8c + 7) of the cached row at `row` as floats: its 16-bit values, or an FP8
// row's dequantized (the cache holds q's dtype; `scale` is unused).
__device__ __forceinline__ void kv_chunk(const kv_t* row, int c, float scale, float* f) {
  unpack8(*reinterpret_cast<const uint4*>(row + c * CHUNK), f);
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

// Output row (b, i, h).
__device__ __forceinline__ elem_t* out_row(const VerifyParams& p, int b, int i, int h) {
  return p.out + (long long)b * p.out_stride_b + (long long)i * p.out_stride_s + (long long)h * p.out_stride_h;
}

// Writes vals[0..N) * inv to dst as elem_t: one 16-, 8- or 4-byte store (N = 8, 4 or 2).
template <int N>
__device__ __forceinline__ void store_elems(elem_t* dst, const float* vals, float inv) {
  static_assert(N == 8 || N == 4 || N == 2, "16-, 8- or 4-byte stores");
  if constexpr (N == 8) {
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = vals[e] * inv;
    *reinterpret_cast<uint4*>(dst) = pack8(f);
  } else if constexpr (N == 4) {
    uint2 v;
    elem2_t* h2 = reinterpret_cast<elem2_t*>(&v);
    h2[0] = from_float2(vals[0] * inv, vals[1] * inv);
    h2[1] = from_float2(vals[2] * inv, vals[3] * inv);
    *reinterpret_cast<uint2*>(dst) = v;
  } else {
    *reinterpret_cast<elem2_t*>(dst) = from_float2(vals[0] * inv, vals[1] * inv);
  }
}

// Writes `vals` (N = 8, 4 or 2 consecutive dims starting at `d0`) of output row (b, i, h),
// divided by l; an empty row (l == 0) writes zeros.
template <int N>
__device__ __forceinline__ void store_out(const VerifyParams& p, int b, int i, int h, int d0,
                                          const float* vals, float l) {
  store_elems<N>(out_row(p, b, i, h) + d0, vals, l > 0.f ? 1.f / l : 0.f);
}

// Workspace rows from one split's (slot's) row (b, i, h) to the next one's: a split holds every
// request's rows; a balanced-split slot holds one request's (see its work list in merge.cuh.j2),
// with ragged rows one request's per row-group slot, each over whole query tiles.
__device__ __forceinline__ long long part_slot_rows(const VerifyParams& p) {
  return (long long)p.batch * p.seqlen_q * H;
}

// Index of row (split, b, i, h) in the partial-result workspace (the balanced split passes its
// slot as `split`). With ragged rows a slot's request numbers are unique within one row-group
// slot's list only, and that list holds different query tiles of its requests: the row goes to
// its position in the slot's query tile, qs (a split block's own, blockIdx.x / head tiles; a
// merge block passes the group's).
__device__ __forceinline__ long long part_row(const VerifyParams& p, int split, int b, int i, int h,
                                              int qs = blockIdx.x / HEAD_TILES) {
  const long long row = ((long long)b * p.seqlen_q + i) * H + h;
  return split * part_slot_rows(p) + row;
}

// Blocks of `bn` keys of [0, limit) that split `split` of `num_splits` owns: [*begin, *end),
// in runs of UNIT blocks (the seesaw's pairs: only the last split can end on half a pair; a
// split past the end owns none).
template <int UNIT = 1>
__device__ __forceinline__ void split_blocks(int limit, int bn, int split, int num_splits,
                                             int* begin, int* end) {
  const int blocks = (limit + bn - 1) / bn;
  const int per = (blocks + num_splits * UNIT - 1) / (num_splits * UNIT) * UNIT;
  const int b0 = split * per;
  *begin = b0 < blocks ? b0 : blocks;
  *end = b0 + per < blocks ? b0 + per : blocks;
}

// The splits of row group (b, queries q0 .. q0 + qt - 1): num_splits, or with
// p.split_keys_log2 > 0 (batch-invariant mode) the fewest of them whose ranges hold at most
// 2^split_keys_log2 keys each. The count follows from the request's own length, and so do its
// split boundaries and the bits of its result; the group's blocks of higher splits do nothing.
// The length goes through a warp maximum, whose result is a uniform register: ptxas then sees
// the branches on the count as not divergent. (A shift, where a division by a run-time count
// would put ~20 more instructions in the prologue ahead of the tile loop, twice.)
__device__ __forceinline__ int group_splits(const VerifyParams& p, int b, int q0, int qt) {
  if (p.split_keys_log2 <= 0) return p.num_splits;
  const int S = p.seqlen_q, q_end = q0 + qt < S ? q0 + qt : S, k = (int)p.split_keys_log2;
  const int limit = __reduce_max_sync(0xffffffffu, key_limit(request_keys(p, b), S, q_end));
  const int splits = (int)(((unsigned)limit + (1u << k) - 1) >> k);
  return splits < 1 ? 1 : (splits < p.num_splits ? splits : p.num_splits);
}


}  // namespace mlagen_naive_w4_sm120_h64_dl512_dr64_bf16_p64_causal_lse

// grid: (H, S, B); block: 128 threads; dynamic shared memory 10528 bytes.
extern "C" __global__ void __launch_bounds__(128)
mlagen_naive_w4_sm120_h64_dl512_dr64_bf16_p64_causal_lse_main(const VerifyParams p) {
  using namespace mlagen_naive_w4_sm120_h64_dl512_dr64_bf16_p64_causal_lse;
  pdl_prologue();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SharedMemory& smem = *reinterpret_cast<SharedMemory*>(smem_raw);
  float* sq = smem.q;
  float* sred = smem.red;
  const int h = blockIdx.x, i = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int S = p.seqlen_q;
  const int n = request_keys(p, b);

  const q_t* qrow = p.q + (long long)b * p.q_stride_b + (long long)i * p.q_stride_s + (long long)h * p.q_stride_h;
  for (int c = threadIdx.x; c < CH; c += blockDim.x)
    unpack8(*reinterpret_cast<const uint4*>(qrow + c * CHUNK), sq + c * CHUNK);
  const unsigned long long bits = MASK_TREE ? tree_bits(p, b, i, lane) : 0ull;
  __syncthreads();

  float m = -INFINITY, l = 0.f;
  float acc[VCH * CHUNK] = {};
  const float kv_scale = 1.f;
  const float score_scale = p.scale_log2;
  const int limit = key_limit(n, S, i + 1);
  for (int j = warp; j < limit; j += WARPS) {
    if (!key_visible(j, n, i, S, bits)) continue;
    const kv_t* row = kv_row(p, b, j);
    if (row == nullptr) continue;     // page id outside the cache: the key is dropped
    float x[QCH][CHUNK];
    float dot = 0.f;
#pragma unroll
    for (int t = 0; t < QCH; ++t) {
      const int c = lane + 32 * t;
      if (c < CH) {
        kv_chunk(row, c, kv_scale, x[t]);
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) dot += x[t][e] * sq[c * CHUNK + e];
      }
    }
    const float s = warp_sum(dot) * score_scale;
    const float m_new = fmaxf(m, s);
    const float alpha = exp2f(m - m_new);   // m == -inf on the first key: alpha = 0
    const float pj = exp2f(s - m_new);
    l = l * alpha + pj;
#pragma unroll
    for (int t = 0; t < VCH; ++t)
#pragma unroll
      for (int e = 0; e < CHUNK; ++e) acc[t * CHUNK + e] = acc[t * CHUNK + e] * alpha + pj * x[t][e];
    m = m_new;
  }

  // Merge the warps: each writes (acc, m, l); warp 0 rescales and sums.
  float* mine = sred + warp * (DL + 2);
#pragma unroll
  for (int t = 0; t < VCH; ++t)
#pragma unroll
    for (int e = 0; e < CHUNK; ++e) mine[(lane + 32 * t) * CHUNK + e] = acc[t * CHUNK + e];
  if (lane == 0) { mine[DL] = m; mine[DL + 1] = l; }
  __syncthreads();
  if (warp != 0) return;
  float mt = -INFINITY;
  for (int w = 0; w < WARPS; ++w) mt = fmaxf(mt, sred[w * (DL + 2) + DL]);
  float lt = 0.f;
  float out[VCH * CHUNK] = {};
  for (int w = 0; w < WARPS; ++w) {
    const float* other = sred + w * (DL + 2);
    if (other[DL + 1] == 0.f) continue;
    const float scale = exp2f(other[DL] - mt);
    lt += other[DL + 1] * scale;
#pragma unroll
    for (int t = 0; t < VCH; ++t)
#pragma unroll
      for (int e = 0; e < CHUNK; ++e) out[t * CHUNK + e] += scale * other[(lane + 32 * t) * CHUNK + e];
  }
#pragma unroll
  for (int t = 0; t < VCH; ++t) store_out<8>(p, b, i, h, (lane + 32 * t) * CHUNK, out + t * CHUNK, lt);
  if (WRITE_LSE && lane == 0) p.lse[((long long)b * H + h) * S + i] = row_lse(mt, lt);
}
