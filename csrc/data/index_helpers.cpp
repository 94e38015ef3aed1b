// Index builders for the GPT and blended datasets (FORMATS.md sections 3 and 4).
//
// Both loops are sequential by nature (each step depends on the previous one) and run over up to
// billions of entries, which is why they live in C++. megatron/data/index_builders.py holds the
// numpy versions that define the same results and are used when this extension is not built.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
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

}  // namespace

PYBIND11_MODULE(_index_helpers, m) {
  m.doc() = "Compiled index builders for the GPT and blended datasets";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  // The two outputs are written in place: noconvert() makes a wrong dtype or a non-contiguous
  // array a TypeError instead of a silently filled (and discarded) converted copy.
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("weights"),
        py::arg("num_datasets"), py::arg("size"));
}
