// The one formatter of diffcomm's messages, and the kind -> class mapping's
// throwing side (error.hpp).
#include "diffcomm/tensor/error.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <iterator>

namespace diffcomm {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return "InvalidArgument";
    case ErrorKind::CollectiveMismatch: return "CollectiveMismatch";
    case ErrorKind::Deadlock: return "Deadlock";
    case ErrorKind::RankFailure: return "RankFailure";
    case ErrorKind::Timeout: return "Timeout";
    case ErrorKind::BackendError: return "BackendError";
    case ErrorKind::ResourceExhausted: return "ResourceExhausted";
    case ErrorKind::Error: break;
  }
  return "Error";
}

std::string bad_alloc_detail(std::string_view what) {
  return fmt::format(
      "out of memory: {} from an allocation outside diffcomm's tensors (a std::vector, string or "
      "map of the code that ran; the standard library names neither what nor how much)",
      what);
}

bool ErrorSite::empty() const {
  return op.empty() && !call && !group && backend.empty() && !rank && !group_size && step.empty() &&
         !global_rank;
}

std::string format_site(const ErrorSite& s) {
  std::string out;
  auto to = std::back_inserter(out);
  if (s.global_rank) fmt::format_to(to, "rank {}", *s.global_rank);
  const bool located = !s.op.empty() || s.call || s.group || !s.backend.empty() || s.rank ||
                       s.group_size || !s.step.empty();
  if (!located) return out;
  if (s.global_rank) out += ": ";
  out += s.op;
  if (s.call) fmt::format_to(to, " #{}", *s.call);
  if (s.group) fmt::format_to(to, " on group '{}'", *s.group);
  // The parenthesis: "(B backend, rank r of n, S step)", the parts present.
  std::string paren;
  auto part = [&paren](const std::string& p) {
    if (!paren.empty()) paren += ", ";
    paren += p;
  };
  if (!s.backend.empty()) part(s.backend + " backend");
  if (s.rank && s.group_size)
    part(fmt::format("rank {} of {}", *s.rank, *s.group_size));
  else if (s.rank)
    part(fmt::format("rank {}", *s.rank));
  else if (s.group_size)
    part(fmt::format("size {}", *s.group_size));
  if (!s.step.empty()) part(s.step + " step");
  if (!paren.empty()) fmt::format_to(to, " ({})", paren);
  return out;
}

std::string format_error(const ErrorSite& site, std::string_view detail) {
  std::string out = format_site(site);
  if (out.empty()) return std::string(detail);
  out += ": ";
  out += detail;
  return out;
}

Error::Error(ErrorKind kind, ErrorSite site, std::string_view detail)
    : std::runtime_error(format_error(site, detail)), kind_(kind) {
  detail_at_ = std::string_view(std::runtime_error::what()).size() - detail.size();
  if (!site.empty()) site_ = std::make_shared<const ErrorSite>(std::move(site));
}

const ErrorSite& Error::site() const noexcept {
  static const ErrorSite none;
  return site_ ? *site_ : none;
}

std::string_view Error::detail() const noexcept {
  // what() may be overridden (sim's shared deadlock report): read it there.
  std::string_view all(what());
  return detail_at_ <= all.size() ? all.substr(detail_at_) : all;
}

void throw_error(ErrorKind kind, ErrorSite site, std::string_view detail) {
  visit_error_class(kind,
                    [&]<class C>(std::type_identity<C>) { throw C(std::move(site), detail); });
  std::abort();  // unreachable: every branch throws
}

}  // namespace diffcomm
