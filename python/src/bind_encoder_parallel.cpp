// diffcomm._core.encoder_parallel: token rules, batches, the planner and the
// exchange on diffcomm tensors.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <vector>

#include "bind.hpp"
#include "diffcomm/encoder_parallel/batch.hpp"
#include "diffcomm/encoder_parallel/exchange.hpp"
#include "diffcomm/encoder_parallel/merge.hpp"
#include "diffcomm/encoder_parallel/planner.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/tensor/error.hpp"

namespace diffcomm_python {

void bind_encoder_parallel(nb::module_& m) {
  auto e = m.def_submodule("encoder_parallel", "The encoder-parallel feature exchange.");
  nb::enum_<ep::FeatureExchangeMode>(e, "FeatureExchangeMode")
      .value("Local", ep::FeatureExchangeMode::Local)
      .value("TpVariableAllGather", ep::FeatureExchangeMode::TpVariableAllGather)
      .value("TpVariableA2A", ep::FeatureExchangeMode::TpVariableA2A)
      .value("ParentVariableA2A", ep::FeatureExchangeMode::ParentVariableA2A);
  nb::enum_<ep::ReceiverGrad>(e, "ReceiverGrad")
      .value("Partial", ep::ReceiverGrad::Partial)
      .value("ReplicatedOverTp", ep::ReceiverGrad::ReplicatedOverTp);
  nb::enum_<ep::CpLayout>(e, "CpLayout")
      .value("Contiguous", ep::CpLayout::Contiguous)
      .value("Zigzag", ep::CpLayout::Zigzag);

  nb::class_<ep::EncoderWorkItem>(e, "EncoderWorkItem")
      .def(nb::init<>())
      .def_rw("item_id", &ep::EncoderWorkItem::item_id)
      .def_rw("batch_index", &ep::EncoderWorkItem::batch_index)
      .def_rw("decoder_token_start", &ep::EncoderWorkItem::decoder_token_start)
      .def_rw("input_rows", &ep::EncoderWorkItem::input_rows)
      .def_rw("output_rows", &ep::EncoderWorkItem::output_rows)
      .def(nb::self == nb::self)
      .def("__repr__", [](const ep::EncoderWorkItem& w) {
        return "EncoderWorkItem(item_id=" + std::to_string(w.item_id) +
               ", batch_index=" + std::to_string(w.batch_index) +
               ", decoder_token_start=" + std::to_string(w.decoder_token_start) +
               ", input_rows=" + std::to_string(w.input_rows) +
               ", output_rows=" + std::to_string(w.output_rows) + ")";
      });
  nb::class_<ep::EncoderFeature>(e, "EncoderFeature")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::EncoderFeature* f, ep::EncoderWorkItem item, Tensor rows) {
            new (f) ep::EncoderFeature{item, std::move(rows)};
          },
          "item"_a, "rows"_a)
      .def_rw("item", &ep::EncoderFeature::item)
      .def_rw("rows", &ep::EncoderFeature::rows);
  nb::class_<ep::MeshContext>(e, "MeshContext")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::MeshContext* c, int cp, int tp, bool sp, int cp_rank, int tp_rank) {
            new (c) ep::MeshContext{cp, tp, sp, cp_rank, tp_rank};
          },
          "cp_size"_a = 1, "tp_size"_a = 1, "sequence_parallel"_a = false, "cp_rank"_a = 0,
          "tp_rank"_a = 0)
      .def_rw("cp_size", &ep::MeshContext::cp_size)
      .def_rw("tp_size", &ep::MeshContext::tp_size)
      .def_rw("sequence_parallel", &ep::MeshContext::sequence_parallel)
      .def_rw("cp_rank", &ep::MeshContext::cp_rank)
      .def_rw("tp_rank", &ep::MeshContext::tp_rank)
      .def("parent_rank", &ep::MeshContext::parent_rank);
  nb::class_<ep::ImageSpan>(e, "ImageSpan")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::ImageSpan* s, int64_t start, int64_t tokens, int64_t patches, int64_t id) {
            new (s) ep::ImageSpan{start, tokens, patches < 0 ? 4 * tokens : patches, id};
          },
          "token_start"_a, "tokens"_a, "patches"_a = -1, "source_id"_a = -1)
      .def_rw("token_start", &ep::ImageSpan::token_start)
      .def_rw("tokens", &ep::ImageSpan::tokens)
      .def_rw("patches", &ep::ImageSpan::patches)
      .def_rw("source_id", &ep::ImageSpan::source_id);
  nb::class_<ep::Sample>(e, "Sample")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::Sample* s, int64_t seq_len, std::vector<ep::ImageSpan> images) {
            new (s) ep::Sample{seq_len, std::move(images)};
          },
          "seq_len"_a, "images"_a = std::vector<ep::ImageSpan>{})
      .def_rw("seq_len", &ep::Sample::seq_len)
      .def_rw("images", &ep::Sample::images);
  nb::class_<ep::Batch>(e, "Batch")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::Batch* b, std::vector<ep::Sample> samples) {
            new (b) ep::Batch{std::move(samples)};
          },
          "samples"_a)
      .def_rw("samples", &ep::Batch::samples);
  nb::class_<ep::DecoderMesh>(e, "DecoderMesh")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::DecoderMesh* d, int cp, int tp, bool sp, ep::CpLayout layout) {
            new (d) ep::DecoderMesh{cp, tp, sp, layout};
          },
          "cp"_a = 1, "tp"_a = 1, "sp"_a = false, "layout"_a = ep::CpLayout::Contiguous)
      .def_rw("cp", &ep::DecoderMesh::cp)
      .def_rw("tp", &ep::DecoderMesh::tp)
      .def_rw("sp", &ep::DecoderMesh::sp)
      .def_rw("layout", &ep::DecoderMesh::layout)
      .def("context", &ep::DecoderMesh::context, "cp_rank"_a, "tp_rank"_a)
      .def("exchange_size", &ep::DecoderMesh::exchange_size,
           "Ranks of the exchange group: cp*tp when cp > 1, else tp.")
      .def("exchange_rank", &ep::DecoderMesh::exchange_rank, "cp_rank"_a, "tp_rank"_a);
  nb::class_<ep::EncoderLayout>(e, "EncoderLayout")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::EncoderLayout* l, int buckets, int ecp) {
            new (l) ep::EncoderLayout{buckets, ecp};
          },
          "buckets"_a = 1, "encoder_cp"_a = 1)
      .def_rw("buckets", &ep::EncoderLayout::buckets)
      .def_rw("encoder_cp", &ep::EncoderLayout::encoder_cp);
  nb::class_<ep::PairTraffic>(e, "PairTraffic")
      .def_ro("src", &ep::PairTraffic::src)
      .def_ro("dst", &ep::PairTraffic::dst)
      .def_ro("rows", &ep::PairTraffic::rows)
      .def_ro("bytes", &ep::PairTraffic::bytes);
  nb::class_<ep::PlanStats>(e, "PlanStats")
      .def_ro("pairs", &ep::PlanStats::pairs)
      .def_ro("total_bytes", &ep::PlanStats::total_bytes)
      .def_ro("padded_all_gather_bytes", &ep::PlanStats::padded_all_gather_bytes)
      .def_ro("owner_minimum_bytes", &ep::PlanStats::owner_minimum_bytes)
      .def_ro("encoder_imbalance", &ep::PlanStats::encoder_imbalance)
      .def_ro("bucket_patches", &ep::PlanStats::bucket_patches)
      .def_ro("rows_sent", &ep::PlanStats::rows_sent)
      .def_ro("rows_received", &ep::PlanStats::rows_received);
  nb::class_<ep::ExchangePlan>(e, "ExchangePlan",
                               "The exchange plan of one micro-batch, identical on every rank.")
      .def_ro("mode", &ep::ExchangePlan::mode)
      .def_ro("decoder", &ep::ExchangePlan::decoder)
      .def_ro("encoder", &ep::ExchangePlan::encoder)
      .def_ro("exchange_size", &ep::ExchangePlan::exchange_size)
      .def_ro("seq_lens", &ep::ExchangePlan::seq_lens)
      .def_ro("items", &ep::ExchangePlan::items)
      .def_ro("buckets", &ep::ExchangePlan::buckets)
      .def_ro("bucket_of", &ep::ExchangePlan::bucket_of)
      .def_ro("destinations", &ep::ExchangePlan::destinations)
      .def("producer", &ep::ExchangePlan::producer, "bucket"_a)
      .def("coordinates", &ep::ExchangePlan::coordinates, "exchange_rank"_a)
      .def("owned", &ep::ExchangePlan::owned, "batch_index"_a, "exchange_rank"_a)
      .def(
          "stats",
          [](const ep::ExchangePlan& p, int64_t hidden, const std::string& d) {
            return p.stats(hidden, dc::parse_dtype(d));
          },
          "hidden"_a, "dtype"_a = "float32")
      .def("fingerprint", &ep::ExchangePlan::fingerprint);
  nb::class_<ep::ShardLayout>(e, "ShardLayout")
      .def(nb::init<const ep::ExchangePlan&, int>(), "plan"_a, "exchange_rank"_a)
      .def("rows", &ep::ShardLayout::rows)
      .def("row_of", &ep::ShardLayout::row_of, "batch_index"_a, "token"_a)
      .def("tokens", &ep::ShardLayout::tokens);
  nb::class_<ep::RoutedFeatures>(e, "RoutedFeatures")
      .def_ro("rows", &ep::RoutedFeatures::rows)
      .def_ro("items", &ep::RoutedFeatures::items);
  nb::class_<ep::ImageSize>(e, "ImageSize")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ep::ImageSize* s, int64_t id, int64_t w, int64_t h) {
            new (s) ep::ImageSize{id, w, h};
          },
          "image_id"_a, "width"_a, "height"_a)
      .def_rw("image_id", &ep::ImageSize::image_id)
      .def_rw("width", &ep::ImageSize::width)
      .def_rw("height", &ep::ImageSize::height);
  nb::class_<ep::BatchOptions>(e, "BatchOptions")
      .def(nb::init<>())
      .def_rw("samples", &ep::BatchOptions::samples)
      .def_rw("images_per_sample", &ep::BatchOptions::images_per_sample)
      .def_rw("text_min", &ep::BatchOptions::text_min)
      .def_rw("text_max", &ep::BatchOptions::text_max)
      .def_rw("seq_multiple", &ep::BatchOptions::seq_multiple)
      .def_rw("seed", &ep::BatchOptions::seed);

  e.def("select_feature_exchange", &ep::select_feature_exchange, "mesh"_a);
  e.def("mode_name", &ep::mode_name, "mode"_a);
  e.def("receiver_grad_for", &ep::receiver_grad_for, "mesh"_a);
  e.def("owned_ranges", &ep::owned_ranges, "seq_len"_a, "mesh"_a, "cp_rank"_a, "tp_rank"_a);
  e.def("plan_exchange", &ep::plan_exchange, "batch"_a, "decoder"_a, "encoder"_a);
  e.def("required_seq_multiple", &ep::required_seq_multiple, "mesh"_a);
  e.def("load_image_sizes", &ep::load_image_sizes, "path"_a);
  e.def("default_image_sizes_path", &ep::default_image_sizes_path);
  e.def("build_batches", &ep::build_batches, "images"_a, "dp"_a, "options"_a);
  e.def(
      "smart_resize",
      [](int64_t h, int64_t w, int64_t min_pixels, int64_t max_pixels) {
        const auto r = ep::qwen2vl::smart_resize(h, w, min_pixels, max_pixels);
        return std::make_pair(r.height, r.width);
      },
      "height"_a, "width"_a, "min_pixels"_a = ep::qwen2vl::kMinPixels,
      "max_pixels"_a = ep::qwen2vl::kMaxPixels);
  e.def("image_tokens", &ep::qwen2vl::image_tokens, "height"_a, "width"_a);
  e.def("image_patches", &ep::qwen2vl::image_patches, "height"_a, "width"_a);
  e.def("route_features", &ep::route_features, "mode"_a, "producer_records"_a, "prototype"_a,
        "exchange_rank"_a, "plan"_a, "group"_a, "grad"_a, release());
  e.def("unpack_records", &ep::unpack_records, "rows"_a, "received_items"_a, release());
  e.def("merge_into_decoder", &ep::merge_into_decoder, "base"_a, "records"_a, "layout"_a,
        "anchor"_a = Tensor{}, release());
}

}  // namespace diffcomm_python
