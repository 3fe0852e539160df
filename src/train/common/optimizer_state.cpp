// An optimizer's options and state as checkpoint records (see optimizer_state.h).
#include "train/common/optimizer_state.h"

#include <c10/util/Type.h>

#include <cstdio>
#include <cstdlib>

namespace contrax::train::detail {

namespace {

namespace optim = torch::optim;

// Each optimizer's fields, visited by reference: once to save, twice to
// load (check everything, then assign). TORCH_ARG's accessors return
// references, so one list serves both directions.
template <class O, class V>
void adam_options(O& o, V& v) {
  v("lr", o.lr());
  v("beta1", std::get<0>(o.betas()));
  v("beta2", std::get<1>(o.betas()));
  v("eps", o.eps());
  v("weight_decay", o.weight_decay());
  v("amsgrad", o.amsgrad());
}
template <class S, class V>
void adam_state(S& s, V& v) {
  v("step", s.step());
  v("exp_avg", s.exp_avg());
  v("exp_avg_sq", s.exp_avg_sq());
  v("max_exp_avg_sq", s.max_exp_avg_sq());
}
template <class V> void fields(optim::AdamOptions& o, V& v) { adam_options(o, v); }
template <class V> void fields(optim::AdamWOptions& o, V& v) { adam_options(o, v); }
template <class V> void fields(optim::AdamParamState& s, V& v) { adam_state(s, v); }
template <class V> void fields(optim::AdamWParamState& s, V& v) { adam_state(s, v); }
template <class V>
void fields(optim::SGDOptions& o, V& v) {
  v("lr", o.lr());
  v("momentum", o.momentum());
  v("dampening", o.dampening());
  v("weight_decay", o.weight_decay());
  v("nesterov", o.nesterov());
}
template <class V> void fields(optim::SGDParamState& s, V& v) { v("momentum_buffer", s.momentum_buffer()); }
template <class V>
void fields(optim::AdagradOptions& o, V& v) {
  v("lr", o.lr());
  v("lr_decay", o.lr_decay());
  v("weight_decay", o.weight_decay());
  v("initial_accumulator_value", o.initial_accumulator_value());
  v("eps", o.eps());
}
template <class V>
void fields(optim::AdagradParamState& s, V& v) {
  v("sum", s.sum());
  v("step", s.step());
}
template <class V>
void fields(optim::RMSpropOptions& o, V& v) {
  v("lr", o.lr());
  v("alpha", o.alpha());
  v("eps", o.eps());
  v("weight_decay", o.weight_decay());
  v("momentum", o.momentum());
  v("centered", o.centered());
}
template <class V>
void fields(optim::RMSpropParamState& s, V& v) {
  v("step", s.step());
  v("square_avg", s.square_avg());
  v("momentum_buffer", s.momentum_buffer());
  v("grad_avg", s.grad_avg());
}

template <class Options, class State>
struct Kind {
  using O = Options;
  using S = State;
};

// Calls f(Kind<Options, State>{}, "<kind>") for the optimizer's kind.
template <class F>
void with_kind(optim::Optimizer& o, const std::string& name, F&& f) {
  if (dynamic_cast<optim::AdamW*>(&o) != nullptr) return f(Kind<optim::AdamWOptions, optim::AdamWParamState>{}, "AdamW");
  if (dynamic_cast<optim::Adam*>(&o) != nullptr) return f(Kind<optim::AdamOptions, optim::AdamParamState>{}, "Adam");
  if (dynamic_cast<optim::SGD*>(&o) != nullptr) return f(Kind<optim::SGDOptions, optim::SGDParamState>{}, "SGD");
  if (dynamic_cast<optim::Adagrad*>(&o) != nullptr) {
    return f(Kind<optim::AdagradOptions, optim::AdagradParamState>{}, "Adagrad");
  }
  if (dynamic_cast<optim::RMSprop*>(&o) != nullptr) {
    return f(Kind<optim::RMSpropOptions, optim::RMSpropParamState>{}, "RMSprop");
  }
  TORCH_CHECK(false, "Checkpoint::optimizer(): optimizer '", name, "' is a ", c10::demangle(typeid(o).name()),
              "; checkpoints store the state of torch::optim::Adam, AdamW, SGD, Adagrad and RMSprop");
}

struct Saver {
  nlohmann::json& j;
  SafetensorsWriter& out;
  std::string record_prefix;
  void operator()(const char* k, double& v) { j[k] = exact_double(v); }
  void operator()(const char* k, bool& v) { j[k] = v; }
  void operator()(const char* k, int64_t& v) { j[k] = v; }
  void operator()(const char* k, torch::Tensor& t) {
    j[k] = t.defined();  // an absent buffer (max_exp_avg_sq without amsgrad) stays absent
    if (t.defined()) out.add(record_prefix + k, t);
  }
};

// Reads each field; with apply == false it only checks (the first pass).
struct Loader {
  const nlohmann::json& j;
  const SafetensorsReader& in;
  std::string record_prefix, where;
  const torch::Tensor* param = nullptr;  // what a state tensor must match
  bool apply = false;

  const nlohmann::json& value(const char* k, bool ok) const {
    TORCH_CHECK(ok, where, " has no valid '", k, "'");
    return j.at(k);
  }
  void operator()(const char* k, double& v) const {
    const bool ok = j.contains(k) && j.at(k).is_string();
    const double d = parse_exact_double(value(k, ok).get<std::string>(), where + " '" + k + "'");
    if (apply) v = d;
  }
  void operator()(const char* k, bool& v) const {
    const bool b = value(k, j.contains(k) && j.at(k).is_boolean()).get<bool>();
    if (apply) v = b;
  }
  void operator()(const char* k, int64_t& v) const {
    const int64_t i = value(k, j.contains(k) && j.at(k).is_number_integer()).get<int64_t>();
    if (apply) v = i;
  }
  void operator()(const char* k, torch::Tensor& t) const {
    if (!value(k, j.contains(k) && j.at(k).is_boolean()).get<bool>()) {
      if (apply) t = torch::Tensor();
      return;
    }
    const std::string name = record_prefix + k;
    TORCH_CHECK(in.has(name), where, ": record '", name, "' is missing in the checkpoint");
    TORCH_CHECK(in.dtype(name) == param->scalar_type() && in.shape(name) == param->sizes().vec(), where,
                ": record '", name, "' has dtype ", in.dtype(name), " and shape ", c10::IntArrayRef(in.shape(name)),
                " in the checkpoint, but its parameter has ", param->scalar_type(), " and ", param->sizes());
    if (!apply) return;
    t = torch::empty(param->sizes(), param->options());
    in.read_into(name, t);
  }
};

}  // namespace

std::string exact_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

double parse_exact_double(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  TORCH_CHECK(!text.empty() && end == text.c_str() + text.size(), what, " is not a number: '", text, "'");
  return v;
}

std::string optimizer_kind(optim::Optimizer& o, const std::string& name) {
  std::string kind;
  with_kind(o, name, [&](auto, const char* k) { kind = k; });
  return kind;
}

nlohmann::json save_optimizer(optim::Optimizer& o, const std::string& prefix, SafetensorsWriter& out) {
  nlohmann::json saved;
  with_kind(o, prefix, [&](auto kind, const char* name) {
    using K = decltype(kind);
    saved["kind"] = name;
    nlohmann::json groups = nlohmann::json::array();
    for (size_t g = 0; g < o.param_groups().size(); ++g) {
      auto& group = o.param_groups()[g];
      nlohmann::json options = nlohmann::json::object(), states = nlohmann::json::array();
      Saver s{options, out, ""};
      fields(static_cast<typename K::O&>(group.options()), s);
      for (size_t i = 0; i < group.params().size(); ++i) {
        const auto it = o.state().find(group.params()[i].unsafeGetTensorImpl());
        if (it == o.state().end()) {
          states.push_back(nullptr);
          continue;
        }
        nlohmann::json st = nlohmann::json::object();
        Saver ps{st, out, prefix + std::to_string(g) + "." + std::to_string(i) + "."};
        fields(static_cast<typename K::S&>(*it->second), ps);
        states.push_back(st);
      }
      groups.push_back({{"options", options}, {"params", group.params().size()}, {"state", states}});
    }
    saved["groups"] = groups;
  });
  return saved;
}

void load_optimizer(optim::Optimizer& o, const nlohmann::json& saved, const std::string& prefix, const SafetensorsReader& in) {
  with_kind(o, prefix, [&](auto kind, const char* name) {
    using K = decltype(kind);
    const std::string what = "optimizer '" + prefix.substr(0, prefix.size() - 1) + "'";
    TORCH_CHECK(saved.is_object() && saved.contains("kind") && saved.at("kind") == name, what, " is a ", name,
                ", but the checkpoint holds ", saved.is_object() && saved.contains("kind") ? saved.at("kind").dump()
                                                                                           : std::string("none"));
    const nlohmann::json none = nlohmann::json::array();
    const nlohmann::json& groups = saved.contains("groups") ? saved.at("groups") : none;
    TORCH_CHECK(groups.is_array() && groups.size() == o.param_groups().size(), what, " has ",
                o.param_groups().size(), " parameter groups, but the checkpoint holds ",
                groups.is_array() ? std::to_string(groups.size()) : std::string("none"));
    for (const bool apply : {false, true}) {
      for (size_t g = 0; g < groups.size(); ++g) {
        auto& group = o.param_groups()[g];
        const nlohmann::json& sg = groups[g];
        const std::string where = what + " group " + std::to_string(g);
        TORCH_CHECK(sg.is_object() && sg.contains("options") && sg.contains("state") && sg.at("state").is_array() &&
                        sg.at("state").size() == group.params().size(),
                    where, " has ", group.params().size(), " parameters, but the checkpoint's differs");
        Loader opts{sg.at("options"), in, "", where + " options", nullptr, apply};
        fields(static_cast<typename K::O&>(group.options()), opts);
        for (size_t i = 0; i < group.params().size(); ++i) {
          const torch::Tensor& p = group.params()[i];
          const nlohmann::json& st = sg.at("state")[i];
          if (st.is_null()) {
            if (apply) o.state().erase(p.unsafeGetTensorImpl());
            continue;
          }
          TORCH_CHECK(st.is_object(), where, " parameter ", i, ": its state is not an object");
          typename K::S state;
          Loader l{st, in, prefix + std::to_string(g) + "." + std::to_string(i) + ".",
                   where + " parameter " + std::to_string(i), &p, apply};
          fields(state, l);
          if (apply) o.state()[p.unsafeGetTensorImpl()] = std::make_unique<typename K::S>(std::move(state));
        }
      }
    }
  });
}

}  // namespace contrax::train::detail
