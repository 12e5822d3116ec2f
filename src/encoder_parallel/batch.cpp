#include "diffcomm/encoder_parallel/batch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include "diffcomm/config.hpp"
#include "diffcomm/encoder_parallel/qwen2vl.hpp"
#include "diffcomm/error.hpp"
#include "diffcomm/tensor.hpp"

namespace diffcomm::encoder_parallel {
namespace {
std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cell;
  std::istringstream in(line);
  while (std::getline(in, cell, ',')) {
    if (!cell.empty() && cell.back() == '\r') cell.pop_back();
    out.push_back(cell);
  }
  return out;
}

// A whole cell as an integer: std::stoll alone would read "640.5" or "20px"
// as 640 or 20.
int64_t parse_integer(const std::string& cell) {
  std::size_t used = 0;
  const long long v = std::stoll(cell, &used);
  if (used != cell.size()) throw std::invalid_argument("'" + cell + "' is not an integer");
  return v;
}
}  // namespace

std::vector<ImageSize> load_image_sizes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(fmt::format("load_image_sizes: cannot open '{}'", path));
  std::string line;
  if (!std::getline(in, line))
    throw InvalidArgument(fmt::format("load_image_sizes: '{}' is empty", path));
  const auto header = split_csv(line);
  auto column = [&](const char* name) {
    auto it = std::find(header.begin(), header.end(), name);
    if (it == header.end())
      throw InvalidArgument(
          fmt::format("load_image_sizes: '{}' has no column '{}' (header: {})", path, name, line));
    return static_cast<std::size_t>(it - header.begin());
  };
  const std::size_t ci = column("image_id"), cw = column("width"), ch = column("height");
  std::vector<ImageSize> out;
  for (int lineno = 2; std::getline(in, line); ++lineno) {
    if (line.empty() || line == "\r") continue;
    const auto cells = split_csv(line);
    try {
      if (cells.size() <= std::max({ci, cw, ch})) throw std::invalid_argument("too few columns");
      ImageSize s{parse_integer(cells[ci]), parse_integer(cells[cw]), parse_integer(cells[ch])};
      if (s.width <= 0 || s.height <= 0) throw std::invalid_argument("non-positive size");
      out.push_back(s);
    } catch (const std::exception& e) {
      throw InvalidArgument(
          fmt::format("load_image_sizes: '{}' line {}: {} ('{}')", path, lineno, e.what(), line));
    }
  }
  return out;
}

std::string default_image_sizes_path() {
  const std::string rel = "coco_val2017/image_sizes.csv";
  std::vector<std::filesystem::path> candidates;
  // Next to an installed program (<prefix>/bin/x -> <prefix>/share/diffcomm/data),
  // wherever the prefix was chosen at install time.
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path().parent_path() / "share/diffcomm/data" / rel);
  candidates.push_back(std::filesystem::path(DIFFCOMM_INSTALL_DATA_DIR) / rel);
  candidates.push_back(std::filesystem::path(DIFFCOMM_SOURCE_DATA_DIR) / rel);
  for (const auto& p : candidates)
    if (std::filesystem::exists(p, ec)) return p.string();
  return "";
}

int64_t required_seq_multiple(const DecoderMesh& mesh) {
  int64_t m = mesh.layout == CpLayout::Zigzag ? 2 * mesh.cp : mesh.cp;
  if (mesh.sp) m *= mesh.tp;
  return m;
}

std::vector<Batch> build_batches(const std::vector<ImageSize>& images, int dp,
                                 const BatchOptions& o) {
  if (dp < 1 || o.samples < 0 || o.images_per_sample < 0 || o.text_min < 0 ||
      o.text_max < o.text_min || o.seq_multiple < 1)
    throw InvalidArgument(fmt::format(
        "build_batches: dp {} samples {} images_per_sample {} text [{}, {}] seq_multiple {} "
        "(need dp >= 1, non-negative counts, text_min <= text_max, seq_multiple >= 1)",
        dp, o.samples, o.images_per_sample, o.text_min, o.text_max, o.seq_multiple));
  if (images.empty() && o.images_per_sample > 0 && o.samples > 0)
    throw InvalidArgument("build_batches: no images to draw from");
  Generator gen(o.seed);
  std::vector<std::size_t> order(images.size());
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = order.size(); i > 1; --i)  // Fisher-Yates with our generator
    std::swap(order[i - 1], order[gen.next_u64() % i]);
  std::size_t cursor = 0;
  auto text = [&] {
    return o.text_min + static_cast<int64_t>(gen.next_u64() %
                                             static_cast<uint64_t>(o.text_max - o.text_min + 1));
  };
  std::vector<Batch> out(static_cast<std::size_t>(dp));
  for (auto& batch : out)
    for (int s = 0; s < o.samples; ++s) {
      Sample sample;
      int64_t pos = 0;
      for (int k = 0; k < o.images_per_sample; ++k) {
        pos += text();
        const ImageSize& im = images[order[cursor++ % order.size()]];
        ImageSpan span;
        span.token_start = pos;
        span.tokens = qwen2vl::image_tokens(im.height, im.width);
        span.patches = qwen2vl::image_patches(im.height, im.width);
        span.source_id = im.image_id;
        sample.images.push_back(span);
        pos += span.tokens;
      }
      pos += text();
      sample.seq_len = (pos + o.seq_multiple - 1) / o.seq_multiple * o.seq_multiple;
      batch.samples.push_back(std::move(sample));
    }
  return out;
}

}  // namespace diffcomm::encoder_parallel
