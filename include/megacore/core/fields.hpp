// Field reflection for configuration structs: a struct lists its fields once, each with its
// user-facing name and doc, and every other view of the config (JSON/YAML, the Python recipe
// objects, `--set`, the schema, the pybind11 properties) is generated from that list.
//
// A reflected struct declares its members with their defaults as usual and adds one static visitor
// in the same header, directly below them:
//
//   struct DataConfig {
//     int64_t seq_length = 128;
//     std::string tokenizer = "byte";
//     template <class Self, class F> static void fields(Self& s, F&& f) {
//       f(Field{"seq_length", "Tokens per training sample."}, s.seq_length);
//       f(Field{"tokenizer", "'byte' or a tokenizer.json path.", "byte|<path>"}, s.tokenizer);
//     }
//   };
//
// `Self` is the struct or a const struct, so the same list serves readers and writers. A field's
// type is one of: bool, an integer, double, std::string, an enum with an EnumNames
// specialisation, std::vector<int64_t>, std::vector<std::string> or BlendList (numbers and strings,
// for weighted data blends). Adding a config field is therefore a change to one header.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace megacore {

/// One field's user-facing name, its doc, for string fields the accepted values ("a|b|c"; empty = any
/// string; enum fields take theirs from EnumNames), and an optional short name for `--set` (tp for
/// tensor_model_parallel_size).
struct Field {
  std::string_view name;
  std::string_view doc;
  std::string_view choices = {};
  std::string_view alias = {};
};

/// A list whose entries are numbers or strings (a weighted blend `[0.3, "data/a", 0.7, "data/b"]`).
using BlendList = std::vector<std::variant<double, std::string>>;

/// Specialise for every enum used as a config field: `static constexpr std::array values{
/// std::pair{E::A, std::string_view{"a"}}, ...}`. The first name of a value is the one written out;
/// reading is case-insensitive.
template <class E>
struct EnumNames;

template <class E>
concept NamedEnum = std::is_enum_v<E> && requires { EnumNames<E>::values; };

/// The written name of an enum value ("?" for a value outside the table, which is a bug).
template <NamedEnum E>
constexpr std::string_view enum_name(E v) {
  for (const auto& [e, n] : EnumNames<E>::values)
    if (e == v) return n;
  return "?";
}

/// The value named `s` (case-insensitive), or nullopt.
template <NamedEnum E>
std::optional<E> enum_from_name(std::string_view s) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
  for (const auto& [e, n] : EnumNames<E>::values) {
    if (n.size() != s.size()) continue;
    bool same = true;
    for (size_t i = 0; i < n.size() && same; ++i) same = lower(n[i]) == lower(s[i]);
    if (same) return e;
  }
  return std::nullopt;
}

/// "a|b|c": the accepted names of E, in the Field::choices format.
template <NamedEnum E>
std::string enum_choices() {
  std::string out;
  for (const auto& [e, n] : EnumNames<E>::values) {
    if (!out.empty()) out += '|';
    out += n;
  }
  return out;
}

/// A struct that lists its fields with a static `fields(self, visitor)`.
template <class T>
concept Reflected = requires(T& t) { T::fields(t, [](const Field&, auto&) {}); };

/// Calls `f(field, member)` for each field of `obj` in declaration order.
template <class T, class F>
  requires Reflected<std::remove_const_t<T>>
void for_each_field(T& obj, F&& f) {
  std::remove_const_t<T>::fields(obj, f);
}

/// The names of T's fields, in order.
template <Reflected T>
std::vector<std::string> field_names() {
  std::vector<std::string> out;
  T probe{};
  for_each_field(probe, [&](const Field& fd, auto&) { out.emplace_back(fd.name); });
  return out;
}

}  // namespace megacore
