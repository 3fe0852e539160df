// The vocabulary's enums (contrax/util/vocabulary.h) as Python spells them:
// one table of words per enum, read both ways: a string parsed for every
// loss's function and operator (a bad one is an argument error, ValueError,
// naming the caller), and a value named (the C++ defaults the binding
// reports, python/src/bind_losses.cpp).
#include <c10/util/Exception.h>

#include <string>
#include <utility>
#include <vector>

#include "bind.h"

namespace contrax::python {

namespace {

template <typename E>
using Words = std::initializer_list<std::pair<const char*, E>>;

// A second word for a value already named is an accepted alias: the message
// lists the first only.
const Words<Reduction> kReductions = {{"mean", Reduction::kMean}, {"sum", Reduction::kSum}, {"none", Reduction::kNone}};
const Words<MemoryPath> kPaths = {{"auto", MemoryPath::kAuto},
                                  {"materialised", MemoryPath::kMaterialised},
                                  {"tiled", MemoryPath::kTiled},
                                  {"materialized", MemoryPath::kMaterialised}};
const Words<LabelMode> kLabelModes = {{"multi_positive", LabelMode::kMultiPositive},
                                      {"mask_duplicates", LabelMode::kMaskDuplicates}};

template <typename E>
const char* name(const Words<E>& words, E e) {
  for (const auto& w : words) {
    if (w.second == e) return w.first;
  }
  TORCH_INTERNAL_ASSERT(false, "contrax: an enum value without a word");
}

template <typename E>
E parse(const Words<E>& words, const std::string& s, const std::string& caller, const char* arg) {
  std::vector<std::string> known;
  for (const auto& w : words) {
    if (s == w.first) return w.second;
    if (w.first == name(words, w.second)) known.push_back(std::string("'") + w.first + "'");
  }
  std::string list = known.back();
  for (size_t i = known.size() - 1; i-- > 0;) list = known[i] + (i + 2 == known.size() ? " or " : ", ") + list;
  TORCH_CHECK(false, caller, "(): argument '", arg, "' must be ", list, ", but got '", s, "'");
}

}  // namespace

Reduction reduction_of(const std::string& s, const std::string& caller) {
  return parse(kReductions, s, caller, "reduction");
}
MemoryPath path_of(const std::string& s, const std::string& caller) { return parse(kPaths, s, caller, "path"); }
LabelMode label_mode_of(const std::string& s, const std::string& caller) {
  return parse(kLabelModes, s, caller, "label_mode");
}

const char* word_of(Reduction r) { return name(kReductions, r); }
const char* word_of(MemoryPath p) { return name(kPaths, p); }
const char* word_of(LabelMode m) { return name(kLabelModes, m); }

}  // namespace contrax::python
