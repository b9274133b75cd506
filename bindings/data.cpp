// Python bindings of the data pipeline (megacore._C.data): indexed datasets, GPT samples, blends,
// packing, the prefetching loader and the default corpus. The Pythonic layer is python/megacore/data/.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "megacore/data/data.hpp"

namespace megacore::py {

namespace {

using namespace megacore::data;

template <class T>
pyb::array_t<T> to_numpy(std::span<const T> v) {
  pyb::array_t<T> a(pyb::ssize_t(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}
template <class T>
pyb::array_t<T> to_numpy(const std::vector<T>& v) {
  return to_numpy(std::span<const T>(v));
}

// Any integer sequence (numpy array of any int dtype, list) as contiguous int64.
std::vector<int64_t> int64_vector(const pyb::handle& o) {
  auto a = pyb::array_t<int64_t, pyb::array::c_style | pyb::array::forcecast>::ensure(o);
  MC_CHECK(a, "expected a sequence of integer token ids");
  MC_CHECK(a.ndim() == 1, "expected a 1-D sequence of token ids, got {} dimensions", a.ndim());
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

// One row of a dataset as numpy arrays (inspection and tests; training goes through DataLoader).
pyb::dict row_dict(const SampleSource& ds, int64_t i) {
  const int64_t s = ds.seq_length();
  pyb::array_t<int64_t> tokens(s), labels(s), pos(s);
  pyb::array_t<float> mask(s);
  std::vector<int32_t> starts;
  {
    pyb::gil_scoped_release nogil;
    ds.get(i, RowView{tokens.mutable_data(), labels.mutable_data(), mask.mutable_data(), pos.mutable_data(), &starts});
  }
  pyb::dict d;
  d["tokens"] = tokens;
  d["labels"] = labels;
  d["loss_mask"] = mask;
  d["position_ids"] = pos;
  d["seq_starts"] = to_numpy(starts);
  return d;
}

int64_t check_index(int64_t i, int64_t n, const char* what) {
  if (i < 0) i += n;
  if (i < 0 || i >= n) throw pyb::index_error(fmt::format("{} index {} out of range for length {}", what, i, n));
  return i;
}

}  // namespace

void bind_data(pyb::module_& parent) {
  auto m = parent.def_submodule("data", "Data pipeline: indexed datasets, GPT samples, blends, packing, loader");

  m.def("token_dtype_for_vocab", [](int64_t v) { return std::string(token_dtype_name(token_dtype_for_vocab(v))); },
        pyb::arg("vocab_size"), "Smallest dtype name for ids below vocab_size ('u16' or 'i32').");

  // ---- indexed dataset -------------------------------------------------------------------------
  pyb::class_<IndexedDataset, std::shared_ptr<IndexedDataset>>(m, "IndexedDataset",
                                                               "Memory-mapped Megatron .bin/.idx dataset (read-only).")
      .def(pyb::init<const std::string&>(), pyb::arg("prefix"))
      .def_property_readonly("prefix", &IndexedDataset::prefix)
      .def_property_readonly("dtype", [](const IndexedDataset& d) { return std::string(token_dtype_name(d.dtype())); })
      .def_property_readonly("num_sequences", &IndexedDataset::num_sequences)
      .def_property_readonly("num_documents", &IndexedDataset::num_documents)
      .def_property_readonly("num_tokens", &IndexedDataset::num_tokens)
      .def_property_readonly("sequence_lengths", [](const IndexedDataset& d) { return to_numpy(d.sequence_lengths()); })
      .def_property_readonly("sequence_pointers", [](const IndexedDataset& d) { return to_numpy(d.sequence_pointers()); })
      .def_property_readonly("document_indices", [](const IndexedDataset& d) { return to_numpy(d.document_indices()); })
      .def("__len__", &IndexedDataset::num_sequences)
      .def("__getitem__", [](const IndexedDataset& d, int64_t i) {
             return to_numpy(d.sequence(check_index(i, d.num_sequences(), "sequence")));
           }, "Tokens of sequence i (int64).")
      .def("document", [](const IndexedDataset& d, int64_t i) {
             i = check_index(i, d.num_documents(), "document");
             std::vector<int64_t> out(size_t(d.document_length(i)));
             d.read_tokens(d.document_token_offset(i), int64_t(out.size()), out.data());
             return to_numpy(out);
           }, pyb::arg("index"), "Tokens of document d (all its sequences, int64).");

  pyb::class_<IndexedDatasetWriter>(m, "IndexedDatasetWriter",
                                    "Writes prefix.bin/.idx through temporary files renamed by finalize().")
      .def(pyb::init([](const std::string& prefix, const std::string& dtype) {
             return std::make_unique<IndexedDatasetWriter>(prefix, token_dtype_from_name(dtype));
           }), pyb::arg("prefix"), pyb::arg("dtype") = "u16")
      .def("add_sequence", [](IndexedDatasetWriter& w, const pyb::object& t) { w.add_sequence(int64_vector(t)); },
           pyb::arg("tokens"))
      .def("end_document", &IndexedDatasetWriter::end_document)
      .def("add_document", [](IndexedDatasetWriter& w, const pyb::object& t) {
             auto v = int64_vector(t);
             w.add_document(v);
           }, pyb::arg("tokens"))
      .def("add_dataset", &IndexedDatasetWriter::add_dataset, pyb::arg("dataset"))
      .def("finalize", &IndexedDatasetWriter::finalize)
      .def("abort", &IndexedDatasetWriter::abort)
      .def_property_readonly("num_sequences", &IndexedDatasetWriter::num_sequences)
      .def_property_readonly("num_documents", &IndexedDatasetWriter::num_documents)
      .def_property_readonly("num_tokens", &IndexedDatasetWriter::num_tokens)
      .def("__enter__", [](IndexedDatasetWriter& w) -> IndexedDatasetWriter& { return w; },
           pyb::return_value_policy::reference)
      .def("__exit__", [](IndexedDatasetWriter& w, const pyb::object& type, const pyb::object&, const pyb::object&) {
        if (type.is_none())
          w.finalize();
        else
          w.abort();
        return false;
      });

  // ---- sample sources ----------------------------------------------------------------------------
  pyb::class_<SampleSource, std::shared_ptr<SampleSource>>(m, "SampleSource", "Fixed-length training rows.")
      .def("__len__", &SampleSource::size)
      .def_property_readonly("seq_length", &SampleSource::seq_length)
      .def("get", [](const SampleSource& s, int64_t i) { return row_dict(s, check_index(i, s.size(), "sample")); },
           pyb::arg("index"), "Row i as numpy arrays: tokens, labels, loss_mask, position_ids, seq_starts.");

  pyb::class_<GPTDataset, SampleSource, std::shared_ptr<GPTDataset>>(m, "GPTDataset")
      .def(pyb::init([](std::shared_ptr<IndexedDataset> data, int64_t seq_length, int64_t num_samples, uint64_t seed,
                        int64_t doc_begin, int64_t doc_end, const std::string& cache_dir, bool use_cache) {
             GPTDatasetConfig c{seq_length, num_samples, seed, doc_begin, doc_end, cache_dir, use_cache};
             pyb::gil_scoped_release nogil;
             return std::make_shared<GPTDataset>(std::move(data), c);
           }),
           pyb::arg("data"), pyb::arg("seq_length"), pyb::arg("num_samples") = 0, pyb::arg("seed") = 1234,
           pyb::arg("doc_begin") = 0, pyb::arg("doc_end") = -1, pyb::arg("cache_dir") = "",
           pyb::arg("use_cache") = true)
      .def("sample_tokens", [](const GPTDataset& d, int64_t i) {
             return to_numpy(d.sample_tokens(check_index(i, d.size(), "sample")));
           }, pyb::arg("index"), "The seq_length + 1 tokens of sample i.")
      .def_property_readonly("num_epochs", &GPTDataset::num_epochs)
      .def_property_readonly("cache_path", &GPTDataset::cache_path)
      .def_property_readonly("loaded_from_cache", &GPTDataset::loaded_from_cache)
      .def_property_readonly("index_hash", &GPTDataset::index_hash)
      .def_property_readonly("document_index", [](const GPTDataset& d) { return to_numpy(d.document_index()); })
      .def_property_readonly("sample_index", [](const GPTDataset& d) {
        auto a = to_numpy(d.sample_index());
        return a.reshape({pyb::ssize_t(d.size() + 1), pyb::ssize_t(2)});
      })
      .def_property_readonly("shuffle_index", [](const GPTDataset& d) { return to_numpy(d.shuffle_index()); });

  pyb::class_<BlendedDataset, SampleSource, std::shared_ptr<BlendedDataset>>(m, "BlendedDataset")
      .def(pyb::init([](const std::vector<std::shared_ptr<SampleSource>>& ds, const std::vector<double>& w, int64_t n) {
             std::vector<std::shared_ptr<const SampleSource>> c(ds.begin(), ds.end());
             return std::make_shared<BlendedDataset>(std::move(c), w, n);
           }), pyb::arg("datasets"), pyb::arg("weights"), pyb::arg("size"))
      .def("locate", &BlendedDataset::locate, pyb::arg("index"), "(dataset, sample within it) of blended sample i.")
      .def_property_readonly("weights", &BlendedDataset::weights)
      .def_property_readonly("dataset_index", [](const BlendedDataset& b) { return to_numpy(b.indices().dataset_index); })
      .def_property_readonly("dataset_sample_index",
                             [](const BlendedDataset& b) { return to_numpy(b.indices().dataset_sample_index); });

  pyb::class_<PackedSequenceDataset, SampleSource, std::shared_ptr<PackedSequenceDataset>>(m, "PackedSequenceDataset")
      .def(pyb::init([](const pyb::object& tokens, const pyb::object& answer_mask, const pyb::object& offsets,
                        int64_t seq_length, bool pack, int64_t pad_id, bool truncate) {
             auto t = int64_vector(tokens), o = int64_vector(offsets);
             auto m64 = int64_vector(answer_mask);
             std::vector<uint8_t> mask(m64.begin(), m64.end());
             PackingConfig c{seq_length, pack, pad_id, truncate};
             pyb::gil_scoped_release nogil;
             return std::make_shared<PackedSequenceDataset>(std::move(t), std::move(mask), std::move(o), c);
           }),
           pyb::arg("tokens"), pyb::arg("answer_mask"), pyb::arg("offsets"), pyb::arg("seq_length"),
           pyb::arg("pack") = true, pyb::arg("pad_id") = 0, pyb::arg("truncate") = true)
      .def_property_readonly("num_sequences", &PackedSequenceDataset::num_sequences)
      .def_property_readonly("num_truncated", &PackedSequenceDataset::num_truncated)
      .def_property_readonly("fill_ratio", &PackedSequenceDataset::fill_ratio)
      .def("row_sequences", &PackedSequenceDataset::row_sequences, pyb::arg("row"));

  m.def("build_blending_indices", [](const std::vector<double>& w, int64_t n) {
    auto r = build_blending_indices(w, n);
    return pyb::make_tuple(to_numpy(r.dataset_index), to_numpy(r.dataset_sample_index));
  }, pyb::arg("weights"), pyb::arg("size"), "(dataset_index, dataset_sample_index) of a greedy exact blend.");
  m.def("blend_samples_needed", &blend_samples_needed, pyb::arg("weights"), pyb::arg("size"));
  m.def("parse_split", &parse_split, pyb::arg("split"));
  m.def("split_document_ranges", &split_document_ranges, pyb::arg("num_documents"), pyb::arg("fractions"));
  m.def("build_pretrain_datasets",
        [](const std::vector<std::pair<double, std::string>>& blend, const std::string& split, int64_t seq_length,
           std::array<int64_t, 3> num_samples, uint64_t seed, const std::string& cache_dir, bool use_cache) {
          PretrainDatasetsConfig c;
          for (auto& [w, p] : blend) c.blend.push_back({w, p});
          c.split = split;
          c.seq_length = seq_length;
          c.num_samples = num_samples;
          c.seed = seed;
          c.cache_dir = cache_dir;
          c.use_cache = use_cache;
          pyb::gil_scoped_release nogil;
          return build_pretrain_datasets(c);
        },
        pyb::arg("blend"), pyb::arg("split"), pyb::arg("seq_length"), pyb::arg("num_samples"), pyb::arg("seed") = 1234,
        pyb::arg("cache_dir") = "", pyb::arg("use_cache") = true,
        "(train, valid, test) sample sources of a blend [(weight, prefix), ...]; None where 0 samples were asked.");
  m.def("pack_first_fit_decreasing", [](const pyb::object& lengths, int64_t capacity) {
    auto l = int64_vector(lengths);
    return pack_first_fit_decreasing(l, capacity);
  }, pyb::arg("lengths"), pyb::arg("capacity"), "Bins (lists of item indices) of first-fit-decreasing packing.");

  // ---- loader -----------------------------------------------------------------------------------
  pyb::class_<Batch>(m, "Batch", "One micro-batch of one data-parallel rank.")
      .def_readonly("tokens", &Batch::tokens)
      .def_readonly("labels", &Batch::labels)
      .def_readonly("loss_mask", &Batch::loss_mask)
      .def_readonly("position_ids", &Batch::position_ids)
      .def_readonly("cu_seqlens", &Batch::cu_seqlens)
      .def_readonly("max_seqlen", &Batch::max_seqlen)
      .def_readonly("sample_indices", &Batch::sample_indices)
      .def_readonly("step", &Batch::step)
      .def_readonly("micro_step", &Batch::micro_step);

  pyb::class_<DataLoader>(m, "DataLoader", "Micro-batches of one DP rank, prepared by a background thread.")
      .def(pyb::init([](std::shared_ptr<SampleSource> ds, int64_t mbs, int64_t gbs, int dp_rank, int dp_size,
                        int64_t consumed, int prefetch, const pyb::object& device, bool pin, bool shuffle,
                        uint64_t seed, int64_t vocab_size, int64_t epochs) {
             LoaderConfig c{.micro_batch_size = mbs, .global_batch_size = gbs, .dp_rank = dp_rank, .dp_size = dp_size,
                            .consumed_samples = consumed, .prefetch = prefetch, .device = device_arg(device),
                            .pin_memory = pin, .shuffle = shuffle, .seed = seed, .epochs = epochs,
                            .vocab_size = vocab_size};
             return std::make_unique<DataLoader>(std::move(ds), c);
           }),
           pyb::arg("dataset"), pyb::arg("micro_batch_size") = 1, pyb::arg("global_batch_size") = 0,
           pyb::arg("dp_rank") = 0, pyb::arg("dp_size") = 1, pyb::arg("consumed_samples") = 0,
           pyb::arg("prefetch") = 4, pyb::arg("device") = "cpu", pyb::arg("pin_memory") = true,
           pyb::arg("shuffle") = false, pyb::arg("seed") = 1234, pyb::arg("vocab_size") = 0, pyb::arg("epochs") = 1)
      .def("next", [](DataLoader& l, const pyb::object& stream) -> std::optional<Batch> {
             Stream s = stream_arg(stream, l.config().device);
             pyb::gil_scoped_release nogil;
             return l.next(s);
           }, pyb::arg("stream") = pyb::none(), "The next micro-batch, or None after the last full step.")
      .def("__iter__", [](DataLoader& l) -> DataLoader& { return l; }, pyb::return_value_policy::reference)
      .def("__next__", [](DataLoader& l) {
        Stream s = current_stream(l.config().device);
        std::optional<Batch> b;
        {
          pyb::gil_scoped_release nogil;
          b = l.next(s);
        }
        if (!b) throw pyb::stop_iteration();
        return std::move(*b);
      })
      .def_property_readonly("consumed_samples", &DataLoader::consumed_samples)
      .def_property_readonly("num_steps", &DataLoader::num_steps)
      .def_property_readonly("micro_batches_per_step", &DataLoader::micro_batches_per_step)
      .def("sample_indices", &DataLoader::sample_indices, pyb::arg("step"), pyb::arg("micro_step"), pyb::arg("rank"))
      .def("stats", [](const DataLoader& l) {
        LoaderStats s = l.stats();
        pyb::dict d;
        d["batches"] = s.batches;
        d["wait_seconds"] = s.wait_seconds;
        d["max_wait_seconds"] = s.max_wait_seconds;
        d["produce_seconds"] = s.produce_seconds;
        d["pinned"] = s.pinned;
        return d;
      });

  // ---- byte tokenizer and default corpus ---------------------------------------------------------
  m.attr("BYTE_EOS") = ByteTokenizer::kEos;
  m.attr("BYTE_PAD") = ByteTokenizer::kPad;
  m.attr("BYTE_BOS") = ByteTokenizer::kBos;
  m.attr("BYTE_VOCAB_SIZE") = ByteTokenizer::kVocabSize;
  m.def("default_corpus_document", &default_corpus_document, pyb::arg("index"), pyb::arg("seed") = 0);
  m.def("write_default_corpus", [](const std::string& prefix, int64_t n, uint64_t seed) {
    CorpusInfo i;
    {
      pyb::gil_scoped_release nogil;
      i = write_default_corpus(prefix, {n, seed});
    }
    pyb::dict d;
    d["documents"] = i.documents;
    d["tokens"] = i.tokens;
    d["prefix"] = prefix;
    return d;
  }, pyb::arg("prefix"), pyb::arg("num_documents") = 4000, pyb::arg("seed") = 0,
        "Writes the default corpus (byte tokens + EOS per document) to prefix.bin/.idx.");
}

}  // namespace megacore::py
