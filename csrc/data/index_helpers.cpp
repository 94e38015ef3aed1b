// Index builders for the GPT and blended datasets (FORMATS.md sections 3 and 4) and the BERT
// sentence-pair sample mapping.
//
// The loops are sequential by nature (each step depends on the previous one) and run over up to
// billions of entries, which is why they live in C++. megatron/data/index_builders.py holds the
// numpy versions of the GPT and blending walks that define the same results and are used when this
// extension is not built; build_mapping (megatron/data/bert_dataset.py) has no such fallback.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

template <typename T>
py::array_t<T> fill_sample_idx(const int32_t* sizes, const int32_t* doc_idx, int64_t doc_idx_len,
                               int64_t seq_length, int64_t num_samples) {
  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T* out = result.mutable_data();
  int64_t doc_pos = 0;     // position in doc_idx
  int64_t doc_offset = 0;  // token offset inside the current document
  out[0] = 0;
  out[1] = 0;
  {
    py::gil_scoped_release release;
    for (int64_t s = 1; s <= num_samples; ++s) {
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_pos >= doc_idx_len) {
          throw std::runtime_error("build_sample_idx: ran past the end of doc_idx; "
                                   "tokens_per_epoch does not match the document sizes");
        }
        const int64_t doc_length = static_cast<int64_t>(sizes[doc_idx[doc_pos]]) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next sample starts on its last token.
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_pos;
          doc_offset = 0;
        }
      }
      out[2 * s] = static_cast<T>(doc_pos);
      out[2 * s + 1] = static_cast<T>(doc_offset);
    }
  }
  return result;
}

py::array build_sample_idx(py::array_t<int32_t, py::array::c_style | py::array::forcecast> sizes,
                           py::array_t<int32_t, py::array::c_style | py::array::forcecast> doc_idx,
                           int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length <= 0) throw std::invalid_argument("build_sample_idx: seq_length must be > 0");
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
  if (num_samples < 0) throw std::invalid_argument("build_sample_idx: no tokens");
  int64_t max_doc_len = 0;
  for (py::ssize_t i = 0; i < sizes.size(); ++i) {
    max_doc_len = std::max<int64_t>(max_doc_len, sizes.data()[i]);
  }
  // An id outside sizes would read past its end; reject it before the walk.
  for (py::ssize_t i = 0; i < doc_idx.size(); ++i) {
    const int32_t id = doc_idx.data()[i];
    if (id < 0 || id >= sizes.size()) {
      throw std::invalid_argument("build_sample_idx: doc_idx[" + std::to_string(i) + "] = " +
                                  std::to_string(id) + " is not a sequence id in [0, " +
                                  std::to_string(sizes.size()) + ")");
    }
  }
  const int64_t limit = std::numeric_limits<int32_t>::max();
  const bool wide = doc_idx.size() > limit || max_doc_len > limit;
  if (wide) {
    return fill_sample_idx<int64_t>(sizes.data(), doc_idx.data(), doc_idx.size(), seq_length,
                                    num_samples);
  }
  return fill_sample_idx<int32_t>(sizes.data(), doc_idx.data(), doc_idx.size(), seq_length,
                                  num_samples);
}

void build_blending_indices(py::array_t<uint8_t, py::array::c_style> dataset_index,
                            py::array_t<int64_t, py::array::c_style> dataset_sample_index,
                            py::array_t<double, py::array::c_style | py::array::forcecast> weights,
                            int32_t num_datasets, int64_t size) {
  if (dataset_index.size() < size || dataset_sample_index.size() < size) {
    throw std::invalid_argument("build_blending_indices: output arrays are smaller than size");
  }
  if (weights.size() != num_datasets || num_datasets <= 0 || num_datasets > 255) {
    throw std::invalid_argument("build_blending_indices: need 1..255 datasets, one weight each");
  }
  uint8_t* ds = dataset_index.mutable_data();
  int64_t* ds_sample = dataset_sample_index.mutable_data();
  const double* w = weights.data();
  std::vector<int64_t> counts(num_datasets, 0);
  py::gil_scoped_release release;
  for (int64_t i = 0; i < size; ++i) {
    const double x = static_cast<double>(std::max<int64_t>(i, 1));
    int32_t best = 0;
    double best_error = w[0] * x - static_cast<double>(counts[0]);
    for (int32_t d = 1; d < num_datasets; ++d) {
      const double error = w[d] * x - static_cast<double>(counts[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    ds[i] = static_cast<uint8_t>(best);
    ds_sample[i] = counts[best];
    ++counts[best];
  }
}

// ------------------------------------------------------------------- BERT sample mapping

// A document with more than one sentence gives no samples when one of its sentences is longer than
// this many tokens: such a "sentence" is a table, a listing or text the splitter could not cut.
constexpr int32_t kLongSentenceLen = 512;

struct MappingArgs {
  const int64_t* docs;      // document d is sentences [docs[d], docs[d + 1])
  int64_t num_docs;
  const int32_t* sizes;     // tokens per sentence
  int64_t num_epochs;
  int64_t max_num_samples;  // no new epoch starts once this many samples exist
  int32_t max_seq_length;
  int32_t short_seq_ratio;  // one start in this many draws a short target; 0: never
  uint32_t seed;
  int64_t min_num_sent;     // 2 with the sentence-order head (a pair needs two), else 1
};

struct MappingStats {
  int64_t empty_docs = 0;
  int64_t one_sentence_docs = 0;
  int64_t long_sentence_docs = 0;
  int64_t epochs = 0;
};

// Target token count of the sample that starts now. One draw of the generator per call (none when
// short sequences are off): r % ratio == 0 gives a short target 2 + r % (max - 1), in [2, max].
int32_t draw_target_length(const MappingArgs& a, std::mt19937& gen) {
  if (a.short_seq_ratio == 0) return a.max_seq_length;
  const uint64_t r = gen();
  if (r % static_cast<uint64_t>(a.short_seq_ratio) == 0) {
    return 2 + static_cast<int32_t>(r % static_cast<uint64_t>(a.max_seq_length - 1));
  }
  return a.max_seq_length;
}

bool has_long_sentence(const int32_t* sizes, int64_t first, int64_t last) {
  for (int64_t s = first; s < last; ++s) {
    if (sizes[s] > kLongSentenceLen) return true;
  }
  return false;
}

// One pass over the epochs: returns the number of samples and, when `rows` is given, writes each
// as (first sentence, end sentence (exclusive), target length). Each pass seeds its own generator,
// so the counting pass and the filling pass draw the same targets.
template <typename T>
int64_t walk_mapping(const MappingArgs& a, T* rows, MappingStats* stats) {
  std::mt19937 gen(a.seed);
  int64_t count = 0;
  for (int64_t epoch = 0; epoch < a.num_epochs && count < a.max_num_samples; ++epoch) {
    const int64_t count_before = count;
    for (int64_t d = 0; d < a.num_docs; ++d) {
      const int64_t first = a.docs[d];
      const int64_t last = a.docs[d + 1];
      int64_t remaining = last - first;
      const bool long_sentence = remaining > 1 && has_long_sentence(a.sizes, first, last);
      if (stats != nullptr && epoch == 0) {
        stats->empty_docs += remaining == 0;
        stats->one_sentence_docs += remaining == 1;
        stats->long_sentence_docs += long_sentence;
      }
      if (remaining < a.min_num_sent || long_sentence) continue;
      int64_t start = first;
      int64_t length = 0;
      int64_t num_sent = 0;
      int32_t target = draw_target_length(a, gen);
      for (int64_t s = first; s < last; ++s) {
        length += a.sizes[s];
        ++num_sent;
        --remaining;
        // A sample ends once it reaches its target, unless fewer than two sentences would be left
        // for the document's last sample; the document's last sentence always ends one.
        const bool full = length >= target && remaining > 1 && num_sent >= a.min_num_sent;
        if (full || remaining == 0) {
          if (rows != nullptr) {
            rows[3 * count] = static_cast<T>(start);
            rows[3 * count + 1] = static_cast<T>(s + 1);
            rows[3 * count + 2] = static_cast<T>(target);
          }
          ++count;
          start = s + 1;
          length = 0;
          num_sent = 0;
          target = draw_target_length(a, gen);
        }
      }
    }
    if (stats != nullptr) stats->epochs = epoch + 1;
    // An epoch that gave no sample means every later one gives none either.
    if (count == count_before) break;
  }
  return count;
}

// Fisher-Yates from the last row down with a 64-bit generator (there may be over 2^32 rows).
template <typename T>
void shuffle_rows(T* rows, int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(gen() % static_cast<uint64_t>(i + 1));
    if (j != i) std::swap_ranges(rows + 3 * i, rows + 3 * i + 3, rows + 3 * j);
  }
}

template <typename T>
py::array fill_mapping(const MappingArgs& a, bool verbose) {
  MappingStats stats;
  int64_t num_samples = 0;
  {
    py::gil_scoped_release release;
    num_samples = walk_mapping<T>(a, nullptr, &stats);
  }
  py::array_t<T> result({num_samples, static_cast<int64_t>(3)});
  T* rows = result.mutable_data();
  {
    py::gil_scoped_release release;
    if (walk_mapping<T>(a, rows, nullptr) != num_samples) {
      throw std::logic_error("build_mapping: the two passes counted different sample numbers");
    }
    shuffle_rows(rows, num_samples, static_cast<uint64_t>(a.seed) + 1);
  }
  if (verbose) {
    py::print("build_mapping:", a.num_docs, "documents,", stats.empty_docs, "empty,",
              stats.one_sentence_docs, "with one sentence,", stats.long_sentence_docs,
              "skipped for a sentence over", kLongSentenceLen, "tokens;", num_samples,
              "samples in", stats.epochs, "epochs");
  }
  return result;
}

using Int64Input = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Int32Input = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

void check_mapping_inputs(const Int64Input& docs, const Int32Input& sizes) {
  if (docs.ndim() != 1 || docs.size() < 1) {
    throw std::invalid_argument("build_mapping: docs must be a 1-D array of num_docs + 1 sentence "
                                "numbers (document boundaries)");
  }
  if (sizes.ndim() != 1) throw std::invalid_argument("build_mapping: sizes must be a 1-D array");
  const int64_t* d = docs.data();
  const int64_t n = docs.size();
  if (d[0] < 0) {
    throw std::invalid_argument("build_mapping: docs[0] = " + std::to_string(d[0]) +
                                " is negative");
  }
  for (int64_t i = 1; i < n; ++i) {
    if (d[i] < d[i - 1]) {
      throw std::invalid_argument("build_mapping: docs must not decrease, but docs[" +
                                  std::to_string(i) + "] = " + std::to_string(d[i]) + " < docs[" +
                                  std::to_string(i - 1) + "] = " + std::to_string(d[i - 1]));
    }
  }
  if (d[n - 1] > sizes.size()) {
    throw std::invalid_argument("build_mapping: docs[-1] = " + std::to_string(d[n - 1]) +
                                " is past the " + std::to_string(sizes.size()) +
                                " sentences in sizes");
  }
  for (int64_t s = d[0]; s < d[n - 1]; ++s) {
    if (sizes.data()[s] < 0) {
      throw std::invalid_argument("build_mapping: sizes[" + std::to_string(s) + "] = " +
                                  std::to_string(sizes.data()[s]) + " is negative");
    }
  }
}

py::array build_mapping(Int64Input docs, Int32Input sizes, int64_t num_epochs,
                        int64_t max_num_samples, int64_t max_seq_length, double short_seq_prob,
                        int64_t seed, bool verbose, int64_t min_num_sent) {
  check_mapping_inputs(docs, sizes);
  if (num_epochs < 1) {
    throw std::invalid_argument("build_mapping: num_epochs must be >= 1, got " +
                                std::to_string(num_epochs));
  }
  if (max_num_samples < 0) {
    throw std::invalid_argument("build_mapping: max_num_samples must be >= 0, got " +
                                std::to_string(max_num_samples));
  }
  if (max_seq_length < 2 || max_seq_length > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("build_mapping: max_seq_length must be in [2, 2^31), got " +
                                std::to_string(max_seq_length));
  }
  if (!(short_seq_prob >= 0.0 && short_seq_prob <= 1.0)) {
    throw std::invalid_argument("build_mapping: short_seq_prob must be in [0, 1], got " +
                                std::to_string(short_seq_prob));
  }
  if (seed < 0 || seed > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    throw std::invalid_argument("build_mapping: seed must be in [0, 2^32), got " +
                                std::to_string(seed));
  }
  if (min_num_sent < 1) {
    throw std::invalid_argument("build_mapping: min_num_sent must be >= 1, got " +
                                std::to_string(min_num_sent));
  }
  MappingArgs a;
  a.docs = docs.data();
  a.num_docs = docs.size() - 1;
  a.sizes = sizes.data();
  a.num_epochs = num_epochs;
  a.max_num_samples = max_num_samples;
  a.max_seq_length = static_cast<int32_t>(max_seq_length);
  a.short_seq_ratio = 0;
  if (short_seq_prob > 0.0) {
    // Probabilities below 1 / 2^31 are treated as 1 / (2^31 - 1).
    const double ratio = std::round(1.0 / short_seq_prob);
    a.short_seq_ratio = static_cast<int32_t>(
        std::min(ratio, static_cast<double>(std::numeric_limits<int32_t>::max())));
  }
  a.seed = static_cast<uint32_t>(seed);
  a.min_num_sent = min_num_sent;
  if (static_cast<uint64_t>(sizes.size()) > std::numeric_limits<uint32_t>::max()) {
    return fill_mapping<uint64_t>(a, verbose);
  }
  return fill_mapping<uint32_t>(a, verbose);
}

}  // namespace

PYBIND11_MODULE(_index_helpers, m) {
  m.doc() = "Compiled index builders for the GPT, blended and BERT datasets";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  // The two outputs are written in place: noconvert() makes a wrong dtype or a non-contiguous
  // array a TypeError instead of a silently filled (and discarded) converted copy.
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("weights"),
        py::arg("num_datasets"), py::arg("size"));
  m.def("build_mapping", &build_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
        py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"),
        py::arg("seed"), py::arg("verbose"), py::arg("min_num_sent"));
}
