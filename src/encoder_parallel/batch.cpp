#include "diffcomm/encoder_parallel/batch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/tokenizer.hpp>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>

#include "diffcomm/config.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::encoder_parallel {
namespace {

using Separator = boost::escaped_list_separator<char>;

// A whole cell as an integer in [lo, hi]: std::stoll alone would read "640.5"
// or "20px" as 640 or 20, and throws bare std::invalid_argument.
int64_t parse_integer(const std::string& cell, int64_t lo, int64_t hi) {
  int64_t v = 0;
  const char* end = cell.data() + cell.size();
  const auto [ptr, ec] = std::from_chars(cell.data(), end, v);
  if (cell.empty()) throw std::invalid_argument("empty cell, expected an integer");
  if (ec == std::errc::result_out_of_range ||
      (ec == std::errc{} && ptr == end && (v < lo || v > hi)))
    throw std::invalid_argument(fmt::format("'{}' is outside [{}, {}]", cell, lo, hi));
  if (ec != std::errc{} || ptr != end)
    throw std::invalid_argument(fmt::format("'{}' is not an integer", cell));
  return v;
}

// The 1-based character column of an unterminated quote, or 0 when quotes
// balance (escaped_list_separator itself silently reads to the end of line).
std::size_t unterminated_quote(std::string_view line) {
  bool in_quote = false;
  std::size_t opened = 0;
  for (std::size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '\\') {
      ++i;  // the escaped character (a bad escape is the tokenizer's to report)
    } else if (line[i] == '"') {
      in_quote = !in_quote;
      if (in_quote) opened = i + 1;
    }
  }
  return in_quote ? opened : 0;
}

std::vector<std::string> split_line(std::string_view line) {
  if (const std::size_t col = unterminated_quote(line))
    throw std::invalid_argument(fmt::format("column {} (character): unterminated quote", col));
  std::vector<std::string> out;
  try {
    const std::string copy(line);
    boost::tokenizer<Separator> cells(copy, Separator('\\', ',', '"'));
    for (const auto& cell : cells) out.push_back(cell);
  } catch (const boost::escaped_list_error& e) {
    throw std::invalid_argument(std::string("bad escape: ") + e.what());
  }
  return out;
}

}  // namespace

std::vector<ImageSize> parse_image_sizes(std::string_view text, const std::string& source) {
  std::size_t lineno = 0, at = 0;
  auto next_line = [&](std::string_view& line) {
    if (at >= text.size()) return false;
    const std::size_t nl = text.find('\n', at);
    const std::size_t end = nl == std::string_view::npos ? text.size() : nl;
    line = text.substr(at, end - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    at = end + 1;
    ++lineno;
    return true;
  };
  std::string_view line;
  if (!next_line(line) || line.empty())
    raise("load_image_sizes",
          fmt::format("'{}' has no header line (expected image_id,width,height)", source));
  if (line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);  // UTF-8 byte order mark
  std::vector<std::string> header;
  try {
    header = split_line(line);
  } catch (const std::invalid_argument& e) {
    raise("load_image_sizes", fmt::format("'{}' line {}: header: {}", source, lineno, e.what()));
  }
  auto column = [&](const char* name, bool required) -> std::optional<std::size_t> {
    const auto n = std::count(header.begin(), header.end(), name);
    if (n > 1)
      raise("load_image_sizes",
            fmt::format("'{}' line {}: column '{}' appears {} times in the header", source, lineno,
                        name, n));
    const auto it = std::find(header.begin(), header.end(), name);
    if (it != header.end()) return static_cast<std::size_t>(it - header.begin());
    if (required)
      raise("load_image_sizes",
            fmt::format("'{}' has no column '{}' (header: {})", source, name, line));
    return std::nullopt;
  };
  const std::size_t ci = *column("image_id", true), cw = *column("width", true),
                    ch = *column("height", true);
  const std::optional<std::size_t> cf = column("frames", false);
  const std::size_t needed = std::max({ci, cw, ch, cf.value_or(0)}) + 1;

  std::vector<ImageSize> out;
  while (next_line(line)) {
    if (line.empty()) continue;
    std::vector<std::string> cells;
    try {
      cells = split_line(line);
    } catch (const std::invalid_argument& e) {
      raise("load_image_sizes", fmt::format("'{}' line {}: {}", source, lineno, e.what()));
    }
    if (cells.size() < needed)
      raise("load_image_sizes",
            fmt::format("'{}' line {}: {} cells, the header needs at least {} ('{}')", source,
                        lineno, cells.size(), needed, line));
    auto cell = [&](std::size_t c, int64_t lo, int64_t hi) {
      try {
        return parse_integer(cells[c], lo, hi);
      } catch (const std::invalid_argument& e) {
        raise("load_image_sizes", fmt::format("'{}' line {}: column {} ({}): {}", source, lineno,
                                              c + 1, header[c], e.what()));
      }
    };
    ImageSize s;
    s.image_id = cell(ci, INT64_MIN, INT64_MAX);
    s.width = cell(cw, 1, kMaxImageSide);
    s.height = cell(ch, 1, kMaxImageSide);
    if (cf) s.frames = cell(*cf, 1, kMaxFrames);
    out.push_back(s);
  }
  return out;
}

std::vector<ImageSize> load_image_sizes(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(st))
    raise("load_image_sizes", fmt::format("'{}' is a directory, not a CSV file", path));
  // Opening a FIFO (or a socket) blocks until a writer comes: refused before
  // it is opened. A character device is read up to the cap below.
  if (std::filesystem::is_fifo(st) || std::filesystem::is_socket(st))
    raise("load_image_sizes",
          fmt::format("'{}' is a FIFO or socket, not a CSV file (it would block)", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) raise("load_image_sizes", fmt::format("cannot open '{}'", path));
  // Read in chunks up to a cap, so a path that never ends (/dev/zero, a
  // character device, a runaway pipe) is an error, not an unbounded allocation.
  std::string text;
  std::vector<char> chunk(std::size_t{1} << 16);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const auto got = static_cast<std::size_t>(in.gcount());
    if (text.size() + got > kMaxImageSizesBytes)
      raise("load_image_sizes",
            fmt::format("'{}' is larger than {} bytes (expected a CSV of image sizes)", path,
                        kMaxImageSizesBytes));
    text.append(chunk.data(), got);
  }
  if (in.bad()) raise("load_image_sizes", fmt::format("cannot read '{}'", path));
  return parse_image_sizes(text, path);
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

std::vector<Batch> build_batches(const std::vector<ImageSize>& images, int dp,
                                 const BatchOptions& o) {
  constexpr int64_t kMaxOption = int64_t{1} << 40;
  if (dp < 1 || o.samples < 0 || o.images_per_sample < 0 || o.text_min < 0 ||
      o.text_max < o.text_min || o.text_max > kMaxOption || o.seq_multiple < 1 ||
      o.seq_multiple > kMaxOption)
    raise("build_batches",
          fmt::format("dp {} samples {} images_per_sample {} text [{}, {}] seq_multiple {} "
                      "(need dp >= 1, non-negative counts, text_min <= text_max <= 2^40, "
                      "1 <= seq_multiple <= 2^40)",
                      dp, o.samples, o.images_per_sample, o.text_min, o.text_max, o.seq_multiple));
  if (images.empty() && o.images_per_sample > 0 && o.samples > 0)
    raise("build_batches", "no images to draw from");
  Generator gen(o.seed);
  std::vector<std::size_t> order(images.size());
  std::iota(order.begin(), order.end(), 0);
  for (std::size_t i = order.size(); i > 1; --i)  // Fisher-Yates with our generator
    std::swap(order[i - 1], order[gen.next_u64() % i]);
  std::size_t cursor = 0;
  auto text = [&] {
    return o.text_min + static_cast<int64_t>(gen.next_u64() %
                                             (static_cast<uint64_t>(o.text_max - o.text_min) + 1));
  };
  o.model.validate();
  constexpr int64_t kMaxSeqLen = int64_t{1} << 62;
  std::vector<Batch> out(static_cast<std::size_t>(dp));
  for (auto& batch : out)
    for (int s = 0; s < o.samples; ++s) {
      Sample sample;
      int64_t pos = 0;
      for (int k = 0; k < o.images_per_sample; ++k) {
        pos += text();
        const ImageSize& im = images[order[cursor++ % order.size()]];
        VideoLayout layout;
        try {
          layout = video_layout(o.model, im.frames, im.height, im.width);
        } catch (const InvalidArgument& e) {
          raise("build_batches", fmt::format("image {} ({}x{}, {} frame(s)): {}", im.image_id,
                                             im.height, im.width, im.frames, e.what()));
        }
        int64_t end = 0;
        if (__builtin_add_overflow(pos, layout.block_tokens, &end) || end > kMaxSeqLen)
          raise("build_batches", "a sample is longer than 2^62 tokens");
        // One span per group: an image or an untimestamped video is one group
        // at offset 0 filling its block; a Qwen3-VL video is one per temporal
        // group, its separator tokens text inside the block.
        for (const VideoGroup& g : layout.groups) {
          ImageSpan span;
          span.token_start = pos + g.offset;  // offset < block_tokens: no overflow
          span.tokens = g.tokens;
          span.patches = g.patches;
          span.source_id = im.image_id;
          sample.images.push_back(span);
        }
        pos = end;
      }
      pos += text();
      if (pos > kMaxSeqLen) raise("build_batches", "a sample is longer than 2^62 tokens");
      sample.seq_len = (pos + o.seq_multiple - 1) / o.seq_multiple * o.seq_multiple;
      batch.samples.push_back(std::move(sample));
    }
  return out;
}

}  // namespace diffcomm::encoder_parallel
