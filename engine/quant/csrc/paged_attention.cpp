// Paged attention on CPU for short queries (decode, draft verification, and prefill chunks row
// by row): which keys each query row sees (the plan, worked out once per step), and the rows
// attended in work items that share key tiles (attend_heads in vec_kernels_impl.h). A row's
// result depends only on that row, its keys and its window: never on the rest of the batch.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_ops.h"

namespace {

void check_float_rows(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
                name, " must be a contiguous CPU float32 tensor");
}

// Multiply-adds of attention (query rows x heads x keys x head_dim) below which one thread does
// it all (at 1 << 13, a batch-1 step splits from ~15 keys on; see git log for the figures).
constexpr int64_t kParallelAttentionWork = 1 << 13;

// Rows a request may have for its attention to be read-bound (see attend): up to a short verify.
constexpr int64_t kStreamRows = 4;

}  // namespace

// Which query rows a step's requests own and where their keys are, from the attention metadata
// of requests with a few new tokens each (decode, draft verification): request s owns query rows
// token_index[s, :query_lens[s]] at positions context_lens[s] - query_lens[s] + r, and sees keys
// at positions up to its own (the last `window` of them where window > 0). Worked out once per
// step: every layer with that window shares it.
AttentionPlan plan_attention(const torch::Tensor& token_index, const torch::Tensor& query_lens,
                             const torch::Tensor& context_lens, const torch::Tensor& block_tables,
                             int64_t num_cache_blocks, int64_t block_size, int64_t window) {
    TORCH_CHECK(window >= 0, "the sliding window must be positive, or 0 for none");
    for (const torch::Tensor* t : {&token_index, &query_lens, &context_lens, &block_tables})
        TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(),
                    "index tensors must be contiguous int64");
    AttentionPlan plan;
    const int64_t num_seqs = token_index.size(0), max_q = token_index.size(1);
    const int64_t max_blocks = block_tables.size(1);
    const int64_t* rows = token_index.data_ptr<int64_t>();
    const int64_t* qlens = query_lens.data_ptr<int64_t>();
    const int64_t* ctxs = context_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    std::vector<int64_t> slot_start(num_seqs + 1, 0);
    for (int64_t s = 0; s < num_seqs; ++s) {
        TORCH_CHECK(qlens[s] >= 1 && qlens[s] <= max_q && qlens[s] <= ctxs[s] &&
                        ctxs[s] <= max_blocks * block_size,
                    "attention metadata of request ", s, " does not fit its tensors");
        // Blocks wholly behind the window are never read: the block manager may have freed them.
        const int64_t first_read = window > 0 ? std::max<int64_t>(0, ctxs[s] - qlens[s] + 1 - window) : 0;
        for (int64_t p = 0; p < ctxs[s]; p += block_size) {
            if (p + block_size <= first_read) {
                plan.slots.insert(plan.slots.end(), block_size, -1);
                continue;
            }
            const int64_t block = tables[s * max_blocks + p / block_size];
            TORCH_CHECK(block >= 0 && block < num_cache_blocks, "block ", block, " out of range");
            for (int64_t j = 0; j < block_size && p + j < ctxs[s]; ++j)
                plan.slots.push_back(block * block_size + j);
        }
        slot_start[s + 1] = (int64_t)plan.slots.size();
        plan.request_rows.push_back((int64_t)plan.rows.size());
        for (int64_t r = 0; r < qlens[s]; ++r) {
            const int64_t num_keys = ctxs[s] - qlens[s] + r + 1;
            const int64_t first_key = window > 0 ? std::max<int64_t>(0, num_keys - window) : 0;
            plan.rows.push_back({rows[s * max_q + r], slot_start[s], first_key, num_keys});
            plan.work += num_keys - first_key;
        }
    }
    plan.request_rows.push_back((int64_t)plan.rows.size());
    return plan;
}

// out[row, h] = softmax(scores(q[row, h], K)) V over the row's planned keys, for every planned row
// and query head; q and out rows are row_stride floats apart (heads D apart), the caches
// [num_blocks, block_size, Hk, D].
void attend(const AttentionPlan& plan, const float* q, int64_t q_row_stride, const float* k_cache,
            const float* v_cache, int64_t num_heads, int64_t num_kv_heads, int64_t D, float* out,
            int64_t out_row_stride, ScoreForm form, int64_t isa) {
    const int64_t group = num_heads / num_kv_heads, slot_stride = num_kv_heads * D;
    const VecOps ops = vec_ops(isa);
    const int64_t num_seqs = (int64_t)plan.request_rows.size() - 1;
    // An item is a request's query heads on some of its KV heads, for a chunk of its rows,
    // sharing their key tiles. One thread computes an item, and a query's result never depends
    // on the others in it (attend_heads), so a row's result is the same however rows are batched
    // or split. Splitting costs a few microseconds: worth it only for enough multiply-adds.
    //  - Where every request has at most kStreamRows rows (decode, short verify), reading the
    //    keys and values is the cost, not the arithmetic: an item holds all of a request's KV
    //    heads, which lie side by side in each slot, so that their lines are read together. A
    //    lone request's KV heads are shared out over the threads: 2 + 1 for 3 on two threads
    //    read 1.3x faster than an item a KV head, 1.7x than one item (attention_rows
    //    --from-memory, a one-row decode at 1,700 keys).
    //  - Else, where attend_heads blocks queries that share keys, an item holds one KV head's
    //    whole GQA group (a row's heads see exactly the same keys), and a request's rows are cut
    //    into chunks until there are two items a thread where the rows allow it.
    //  - Else the whole GQA group where that leaves every thread two items, one head of it if not.
    const int64_t threads = at::get_num_threads();
    int64_t most_rows = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        most_rows = std::max(most_rows, plan.request_rows[s + 1] - plan.request_rows[s]);
    const bool streaming = most_rows <= kStreamRows;
    const int64_t kv_per_item =
        !streaming ? 1
        : num_seqs >= threads ? num_kv_heads
                              : (num_kv_heads + threads / num_seqs - 1) / (threads / num_seqs);
    const int64_t kv_groups = (num_kv_heads + kv_per_item - 1) / kv_per_item;
    const int64_t kv_items = num_seqs * kv_groups;
    const bool blocked = ops.query_block > 1;
    const int64_t heads_per_item = streaming || blocked || kv_items >= 2 * threads ? group : 1;
    const int64_t chunks = !streaming && blocked
                               ? std::max<int64_t>(1, (2 * threads + kv_items - 1) / kv_items)
                               : 1;
    const int64_t parts = group / heads_per_item;
    const int64_t items = kv_items * parts * chunks;
    const int64_t grain = plan.work * num_heads * D < kParallelAttentionWork ? items : 1;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scratch;
        thread_local std::vector<HeadQuery> queries;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t s = item / (kv_groups * parts * chunks);
            const int64_t first_kv = item / (parts * chunks) % kv_groups * kv_per_item;
            const int64_t kv_count = std::min(kv_per_item, num_kv_heads - first_kv);
            const int64_t head_offset = item / chunks % parts * heads_per_item;
            const int64_t chunk = item % chunks;
            const int64_t request_begin = plan.request_rows[s];
            const int64_t num_rows = plan.request_rows[s + 1] - request_begin;
            const int64_t row_begin = request_begin + num_rows * chunk / chunks;
            const int64_t row_end = request_begin + num_rows * (chunk + 1) / chunks;
            if (row_begin == row_end) continue;
            queries.clear();
            int64_t max_keys = 0;
            for (int64_t kvh = first_kv; kvh < first_kv + kv_count; ++kvh)  // KV head by KV head
                for (int64_t r = row_begin; r < row_end; ++r) {
                    const AttentionPlan::Row& row = plan.rows[r];
                    max_keys = std::max(max_keys, row.num_keys - row.first_key);
                    const int64_t first_head = kvh * group + head_offset;
                    for (int64_t h = first_head; h < first_head + heads_per_item; ++h)
                        queries.push_back({q + row.index * q_row_stride + h * D,
                                           out + row.index * out_row_stride + h * D,
                                           row.first_key, row.num_keys});
                }
            const int64_t need = attend_scratch_floats((int64_t)queries.size(), max_keys, D);
            if ((int64_t)scratch.size() < need) scratch.resize(need);
            const int64_t* slots = plan.slots.data() + plan.rows[row_begin].slot_start;
            ops.attend_heads(queries.data(), (int64_t)queries.size() / kv_count, kv_count, D,
                             form, PagedRows{k_cache + first_kv * D, slots, slot_stride},
                             PagedRows{v_cache + first_kv * D, slots, slot_stride},
                             scratch.data());
        }
    });
}

// q [T, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hk, D] already holding this step's KV.
// Writes out[token_index[s, r]] for every real row; other rows of out are left untouched.
// window > 0: sliding-window attention; scale <= 0: 1 / sqrt(D); softcap > 0: soft-capped scores.
// isa: the float variant to run (tests; kAuto: the process's own, as isa.h's float_isa says).
void paged_attention_small(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& token_index,
                           const torch::Tensor& query_lens, const torch::Tensor& context_lens,
                           const torch::Tensor& block_tables, torch::Tensor& out, int64_t window,
                           double scale, double softcap, int64_t isa) {
    check_float_rows(q, "q");
    check_float_rows(k_cache, "k_cache");
    check_float_rows(v_cache, "v_cache");
    check_float_rows(out, "out");
    const AttentionPlan plan = plan_attention(token_index, query_lens, context_lens, block_tables,
                                              k_cache.size(0), k_cache.size(1), window);
    const int64_t num_heads = q.size(1), D = q.size(2);
    attend(plan, q.data_ptr<float>(), num_heads * D, k_cache.data_ptr<float>(),
           v_cache.data_ptr<float>(), num_heads, k_cache.size(2), D, out.data_ptr<float>(),
           num_heads * D, score_form(D, scale, softcap), isa);
}

void register_paged_attention(pybind11::module& m) {
    m.def("paged_attention_small", &paged_attention_small, py::call_guard<py::gil_scoped_release>(),
          "paged attention of short queries over the KV cache", py::arg("q"), py::arg("k_cache"),
          py::arg("v_cache"), py::arg("token_index"), py::arg("query_lens"),
          py::arg("context_lens"), py::arg("block_tables"), py::arg("out"), py::arg("window") = 0,
          py::arg("scale") = 0.0, py::arg("softcap") = 0.0, py::arg("isa") = (int64_t)kAuto);
    m.def("attention_query_block", [](int64_t isa) { return vec_ops(isa).query_block; },
          "how many query heads attention takes at once where they share keys (1: one at a time)",
          py::arg("isa") = (int64_t)kAuto);
    m.def("attention_stream_rows", [] { return kStreamRows; },
          "the most rows a request may have for its step's attention to take all its KV heads "
          "an item (a read-bound step: decode, short verify)");
    m.def("float_isa", &float_isa,
          "the float variant this process runs: 0 generic, 1 AVX2+FMA, 2 AVX-512");
}
