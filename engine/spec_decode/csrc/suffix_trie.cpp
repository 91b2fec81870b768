// The suffix trie of engine/spec_decode/suffix_tree.py in C++: the same nodes, counts, node ids,
// matches and drafts (tests/engine/spec_decode/test_suffix_native.py holds the two to each other
// on random traffic), at ~36 bytes a node instead of ~140 and without the interpreter's cost per
// lookup. Read suffix_tree.py for what each method means; this file says only how.
//
// Nothing here throws with a formatted number: the callers (suffix_native.py) check arguments.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <optional>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kRoot = 0;
constexpr int32_t kNoChild = -1;
constexpr uint64_t kEmptyKey = ~uint64_t{0};

using Tokens = std::vector<int32_t>;
using Nodes = std::vector<int32_t>;

uint64_t edge_key(int32_t node, int32_t token) {
    return (uint64_t(uint32_t(node)) << 32) | uint32_t(token);
}

// Edges keyed by (parent, token): open addressing with linear probing, at most 70% full, and
// backward-shift deletion (no tombstones, so lookups stay short after many removals). Like a
// Python dict it keeps its size after removals; the cache rebuilds a trie that shrank.
class EdgeTable {
  public:
    EdgeTable() { rehash(16); }

    int32_t get(uint64_t key) const {
        for (size_t i = home(key);; i = (i + 1) & mask_) {
            if (keys_[i] == key) return values_[i];
            if (keys_[i] == kEmptyKey) return kNoChild;
        }
    }

    void insert(uint64_t key, int32_t value) {  // key is absent
        if ((size_ + 1) * 10 > keys_.size() * 7) rehash(keys_.size() * 2);
        size_t i = home(key);
        while (keys_[i] != kEmptyKey) i = (i + 1) & mask_;
        keys_[i] = key;
        values_[i] = value;
        ++size_;
    }

    void erase(uint64_t key) {  // key is present
        size_t hole = home(key);
        while (keys_[hole] != key) hole = (hole + 1) & mask_;
        for (size_t next = (hole + 1) & mask_; keys_[next] != kEmptyKey;
             next = (next + 1) & mask_) {
            // An entry may fill the hole unless its home lies cyclically in (hole, next].
            size_t h = home(keys_[next]);
            bool stays = hole <= next ? (hole < h && h <= next) : (hole < h || h <= next);
            if (!stays) {
                keys_[hole] = keys_[next];
                values_[hole] = values_[next];
                hole = next;
            }
        }
        keys_[hole] = kEmptyKey;
        --size_;
    }

    template <typename Visit>
    void for_each(Visit visit) const {
        for (size_t i = 0; i < keys_.size(); ++i)
            if (keys_[i] != kEmptyKey) visit(keys_[i], values_[i]);
    }

    size_t num_bytes() const { return keys_.capacity() * 8 + values_.capacity() * 4; }

    // num_bytes() once `more` edges were added: the capacity doubles while they would not fit.
    size_t num_bytes_with(size_t more) const {
        size_t capacity = keys_.size();
        while ((size_ + more) * 10 > capacity * 7) capacity *= 2;
        return capacity * 12;
    }

  private:
    size_t home(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }

    void rehash(size_t capacity) {
        std::vector<uint64_t> keys(capacity, kEmptyKey);
        std::vector<int32_t> values(capacity, 0);
        keys.swap(keys_);
        values.swap(values_);
        mask_ = capacity - 1;
        shift_ = 64;
        for (size_t c = capacity; c > 1; c >>= 1) --shift_;
        size_ = 0;
        for (size_t i = 0; i < keys.size(); ++i)
            if (keys[i] != kEmptyKey) insert(keys[i], values[i]);
    }

    std::vector<uint64_t> keys_;
    std::vector<int32_t> values_;
    size_t mask_ = 0, size_ = 0;
    int shift_ = 64;
};

using DraftTuple = std::tuple<Tokens, double, int, double, double>;

class SuffixTrie {
  public:
    explicit SuffixTrie(int max_depth) : max_depth_(max_depth) {
        counts_.push_back(0);
        best_.push_back(kNoChild);
        tokens_.push_back(0);
    }

    Nodes extend(const Nodes& active, int32_t token) {
        size_t keep = std::min(active.size(), size_t(max_depth_ - 1));
        Nodes extended;
        extended.reserve(keep + 1);
        for (size_t i = 0; i <= keep; ++i) {
            int32_t node = i == 0 ? kRoot : active[i - 1];
            uint64_t key = edge_key(node, token);
            int32_t child = edges_.get(key);
            if (child == kNoChild) {
                child = new_node(token);
                edges_.insert(key, child);
            }
            counts_[child] += 1;
            int32_t known = best_[node];
            if (known < 0 || (known != child && counts_[child] > counts_[known]))
                best_[node] = child;
            extended.push_back(child);
        }
        return extended;
    }

    Nodes extend_all(Nodes active, const Tokens& tokens) {
        check_nodes(active);
        for (int32_t token : tokens) active = extend(active, token);
        return active;
    }

    void insert(const Tokens& tokens) {
        ++version_;
        extend_all({}, tokens);
    }

    void remove(const Tokens& tokens) {
        ++version_;
        size_t length = tokens.size();
        for (size_t start = 0; start < length; ++start) {
            int32_t node = kRoot;
            size_t end = std::min(start + size_t(max_depth_), length);
            for (size_t position = start; position < end; ++position) {
                uint64_t key = edge_key(node, tokens[position]);
                int32_t child = edges_.get(key);
                if (child == kNoChild) break;  // never inserted: nothing of it to take back
                if (--counts_[child] == 0) {
                    edges_.erase(key);
                    if (best_[node] == child) best_[node] = kNoChild;
                    drop_chain(child, tokens, position + 1, end);
                    break;
                }
                node = child;
            }
        }
    }

    Nodes advance(const Nodes& matched, int32_t token) const {
        size_t keep = std::min(matched.size(), size_t(max_depth_ - 1));
        Nodes advanced;
        advanced.reserve(keep + 1);
        for (size_t i = 0; i <= keep; ++i) {
            int32_t child = edges_.get(edge_key(i == 0 ? kRoot : matched[i - 1], token));
            if (child == kNoChild) break;
            advanced.push_back(child);
        }
        return advanced;
    }

    Nodes advance_all(Nodes matched, const Tokens& tokens) const {
        check_nodes(matched);
        for (int32_t token : tokens) matched = advance(matched, token);
        return matched;
    }

    Nodes match(const Tokens& tokens) const {
        size_t from = tokens.size() > size_t(max_depth_ - 1) ? tokens.size() - (max_depth_ - 1) : 0;
        return advance_all({}, Tokens(tokens.begin() + from, tokens.end()));
    }

    std::optional<DraftTuple> draft(const Nodes& matched, const Tokens& tail, int num_tokens,
                                    double max_spec_factor, double min_token_prob) const {
        check_nodes(matched);
        int length = int(matched.size());
        int32_t node = kNoChild;
        for (; length > 0; --length) {
            node = matched[length - 1];
            if (best_[node] >= 0) break;
        }
        if (length == 0) return std::nullopt;
        // In double: a large --suffix-max-spec-factor must not overflow an int.
        double by_match = std::max(1.0, std::floor(max_spec_factor * length));
        int limit = by_match < double(num_tokens) ? int(by_match) : num_tokens;
        Tokens drafted;
        double probability = 1.0, smoothed = 1.0, score = 0.0;
        int depth = length;
        while (int(drafted.size()) < limit) {
            int32_t child = best_[node];
            if (child < 0) {
                if (depth < max_depth_) break;
                std::tie(node, depth) = reanchor(tail, drafted);
                if (node < 0) break;
                child = best_[node];
            }
            double extended = probability * counts_[child] / counts_[node];
            if (extended < min_token_prob) break;
            probability = extended;
            smoothed *= double(counts_[child]) / double(counts_[node] + 1);
            drafted.push_back(tokens_[child]);
            score += probability;
            node = child;
            depth += 1;
        }
        if (drafted.empty()) return std::nullopt;
        return DraftTuple(std::move(drafted), score, length, probability, smoothed);
    }

    // (parent, token, child) of every edge, for tests that rebuild the substrings.
    std::vector<std::tuple<int32_t, int32_t, int32_t>> edges() const {
        std::vector<std::tuple<int32_t, int32_t, int32_t>> out;
        edges_.for_each([&](uint64_t key, int32_t child) {
            out.emplace_back(int32_t(key >> 32), int32_t(uint32_t(key)), child);
        });
        return out;
    }

    int32_t count(int32_t node) const { check_nodes({node}); return counts_[node]; }
    int max_depth() const { return max_depth_; }
    int64_t version() const { return version_; }
    size_t num_nodes() const { return counts_.size() - free_.size(); }
    size_t num_free_slots() const { return free_.size(); }
    size_t num_bytes() const {
        return sizeof(*this) + edges_.num_bytes() +
               4 * (counts_.capacity() + best_.capacity() + tokens_.capacity() + free_.capacity());
    }

    // num_bytes() once `more` nodes were added: freed ids are reused first, then the node arrays
    // grow as push_back grows them (doubling), and the edge table as it does.
    size_t num_bytes_with(size_t more) const {
        size_t appended = more > free_.size() ? more - free_.size() : 0;
        size_t capacity = counts_.capacity(), needed = counts_.size() + appended;
        while (capacity < needed) capacity = std::max<size_t>(2 * capacity, 1);
        return sizeof(*this) + edges_.num_bytes_with(more) +
               4 * (3 * capacity + free_.capacity());
    }

  private:
    // Node ids come back from Python: one this trie never gave out would index past its arrays.
    void check_nodes(const Nodes& nodes) const {
        for (int32_t node : nodes)
            if (node < 0 || size_t(node) >= counts_.size())
                throw std::invalid_argument("a node id this suffix trie does not hold");
    }

    int32_t new_node(int32_t token) {
        if (!free_.empty()) {
            int32_t node = free_.back();
            free_.pop_back();
            tokens_[node] = token;
            return node;
        }
        counts_.push_back(0);
        best_.push_back(kNoChild);
        tokens_.push_back(token);
        return int32_t(counts_.size() - 1);
    }

    void drop_chain(int32_t node, const Tokens& tokens, size_t from, size_t end) {
        for (size_t position = from; position < end; ++position) {
            uint64_t key = edge_key(node, tokens[position]);
            int32_t child = edges_.get(key);
            edges_.erase(key);
            release(node);
            node = child;
        }
        release(node);
    }

    void release(int32_t node) {
        counts_[node] = 0;
        best_[node] = kNoChild;
        free_.push_back(node);
    }

    std::pair<int32_t, int> reanchor(const Tokens& tail, const Tokens& drafted) const {
        Tokens window(tail);
        window.insert(window.end(), drafted.begin(), drafted.end());
        size_t keep = size_t(2 * max_depth_ / 3);
        size_t first = window.size() > keep ? window.size() - keep : 0;
        for (size_t start = first; start < window.size(); ++start) {
            int32_t node = kRoot;
            for (size_t i = start; i < window.size() && node >= 0; ++i)
                node = edges_.get(edge_key(node, window[i]));
            if (node > kRoot && best_[node] >= 0) return {node, int(window.size() - start)};
        }
        return {kNoChild, 0};
    }

    int max_depth_;
    int64_t version_ = 0;
    EdgeTable edges_;
    std::vector<int32_t> counts_, best_, tokens_, free_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "specserve's suffix trie (engine/spec_decode/suffix_native.py)";
    py::class_<SuffixTrie>(m, "SuffixTrie")
        .def(py::init<int>())
        .def("extend_all", &SuffixTrie::extend_all)
        .def("insert", &SuffixTrie::insert)
        .def("remove", &SuffixTrie::remove)
        .def("advance_all", &SuffixTrie::advance_all)
        .def("match", &SuffixTrie::match)
        .def("draft", &SuffixTrie::draft)
        .def("edge_list", &SuffixTrie::edges)
        .def("count", &SuffixTrie::count)
        .def_property_readonly("max_depth", &SuffixTrie::max_depth)
        .def_property_readonly("version", &SuffixTrie::version)
        .def_property_readonly("num_nodes", &SuffixTrie::num_nodes)
        .def_property_readonly("num_free_slots", &SuffixTrie::num_free_slots)
        .def_property_readonly("num_bytes", &SuffixTrie::num_bytes)
        .def("num_bytes_with", &SuffixTrie::num_bytes_with);
}
