// mlagen generated kernel: mlagen_mma_ht32_qt1_bn32_w4_st1_sm120_h64_dl512_dr64_bf16_p64_causal_lse
// family mma, lockstep schedule: head-tiled split-KV on the tensor cores (scores on
// mma.sync, P V on mma.sync, fp32 accumulation). One block per (query tile x head tile,
// split, request) holds q_tile*head_tile = 32 query rows (padded to 32); each KV tile of
// 32 keys is staged once in shared memory (1-stage cp.async pipeline, KvTiles) and feeds both products:
//   scores S = Q K^T: warps form a 2 x 2 grid over (32 rows, 32 keys) (tile_scores);
//   their row maxima meet in shared memory, P = exp2(S - m) goes to shared memory as bf16;
//   output O += P V, accumulated in registers (tile_pv).
// With one split the block writes out/lse; otherwise partials go to the workspace for the row
// group's merge blocks (z slabs after the requests').
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
namespace mlagen_mma_ht32_qt1_bn32_w4_st1_sm120_h64_dl512_dr64_bf16_p64_causal_lse {

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
constexpr int HT = 32;                  // heads per block
constexpr int QT = 1;                     // query positions per block
constexpr int ROWS = QT * HT;                             // query rows of a row group
constexpr int HEAD_TILES = H / HT;
static_assert(H % HT == 0, "head tiles cover the heads");
constexpr int BN = 32;                    // keys per KV tile
constexpr int STAGES = 1;
// A split's partial rows: fp32 unnormalized, or (PART16) 16-bit rows divided by their own sum.
constexpr bool PART16 = false;
using part_t = float;
// Whether a row group split in two merges its pair without a merge block (split_counters.cuh.j2).
constexpr bool PAIR_MERGE = false;

// The kernel's own constants (mma.cu.j2).
constexpr int M_PAD = 32;
constexpr int WMQ = 2, WNQ = 2;
constexpr int ROWS_W = 16, KEYS_W = 16;     // score tile per warp
constexpr int MTQ = ROWS_W / 16, NTQ = KEYS_W / 8;                  // its m16 / n8 pieces
constexpr int MT = M_PAD / 16;                                      // output m16 pieces
constexpr int DIMS_W = 128;                              // output dims per warp
constexpr int NTO = DIMS_W / 8;
constexpr int PS = 40;                                // P row stride (padded)
// The KV tiles: a 16-bit cache's land in STAGES swizzled 16-bit tiles. An FP8 cache's rows are
// staged as the cache holds them (ROW_BYTES each, STAGED_BYTES for STAGES tiles with padding) and
// dequantized into one 16-bit tile, which both products read (FP8); with a producer warpgroup (WS)
// they land in the back of the STAGES 16-bit tiles they widen into (mma_ws_producer.cuh.j2).
constexpr bool FP8 = false;
constexpr bool WS = false;
// e4m3 queries over an e4m3 cache (the fp8_mma schedule): both products run on e4m3 wgmma. Q and the
// STAGES KV stages hold e4m3 bytes in TILE_ROW-byte rows of the same 128-byte swizzled column
// blocks, and after the stages each has a key-major copy of its value dims (VT_BYTES, written by
// the producer) for P·V, whose e4m3 P is P_SCALE times the softmax's.
constexpr bool F8MMA = false;
constexpr int STAGE_BYTES = BN * D * (int)sizeof(elem_t);   // a KV stage
constexpr int ROW_BYTES = 1152;
constexpr int STAGED_BYTES = 0;
constexpr int KV_TILES = FP8 ? 1 : STAGES;                          // 16-bit KV tiles in shared memory
constexpr int AHEAD = FP8 ? STAGES : STAGES - 1;                    // tiles loading while one is used (cp.async)
constexpr int STAGE_ROW = FP8 ? ROW_BYTES : D;                      // a cp.async stage's row, in kv_t values
constexpr int STAGED_CHUNKS = FP8 ? ROW_BYTES / 16 : 0;             // its 16-byte chunks (0: a swizzled 16-bit tile)
static_assert(!FP8 || (ROW_BYTES % 16 == 0 && STAGED_BYTES >= STAGES * BN * ROW_BYTES && STAGED_BYTES % 1024 == 0),
              "staged rows in whole 16-byte chunks; P after them 1024-byte aligned");
// An e4m3 cache's tiles hold its stored values, which 16 bits hold exactly: kv_scale multiplies
// the scores and the output instead of every element.
constexpr bool E4M3 = false;
constexpr bool SEESAW = false;
constexpr int MBARRIERS = 0, LOAD_MBARRIERS = 0;   // TMA loads' (and the seesaw's P hand-offs)

constexpr int MT_O = MT, NT_O = NTO;                                // every warp: all rows, DIMS_W dims
// The epilogue stages the output rows in the Q and KV buffers (free once the tile loop ends) as
// part_t (fp32 unnormalized; with part16 divided by l, in elem_t), rows padded by 8 values so
// the staging stores meet 32 distinct banks (fp32: a half-warp's float2 stores, 4 rows x 4
// lanes; part16: a warp's 4-byte pairs, 8 rows x 4 lanes), and each warp then writes whole rows
// in 16-byte lanes, instead of the accumulator layout's scatter (every warp store touching 8
// rows; ptxas even split the float2 partial stores). Kernels whose buffers are too small for it
// store from registers.
constexpr int STAGE_STRIDE = DL + 8;
constexpr bool STAGE_EPILOGUE = M_PAD * STAGE_STRIDE * (int)sizeof(part_t) <= (M_PAD + KV_TILES * BN) * D * (int)sizeof(elem_t) + STAGED_BYTES;
static_assert(!PART16 || STAGE_EPILOGUE, "16-bit rows always fit the buffers: their epilogue stages them");
constexpr bool SCORES_WGMMA = false, PV_WGMMA = false;   // which products run on wgmma
static_assert(!PV_WGMMA || (MT_O == MTQ && ROWS_W == 16), "P V on wgmma: a thread's output rows are its score rows (o_row0 = 16 * wmq)");
static_assert(WMQ * WNQ == WARPS && ROWS_W * WMQ == M_PAD && KEYS_W * WNQ == BN, "score warp grid");
static_assert(ROWS_W % 16 == 0 && KEYS_W % 16 == 0 && DIMS_W % 16 == 0 && DIMS_W * WARPS == DL, "mma pieces");
static_assert(CH % 8 == 0, "the swizzle permutes chunks within groups of 8");
static_assert((M_PAD * D * 2) % 1024 == 0 && (BN * D * 2) % 1024 == 0, "tiles start 1024-byte aligned");
// The block's dynamic shared memory (1024-byte aligned: the tiles start 1024-byte aligned).
struct SharedMemory {
  elem_t q[M_PAD * D];                       // (M_PAD, D) swizzled
  elem_t kv[KV_TILES * BN * D];              // (KV_TILES, BN, D) swizzled
  elem_t p[M_PAD * PS];                      // (M_PAD, PS) P
  float part[WNQ * M_PAD];                   // (WNQ, M_PAD) row max / sum parts
  float m[M_PAD];                            // (M_PAD,) running row max
  unsigned long long bits[TREE_ROWS];        // the tree mask's rows
};
static_assert(sizeof(SharedMemory) == 77184, "shared-memory plan matches mlagen/plan/mma_plan.py");


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


// A split's partial row: Dl values of part_t, then its (m, l) in part_ml. fp32 values are the
// unnormalized accumulators; with part16 they are divided by the row's own sum l and rounded to
// the output's type: half the bytes to write and read, one more rounding (the merge weighs such
// a row by l as well). (PART16 and part_t are the traits block's.)

// (m, l) of a split's partial row; a row that saw no key gets m = -inf: weight 0 in the merge.
__device__ __forceinline__ float2 partial_stats(float m, float l) {
  return make_float2(l > 0.f ? m : -INFINITY, l);
}

__device__ __forceinline__ part_t* partial_row(const VerifyParams& p, int split, int b, int i, int h,
                                               int qs = blockIdx.x / HEAD_TILES) {
  return static_cast<part_t*>(p.part_o) + part_row(p, split, b, i, h, qs) * DL;
}

// The values of one 16-byte piece of a partial row (4 floats, or 8 of the output's type).
__device__ __forceinline__ void unpack_part(const uint4& v, float* f) {
  if constexpr (PART16) {
    unpack8(v, f);
  } else {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
}

// Ends row (b, i, h) of one split. `direct` (the row group has one split): the row is final,
// out = acc / l and lse. Otherwise the row and (m, l) go to workspace slot `split` for the row
// group's merge blocks. `acc` holds N (8, 4 or 2) consecutive unnormalized dims starting at d0;
// writes_stats picks one thread per row.
template <int N>
__device__ __forceinline__ void finish_row(const VerifyParams& p, int split, bool direct, int b, int i, int h,
                                           int d0, const float* acc, float m, float l,
                                           bool writes_stats) {
  if (direct) {
    store_out<N>(p, b, i, h, d0, acc, l);
    if (WRITE_LSE && writes_stats)
      p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
    return;
  }
  part_t* dst = partial_row(p, split, b, i, h) + d0;
  if constexpr (PART16) {
    store_elems<N>(dst, acc, l > 0.f ? 1.f / l : 0.f);
  } else if constexpr (N % 4 == 0) {     // 16-byte stores (d0 is a multiple of N)
#pragma unroll
    for (int e = 0; e < N / 4; ++e)
      reinterpret_cast<float4*>(dst)[e] = make_float4(acc[4 * e], acc[4 * e + 1], acc[4 * e + 2], acc[4 * e + 3]);
  } else {
#pragma unroll
    for (int e = 0; e < N / 2; ++e) reinterpret_cast<float2*>(dst)[e] = make_float2(acc[2 * e], acc[2 * e + 1]);
  }
  if (writes_stats) p.part_ml[part_row(p, split, b, i, h)] = partial_stats(m, l);
}

// With num_splits > 1 the grid's z slabs 0..B-1 hold the split blocks (x: row group of request z,
// y: split) and the slabs after them the merge blocks: one launch, no combine kernel. A split
// block counts itself done in its row group's counter after writing its partials; each of the
// group's p.merge_blocks merge blocks waits for all its splits' counts, counts itself too (the
// last of all wraps the counter back to 0 for the next launch) and merges its share of the
// group's rows, one row per warp at a time. The wait cannot deadlock: blocks start in grid order
// and every merge block comes after every split block, so those are running or done when it waits.
// Balanced split (kv_split "balanced"): the split blocks are slab 0, (x: row group of a request,
// y: an equal range of the list of all requests' KV tiles, see its work list below), so a range may
// span requests and a request's groups are split wherever a range ends; the merge blocks are the
// slabs after it.
__device__ __forceinline__ int merge_z0(const VerifyParams& p) {   // the first merge slab
  return p.batch;
}

// Row groups (query tile x head tile) of one request.
__device__ __forceinline__ int request_groups(const VerifyParams& p) {
  return ((p.seqlen_q + QT - 1) / QT) * HEAD_TILES;
}

__device__ __forceinline__ unsigned* group_counter(const VerifyParams& p, int b, int x) {
  return p.counters + ((long long)b * request_groups(p) + x);
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* ptr) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// A row group split in two (a fixed split of 2, or a balanced request over two aligned ranges)
// needs no merge block when its partials are 16-bit staged rows: after its range (one segment),
// each of its blocks takes a ticket from the group's counter; the first writes its partial rows
// and counts them done, and the second, its rows still staged in shared memory, waits for that
// count and merges the first's rows with its own straight into the output (end_pair). The
// second writes no partial, and the row group's end waits for no merge block to start on an SM
// the split blocks free (docs/design.md, "The balanced split", has the figure). A group of three or more splits goes through the merge blocks: one block merging them
// all would read every partial through one SM. (The transposed kernel has no pair path: its rows
// split in more than two.) PAIR_MERGE (the traits block) says whether the kernel has it.

// A split block of row group (b, x), after every finish_row of that group: counts itself done
// for the group's merge blocks, which wait for `splits` counts.
// One release by the counting thread: the barrier orders every thread's partial stores before
// its fence, and a gpu-scope release covers what is ordered before it (the pattern of a grid
// barrier). A __threadfence() in every thread would be a sequentially consistent fence per warp
// (MEMBAR.SC.GPU + ERRBAR), the costliest kind, at the end of every split block.
__device__ __forceinline__ void count_split_done(const VerifyParams& p, int b, int x, int splits, bool pair = false) {
  block_sync();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
    if (pair)
      atomicAdd(group_counter(p, b, x), 1u);              // the pair's third count (end_pair)
    else
      atomicInc(group_counter(p, b, x), splits + p.merge_blocks - 1);
  }
}

// Whether a row group of `splits` splits ends as a pair. Only where each split block runs one
// segment (a fixed split; the balanced split's aligned layout): a packed range's block that ended
// one request as the second of its pair would merge before its next request's segment, on its
// range's path (slower: docs/performance.md, "Split and merge"), where a merge block does that
// off it.
// Not with ragged rows: a pair's blocks are those of one row-group slot, which holds different
// row groups of a request from slot to slot.
__device__ __forceinline__ bool pair_merge(int splits) {
  return PAIR_MERGE && splits == 2;
}

// Row (b, i, h): m = max_k m_k;  l = sum_k l_k 2^(m_k - m);  out = sum_k acc_k 2^(m_k - m) / l
// (a part16 row holds acc_k / l_k: its weight is l_k 2^(m_k - m)).
// One warp; partials are read from L2 (other SMs wrote them), so latency decides this on short
// rows and no load may wait on another: the stats of 32 splits (lane k: split k's (m, l)) and the
// rows of the first MERGE_BATCH splits go out together, then the max, the weights and the sums
// when they land, then the next batches (at 6 splits: two L2 round trips, where reading the max,
// then the weights, then 4 + 2 rows takes four). MERGE_BATCH is 3 fp32 rows (4 16-byte loads a
// lane each) because the merge shares the kernel's register allocation with the tile loop: at 4
// the one-stage pvm kernel spills; part16 rows take half the registers, so 6 of them. Rounds of
// more than 32 splits rescale what the earlier rounds summed. A split without keys has l = 0:
// weight 0, by select.
constexpr int MERGE_BATCH = PART16 ? 6 : 3;
__device__ void merge_row(const VerifyParams& p, int b, int i, int h, int lane, int splits, int slot0, int qs) {
  constexpr int E = 16 / (int)sizeof(part_t);   // values per 16-byte load
  constexpr int V = DL / (32 * E);              // 16-byte loads per lane and partial row
  float acc[V * E] = {};
  float m = -INFINITY, l = 0.f;
  for (int k0 = 0; k0 < splits; k0 += 32) {
    const int n = splits - k0 < 32 ? splits - k0 : 32;
    const float2 ml = lane < n ? __ldcg(&p.part_ml[part_row(p, slot0 + k0 + lane, b, i, h, qs)])
                               : make_float2(-INFINITY, 0.f);
    uint4 x[MERGE_BATCH][V];
    const uint4* src = reinterpret_cast<const uint4*>(partial_row(p, slot0 + k0, b, i, h, qs)) + lane;
    const long long split_stride = part_slot_rows(p) * (DL / E);   // in 16-byte loads
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v)
        if (j < n) x[j][v] = __ldcg(src + j * split_stride + 32 * v);
    const float m_new = fmaxf(m, warp_max(ml.y > 0.f ? ml.x : -INFINITY));
    if (m_new == -INFINITY) continue;                    // no keys in these splits yet
    const float w = ml.y > 0.f ? exp2f(ml.x - m_new) : 0.f;   // lane k: split k0 + k's weight
    const float rescale = exp2f(m - m_new);             // 0 on the first round with keys
    l = l * rescale + warp_sum(ml.y * w);
    const float w_row = PART16 ? w * ml.y : w;          // what multiplies the row's values
#pragma unroll
    for (int e = 0; e < V * E; ++e) acc[e] *= rescale;
    m = m_new;
    for (int j0 = 0; j0 < n; j0 += MERGE_BATCH) {
      if (j0 > 0)
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
#pragma unroll
          for (int v = 0; v < V; ++v)
            if (j0 + j < n) x[j][v] = __ldcg(src + (j0 + j) * split_stride + 32 * v);
#pragma unroll
      for (int j = 0; j < MERGE_BATCH; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w_row, (j0 + j) & 31);
        if (j0 + j >= n) break;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          float f[E];
          unpack_part(x[j][v], f);
#pragma unroll
          for (int e = 0; e < E; ++e) acc[E * v + e] += wj != 0.f ? wj * f[e] : 0.f;
        }
      }
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) store_out<E>(p, b, i, h, E * (lane + 32 * v), acc + E * v, l);
  if (WRITE_LSE && lane == 0) p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
}

// A merge block (blockIdx.z >= merge_z0(p); a balanced split passes it the kernel's work list).
// Merge blocks are numbered x fastest, then y, then z slab; number f merges part f / groups of row
// group f % groups (request g / request_groups, tile g % request_groups).
__device__ void merge_block(const VerifyParams& p) {
  const int gx = request_groups(p);
  const long long groups = (long long)gx * p.batch;
  const long long f = ((long long)(blockIdx.z - merge_z0(p)) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (f >= groups * p.merge_blocks) return;             // the last slab's spare blocks
  const int part = (int)(f / groups), g = (int)(f % groups);
  const int x = g % gx, b = g / gx;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h0 = (x % HEAD_TILES) * HT;
  const int q0 = (x / HEAD_TILES) * QT;
  const int splits = group_splits(p, b, q0, QT), slot0 = 0, qs = 0;   // (qs: balanced only)
  if (splits == 1 || pair_merge(splits)) return;        // its split block wrote it, or the pair's second merges it
  unsigned* counter = group_counter(p, b, x);
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < (unsigned)splits) __nanosleep(100);
    atomicInc(counter, splits + p.merge_blocks - 1);
  }
  MLAGEN_TRACE(merge_wait);
  block_sync();   // the partials thread 0 acquired are visible to the whole block
  const int per = (ROWS + p.merge_blocks - 1) / p.merge_blocks;
  const int end = (part + 1) * per < ROWS ? (part + 1) * per : ROWS;
  for (int r = part * per + warp; r < end; r += WARPS) {
    const int i = q0 + r / HT, h = h0 + r % HT;
    if (i < p.seqlen_q) merge_row(p, b, i, h, lane, splits, slot0, qs);
  }
}




// Element offset of 16-byte chunk `c` of row `r` in a tile of NROWS rows: the tile is stored as
// D/64 column blocks of [NROWS][64] (128-byte rows) and chunks are XOR-swizzled by row % 8, so
// 8 rows read at one chunk column hit 8 bank groups. This is also the K-major 128-byte-swizzle
// layout wgmma descriptors read (blocks start 1024-byte aligned).
template <int NROWS>
__device__ __forceinline__ int swz(int r, int c) {
  return (c >> 3) * (NROWS * 64) + r * 64 + (((c ^ r) & 7) << 3);
}

// Four 8x8 16-bit matrices from shared memory, lane l giving row l % 8 of matrix l / 8 (with
// .trans, each matrix transposed): a whole m16k16 mma.sync A piece, or two n8k16 B pieces.
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Orders this thread's shared-memory stores and landed cp.async data before the async proxy's reads
// (wgmma operands): where products that read them run on wgmma (ON), else nothing.
template <bool ON>
__device__ __forceinline__ void async_proxy_fence() {
  if constexpr (ON) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// c += a * b for one m16n8k16 piece.
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
  if (FP16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// s += Q K^T for this warp's score piece, rows [wmq*ROWS_W, +ROWS_W) x keys [wnq*KEYS_W, +KEYS_W)
// over all D dims: Q at shared address `q`, the KV tile at `tile`, both swizzled.
__device__ __forceinline__ void scores_mma(float (&s)[MTQ][NTQ][4], unsigned q, unsigned tile, int wmq, int wnq, int lane) {
#pragma unroll 4
  for (int ks = 0; ks < D / 16; ++ks) {
    unsigned a[MTQ][4], bk[NTQ / 2][4];
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
      ldsm_x4(q + 2 * swz<M_PAD>(wmq * ROWS_W + mt * 16 + lane % 16, 2 * ks + lane / 16), a[mt]);
#pragma unroll
    for (int np = 0; np < NTQ / 2; ++np) {
      const int mi = lane / 8;
      ldsm_x4(tile + 2 * swz<BN>(wnq * KEYS_W + np * 16 + lane % 8 + 8 * (mi / 2), 2 * ks + mi % 2), bk[np]);
    }
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTQ; ++nt) mma16816(s[mt][nt], a[mt], &bk[nt / 2][2 * (nt % 2)]);
  }
}
// s = Q K^T of tile kb (its 16-bit tile at `tile`) for this warp's score piece, the KV
// pipeline's copies of a later tile issued first (kv.load_before_scores).
template <class Tiles>
__device__ __forceinline__ void tile_scores(float (&s)[MTQ][NTQ][4], unsigned q, unsigned tile, Tiles& kv, int kb, int wmq,
                                            int wnq, int lane) {
  kv.load_before_scores(kb);
  scores_mma(s, q, tile, wmq, wnq, lane);
}

// o += P V for this warp's output dims [warp*DIMS_W, +DIMS_W), all rows, over the tile's BN keys:
// P at shared address `pa` (padded rows of PS), V = the KV tile at `tile` read transposed.
__device__ __forceinline__ void pv_mma(float (&o)[MT][NTO][4], unsigned pa, unsigned tile, int warp, int lane) {
#pragma unroll 2
  for (int ks = 0; ks < BN / 16; ++ks) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldsm_x4(pa + 2 * ((mt * 16 + lane % 16) * PS + ks * 16 + 8 * (lane / 16)), a[mt]);
#pragma unroll
    for (int np = 0; np < NTO / 2; ++np) {
      unsigned bv[4];
      const int mi = lane / 8;
      ldsm_x4_t(tile + 2 * swz<BN>(ks * 16 + lane % 8 + 8 * (mi % 2), (warp * DIMS_W + np * 16) / 8 + mi / 2), bv);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(o[mt][2 * np], a[mt], bv);
        mma16816(o[mt][2 * np + 1], a[mt], bv + 2);
      }
    }
  }
}
// o += P V of tile kb for this warp's dims, then the KV pipeline's lookups (kv.during_pv).
template <class Tiles>
__device__ __forceinline__ void tile_pv(float (&o)[MT_O][NT_O][4], unsigned pa, unsigned tile, Tiles& kv, int kb, int warp,
                                        int, int lane) {
  pv_mma(o, pa, tile, warp, lane);
  kv.during_pv(kb);
}
// Element offset of P(row, key) in shared memory: padded rows for ldmatrix.
__device__ __forceinline__ int p_off(int row, int key) { return row * PS + key; }


// Running max of `row` after the current tile, from the one in sM and every warp's tile maximum.
// It moves only when the tile's maximum passes it by more than RESCALE_SLACK (log2 units), so on
// most tiles of a long row no output row needs the 2^(m_old - m_new) rescale (its multiplies sit
// between the softmax and P.V issue). Exact either way: P = 2^(s - m) then reaches at most
// 2^RESCALE_SLACK (fp32 sums, and bf16/fp16 P, hold that with room), and out = acc / l and the
// lse use the same m.
constexpr float RESCALE_SLACK = 8.f;
__device__ __forceinline__ float new_max(const float* sM, const float* sPart, int row) {
  const float m = sM[row];
  float tile = -INFINITY;
#pragma unroll
  for (int w = 0; w < WNQ; ++w) tile = fmaxf(tile, sPart[w * M_PAD + row]);
  return tile > m + RESCALE_SLACK ? tile : m;      // m = -inf: any finite tile maximum moves it
}

// One thread's share of loading NROWS rows with cp.async: 8 threads per row (thread `tid` of
// NT), each one 16-byte chunk of every 128 bytes of the row, so a warp reads whole 128-byte lines.
// The thread's rows are tid/8 + k*NT/8 (pass k), and every copy's addresses are a per-row base
// plus constants. Two layouts:
// - ROW_CHUNKS 0: a swizzled [NROWS][D] tile of T, column blocks of [NROWS][128 bytes] with
//   chunks XOR-swizzled by row % 8 (`swz` for elem_t); a thread's rows share row % 8 and so its
//   chunk offset. A row of 1-byte values that ends inside a block (e4m3 queries: 576 bytes)
//   leaves that block's last chunks uncopied.
// - ROW_CHUNKS > 0: rows as the cache holds them (an FP8 cache's, T = kv_t), ROW_CHUNKS 16-byte
//   chunks each, one after another in a staging tile; a row's chunks past ROW_CHUNKS are skipped
//   by a PTX predicate (the count is no multiple of the 8 threads).
// prepare() does the row lookups and copy() issues one 128-byte column of every row: the two may
// be a tile apart, and one tile's copies may be spread between other instructions (the score
// wgmmas).
template <int NROWS, int NT, typename T = elem_t, int ROW_CHUNKS = 0>
struct RowLoad {
  static_assert(NT % 64 == 0, "NT/8 rows per pass keep row % 8");
  static constexpr bool STAGED = ROW_CHUNKS > 0;
  static constexpr int PASSES = (NROWS * 8 + NT - 1) / NT;
  static constexpr int ROW = STAGED ? ROW_CHUNKS * 16 : 128;   // bytes between rows in the destination
  static constexpr int COLUMNS = STAGED ? (ROW_CHUNKS + 7) / 8 : (D * (int)sizeof(T) + 127) / 128;   // copy()'s columns
  static constexpr int TAIL = D * (int)sizeof(T) / 16 % 8;    // chunks of a tile row's last block (0: whole)
  const T* src[PASSES];        // this thread's chunk of each row's first 128 bytes
  int bytes[PASSES];           // 16, or 0 to zero-fill the row
  unsigned dst;                // the chunk's byte offset in the destination's row tid/8
  int row0;                    // tid/8

  // `row_ptr(r, k)`: global address of row r (pass k), or nullptr to zero-fill it.
  template <typename RowPtr>
  __device__ __forceinline__ void prepare(int tid, const T* fallback, RowPtr row_ptr) {
    row0 = tid / 8;
    const int sub = tid % 8;
    dst = STAGED ? row0 * ROW + sub * 16 : row0 * 128 + (((sub ^ row0) & 7) << 4);
#pragma unroll
    for (int k = 0; k < PASSES; ++k) {
      const int r = row0 + k * (NT / 8);
      const T* p = r < NROWS ? row_ptr(r, k) : nullptr;
      src[k] = (p ? p : fallback) + sub * (16 / (int)sizeof(T));
      bytes[k] = p ? 16 : 0;
    }
  }
  // Column `blk` (bytes 128 blk .. 128 blk + 127 of every prepared row), into the destination at
  // shared address `tile`.
  __device__ __forceinline__ void copy(unsigned tile, int blk) const {
#pragma unroll
    for (int k = 0; k < PASSES; ++k)
      if (NROWS % (NT / 8) == 0 || row0 + k * (NT / 8) < NROWS) {
        if constexpr (STAGED) {
          const int take = (int)(threadIdx.x % 8) + 8 * blk < ROW_CHUNKS;   // chunk sub + 8 blk of the row
          asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n"
                       :: "r"(tile + dst + k * (NT / 8) * ROW + blk * 128), "l"(src[k] + blk * 128), "r"(bytes[k]),
                          "r"(take));
        } else if (TAIL == 0 || blk + 1 < COLUMNS || (int)(threadIdx.x % 8) < TAIL) {
          cp_async16_to(tile + dst + k * (NT / 8) * 128 + blk * (NROWS * 128), src[k] + blk * (128 / (int)sizeof(T)),
                        bytes[k]);
        }
      }
  }
  __device__ __forceinline__ void copy_all(unsigned tile) const {
#pragma unroll
    for (int blk = 0; blk < COLUMNS; ++blk) copy(tile, blk);
  }
};


// A segment's KV tiles [kb_begin, kb_end) of request b (n keys), copied with cp.async by every
// thread, one commit group a tile, into STAGES stages of rows STAGE_ROW kv_t values apart. Each
// tile loads in three steps a tile apart (docs/performance.md, "Loads and pipelines"): the
// block-table ids are read (fetch_pages) a tile before the row lookups (prepare), and the lookups
// a tile before the copies, so no copy waits on a dependent global read. With gathered keys the ids are the row
// ids the segment's query token lists, and each row is copied from its own address.
struct KvRows {
  using Load = RowLoad<BN, THREADS, kv_t, STAGED_CHUNKS>;
  const VerifyParams& p;
  int b, n, kb_begin, kb_end, t_base;
  elem_t* sKV;                     // (KV_TILES, BN, D) swizzled 16-bit tiles
  kv_t* sStage;                    // (STAGES, BN, STAGE_ROW): where the copies land
  Load kv;                         // the prepared copies of the next tile to load
  int next_pages[Load::PASSES];    // block-table ids of the tile after it (-1: none)

  __device__ __forceinline__ KvRows(const VerifyParams& p, int b, int n, int kb_begin, int kb_end, int tiles_done,
                                    elem_t* sKV, kv_t* sStage, unsigned long long*)
      : p(p), b(b), n(n), kb_begin(kb_begin), kb_end(kb_end), t_base(tiles_done), sKV(sKV), sStage(sStage) {}
  static __device__ __forceinline__ void init(unsigned long long*, const VerifyParams&) {}   // (no mbarriers)
  __device__ __forceinline__ void fetch_pages(int kb) {
#pragma unroll
    for (int k = 0; k < Load::PASSES; ++k) {
      const int r = threadIdx.x / 8 + k * (THREADS / 8), j = kb * BN + r;
      next_pages[k] = r < BN && j < n ? kv_page(p, b, j) : -1;
    }
  }
  // Tile kb's copies, and the pages of the tile after it. Past kb_end: zero-fill (those copies
  // land in a free buffer). (The lookup compares with a local copy of kb_end: read through this
  // struct inside the lambda, it costs the wgmma tiles up to 5 registers.)
  __device__ __forceinline__ void prepare(int kb) {
    const int end = kb_end;
    kv.prepare(threadIdx.x, p.kv, [&](int r, int k) { return kb < end ? kv_row_in(p, next_pages[k], kb * BN + r) : nullptr; });
    fetch_pages(kb + 1);
  }
  __device__ __forceinline__ kv_t* stage_rows(int kb) const { return sStage + ((kb - kb_begin) % STAGES) * BN * STAGE_ROW; }
  __device__ __forceinline__ unsigned stage(int kb) const { return smem_addr(stage_rows(kb)); }
  // The first AHEAD tiles, one commit group each (Q's copies, issued just before, join the first).
  __device__ __forceinline__ void start() {
    fetch_pages(kb_begin);
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      prepare(kb_begin + s);
      if (kb_begin + s < kb_end) kv.copy_all(stage(kb_begin + s));
      cp_async_commit();
    }
    prepare(kb_begin + AHEAD);
  }
  __device__ __forceinline__ void release(int) const {}
  // The block's tiles after this segment's.
  __device__ __forceinline__ int tiles_after() const { return t_base + kb_end - kb_begin; }
};


// 16-bit rows land in STAGES swizzled tiles, AHEAD = STAGES - 1 of them loading while one is used;
// a tile's copies go out during the previous tile's scores, into the buffer that tile used. The
// lockstep loop calls, per tile: acquire, the products with the hooks, release.
struct KvTiles : KvRows {
  using KvRows::KvRows;
  // Waits for tile kb and for every thread's use of the tile before it; returns its shared address.
  __device__ __forceinline__ unsigned acquire(int kb) {
    if (STAGES == 1) {                                    // one buffer: refill it once all used it
      __syncthreads();
      kv.copy_all(stage(kb));
      cp_async_commit();
      prepare(kb + 1);
    }
    cp_async_wait<STAGES == 1 ? 0 : STAGES - 2>();
    async_proxy_fence<SCORES_WGMMA>();                    // cp.async data -> wgmma reads
    __syncthreads();                                      // tile kb landed; tile kb-1 fully used
    MLAGEN_TRACE(tile_landed);
    return stage(kb);
  }
  // With two or more stages tile kb + AHEAD's copies go into tile kb-1's buffer during tile kb's
  // scores: a column block at a time between the score wgmmas (the tensor cores stay fed while
  // this warp issues them) ...
  __device__ __forceinline__ void load_during_scores(int kb, int blk) const {
    if (STAGES > 1) kv.copy(stage(kb + AHEAD), blk);
  }
  __device__ __forceinline__ void scores_issued() const { cp_async_commit(); }
  // ... or all at once before the mma.sync scores.
  __device__ __forceinline__ void load_before_scores(int kb) const {
    if (STAGES > 1) {
      if (kb + AHEAD < kb_end) kv.copy_all(stage(kb + AHEAD));
      cp_async_commit();
    }
  }
  // The lookups of the tile after the one just refilled, while the tensor cores run P V.
  __device__ __forceinline__ void during_pv(int kb) {
    if (STAGES > 1) prepare(kb + AHEAD + 1);
  }
};



// Which rows a segment ends and how: row group x of request b (queries q0.. of S, heads h0..),
// split `split` of the group's `splits` (t0: the balanced range's first tile), written out
// directly when `direct`.
struct SegmentEnd {
  int b, x, S, q0, h0, t0, split, splits;
  bool direct;
};
// A thread's place in the mma fragments: warp (wmq, wnq) of the score grid, fragment coordinates
// g and t, and its piece of the output at rows o_row0.., dims o_dim0...
struct FragmentAt {
  int warp, lane, g, t, wmq, wnq, o_row0, o_dim0;
};

// The end of a segment: o and lpart are this thread's output fragment and row-sum parts, sM the
// rows' running maxima, sPart the warps' sum parts (row_sum(row) adds them once they met), and
// smem_raw the block's shared memory, whose Q and KV buffers stage the rows.
template <class RowSum>
__device__ __forceinline__ void end_segment(const VerifyParams& p, const SegmentEnd& e, const FragmentAt& f,
                                            const float (&o)[MT_O][NT_O][4], const float (&lpart)[MTQ][2],
                                            unsigned char* smem_raw, float* sM, float* sPart, RowSum row_sum) {
  const int b = e.b, x = e.x, S = e.S, q0 = e.q0, h0 = e.h0, split = e.split, splits = e.splits;
  const bool direct = e.direct;
  const int warp = f.warp, lane = f.lane, g = f.g, t = f.t, wmq = f.wmq, wnq = f.wnq, o_row0 = f.o_row0, o_dim0 = f.o_dim0;
  // ---- epilogue: row sums meet in shared memory; write out/lse or the split's partial ----
  // The commit puts Q's copies in a group when no tile ran (an empty split with one stage
  // commits nothing before this): the wait must cover them, the epilogue reuses their buffer.
  cp_async_commit();
  cp_async_wait<0>();
  block_sync();
  MLAGEN_TRACE(epilogue);
#pragma unroll
  for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = lpart[mt][half];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t == 0) sPart[wnq * M_PAD + wmq * ROWS_W + mt * 16 + g + 8 * half] = l;
    }
  block_sync();
  if (STAGE_EPILOGUE) {
    // The output rows go to shared memory over Q and the KV stages, then each warp ends whole
    // rows in 16-byte stores.
    part_t* sStage = reinterpret_cast<part_t*>(smem_raw);   // (M_PAD, STAGE_STRIDE)
#pragma unroll
    for (int mt = 0; mt < MT_O; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = o_row0 + mt * 16 + g + 8 * half;
        if (row >= ROWS || q0 + row / HT >= S) continue;
        const float l = PART16 ? row_sum(row) : 1.f, inv = l > 0.f ? 1.f / l : 0.f;   // part16 stages final values
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          part_t* at = sStage + row * STAGE_STRIDE + o_dim0 + nt * 8 + 2 * t;
          if constexpr (PART16)
            *reinterpret_cast<elem2_t*>(at) = from_float2(o[mt][nt][2 * half] * inv, o[mt][nt][2 * half + 1] * inv);
          else
            *reinterpret_cast<float2*>(at) = make_float2(o[mt][nt][2 * half], o[mt][nt][2 * half + 1]);
        }
      }
    MLAGEN_TRACE(stage_sync);
    block_sync();
    for (int row = warp; row < ROWS; row += WARPS) {
      const int i = q0 + row / HT, h = h0 + row % HT;
      if (i >= S) continue;
      const float l = row_sum(row);
      // a warp store covers 512 contiguous bytes: 16 (8 bf16) a lane out, 16 (4 floats) a partial
      if (direct)
        for (int c = lane; c < DL / 8; c += 32)
          finish_row<8>(p, split, true, b, i, h, 8 * c, sStage + row * STAGE_STRIDE + 8 * c, sM[row], l, c == 0);
      else
        for (int c = lane; c < DL / 4; c += 32)
          finish_row<4>(p, split, false, b, i, h, 4 * c, sStage + row * STAGE_STRIDE + 4 * c, sM[row], l, c == 0);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < MT_O; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = o_row0 + mt * 16 + g + 8 * half;
        const int i = q0 + row / HT, h = h0 + row % HT;
        if (row >= ROWS || i >= S) continue;
        const float l = row_sum(row), m = sM[row];
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) {
          const float pair[2] = {o[mt][nt][2 * half], o[mt][nt][2 * half + 1]};
          finish_row<2>(p, split, direct, b, i, h, o_dim0 + nt * 8 + 2 * t, pair, m, l,
                        o_dim0 == 0 && nt == 0 && t == 0);
        }
      }
  }
  MLAGEN_TRACE(counting);
  if (!direct) count_split_done(p, b, x, splits);
  MLAGEN_TRACE(counted);}


// A segment's KV tiles [*kb_begin, *kb_end): those of row group x of a request with n keys in
// tiles [t0, t1) (a balanced split's range) or split `split` of `splits`'s share of the group's keys.
__device__ __forceinline__ void segment_tiles(const VerifyParams& p, int x, int n, int t0, int t1, int split, int splits,
                                              int* kb_begin, int* kb_end) {
  const int S = p.seqlen_q, q0 = (x / HEAD_TILES) * QT;
  const int q_end = q0 + QT < S ? q0 + QT : S;
  split_blocks(key_limit(n, S, q_end), BN, split, splits, kb_begin, kb_end);
}

// Launched as a programmatic dependent (p.dependent), while the previous grid drains: this
// block's Q rows and first KV tile into L2, four threads a row. The length and page ids read
// here may be stale, as the previous grid may still write them: they only choose what to
// prefetch (bounded by the cache, read past L1 so that no stale line stays there), and the
// segment reads them again after the wait. (A balanced split's ranges need every request's
// length: its blocks do not guess. The seesaw, whose first tiles thread 0 issues as TMA boxes
// right after the wait, loses time with it: docs/performance.md, "Programmatic dependent
// launch".)
__device__ __forceinline__ void prefetch_inputs(const VerifyParams& p) {
  const int b = blockIdx.z, x = blockIdx.x, S = p.seqlen_q;
  if (b >= merge_z0(p)) return;                     // a merge block reads partials only
  const int h0 = (x % HEAD_TILES) * HT, q0 = (x / HEAD_TILES) * QT;
  const int seen = __ldcg(p.seqlens + b);
  const int n = seen < 0 ? 0 : (seen > key_capacity(p) ? (int)key_capacity(p) : seen);
  int kb_begin, kb_end;
  split_blocks(key_limit(n, S, q0 + QT < S ? q0 + QT : S), BN, blockIdx.y, p.num_splits, &kb_begin, &kb_end);
  for (int r = threadIdx.x / 4; r < (ROWS > BN ? ROWS : BN); r += THREADS / 4) {
    const int i = q0 + r / HT, j = kb_begin * BN + r;
    const elem_t* q = r < ROWS && i < S
        ? p.q + (long long)b * p.q_stride_b + (long long)i * p.q_stride_s + (long long)(h0 + r % HT) * p.q_stride_h : nullptr;
    const elem_t* k = r < BN && kb_begin < kb_end && j < n
        ? kv_row_in(p, __ldcg(p.block_table + (long long)b * p.bt_stride_b + j / PAGE), j) : nullptr;
    prefetch_row_quarters(q, k, threadIdx.x % 4);
  }
}

// A row's sum once the epilogue met its parts: the WNQ warps' parts in `part`.
struct RowSum {
  const float* part;
  __device__ __forceinline__ float operator()(int row) const {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < WNQ; ++w) l += part[w * M_PAD + row];
    return l;
  }
};

// What every segment of a block reads: the block's shared memory as the kernel lays it out
// (SharedMemory's members), the scores' and the output's scale factors, and the thread's place
// in the mma fragments. References to the kernel's locals, as a lambda's captures are: ptxas
// then compiles `segment` as it compiles the kernel's own code (with copies, some kernels hold
// more registers: docs/performance.md, "Code layout and the compiler").
struct BlockState {
  unsigned char* smem_raw;
  elem_t* const& sQ;                         // (M_PAD, D) swizzled
  elem_t* const& sKV;                        // the KV tiles
  elem_t* const& sP;                         // (M_PAD, PS) P
  kv_t* const& sStage;                       // an FP8 cache's staged rows (else the KV tiles)
  float* const& sPart;                       // (WNQ, M_PAD) row max / sum parts
  float* const& sM;                          // (M_PAD,) running row max
  unsigned long long* const& sBits;          // (TREE_ROWS,) the tree mask's rows
  unsigned long long* const& sFull;          // (MBARRIERS,) the mbarriers
  const float &kv_scale, &scale_log2;        // the output's factor; the scores' (log2 units)
  const int &warp, &lane, &g, &t, &wmq, &wnq;   // the thread's place in the mma fragments
};

// One row group's share of the work: row group x of request b, over its KV tiles [t0, t1) (a
// balanced split's range; otherwise split `split`'s share of the group's keys), ending as
// workspace slot `split` of the group's `splits`, or written out directly when `direct`.
// tiles_done counts the block's KV tiles over its segments (the pipeline's phases follow it).
__device__ __forceinline__ void segment(const VerifyParams& p, const BlockState& blk, int b, int x, int t0, int t1,
                                        int split, bool direct, int splits, int& tiles_done) {
  unsigned char* const smem_raw = blk.smem_raw;
  elem_t *const sQ = blk.sQ, *const sKV = blk.sKV, *const sP = blk.sP;
  kv_t* const sStage = blk.sStage;
  float *const sPart = blk.sPart, *const sM = blk.sM;
  unsigned long long *const sBits = blk.sBits, *const sFull = blk.sFull;
  const float kv_scale = blk.kv_scale, scale_log2 = blk.scale_log2;
  const int warp = blk.warp, lane = blk.lane, g = blk.g, t = blk.t, wmq = blk.wmq, wnq = blk.wnq;
  MLAGEN_TRACE(segment);
  const int h0 = (x % HEAD_TILES) * HT, q0 = (x / HEAD_TILES) * QT;
  const int S = p.seqlen_q;
  const int n = request_keys(p, b);
  int kb_begin, kb_end;
  segment_tiles(p, x, n, t0, t1, split, splits, &kb_begin, &kb_end);

  {
    RowLoad<M_PAD, THREADS, q_t> ql;
    ql.prepare(threadIdx.x, p.q, [&](int r, int) -> const q_t* {
      const int i = q0 + r / HT;
      if (r >= ROWS || i >= S) return nullptr;
      return p.q + (long long)b * p.q_stride_b + (long long)i * p.q_stride_s + (long long)(h0 + r % HT) * p.q_stride_h;
    });
    ql.copy_all(smem_addr(sQ));
  }
  KvTiles kv(p, b, n, kb_begin, kb_end, tiles_done, sKV, sStage, sFull);
  kv.start();
  if (MASK_TREE) load_tree_rows<QT, WARPS>(p, b, q0, S, sBits, warp, lane);
  if (!SEESAW && threadIdx.x < M_PAD) sM[threadIdx.x] = -INFINITY;   // (the seesaw starts its own)

  float o[MT_O][NT_O][4] = {};
  // This warp's output piece: on wgmma its warpgroup's DL/2 dims, rows 16*wmq..; else all rows, DIMS_W dims.
  const int o_row0 = PV_WGMMA ? 16 * wmq : 0, o_dim0 = PV_WGMMA ? (DL / 2) * wnq : warp * DIMS_W;
  float lpart[MTQ][2] = {};                 // this thread's share of each score row's sum
  const unsigned sQa = smem_addr(sQ), sPa = smem_addr(sP);
  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const unsigned tileA = kv.acquire(kb);               // tile kb landed (16-bit); tile kb-1 fully used

    // ---- scores: rows [wmq*ROWS_W, +ROWS_W) x keys [wnq*KEYS_W, +KEYS_W), k over D ----
    float s[MTQ][NTQ][4] = {};
    tile_scores(s, sQa, tileA, kv, kb, wmq, wnq, lane);

    // ---- mask, scale, and this warp's row maxima ----
    // A tile inside every row's prefix needs no mask. Its padding rows (past ROWS or S) then
    // hold finite scores of zero-filled queries; they are never written out.
    const bool all_visible = (kb + 1) * BN <= n - S;
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = wmq * ROWS_W + mt * 16 + g + 8 * half;
        const int i = q0 + row / HT;
        const bool live = row < ROWS && i < S;
        const unsigned long long bits = MASK_TREE && live ? sBits[row / HT] : 0ull;
        float mx = -INFINITY;
        if (all_visible) {
#pragma unroll
          for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[mt][nt][2 * half + e];
              x *= scale_log2;
              mx = fmaxf(mx, x);
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = kb * BN + wnq * KEYS_W + nt * 8 + 2 * t + e;
              float& x = s[mt][nt][2 * half + e];
              x = live & key_visible(j, n, i, S, bits) ? x * scale_log2 : -INFINITY;   // `&`: a select, no branch
              mx = fmaxf(mx, x);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (t == 0) sPart[wnq * M_PAD + row] = mx;
      }
    block_sync();

    // ---- new row maxima; P = exp2(S - m) to shared memory ----
    float m_prev[MTQ][2], m_next[MTQ][2];     // each score row's running max before / after this tile
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = wmq * ROWS_W + mt * 16 + g + 8 * half;
        m_prev[mt][half] = sM[row];
        m_next[mt][half] = new_max(sM, sPart, row);
      }
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = wmq * ROWS_W + mt * 16 + g + 8 * half;
        const float m_old = m_prev[mt][half], m_new = m_next[mt][half];
        const float m_use = m_new == -INFINITY ? 0.f : m_new;     // an all-masked row stays empty
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTQ; ++nt) {
          const float p0 = exp2f(s[mt][nt][2 * half] - m_use), p1 = exp2f(s[mt][nt][2 * half + 1] - m_use);
          sum += p0 + p1;
          *reinterpret_cast<elem2_t*>(sP + p_off(row, wnq * KEYS_W + nt * 8 + 2 * t)) = from_float2(p0, p1);
        }
        lpart[mt][half] = lpart[mt][half] * exp2f(m_old - m_use) + sum;
      }
    // Output rows of this thread: rescale by exp2(m_old - m_new) before adding this tile.
#pragma unroll
    for (int mt = 0; mt < MT_O; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float m_old, m_new;
        if constexpr (PV_WGMMA) {         // output rows = score rows (o_row0 = 16 * wmq)
          m_old = m_prev[mt][half];
          m_new = m_next[mt][half];
        } else {
          const int row = o_row0 + mt * 16 + g + 8 * half;
          m_old = sM[row];
          m_new = new_max(sM, sPart, row);
        }
        if (m_new == m_old) continue;     // most tiles of a long row: alpha = 1, skip the multiplies
        const float alpha = exp2f(m_old - (m_new == -INFINITY ? 0.f : m_new));
#pragma unroll
        for (int nt = 0; nt < NT_O; ++nt) { o[mt][nt][2 * half] *= alpha; o[mt][nt][2 * half + 1] *= alpha; }
      }
    async_proxy_fence<PV_WGMMA>();                        // P stores -> wgmma reads
    block_sync();                                      // P complete; sM and sPart read

    // ---- O += P V over the tile's keys ----
    tile_pv(o, sPa, tileA, kv, kb, warp, wnq, lane);
    if (threadIdx.x < M_PAD)      // after P V's issue, off its path; read after the next tile's barriers
      sM[threadIdx.x] = new_max(sM, sPart, threadIdx.x);
    kv.release(kb);                                       // tile kb's buffer is free
  }
  tiles_done = kv.tiles_after();
  MLAGEN_TRACE(loop_end);
#pragma unroll
  for (int mt = 0; mt < MT_O; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] *= kv_scale;   // (E4M3: the products ran on stored values)
  end_segment(p, SegmentEnd{b, x, S, q0, h0, t0, split, splits, direct}, FragmentAt{warp, lane, g, t, wmq, wnq, o_row0, o_dim0},
              o, lpart, smem_raw, sM, sPart, RowSum{sPart});
}
}  // namespace mlagen_mma_ht32_qt1_bn32_w4_st1_sm120_h64_dl512_dr64_bf16_p64_causal_lse

// grid: (ceil(S/QT) * H/HT, num_splits, B + merge slabs when num_splits > 1); block: 128 threads;
// dynamic shared memory 77184 bytes.
extern "C" __global__ void __launch_bounds__(128, 1)
mlagen_mma_ht32_qt1_bn32_w4_st1_sm120_h64_dl512_dr64_bf16_p64_causal_lse_main(const VerifyParams p) {
  using namespace mlagen_mma_ht32_qt1_bn32_w4_st1_sm120_h64_dl512_dr64_bf16_p64_causal_lse;
  pdl_trigger();
  if (p.dependent) prefetch_inputs(p);
  pdl_wait();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // SharedMemory's members, in order, as running sums (its sizeof is asserted above): NVRTC 13.0
  // schedules the sm_120 FP8 tiles differently when the pointers are the struct's members.
  elem_t* sQ = reinterpret_cast<elem_t*>(smem_raw);                       // (M_PAD, D) swizzled
  elem_t* sKV = sQ + M_PAD * D;                                           // (KV_TILES, BN, D) swizzled
  // (STAGES, BN, ROW_BYTES) an FP8 cache's staged rows; 16-bit rows land in the 16-bit tiles
  kv_t* sStage = FP8 ? reinterpret_cast<kv_t*>(sKV + KV_TILES * BN * D) : reinterpret_cast<kv_t*>(sKV);
  elem_t* sP = reinterpret_cast<elem_t*>(reinterpret_cast<unsigned char*>(sKV + KV_TILES * BN * D) + STAGED_BYTES);   // (M_PAD, PS)
  float* sPart = reinterpret_cast<float*>(sP + M_PAD * PS);               // (WNQ, M_PAD) row max / sum parts
  float* sM = sPart + WNQ * M_PAD;                                        // (M_PAD,) running row max
  unsigned long long* sBits = reinterpret_cast<unsigned long long*>(sM + M_PAD);   // (TREE_ROWS,)
  const float kv_scale = E4M3 ? kv_scale_of(p) : 1.f;   // the output's factor (E4M3: the products ran on stored values)
  const float scale_log2 = p.scale_log2 * kv_scale;     // the scores'

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;                 // mma fragment coordinates
  // wnq through a lane-0 broadcast: the same value, but ptxas then knows it is warp-uniform.
  const int wmq = warp % WMQ, wnq = __shfl_sync(0xffffffffu, warp / WMQ, 0);   // wgmma: wnq is the warpgroup
  MLAGEN_TRACE(start);
  if (blockIdx.z >= merge_z0(p)) {  // a merge block (split launches only; the balanced seesaw's merge at the end)
    MLAGEN_TRACE(merge_begin);
    merge_block(p);
    MLAGEN_TRACE(merge_end);
    return;
  }
  unsigned long long* sFull = sBits + TREE_ROWS;        // (MBARRIERS,) after the tree-mask rows
  KvTiles::init(sFull, p);
  int tiles_done = 0;                                   // this block's KV tiles over its segments
  const BlockState blk{smem_raw, sQ, sKV, sP, sStage, sPart, sM, sBits, sFull, kv_scale, scale_log2,
                       warp, lane, g, t, wmq, wnq};

  const int splits = group_splits(p, blockIdx.z, (blockIdx.x / HEAD_TILES) * QT, QT);
  if (blockIdx.y < splits) segment(p, blk, blockIdx.z, blockIdx.x, 0, 0, blockIdx.y, splits == 1, splits, tiles_done);
}
