// The Python caller of a collective: the first frame outside diffcomm and
// torch, so that a Deadlock report or a dump names the user's line, not
// diffcomm.torch's wrapper or torch.distributed's (bind.hpp, caller.hpp).
#include <Python.h>
#include <frameobject.h>

#include <string>
#include <string_view>
#include <vector>

#include "bind.hpp"

namespace diffcomm_python {
namespace {
// Path prefixes of the packages whose frames are skipped; written under the
// GIL by _set_caller_skip (diffcomm/__init__.py), read under the GIL.
std::vector<std::string>& skipped() {
  static std::vector<std::string> prefixes;
  return prefixes;
}

// DIFFCOMM_CALL_SITES=0 (read by diffcomm/__init__.py) turns the frame walk
// off: calls then record no caller.
bool g_enabled = true;

bool is_skipped(std::string_view file) {
  for (const std::string& p : skipped())
    if (file.substr(0, p.size()) == p) return true;
  return false;
}
}  // namespace

dc::dist::Caller python_caller() {
  if (!g_enabled) return {};
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  dc::dist::Caller found;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    Py_ssize_t size = 0;
    const char* file = PyUnicode_AsUTF8AndSize(code->co_filename, &size);
    Py_DECREF(code);
    if (file == nullptr) {
      PyErr_Clear();
    } else if (!is_skipped(std::string_view(file, static_cast<std::size_t>(size)))) {
      found.file = dc::dist::intern_file(std::string_view(file, static_cast<std::size_t>(size)));
      found.line = static_cast<uint32_t>(PyFrame_GetLineNumber(frame));
      Py_DECREF(frame);
      break;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  return found;
}

void bind_caller(nb::module_& m) {
  m.def(
      "_set_caller_skip",
      [](std::vector<std::string> prefixes, bool enabled) {
        skipped() = std::move(prefixes);
        g_enabled = enabled;
      },
      "prefixes"_a, "enabled"_a = true,
      "Path prefixes whose frames are not the caller of a collective (diffcomm's and torch's "
      "package directories), and whether to record callers at all (DIFFCOMM_CALL_SITES); set by "
      "diffcomm/__init__.py.");
}

}  // namespace diffcomm_python
