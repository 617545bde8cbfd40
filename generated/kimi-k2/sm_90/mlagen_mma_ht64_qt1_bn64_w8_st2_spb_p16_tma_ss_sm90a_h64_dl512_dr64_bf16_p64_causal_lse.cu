// mlagen generated kernel: mlagen_mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a_h64_dl512_dr64_bf16_p64_causal_lse
// family mma, seesaw schedule: head-tiled split-KV on the tensor cores (scores on
// wgmma, P V on wgmma, fp32 accumulation). One block per (query tile x head tile,
// split, request) holds q_tile*head_tile = 64 query rows (padded to 64); each KV tile of
// 64 keys is staged once in shared memory (2-stage TMA pipeline, KvTiles) and feeds both products:
//   tiles go in pairs, one a warpgroup, each one's softmax running while the other's products
//   do (seesaw_tiles, mma_seesaw.cuh.j2).
// With one split the block writes out/lse; otherwise partials go to the workspace for the row
// group's merge blocks (z slabs after the requests').
#include <cuda_bf16.h>

// sm_90a's own instructions (wgmma, TMA) are in no other target's PTX: an nvcc build
// that also compiles this file for another target stops here, naming the flags to use instead
// (mlagen's own NVRTC compiles name the target exactly).
#if defined(__CUDA_ARCH__) && !defined(__CUDACC_RTC__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "mlagen: this kernel is for sm_90a alone; build it with nvcc -gencode arch=compute_90a,code=sm_90a"
#endif

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
namespace mlagen_mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a_h64_dl512_dr64_bf16_p64_causal_lse {

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
constexpr int WARPS = 8;
constexpr int THREADS = 256;                   // the threads that compute
static_assert(THREADS == WARPS * 32, "whole warps");
// A producer warpgroup's threads, launched after THREADS (TileSchedule.producer_warps): it loads
// the KV tiles and widens an FP8 cache's bytes; 0 where the computing threads load.
constexpr int PRODUCER_THREADS = 0;
constexpr int HT = 64;                  // heads per block
constexpr int QT = 1;                     // query positions per block
constexpr int ROWS = QT * HT;                             // query rows of a row group
constexpr int HEAD_TILES = H / HT;
static_assert(H % HT == 0, "head tiles cover the heads");
constexpr int BN = 64;                    // keys per KV tile
constexpr int STAGES = 2;
// A split's partial rows: fp32 unnormalized, or (PART16) 16-bit rows divided by their own sum.
constexpr bool PART16 = true;
using part_t = elem_t;
// Whether a row group split in two merges its pair without a merge block (split_counters.cuh.j2).
constexpr bool PAIR_MERGE = true;
// The balanced split's work list (split_work_list.cuh.j2): its work unit in KV tiles
// (mlagen.plan.validate.split_unit), a segment's cost and the unsplit slack in units
// (validate's SEGMENT_TILES and UNSPLIT_SLACK_TILES), whether merge blocks run the (empty) range
// loop and merge after it, and whether the work lists hold only the requests' real rows.
constexpr int WORK_UNIT = 2;
constexpr int SEGMENT_COST = 2;
constexpr int UNSPLIT_SLACK = 1;
constexpr bool MERGE_AFTER_RANGES = true;
constexpr bool RAGGED_ROWS = false;

// The kernel's own constants (mma.cu.j2).
constexpr int M_PAD = 64;
constexpr int WMQ = 4, WNQ = 2;
constexpr int ROWS_W = 16, KEYS_W = 32;     // score tile per warp
constexpr int MTQ = ROWS_W / 16, NTQ = KEYS_W / 8;                  // its m16 / n8 pieces
constexpr int MT = M_PAD / 16;                                      // output m16 pieces
constexpr int DIMS_W = 64;                              // output dims per warp
constexpr int NTO = DIMS_W / 8;
constexpr int PS = 72;                                // P row stride (padded)
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
constexpr bool SEESAW = true;
constexpr int MBARRIERS = 6, LOAD_MBARRIERS = 4;   // TMA loads' (and the seesaw's P hand-offs)

// Output on wgmma: warpgroup wnq holds all 64 rows x dims [DL/2*wnq, +DL/2); its warp wmq rows
// 16*wmq.. as one m16 piece of DL/16 n8 pieces (the same register order as mma.sync pieces).
constexpr int MT_O = 1, NT_O = DL / 16;
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
constexpr bool SCORES_WGMMA = true, PV_WGMMA = true;   // which products run on wgmma
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
  unsigned long long full[MBARRIERS];        // the mbarriers
};
static_assert(sizeof(SharedMemory) == 231728, "shared-memory plan matches mlagen/plan/mma_plan.py");


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
  return (long long)p.seqlen_q * H;
}

// Index of row (split, b, i, h) in the partial-result workspace (the balanced split passes its
// slot as `split`). With ragged rows a slot's request numbers are unique within one row-group
// slot's list only, and that list holds different query tiles of its requests: the row goes to
// its position in the slot's query tile, qs (a split block's own, blockIdx.x / head tiles; a
// merge block passes the group's).
__device__ __forceinline__ long long part_row(const VerifyParams& p, int split, int b, int i, int h,
                                              int qs = blockIdx.x / HEAD_TILES) {
  const long long row = (long long)i * H + h;
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

// finish_row for a whole row that is already final in the output's type (divided by l), as
// part16 kernels stage it in shared memory: one warp copies it in 16-byte pieces to out or to
// the split's partial row.
__device__ __forceinline__ void finish_staged_row(const VerifyParams& p, int split, bool direct, int b, int i,
                                                  int h, const elem_t* vals, float m, float l, int lane) {
  uint4* dst = reinterpret_cast<uint4*>(direct ? out_row(p, b, i, h) : partial_row(p, split, b, i, h));
  for (int c = lane; c < DL / 8; c += 32) dst[c] = reinterpret_cast<const uint4*>(vals)[c];
  if (lane == 0) {
    if (!direct) p.part_ml[part_row(p, split, b, i, h)] = partial_stats(m, l);
    else if (WRITE_LSE) p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
  }
}

// finish_staged_row for every row of a row group (query q0 on, head h0 on) staged at sStage +
// r * stride, its max in sM[r] and sum row_sum(r): warp w ends rows w, w + WARPS, ...
template <int ROWS, int HT, int WARPS, class RowSum>
__device__ __forceinline__ void finish_staged_rows(const VerifyParams& p, int split, bool direct, int b, int q0,
                                                   int h0, const elem_t* sStage, int stride, const float* sM,
                                                   RowSum row_sum, int warp, int lane) {
  for (int row = warp; row < ROWS; row += WARPS) {
    const int i = q0 + row / HT, h = h0 + row % HT;
    if (i < p.seqlen_q) finish_staged_row(p, split, direct, b, i, h, sStage + row * stride, sM[row], row_sum(row), lane);
  }
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
  return 1;
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

// The balanced split's work list: request b owns positions [P_b, P_b + span_b) of it, and split
// blocks (x, y) of every row group x own range y, [y*W, (y+1)*W), of gridDim.y equal ranges. Its
// "tiles" T_b are work units (WORK_UNIT) and come from cache_seqlens, on the device, so a
// ragged batch is balanced by the keys it holds. Each warp computes what it needs from the
// lengths alone: no shared memory, no barrier.
// Two ways to lay the list out, both fixed by the lengths, so every block agrees:
// - packed: span_b = C + T_b, C = SEGMENT_COST positions standing for the fixed cost of a block
//   starting the request (its Q, first tiles and epilogue), then its tiles. A range may span
//   requests, a range that starts one streams fewer tiles, and the blocks end together.
// - aligned: every range holds tiles of one request only. With M the fewest tiles a range may
//   hold such that the requests' ceil(T_b / M) ranges fit the grid, span_b = ceil(T_b / M) * W,
//   W = C + M, and request b's ranges share its tiles evenly. Each block then starts one
//   segment: one Q and one partial row per row, where packed ranges that cross a request pay
//   two. Taken when M is at most the packed W, or at most UNSPLIT_SLACK more when every
//   request then takes one range (mlagen/plan/validate.py, UNSPLIT_SLACK_TILES); a ragged batch
//   whose short requests would each hold a range nearly empty stays packed.
// All row groups of a request stream its keys in step (L2 serves all but the first read of a
// tile). Range y's partial of request b goes to workspace slot y + b: one request's slots are
// consecutive and the next request's come after them (its first range is at least this one's
// last), so a launch needs at most gridDim.y + B - 1 slots (mlagen.plan.validate.SplitPlan.partial_rows
// sizes the workspace so).
// Warp sums and maxima on the reduction unit (redux.sync, sm_80+): one instruction, where a
// butterfly takes five shuffles, and its result lands in a uniform register, so ptxas sees the
// branches on it (the layout's, the search's) as not divergent. (With plain butterfly sums the
// balanced kernels lose their uniform-register tile loops and spill: the transposed kernel takes
// ~2500 more SASS instructions and 260 spill stores against 44.)
__device__ __forceinline__ int warp_sum_uniform(int x) { return __reduce_add_sync(0xffffffffu, x); }
__device__ __forceinline__ int warp_max_uniform(int x) { return __reduce_max_sync(0xffffffffu, x); }
// Unsigned throughout: a signed division by a run-time value takes ~25 dependent instructions,
// an unsigned one ~15, and ~7 once its divisor's reciprocal is hoisted.
__device__ __forceinline__ int ceil_div(int a, int d) { return (int)(((unsigned)a + d - 1) / (unsigned)d); }
// The list counts work units of WORK_UNIT KV tiles (mlagen.plan.validate.split_unit): a tile, or the
// seesaw's pair, whose warpgroups take a tile each. Counted in tiles, a seesaw range of an odd
// count would run a padding tile, and ranges would end far apart (docs/performance.md, "Split
// and merge").
// SEGMENT_COST and UNSPLIT_SLACK are validate's SEGMENT_TILES and UNSPLIT_SLACK_TILES in units.
// MERGE_AFTER_RANGES: whether merge blocks run the range loop (empty) and merge after it
// (balanced_block), rather than returning at the top of the kernel. (All four: the traits block.)
// A request's work units: its KV tiles, WORK_UNIT to a unit, rounded up.
__device__ __forceinline__ int request_units(const VerifyParams& p, int b) {
  return ceil_div(request_keys(p, b), BN * WORK_UNIT);
}

// The tiles of a lane's requests, lane + 32k for k < LANE_REQUESTS (0 past the batch), read once
// with their loads in flight together: the work list's passes and lookups then run on registers,
// where a pass that re-reads the lengths one request at a time makes the prologue a chain of
// ~800 dependent instructions a warp. Requests past 32 * LANE_REQUESTS are read again.
constexpr int LANE_REQUESTS = 4;
struct LaneRequests {
  int v[LANE_REQUESTS];   // a value of request lane + 32k
};
// Ragged rows (Variant.rows "ragged"): request b's real rows are its last q_counts[b] of S (the
// rows before them are padding), so its real query tiles are the last `count` of the Q_TILES,
// from `first`. Block x of the grid is then a row-group slot, query-tile slot x / HEAD_TILES of
// head tile x % HEAD_TILES: slot qs holds request b's real query tile k = (qs - rot_b) mod
// Q_TILES while k < count (tile first + k), and no row group of b otherwise. rot_b, the real tiles
// of the requests before b modulo Q_TILES, deals each request's tiles round the slots after the
// previous request's, so that every slot's work list (its requests only) holds about the same
// work; a block's range streams one slot's list. With all rows real rot_b = 0 and slot qs holds
// tile qs: the dense layout. So it is where the requests are not dealt (`dealt`): q_counts null,
// or more than 32 LANE_REQUESTS requests, whose counts the lanes' registers do not hold (the
// padded rows are then computed, as on the dense kernels). RAGGED_ROWS (the traits block) says
// whether the kernel deals them.
struct RealTiles {
  int first, count;   // request b's first real query tile; its real tiles (0 without real rows)
};
__device__ __forceinline__ int query_tiles(const VerifyParams& p) { return ceil_div(p.seqlen_q, QT); }
__device__ __forceinline__ RealTiles real_tiles(const VerifyParams& p, int b) {   // (q_counts given)
  const int S = p.seqlen_q, qn = query_tiles(p);
  const int c = min(max(__ldg(p.q_counts + b), 0), S);
  const int first = (int)((unsigned)(S - c) / (unsigned)QT);   // the tile holding row S - c
  return {first, c > 0 ? qn - first : 0};
}
// Ragged rows: whether the requests are dealt round the slots (rot_b from the lanes' registers).
__device__ __forceinline__ bool dealt(const VerifyParams& p) {
  return RAGGED_ROWS && p.q_counts != nullptr && p.batch <= 32 * LANE_REQUESTS;
}
// The query tile of request b in query-tile slot qs, given its rotation; -1 where b has none.
__device__ __forceinline__ int slot_q_tile(const VerifyParams& p, int b, int qs, int rot) {
  if (!dealt(p)) return qs;
  const RealTiles r = real_tiles(p, b);
  const unsigned qn = query_tiles(p), k = ((unsigned)qs + qn - (unsigned)rot) % qn;
  return k < (unsigned)r.count ? r.first + (int)k : -1;
}
// Request b's work units in query-tile slot qs: request_units where the slot holds one of its row
// groups, else none.
__device__ __forceinline__ int slot_units(const VerifyParams& p, int b, int qs, int rot) {
  if (!dealt(p)) return request_units(p, b);
  return slot_q_tile(p, b, qs, rot) >= 0 ? request_units(p, b) : 0;
}

// rot_b (every lane): the real query tiles of requests 0 .. b-1, modulo Q_TILES; 0 where the
// requests are not dealt.
__device__ __forceinline__ int rotation(const VerifyParams& p, int b, int lane) {
  if (!dealt(p)) return 0;
  int sum = 0;
  for (int k0 = 0; k0 < b; k0 += 32)                    // the same trips in every lane: a uniform loop
    sum += k0 + lane < b ? real_tiles(p, k0 + lane).count : 0;
  return (int)((unsigned)warp_sum_uniform(sum) % (unsigned)query_tiles(p));
}

// The lanes' requests' units in query-tile slot qs (every request's where the rows are dense).
__device__ __forceinline__ LaneRequests lane_tiles(const VerifyParams& p, int qs, int lane) {
  LaneRequests lt;
  int rot = 0;                                            // ragged rows: rot of request 32k
#pragma unroll
  for (int k = 0; k < LANE_REQUESTS; ++k) {
    const int b = lane + 32 * k;
    if (dealt(p)) {
      const int count = b < p.batch ? real_tiles(p, b).count : 0;
      int upto = count;                                   // inclusive scan over the lanes
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, upto, d);
        if (lane >= d) upto += v;
      }
      const int mine = (int)((unsigned)(rot + upto - count) % (unsigned)query_tiles(p));
      rot += __shfl_sync(0xffffffffu, upto, 31);
      lt.v[k] = b < p.batch ? slot_units(p, b, qs, mine) : 0;
    } else {
      lt.v[k] = b < p.batch ? request_units(p, b) : 0;
    }
  }
  return lt;
}

// f(b, tiles of b) for each of this lane's requests b (and for the register slots past the batch,
// with 0 tiles).
template <class F>
__device__ __forceinline__ void for_lane_requests(const VerifyParams& p, const LaneRequests& lt, int lane, F f) {
#pragma unroll
  for (int k = 0; k < LANE_REQUESTS; ++k) f(lane + 32 * k, lt.v[k]);
#pragma unroll 1
  for (int b = lane + 32 * LANE_REQUESTS; b < p.batch; b += 32) f(b, request_units(p, b));   // (such a batch: not dealt)
}

struct WorkList {
  int total;   // the list's length in positions
  int per;     // a range's length, W (0 when the list is empty)
  int tiles;   // aligned: the most tiles a range holds, M; packed: 0
};

// Ranges the aligned layout gives the requests when a range holds at most m tiles (every lane).
__device__ __forceinline__ int aligned_ranges(const VerifyParams& p, const LaneRequests& lt, int m, int lane) {
  int n = 0;
  for_lane_requests(p, lt, lane, [&](int, int t) { n += ceil_div(t, m); });
  return warp_sum_uniform(n);
}

// Positions in the work list of a request with t tiles: none without keys.
__device__ __forceinline__ int request_span(const WorkList& wl, int t) {
  return wl.tiles ? ceil_div(t, wl.tiles) * wl.per : t + (t > 0 ? SEGMENT_COST : 0);
}

// The spans of a lane's register requests, the layout's branch taken once: per request, ptxas
// branched on it and computed the divisor's reciprocal again, four times in a row.
__device__ __forceinline__ LaneRequests lane_spans(const WorkList& wl, const LaneRequests& lt) {
  LaneRequests s;
  if (wl.tiles) {
#pragma unroll
    for (int k = 0; k < LANE_REQUESTS; ++k) s.v[k] = ceil_div(lt.v[k], wl.tiles) * wl.per;
  } else {
#pragma unroll
    for (int k = 0; k < LANE_REQUESTS; ++k) s.v[k] = lt.v[k] + (lt.v[k] > 0 ? SEGMENT_COST : 0);
  }
  return s;
}

// The inclusive scan of the spans s of requests b0 + lane: when list position u lies in one of
// them, that request's (b, P_b, tiles) go to every lane and it returns true; otherwise `base`
// (P_b0) moves past them.
__device__ __forceinline__ bool find_in_chunk(int s, int t, int b0, int u, int lane, int* base, int* b_at,
                                              int* start, int* tiles) {
  int upto = s;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, upto, d);
    if (lane >= d) upto += v;
  }
  const unsigned past = __ballot_sync(0xffffffffu, s > 0 && *base + upto > u);
  if (!past) {
    *base += __shfl_sync(0xffffffffu, upto, 31);
    return false;
  }
  const int j = __ffs(past) - 1;
  *b_at = b0 + j;
  *start = *base + __shfl_sync(0xffffffffu, upto - s, j);
  *tiles = __shfl_sync(0xffffffffu, t, j);
  return true;
}

// The request whose positions hold list position u (P_b <= u < P_b + span_b), its P_b and its
// tiles, or (B, the list's length, 0) when u is past the list. Every lane gets the answer. The
// register chunks' sums go out together, and only the chunk that holds u is scanned.
__device__ __forceinline__ void request_at(const VerifyParams& p, const WorkList& wl, const LaneRequests& lt,
                                           int u, int lane, int* b_at, int* start, int* tiles) {
  const LaneRequests s = lane_spans(wl, lt);
  int sums[LANE_REQUESTS];
#pragma unroll
  for (int k = 0; k < LANE_REQUESTS; ++k) sums[k] = warp_sum_uniform(s.v[k]);
  int base = 0, chunk = LANE_REQUESTS, s_at = 0, t_at = 0;
#pragma unroll
  for (int k = 0; k < LANE_REQUESTS; ++k) {
    if (chunk < LANE_REQUESTS) continue;
    if (base + sums[k] > u) {
      chunk = k;
      s_at = s.v[k];
      t_at = lt.v[k];
    } else {
      base += sums[k];
    }
  }
  *b_at = p.batch;
  *tiles = 0;
  if (chunk < LANE_REQUESTS) {                            // its sum took the count past u: u lies in it
    find_in_chunk(s_at, t_at, 32 * chunk, u, lane, &base, b_at, start, tiles);
    return;
  }
#pragma unroll 1
  for (int b0 = 32 * LANE_REQUESTS; b0 < p.batch; b0 += 32) {
    const int t = b0 + lane < p.batch ? request_units(p, b0 + lane) : 0;   // (such a batch: not dealt)
    if (find_in_chunk(request_span(wl, t), t, b0, u, lane, &base, b_at, start, tiles)) return;
  }
  *start = base;
}

// The launch's work list (every lane): aligned when its ranges hold no more tiles than packed ones
// hold positions, or UNSPLIT_SLACK more when every request then takes one range (no partial
// rows, no merge); packed otherwise. A kernel computes it once, before its split and merge blocks
// part ways: a second inlined copy ahead of the seesaw's tile loop would push that loop further
// past the kernel's first 64 KB, where its warps stall on instruction fetch more often
// (docs/performance.md, "Code layout and the compiler").
__device__ __forceinline__ WorkList balanced_ranges(const VerifyParams& p, const LaneRequests& lt, int lane) {
  const int ranges = gridDim.y;
  int tiles = 0, busy = 0, longest = 0;                   // all requests' tiles, requests with keys, most tiles
  for_lane_requests(p, lt, lane, [&](int, int t) {
    tiles += t;
    busy += t > 0;
    longest = max(longest, t);
  });
  tiles = warp_sum_uniform(tiles);
  busy = warp_sum_uniform(busy);
  longest = warp_max_uniform(longest);
  const int total = tiles + SEGMENT_COST * busy, per = ceil_div(total, ranges);
  const WorkList packed = {total, per, 0};
  if (tiles == 0 || busy > ranges) return packed;
  int m = longest, used = busy;                           // one range a request: fits, as busy <= ranges
  const int at_per = aligned_ranges(p, lt, per, lane);
  if (at_per <= ranges) {
    int lo = ceil_div(tiles, ranges), hi = per;           // ranges * M >= tiles: no fewer than lo
    used = at_per;                                        // the ranges that hi takes
    while (lo < hi) {                                     // the fewest that fit; hi always does
      const int mid = (lo + hi) / 2, n = aligned_ranges(p, lt, mid, lane);
      if (n <= ranges) {
        hi = mid;
        used = n;
      } else {
        lo = mid + 1;
      }
    }
    m = hi;
  } else if (longest > per + UNSPLIT_SLACK) {
    return packed;
  }
  return {used * (SEGMENT_COST + m), SEGMENT_COST + m, m};
}

// The ranges that meet a request of t tiles whose positions start at `start`: the first, and how
// many (its row groups' splits; 0 for a request without keys). A packed range that meets only
// the request's first C positions runs none of it.
__device__ __forceinline__ void request_splits(const WorkList& wl, int t, int start, int* first, int* count) {
  if (t == 0) {
    *first = *count = 0;
  } else if (wl.tiles) {
    *first = (int)((unsigned)start / (unsigned)wl.per);
    *count = ceil_div(t, wl.tiles);
  } else {
    const int t0 = start + SEGMENT_COST;
    *first = (int)((unsigned)t0 / (unsigned)wl.per);
    *count = (int)((unsigned)(t0 + t - 1) / (unsigned)wl.per) - *first + 1;
  }
}

// Tiles [*t0, *t1) of a request (t tiles, positions from `start`) that range [u0, u1) runs; empty
// when the range does not meet them. An aligned request's k ranges share its tiles evenly: range j
// takes t / k, and one more while j < t % k (no product j * t that could pass 2^31).
__device__ __forceinline__ void range_tiles(const WorkList& wl, int t, int start, int u0, int u1, int* t0, int* t1) {
  if (t == 0) {
    *t0 = *t1 = 0;
  } else if (wl.tiles) {
    const unsigned k = ceil_div(t, wl.tiles), j = (unsigned)(u0 - start) / (unsigned)wl.per;
    const unsigned q = (unsigned)t / k, r = (unsigned)t - q * k;
    *t0 = (int)(j * q + min(j, r));
    *t1 = *t0 + (int)q + (j < r);
  } else {
    const int at = start + SEGMENT_COST;
    *t0 = (u0 > at ? u0 : at) - at;
    *t1 = (u1 < at + t ? u1 : at + t) - at;
  }
}

// The balanced split's range loop: split block (x, y) runs range y = blockIdx.y of its row group
// x = blockIdx.x (with ragged rows, of row-group slot x's list), calling segment(b, x, t0, t1,
// split, direct, splits) once for every request the range meets, with that request's row group x
// (with ragged rows, the one slot x holds), its KV tiles [t0, t1) of the range, its workspace
// slot y + b, and whether its one range writes it out directly. A block that `merging` runs an
// empty range (its kernel merges after the loop, so that the merge's code is laid out after the
// tile loop). wl and lt are the kernel's work list and its lanes' request tiles; after the first
// request the loop reads the lengths. Every value of the range goes through a lane-0 broadcast: the same
// values, but ptxas then sees the request loop as uniform and keeps the tile loop's indices and
// shared addresses in uniform registers (without the broadcast every wgmma descriptor is rebuilt
// per instruction: docs/performance.md, "Code layout and the compiler").
template <class Segment>
__device__ __forceinline__ void run_range(const VerifyParams& p, const WorkList& wl, const LaneRequests& lt, int lane,
                                          bool merging, Segment&& segment) {
  auto uniform = [](int v) { return __shfl_sync(0xffffffffu, v, 0); };
  // (b, start, tiles): a request this range meets, its first position, its tiles.
  // With ragged rows, rot_b is computed again for each request (a pass over the counts) rather
  // than carried across its segment, where one more live register makes the seesaw spill.
  int b = p.batch, start = 0, tiles = 0;
  const int slot = blockIdx.x / HEAD_TILES;
  const int u0 = uniform(blockIdx.y * wl.per);
  const int u1 = merging ? u0 : uniform(u0 + wl.per < wl.total ? u0 + wl.per : wl.total);
  if (u0 < u1) request_at(p, wl, lt, u0, lane, &b, &start, &tiles);
  for (b = uniform(b), start = uniform(start), tiles = uniform(tiles); u0 < u1 && start < u1;   // the requests
       tiles = ++b < p.batch ? uniform(slot_units(p, b, slot, rotation(p, b, lane))) : 0) {      // it meets
    int first, splits, t0, t1;
    request_splits(wl, tiles, start, &first, &splits);
    range_tiles(wl, tiles, start, u0, u1, &t0, &t1);
    if (t0 < t1) {                                        // the range meets its tiles (request_splits counts so)
      block_sync();                                    // the previous request's shared reads are done
      const int x = RAGGED_ROWS ? uniform(slot_q_tile(p, b, slot, rotation(p, b, lane))) * HEAD_TILES
                                      + blockIdx.x % HEAD_TILES
                                : blockIdx.x;
      segment(b, x, uniform(t0 * WORK_UNIT), uniform(t1 * WORK_UNIT), uniform(blockIdx.y + b), splits == 1,
              uniform(splits));   // units to KV tiles: segment caps them at the request's
    }
    start += uniform(request_span(wl, tiles));
  }
}

// Whether a row group of `splits` splits ends as a pair. Only where each split block runs one
// segment (a fixed split; the balanced split's aligned layout): a packed range's block that ended
// one request as the second of its pair would merge before its next request's segment, on its
// range's path (slower: docs/performance.md, "Split and merge"), where a merge block does that
// off it.
// Not with ragged rows: a pair's blocks are those of one row-group slot, which holds different
// row groups of a request from slot to slot.
__device__ __forceinline__ bool pair_merge(int splits, const WorkList& wl) {
  return PAIR_MERGE && splits == 2 && !RAGGED_ROWS && wl.tiles != 0;
}

// A pair's block, after its range (its rows still staged: sStage + r * stride, final values in
// elem_t; m in sM, l from row_sum; `smem_flag` a free shared word). Thread 0 takes the group's
// ticket (counts 0 -> 1 -> 2) and hands it over in shared memory. The first block writes its
// partial rows to workspace slot `own` and counts them (-> 3). The second waits for that count,
// leaves the counter at zero for the next launch, and writes the output rows from the first
// block's partial rows (slot `other`) and its own. Rows go to warps and 16-byte pieces to lanes
// as in finish_staged_row, and a warp's loads of PAIR_BATCH rows go out before any is used: one
// L2 round trip a batch. (A warp's 8 rows at once take 80 registers: the balanced seesaw spills
// when it merges inside its range loop.)
constexpr int PAIR_BATCH = 4;
template <int ROWS, int HT, int WARPS, class RowSum>
__device__ __forceinline__ void end_pair(const VerifyParams& p, int b, int x, int own, int other, int q0, int h0,
                                         const elem_t* sStage, int stride, const float* sM, RowSum row_sum,
                                         unsigned* smem_flag, int warp, int lane) {
  unsigned* counter = group_counter(p, b, x);
  if (threadIdx.x == 0) *smem_flag = atomicAdd(counter, 1u);
  block_sync();
  if (*smem_flag == 0u) {                               // the first: its rows go to its slot
    finish_staged_rows<ROWS, HT, WARPS>(p, own, false, b, q0, h0, sStage, stride, sM, row_sum, warp, lane);
    count_split_done(p, b, x, 2, true);
    return;
  }
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < 3u) __nanosleep(32);   // two tickets and the first's rows
    *counter = 0u;                                      // nothing else counts on it in this launch
  }
  block_sync();   // the rows thread 0 acquired are visible to the whole block
  constexpr int V = (DL / 8 + 31) / 32;                 // 16-byte pieces a lane
  constexpr int RW = (ROWS + WARPS - 1) / WARPS;         // rows a warp
  constexpr int BATCH = RW < PAIR_BATCH ? RW : PAIR_BATCH;
#pragma unroll 1
  for (int j0 = 0; j0 < RW; j0 += BATCH) {
    float2 ml[BATCH];
    uint4 x1[BATCH][V];
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int row = warp + WARPS * (j0 + j), i = q0 + row / HT, h = h0 + row % HT;
      if (row >= ROWS || i >= p.seqlen_q) continue;
      ml[j] = __ldcg(&p.part_ml[part_row(p, other, b, i, h)]);
      const uint4* src = reinterpret_cast<const uint4*>(partial_row(p, other, b, i, h));
#pragma unroll
      for (int v = 0; v < V; ++v)
        if (lane + 32 * v < DL / 8) x1[j][v] = __ldcg(src + lane + 32 * v);
    }
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int row = warp + WARPS * (j0 + j), i = q0 + row / HT, h = h0 + row % HT;
      if (row >= ROWS || i >= p.seqlen_q) continue;
      // weights l_k 2^(m_k - m) of the two normalized rows; a row without keys weighs 0, by select
      const float l0 = row_sum(row), m0 = sM[row], l1 = ml[j].y, m1 = ml[j].x;
      const float m = fmaxf(l0 > 0.f ? m0 : -INFINITY, l1 > 0.f ? m1 : -INFINITY);
      const float w0 = l0 > 0.f ? l0 * exp2f(m0 - m) : 0.f, w1 = l1 > 0.f ? l1 * exp2f(m1 - m) : 0.f;
      const float l = w0 + w1, a0 = l > 0.f ? w0 / l : 0.f, a1 = l > 0.f ? w1 / l : 0.f;
      const uint4* mine = reinterpret_cast<const uint4*>(sStage + row * stride);
      uint4* dst = reinterpret_cast<uint4*>(out_row(p, b, i, h));
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int c = lane + 32 * v;
        if (c >= DL / 8) break;
        float f0[8], f1[8];
        unpack8(mine[c], f0);
        unpack8(x1[j][v], f1);
#pragma unroll
        for (int e = 0; e < 8; ++e) f0[e] = (a0 != 0.f ? a0 * f0[e] : 0.f) + (a1 != 0.f ? a1 * f1[e] : 0.f);
        dst[c] = pack8(f0);
      }
      if (WRITE_LSE && lane == 0) p.lse[((long long)b * H + h) * p.seqlen_q + i] = row_lse(m, l);
    }
  }
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
__device__ void merge_block(const VerifyParams& p, const WorkList& wl) {
  const int gx = request_groups(p);
  const long long groups = (long long)gx * p.batch;
  const long long f = ((long long)(blockIdx.z - merge_z0(p)) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (f >= groups * p.merge_blocks) return;             // the last slab's spare blocks
  const int part = (int)(f / groups), g = (int)(f % groups);
  const int x = g % gx, b = g / gx;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Its request's positions start after the spans of the requests before it: one warp sum. The
  // lengths are read here again, not kept from the work list's pass: in the seesaw this runs
  // after the tile loop, which has no registers to hold them. With ragged rows the list is that
  // of the slot holding the group (split_work_list.cuh.j2), and a padded group has no split to
  // merge: its rows' outputs are unspecified.
  int qs = x / HEAD_TILES, rot = 0;          // the group's query-tile slot, its request's rot_b
  WorkList gl = wl;
  if (dealt(p)) {
    const RealTiles r = real_tiles(p, b);
    const int k = qs - r.first;                         // which of its real query tiles
    if (k < 0) return;
    rot = rotation(p, b, lane);
    qs = (int)((unsigned)(rot + k) % (unsigned)query_tiles(p));
  }
  const LaneRequests lt = lane_tiles(p, qs, lane);
  if (dealt(p)) gl = balanced_ranges(p, lt, lane);
  const int t = slot_units(p, b, qs, rot);
  const LaneRequests s = lane_spans(gl, lt);
  int before = 0, first, splits;
#pragma unroll
  for (int k = 0; k < LANE_REQUESTS; ++k) before += lane + 32 * k < b ? s.v[k] : 0;
#pragma unroll 1
  for (int k = lane + 32 * LANE_REQUESTS; k < b; k += 32) before += request_span(gl, request_units(p, k));   // (not dealt)
  request_splits(gl, t, warp_sum_uniform(before), &first, &splits);
  if (splits == 1 || pair_merge(splits, gl)) return;    // its split blocks wrote it (one, or a pair)
  const int slot0 = first + b;                          // its ranges' workspace slots (the work list above)
  const int h0 = (x % HEAD_TILES) * HT;
  const int q0 = (x / HEAD_TILES) * QT;
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

// A balanced split's block: its range's segments (run_range). Where merge blocks merge after the
// range loop (MERGE_AFTER_RANGES), a merge block runs an empty range, then merges: reached only
// through the loop's exit, its code is laid out after the tile loop. With the merge in a branch at
// the top, ptxas put it before, and the seesaw's tile loop would end past the kernel's first 64 KB,
// where the warps stall on instruction fetch up to three times as often (Nsight Compute, H=16
// B=64 S=4 at 4096 keys: 0.72 stalls per issue with 18 KB of the loop past it, 0.26 with none).
// (The lockstep kernels' loops are short, 13 KB; the mma.sync ones have no registers to spare.)
// Otherwise merge blocks returned at the top of the kernel.
template <class Segment>
__device__ __forceinline__ void balanced_block(const VerifyParams& p, const WorkList& wl, const LaneRequests& lt, int lane,
                                               Segment&& segment) {
  const bool merging = MERGE_AFTER_RANGES && blockIdx.z >= merge_z0(p);
  run_range(p, wl, lt, lane, merging, segment);
  if (merging) {
    MLAGEN_TRACE(merge_begin);
    merge_block(p, wl);
    MLAGEN_TRACE(merge_end);
  }
}


// `count` arrivals complete a phase (with the bytes an arrival expects).
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// The issuing thread's arrival, expecting `bytes` to land before the phase completes.
__device__ __forceinline__ void mbar_expect(unsigned bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

// An arrival that brings no bytes (the seesaw's parts past the segment, its P hand-offs); it
// releases this thread's earlier writes to the threads whose wait completes the phase.
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// One thread waits until the phase of parity `parity` has completed (the tile is in shared memory).
__device__ __forceinline__ void mbar_wait_thread(unsigned bar, int parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
// Whole warps wait, and leave converged: try_wait may suspend each thread on its own, so a warp
// may leave the loop split, and the aligned instructions that follow (wgmma, ldmatrix, stmatrix,
// bar.sync) need every thread of the warp together.
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
  mbar_wait_thread(bar, parity);
  __syncwarp();
}

// mbar_wait with its loop (and the warp's reconvergence) inside the asm statement, for a wait
// between two wgmma groups whose accumulators are in flight: a loop in the kernel's own control
// flow there makes ptxas serialize every wgmma of the kernel (mma_seesaw.cuh.j2, scores_widened).
__device__ __forceinline__ void mbar_wait_in_asm(unsigned bar, int parity) {
  asm volatile("{\n.reg .pred p;\nwait_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra wait_%=;\n"
               "bar.warp.sync -1;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}

// Whether the phase of parity `parity` of mbarrier `bar` has completed, without waiting.
__device__ __forceinline__ bool mbar_done(unsigned bar, int parity) {
  unsigned done;
  asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done;
}

// Rows [r0, rows) of a stage at `stage` to zeros: `chunks` 16-byte chunks a row, in 64-dim
// column blocks of `rows` 128-byte rows one after another (as the boxes land), by threads `tid`
// of `threads`. A box brings its page's rows past the request's keys, which may hold anything.
__device__ __forceinline__ void zero_tile_rows(unsigned stage, int r0, int rows, int chunks, int tid, int threads) {
  for (int i = tid; i < (rows - r0) * chunks; i += threads) {
    const int r = r0 + i / chunks, c = i % chunks;
    asm volatile("st.shared.v4.u32 [%0], { %1, %1, %1, %1 };\n"
                 :: "r"(stage + (c / 8) * (rows * 128) + r * 128 + (c % 8) * 16), "r"(0) : "memory");
  }
}

// The descriptor was written by a copy before the launch (generic proxy); TMA reads it through
// the tensormap proxy.
__device__ __forceinline__ void tma_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" :: "l"(map) : "memory");
}

// Rows [row, row + box rows) of page `page`, dims [dim0, dim0 + 64), into shared address `dst`
// (128-byte swizzled rows); coordinates outside the cache load zeros.
__device__ __forceinline__ void tma_load(unsigned dst, const void* map, int dim0, int row, int page, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4 }], [%5];\n"
               :: "r"(dst), "l"(map), "r"(dim0), "r"(row), "r"(page), "r"(bar) : "memory");
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

// wgmma descriptor of a 128-byte-swizzled operand at shared address `addr`. K-major: 8-row
// groups 1024 bytes apart (stride byte offset), the leading byte offset unused. Read N-major
// (V as the B of P·V): 64-dim column blocks `lbo` bytes apart, 8-key groups `sbo` apart.
// The address field is the byte address / 16: a k-step's descriptor is a base plus a constant
// (shared addresses stay below 256 KB, so nothing carries out of the field).
// The descriptor's fields (PTX ISA, "Matrix Descriptor Format"), each a byte count / 16 at its bit.
struct WgmmaDesc {
  static constexpr int START_ADDRESS = 0, LEADING_BYTE_OFFSET = 16, STRIDE_BYTE_OFFSET = 32, LAYOUT = 62;
  // the layout field's swizzles: 128-byte rows (chunk ^ row % 8), 64-byte rows (chunk ^ row / 2 % 4)
  static constexpr unsigned long long SWIZZLE_128B = 1, SWIZZLE_64B = 2;
};
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned addr, unsigned lbo = 16, unsigned sbo = 1024,
                                                         unsigned long long layout = WgmmaDesc::SWIZZLE_128B) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) << WgmmaDesc::START_ADDRESS
         | (unsigned long long)(lbo >> 4) << WgmmaDesc::LEADING_BYTE_OFFSET
         | (unsigned long long)(sbo >> 4) << WgmmaDesc::STRIDE_BYTE_OFFSET
         | layout << WgmmaDesc::LAYOUT;
}
// d (+)= A B, m64n32k16 with fp32 accumulators, for one warpgroup: A from shared memory, B from
// shared memory.
// `accumulate` 0 overwrites d. Asynchronous until wgmma.wait_group.
__device__ __forceinline__ void wgmma_m64n32k16(float* d, unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
               "%16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(a), "l"(b), "r"(accumulate));
}
// Scores of one warpgroup: all 64 rows of Q at `q` x 32 keys of the KV tile at `tile` (offset to
// the warpgroup's keys); each k-step's descriptor is the tile's plus a constant. `after_block(c)`
// runs once column block c's 4 k-steps are issued (it must not touch `s`).
template <typename AfterBlock>
__device__ __forceinline__ void scores_wgmma(float* s, unsigned q, unsigned tile, AfterBlock after_block) {
  const unsigned long long qd = wgmma_desc(q), kd = wgmma_desc(tile);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const unsigned within = (ks % 4) * 32, block = ks / 4;   // 4 k-steps per 128-byte column block
    wgmma_m64n32k16(s, qd + ((block * (M_PAD * 128) + within) >> 4), kd + ((block * (BN * 128) + within) >> 4),
                    ks > 0);
    if (ks % 4 == 3) after_block(block);
  }
}
// s = Q K^T of tile kb (its 16-bit tile at `tile`) for this warp's score piece: warpgroup wnq
// takes all 64 rows x keys [32*wnq, +32), and its warp wmq gets rows 16*wmq.. in the mma.sync
// accumulator layout (per 8 keys: row g cols 2t,2t+1; row g+8 likewise). The KV pipeline's
// copies of a later tile go out between the wgmmas (kv.load_during_scores).
template <class Tiles>
__device__ __forceinline__ void tile_scores(float (&s)[MTQ][NTQ][4], unsigned q, unsigned tile, Tiles& kv, int kb, int,
                                            int wnq, int) {
  static_assert(MTQ == 1 && NTQ == 4 && M_PAD == 64, "one m64n32 wgmma per warpgroup");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  scores_wgmma(&s[0][0][0], q, tile + wnq * KEYS_W * 128, [&](int blk) { kv.load_during_scores(kb, blk); });
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  kv.scores_issued();
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// o += P V for P = 64 rows x 16 keys (K-major, shared) and V = 16 keys x DL/2 dims read
// N-major (transposed) from the KV tile: 64-dim column blocks BN*128 bytes apart (leading byte
// offset), 8-key groups 1024 bytes apart (stride byte offset), as probed on the H200 (the other
// order gives garbage).
// d (+)= A B, m64n256k16 with fp32 accumulators, for one warpgroup: A from shared memory, B from
// shared memory, read N-major.
// `accumulate` 0 overwrites d. Asynchronous until wgmma.wait_group.
__device__ __forceinline__ void wgmma_pv(float* d, unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
               "%128, %129, p, 1, 1, 0, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "l"(a), "l"(b), "r"(accumulate));
}
// O (+)= P V for one warpgroup: P (64 rows x BN keys) at `pa`, V = the KV tile at `tile`
// (offset to the warpgroup's DL/2 dims).
__device__ __forceinline__ void pv_wgmma(float* o, unsigned pa, unsigned tile) {
  const unsigned long long pd = wgmma_desc(pa), vd = wgmma_desc(tile, BN * 128, 1024);
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) wgmma_pv(o, pd + ks * 2, vd + ks * 128, 1);   // 32 and 2048 bytes
}
// o += P V of tile kb for warpgroup wnq's DL/2 dims (its warp's 16 rows), the KV pipeline's
// lookups going out while the tensor cores run (kv.during_pv).
template <class Tiles>
__device__ __forceinline__ void tile_pv(float (&o)[MT_O][NT_O][4], unsigned pa, unsigned tile, Tiles& kv, int kb, int,
                                        int wnq, int) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  pv_wgmma(&o[0][0][0], pa, tile + (DL / 128) * wnq * (BN * 128));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  kv.during_pv(kb);
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Element offset of P(row, key) in shared memory: the K-major 128-byte-swizzle layout (BN = 64
// keys = one 128-byte row) that wgmma reads.
__device__ __forceinline__ int p_off(int row, int key) { return row * 64 + ((((key >> 3) ^ row) & 7) << 3) + (key & 7); }


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

// A segment's KV tiles [kb_begin, kb_end) of request b (n keys), TMA boxes counted by one
// mbarrier per stage. tiles_done counts the block's tiles before this segment, so tile kb uses
// stage (t_base + kb - kb_begin) % STAGES and completes phase (t_base + kb - kb_begin) / STAGES % 2
// of its mbarrier. Thread 0 issues tile kb as D/64 boxes of [64 dims, BN rows] of its page (a tile
// is one page's run of rows: validate checks PAGE % BN == 0), reading the block-table id an
// iteration before the tile is issued. The lockstep loop calls, per tile: acquire, the products
// (with the hooks, which TMA does not need), release.
struct KvTiles {
  const VerifyParams& p;
  int b, n, kb_begin, kb_end, t_base;
  elem_t* sKV;                     // (STAGES, BN, D) swizzled
  unsigned long long* sFull;       // one mbarrier per stage (the seesaw's: MBARRIERS)
  int page_next = 0;               // thread 0: block-table id of the next tile to issue

  __device__ __forceinline__ KvTiles(const VerifyParams& p, int b, int n, int kb_begin, int kb_end, int tiles_done,
                                     elem_t* sKV, kv_t*, unsigned long long* sFull)
      : p(p), b(b), n(n), kb_begin(kb_begin), kb_end(kb_end), t_base(tiles_done), sKV(sKV), sFull(sFull) {}

  // The block's mbarriers, once per launch, with every thread launched: LOAD_MBARRIERS count one
  // arrival (the issuing thread's, with the bytes it expects); the seesaw's others a warpgroup's
  // (with a producer warpgroup: ws_arrivals).
  static __device__ __forceinline__ void init(unsigned long long* sFull, const VerifyParams& p) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < MBARRIERS; ++s) mbar_init(smem_addr(&sFull[s]), s < LOAD_MBARRIERS ? 1 : 128);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      tma_acquire(p.kv_map);
    }
    __syncthreads();
  }
  // Tile kb's page id; -1 past the segment.
  __device__ __forceinline__ int page(int kb) const { return kb < kb_end ? kv_page(p, b, kb * BN) : -1; }
  __device__ __forceinline__ unsigned stage(int kb) const { return smem_addr(sKV + ((t_base + kb - kb_begin) % STAGES) * BN * D); }
  __device__ __forceinline__ unsigned full(int kb) const { return smem_addr(&sFull[(t_base + kb - kb_begin) % STAGES]); }
  // Thread 0: tile kb's boxes (none past the segment).
  __device__ __forceinline__ void issue(int kb, int page) const {
    if (kb >= kb_end) return;
    const unsigned bar = full(kb), dst = stage(kb);
    mbar_expect(bar, BN * D * (int)sizeof(elem_t));
#pragma unroll
    for (int blk = 0; blk < CH / 8; ++blk) tma_load(dst + blk * (BN * 128), p.kv_map, blk * 64, (kb * BN) % PAGE, page, bar);
  }
  // Before the first tile: the previous segment's epilogue read and wrote these buffers through
  // the generic proxy, and TMA writes through the async proxy: fence, then barrier, then issue the
  // first STAGES tiles (the seesaw issues its own, in pairs). Q's copies, issued just before, are
  // the only cp.async group.
  __device__ __forceinline__ void start() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    block_sync();
    if constexpr (!SEESAW) {
      if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) issue(kb_begin + s, page(kb_begin + s));
        page_next = page(kb_begin + STAGES);
      }
    }
    cp_async_commit();
  }
  // Waits for tile kb (issued STAGES tiles ago, right after its buffer's last use) and returns its
  // shared address. The first tile also waits for Q; the last zeroes its rows past the request's
  // keys, which a box brings in from the page.
  __device__ __forceinline__ unsigned acquire(int kb) const {
    mbar_wait(full(kb), ((t_base + kb - kb_begin) / STAGES) & 1);
    MLAGEN_TRACE(tile_landed);
    if (kb == kb_begin || (kb + 1) * BN > n) {            // block-uniform: the first and the last tile
      cp_async_wait<0>();                                 // Q's copies
      MLAGEN_TRACE(q_landed);
      if ((kb + 1) * BN > n) zero_tile_rows(stage(kb), n - kb * BN, BN, CH, threadIdx.x, THREADS);
      async_proxy_fence<SCORES_WGMMA>();                  // Q and zeroed rows -> wgmma reads
      block_sync();                                    // everyone's stores above, sM's start
    }
    return stage(kb);
  }
  __device__ __forceinline__ void load_during_scores(int, int) const {}
  __device__ __forceinline__ void scores_issued() const {}
  __device__ __forceinline__ void load_before_scores(int) const {}
  __device__ __forceinline__ void during_pv(int) const {}
  // Tile kb's buffer is free (its wgmmas were waited for) and sM settled: refill the buffer now,
  // before waiting for tile kb + 1, so STAGES tiles stay in flight while one is in use.
  __device__ __forceinline__ void release(int kb) {
    block_sync();
    if (threadIdx.x == 0) {
      issue(kb + STAGES, page_next);
      page_next = page(kb + STAGES + 1);
    }
  }
  // The block's tiles after this segment's.
  __device__ __forceinline__ int tiles_after() const { return t_base + kb_end - kb_begin; }
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
// smem_raw the block's shared memory, whose Q and KV buffers stage the rows. pair_at is set
// when the group ends as a pair after the range (end_pair).
template <class RowSum>
__device__ __forceinline__ void end_segment(const VerifyParams& p, const SegmentEnd& e, const FragmentAt& f,
                                            const float (&o)[MT_O][NT_O][4], const float (&lpart)[MTQ][2],
                                            unsigned char* smem_raw, float* sM, float* sPart, RowSum row_sum, int& pair_at, const WorkList& wl) {
  const int b = e.b, x = e.x, S = e.S, q0 = e.q0, h0 = e.h0, split = e.split, splits = e.splits;
  const bool direct = e.direct;
  const int warp = f.warp, lane = f.lane, g = f.g, t = f.t, wmq = f.wmq, wnq = f.wnq, o_row0 = f.o_row0, o_dim0 = f.o_dim0;
  // ---- epilogue: row sums meet in shared memory; write out/lse or the split's partial ----
  const bool in_pair = !direct && pair_merge(splits, wl);   // (uniform)
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
    if (in_pair) {                                      // it ends after its range, rows staged
      pair_at = 2 * b + (e.t0 == 0);
    } else {
      MLAGEN_TRACE(staged);
      finish_staged_rows<ROWS, HT, WARPS>(p, split, direct, b, q0, h0, sStage, STAGE_STRIDE, sM, row_sum, warp, lane);
      MLAGEN_TRACE(written);
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
  if (!direct && !in_pair) count_split_done(p, b, x, splits);
  MLAGEN_TRACE(counted);}



// d (+)= A B, m64n64k16 with fp32 accumulators, for one warpgroup: A from shared memory, B from
// shared memory.
// `accumulate` 0 overwrites d. Asynchronous until wgmma.wait_group.
__device__ __forceinline__ void wgmma_m64n64k16(float* d, unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
               "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "%32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(accumulate));
}
// Scores of a whole tile for one warpgroup: all 64 rows of Q at `q` x all 64 keys of the KV tile
// at `tile`, over all D dims, in k steps of 32 bytes (16-bit values, or e4m3 ones with F8MMA).
// k steps [K0, K1) of them (column blocks K0 / 4 ..), added to s from K0 > 0 on.
constexpr int K_STEPS = D * (int)sizeof(q_t) / 32;
template <int K0 = 0, int K1 = K_STEPS>
__device__ __forceinline__ void scores_wgmma64(float* s, unsigned q, unsigned tile) {
  const unsigned long long qd = wgmma_desc(q), kd = wgmma_desc(tile);
#pragma unroll
  for (int ks = K0; ks < K1; ++ks) {
    const unsigned within = (ks % 4) * 32, block = ks / 4;
    wgmma_m64n64k16(s, qd + ((block * (M_PAD * 128) + within) >> 4), kd + ((block * (BN * 128) + within) >> 4), ks > 0);
  }
}
// d (+)= A B, m64n256k16 with fp32 accumulators, for one warpgroup: A from registers, B from
// shared memory, read N-major. A: a thread's 4 pairs of 16-bit values in the m64n16 accumulator layout.
// `accumulate` 0 overwrites d. Asynchronous until wgmma.wait_group.
__device__ __forceinline__ void wgmma_pv_regs(float* d, const unsigned* a, unsigned long long b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{ %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
               "{ %128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
// Named barrier `id` over `count` threads. Not the aligned form (bar.sync): the two warpgroups
// meet at S0_ISSUED from different instructions, which an aligned barrier does not allow
// (compute-sanitizer's synccheck reports it).
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

// A segment as the seesaw's tile loop takes it: tiles [kb_begin, kb_end) of a request with n keys,
// for the row group of queries q0.. of S; t_base counts the block's tiles before the segment (the
// mbarriers' phases follow it). The shared memory it reads: Q at sQa, the KV stages at sKV, the
// mbarriers at sFull, the tree rows at sBits, the maxima's exchange in sPart, the running max at
// sM, all of it from smem_raw.
struct PairedSegment {
  int n, S, q0, kb_begin, kb_end, t_base;
  unsigned sQa;
  elem_t* sKV;
  unsigned long long* sFull;
  const unsigned long long* sBits;
  float* sPart;
  float* sM;
  unsigned char* smem_raw;
};

// The seesaw's tile loop over segment `seg`: o, lpart and sM end as the lockstep loop leaves them
// for end_segment; tile_page(kb) is tile kb's page id (-1 past the segment). Returns the tiles it
// ran, padding included.
template <class TilePage>
__device__ __forceinline__ int seesaw_tiles(const VerifyParams& p, const PairedSegment& seg, TilePage tile_page,
                                            float (&o)[MT_O][NT_O][4], float (&lpart)[MTQ][2], const FragmentAt& at) {
  const int n = seg.n, S = seg.S, q0 = seg.q0, kb_begin = seg.kb_begin, kb_end = seg.kb_end, t_base = seg.t_base;
  const unsigned sQa = seg.sQa;
  elem_t* sKV = seg.sKV;
  unsigned long long* sFull = seg.sFull;
  const unsigned long long* sBits = seg.sBits;
  float *sPart = seg.sPart, *sM = seg.sM;
  unsigned char* smem_raw = seg.smem_raw;
  const int g = at.g, t = at.t, wmq = at.wmq, wnq = at.wnq;
  // ---- seesaw: the tiles go in pairs, k0 in stage 0 and k1 in stage 1 ----
  //   warpgroup 0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 = exp2(S0 - m0) (to K0's rope block
  //                for warpgroup 1); O_L = O_L 2^(m - m0) + P0 V0_L (P0 from registers);
  //                then O_L = O_L 2^(m0 - m1) + P1 V1_L (P1 from K1's rope block)
  //   warpgroup 1: S1 = Q K1^T, issued after S0 so that it runs during warpgroup 0's softmax;
  //                O_R = O_R 2^(m - m0) + P0 V0_R; m1 = max(m0, rowmax S1); P1 to K1's rope
  //                block; O_R = O_R 2^(m0 - m1) + P1 V1_R (P1 from registers)
  // O_L / O_R are the value dims [0, DL/2) / [DL/2, DL), the same layout as the lockstep
  // loop's. Each part of the next pair's tiles is issued by the warpgroup that reads it last,
  // once it has: four mbarriers, one per part, each completing once a pair. A rope block is
  // free once its tile's scores are done: P goes there. (With e4m3 products, F8MMA, P goes to
  // buffers of its own and the producer lands the tiles: mma_ws_producer.cuh.j2.)
  const int pairs = (kb_end - kb_begin + 1) / 2;          // an odd count ends with a padding tile
  const int lim = kb_end * BN < n ? kb_end * BN : n;      // keys this segment reads
  const unsigned buf0 = smem_addr(sKV), buf1 = buf0 + STAGE_BYTES;
  const unsigned bars = smem_addr(sFull);
  constexpr int VB = DL / 128, PB = DL / 64, NBLK = D / 64;   // value blocks of a half; the rope block; all
  static_assert(NBLK == PB + 1, "one rope column block: P's place");
  // mbarriers: the four load parts, then P0 / P1 with their row maxima (every thread of the
  // giving warpgroup arrives; the taking one waits). A hand-off of data goes through an
  // mbarrier (release / acquire), which compute-sanitizer's racecheck follows; the named
  // barriers carry none. Both warpgroups pass every named barrier equally often: racecheck
  // pairs barrier passes by count, and a barrier one warpgroup passes more often (a
  // bar.arrive, a skipped zeroing) makes it report hazards across the epilogue's
  // __syncthreads (the kernel takes the same time either way).
  enum Part { K0_LO, K0_HI, K1_MID, K1_REST, P0_FULL, P1_FULL };
  enum Barrier { S0_ISSUED = 1, ZEROED = 2 };             // named barriers (0: __syncthreads)
  static_assert(P0_FULL == LOAD_MBARRIERS && P1_FULL + 1 == MBARRIERS,
                "the parts are the plan's mbarriers: its loads', then the P hand-offs' (mlagen/plan/mma_plan.py)");
  // Column blocks [c0, c1) and [c2, c3) of tile kb into the stage at `dst`, counted by part
  // mbarrier `part`; a tile past the segment only arrives (its rows are zeroed before use).
  auto issue_part = [&](unsigned dst, int kb, int page, int part, int c0, int c1, int c2, int c3) {
    const unsigned mb = bars + 8 * part;
    if (kb >= kb_end) {
      mbar_arrive(mb);
      return;
    }
    mbar_expect(mb, (c1 - c0 + c3 - c2) * BN * 128);
    for (int blk = c0; blk < c1; ++blk) tma_load(dst + blk * (BN * 128), p.kv_map, blk * 64, (kb * BN) % PAGE, page, mb);
    for (int blk = c2; blk < c3; ++blk) tma_load(dst + blk * (BN * 128), p.kv_map, blk * 64, (kb * BN) % PAGE, page, mb);
  };
  if (threadIdx.x == 0 && pairs > 0) {
    const int page0 = WS ? -1 : tile_page(kb_begin), page1 = WS ? -1 : tile_page(kb_begin + 1);
    issue_part(buf0, kb_begin, page0, K0_LO, 0, VB, 0, 0);
    issue_part(buf0, kb_begin, page0, K0_HI, VB, NBLK, 0, 0);
    issue_part(buf1, kb_begin + 1, page1, K1_MID, VB, 2 * VB, 0, 0);
    issue_part(buf1, kb_begin + 1, page1, K1_REST, 0, VB, 2 * VB, NBLK);
  }
  cp_async_wait<0>();                                     // Q's copies
  MLAGEN_TRACE(q_landed);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  block_sync();                                        // Q and the tree-mask rows
  MLAGEN_TRACE(q_ready);

  const int wt = threadIdx.x % 128;                       // thread in the warpgroup
  // The scores' scale in log2 units; an e4m3 tile holds the stored values, so kv_scale joins it.
  const float scale_log2 = E4M3 ? p.scale_log2 * kv_scale_of(p) : p.scale_log2;
  int rows[2], qi[2];
  bool live[2];
  unsigned long long bits[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    rows[half] = 16 * wmq + g + 8 * half;
    qi[half] = q0 + rows[half] / HT;
    live[half] = rows[half] < ROWS && qi[half] < S;
    bits[half] = MASK_TREE && live[half] ? sBits[rows[half] / HT] : 0ull;
  }
  float m[2] = {-INFINITY, -INFINITY};    // running row max (log2 units), the same in both warpgroups
  float* sMax = sPart;                    // (2, M_PAD): m0 from warpgroup 0, m1 from warpgroup 1
  float* ov = &o[0][0][0];
  auto finite = [](float x) { return x == -INFINITY ? 0.f : x; };
  // 2^(a - b) for maxima a <= b: 0 when a is -inf (nothing was accumulated under it).
  auto factor = [](float a, float b) { return a == -INFINITY ? 0.f : exp2f(a - (b == -INFINITY ? 0.f : b)); };
  // O *= f per row, skipped when the warp's factors are all 1 (most tiles of a long row): a
  // warp-uniform branch, so ptxas keeps the wgmmas unserialized.
  auto rescale = [&](const float* f) {
    if (__all_sync(0xffffffffu, f[0] == 1.f && f[1] == 1.f)) return;
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) { o[0][nt][2 * half] *= f[half]; o[0][nt][2 * half + 1] *= f[half]; }
  };
  // Rows [r0, BN) of the stage at `dst` to zeros, by this warpgroup (keys past the segment:
  // a padding tile, or the request's last rows, whose memory may hold anything).
  auto zero_rows = [&](unsigned dst, int kb) {
    const int r0 = kb >= kb_end ? 0 : (n - kb * BN < BN ? n - kb * BN : BN);
    if (r0 < BN) {
      zero_tile_rows(dst, r0, BN, CH, wt, 128);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    named_sync(ZEROED + wnq, 128);                        // on every tile, zeroed or not (above)
  };
  // Mask and scale tile kb's scores into log2 units; each row's max over the tile into mx.
  // One branch around the loops (a tile inside every row's prefix needs no mask), and the
  // max in four independent chains: the softmax is on the pair's critical path.
  auto mask_scale = [&](float* s, int kb, float* mx) {
    if (kb < kb_end && (kb + 1) * BN <= n - S) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] *= scale_log2;
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& v = s[4 * nt + 2 * half + e];
            const int j = kb * BN + nt * 8 + 2 * t + e;
            v = live[half] & (j < lim) & key_visible(j, n, qi[half], S, bits[half]) ? v * scale_log2 : -INFINITY;
          }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) mm[(2 * nt + e) % 4] = fmaxf(mm[(2 * nt + e) % 4], s[4 * nt + 2 * half + e]);
      float r = fmaxf(fmaxf(mm[0], mm[1]), fmaxf(mm[2], mm[3]));
      r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, 1));
      mx[half] = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, 2));
    }
  };
  // s = exp2(s - m) per row; this thread's share of each row's sum into sum.
  auto exponentiate = [&](float* s, const float* mr, float* sum) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float mu = finite(mr[half]);
      float acc[2] = {0.f, 0.f};                         // two chains: the sum is off the store's path
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[4 * nt + 2 * half + e];
          v = exp2f(v - mu);
          acc[nt % 2] += v;
        }
      sum[half] = acc[0] + acc[1];
    }
  };
  // P into the rope block of the stage at `dst` (the K-major swizzled layout P·V reads).
  auto store_p = [&](unsigned dst, const float* s) {
    unsigned char* base = smem_raw - smem_addr(smem_raw) + dst + PB * (BN * 128);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
        *reinterpret_cast<elem2_t*>(base + 2 * p_off(rows[half], nt * 8 + 2 * t)) =
            from_float2(s[4 * nt + 2 * half], s[4 * nt + 2 * half + 1]);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // P stores -> the other warpgroup's wgmma
  };
  // O += P V over this warpgroup's value half, P from this thread's scores (the m64n64
  // accumulator layout is four k16 steps of the A-fragment layout).
  auto pv_regs = [&](const float* s, unsigned tile) {
    unsigned a[BN / 16][4];
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const elem2_t v = from_float2(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
        a[ks][r] = *reinterpret_cast<const unsigned*>(&v);
      }
    const unsigned long long vd = wgmma_desc(tile + wnq * VB * (BN * 128), BN * 128, 1024);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) wgmma_pv_regs(ov, a[ks], vd + ks * 128, 1);   // 2048 bytes a k-step
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  };
  // O += P V with P from the rope block of `tile` (the other warpgroup's).
  auto pv_smem = [&](unsigned tile) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    pv_wgmma(ov, tile + PB * (BN * 128), tile + wnq * VB * (BN * 128));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  };
  auto scores = [&](float* s, unsigned tile) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    scores_wgmma64(s, sQa, tile);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  };
  auto wait_all = [] { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); };

  for (int pi = 0; pi < pairs; ++pi) {
    const int k0 = kb_begin + 2 * pi, k1 = k0 + 1;
    const bool more = pi + 1 < pairs;
    const unsigned parity = (t_base / 2 + pi) & 1;
    // the issuing thread of each warpgroup reads the next pair's pages now, off the path
    int page0 = -1, page1 = -1;
    if (!WS && more && wt == 0) {
      page0 = tile_page(k0 + 2);
      page1 = tile_page(k1 + 2);
    }
    float s[BN / 2], mx[2], m0[2], m1[2], f[2], sum[2];
    if (wnq == 0) {
      mbar_wait(bars + 8 * K0_LO, parity);
      mbar_wait(bars + 8 * K0_HI, parity);
      MLAGEN_TRACE(k0_landed);
      zero_rows(buf0, k0);
      scores(s, buf0);
      MLAGEN_TRACE(s0_issued);
      named_sync(S0_ISSUED, THREADS);                     // S1 queues behind S0 on the tensor cores
      wait_all();
      MLAGEN_TRACE(s0_done);
      mask_scale(s, k0, mx);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m0[half] = fmaxf(m[half], mx[half]);
        f[half] = factor(m[half], m0[half]);
        if (t == 0) sMax[rows[half]] = m0[half];
      }
      exponentiate(s, m0, sum);
#pragma unroll
      for (int half = 0; half < 2; ++half) lpart[0][half] = lpart[0][half] * f[half] + sum[half];
      store_p(buf0, s);
      mbar_arrive(bars + 8 * P0_FULL);
      MLAGEN_TRACE(p0_stored);
      rescale(f);
      pv_regs(s, buf0);
      wait_all();
      MLAGEN_TRACE(p0_v0l_done);
      if (more && wt == 0) issue_part(buf0, k0 + 2, page0, K0_LO, 0, VB, 0, 0);   // K0's value-left blocks are read
      mbar_wait(bars + 8 * P1_FULL, parity);
      MLAGEN_TRACE(p1_received);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m1[half] = sMax[M_PAD + rows[half]];
        f[half] = factor(m0[half], m1[half]);
        lpart[0][half] *= f[half];
      }
      rescale(f);
      pv_smem(buf1);
      wait_all();
      MLAGEN_TRACE(p1_v1l_done);
      if (more && wt == 0) issue_part(buf1, k1 + 2, page1, K1_REST, 0, VB, 2 * VB, NBLK);   // and K1's, with P1
    } else {
      named_sync(S0_ISSUED, THREADS);
      MLAGEN_TRACE(s0_seen);
      mbar_wait(bars + 8 * K1_MID, parity);
      mbar_wait(bars + 8 * K1_REST, parity);
      MLAGEN_TRACE(k1_landed);
      zero_rows(buf1, k1);
      scores(s, buf1);
      MLAGEN_TRACE(s1_issued);
      wait_all();                                         // S1 done: o is touched with no wgmma in flight
      MLAGEN_TRACE(s1_done);
      mask_scale(s, k1, mx);                              // while P0 is on its way
      mbar_wait(bars + 8 * P0_FULL, parity);
      MLAGEN_TRACE(p0_received);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m0[half] = sMax[rows[half]];
        f[half] = factor(m[half], m0[half]);
      }
      rescale(f);
      pv_smem(buf0);                                      // runs during this softmax
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        m1[half] = fmaxf(m0[half], mx[half]);
        if (t == 0) sMax[M_PAD + rows[half]] = m1[half];
      }
      exponentiate(s, m1, sum);
#pragma unroll
      for (int half = 0; half < 2; ++half) lpart[0][half] = lpart[0][half] * factor(m[half], m1[half]) + sum[half];
      store_p(buf1, s);
      mbar_arrive(bars + 8 * P1_FULL);
      MLAGEN_TRACE(p1_stored);
      wait_all();
      MLAGEN_TRACE(p0_v0r_done);
      if (more && wt == 0) issue_part(buf0, k0 + 2, page0, K0_HI, VB, NBLK, 0, 0);   // K0's value-right and rope blocks
#pragma unroll
      for (int half = 0; half < 2; ++half) f[half] = factor(m0[half], m1[half]);
      rescale(f);
      pv_regs(s, buf1);
      wait_all();
      MLAGEN_TRACE(p1_v1r_done);
      if (more && wt == 0) issue_part(buf1, k1 + 2, page1, K1_MID, VB, 2 * VB, 0, 0);   // K1's value-right blocks
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) m[half] = m1[half];
  }
  if (wnq == 0 && t == 0)
#pragma unroll
    for (int half = 0; half < 2; ++half) sM[rows[half]] = m[half];
  return 2 * pairs;
}


// A segment's KV tiles [*kb_begin, *kb_end): those of row group x of a request with n keys in
// tiles [t0, t1) (a balanced split's range) or in split `split` of `splits`'s share of the group's keys.
__device__ __forceinline__ void segment_tiles(const VerifyParams& p, int x, int n, int t0, int t1, int split, int splits,
                                              int* kb_begin, int* kb_end) {
  const int S = p.seqlen_q, q0 = (x / HEAD_TILES) * QT;
  const int q_end = q0 + QT < S ? q0 + QT : S;
  const int limit = (key_limit(n, S, q_end) + BN - 1) / BN;   // the group's tiles with keys
  *kb_begin = t0 < limit ? t0 : limit;
  *kb_end = t1 < limit ? t1 : limit;
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
                                        int split, bool direct, int splits, int& tiles_done, int& pair_at, const WorkList& wl) {
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
  tiles_done += seesaw_tiles(p, PairedSegment{n, S, q0, kb_begin, kb_end, kv.t_base, sQa, sKV, sFull, sBits, sPart, sM, smem_raw},
                             [&](int kb) { return kv.page(kb); }, o, lpart, FragmentAt{warp, lane, g, t, wmq, wnq, o_row0, o_dim0});
  MLAGEN_TRACE(loop_end);
#pragma unroll
  for (int mt = 0; mt < MT_O; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] *= kv_scale;   // (E4M3: the products ran on stored values)
  end_segment(p, SegmentEnd{b, x, S, q0, h0, t0, split, splits, direct}, FragmentAt{warp, lane, g, t, wmq, wnq, o_row0, o_dim0},
              o, lpart, smem_raw, sM, sPart, RowSum{sPart}, pair_at, wl);
}
}  // namespace mlagen_mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a_h64_dl512_dr64_bf16_p64_causal_lse

// grid: (row groups of a request, ranges, 1 + merge slabs when a row group is split); block: 256 threads;

// dynamic shared memory 231728 bytes.
extern "C" __global__ void __launch_bounds__(256, 1)
mlagen_mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a_h64_dl512_dr64_bf16_p64_causal_lse_main(const VerifyParams p) {
  using namespace mlagen_mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a_h64_dl512_dr64_bf16_p64_causal_lse;
  pdl_prologue();
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
  const LaneRequests lt = lane_tiles(p, blockIdx.x / HEAD_TILES, lane);   // the requests' tiles, for the work list and the range's lookup
  const WorkList wl = balanced_ranges(p, lt, lane);     // once, for the merge and the split blocks alike
  MLAGEN_TRACE(work_list);
  unsigned long long* sFull = sBits + TREE_ROWS;        // (MBARRIERS,) after the tree-mask rows
  KvTiles::init(sFull, p);
  int tiles_done = 0;                                   // this block's KV tiles over its segments
  const BlockState blk{smem_raw, sQ, sKV, sP, sStage, sPart, sM, sBits, sFull, kv_scale, scale_log2,
                       warp, lane, g, t, wmq, wnq};
  // A pair's block ends it after its range (end_pair): 2 b + 1 when its range is request b's
  // first, 2 b when its second; -1 otherwise. (Its row group is blockIdx.x.) The ticket, and the
  // block-wide answer it needs, wait until then: inside the range loop a barrier reduction or a
  // shared read of it costs the tile loop its convergence or its uniform registers.
  int pair_at = -1;

  balanced_block(p, wl, lt, lane, [&](int b, int x, int t0, int t1, int split, bool direct, int splits) {
    segment(p, blk, b, x, t0, t1, split, direct, splits, tiles_done, pair_at, wl);
  });
  if (pair_at >= 0) {                                     // its rows are still staged: its range ran one segment
    // its slot and the other block's: a fixed split's two; a balanced request's ranges have
    // consecutive slots, y + b
    const int b = pair_at / 2, own = blockIdx.y + b, other = own + (pair_at % 2 ? 1 : -1);
    end_pair<ROWS, HT, WARPS>(p, b, blockIdx.x, own, other, (blockIdx.x / HEAD_TILES) * QT,
                              (blockIdx.x % HEAD_TILES) * HT, reinterpret_cast<const elem_t*>(smem_raw), STAGE_STRIDE,
                              sM, RowSum{sPart}, reinterpret_cast<unsigned*>(sP), warp, lane);   // (sP: free now)
    MLAGEN_TRACE(pair_done);
  }
}
