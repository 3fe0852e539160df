// WordNet data-file parser, the retrieval corpus built from it (split, passage
// ids, hashed features, hard-negative pools) and the hard-negative draws.
#include "contrax/train/retrieval/wordnet.h"

#include "contrax/train/common/errors.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace contrax::train {

namespace {

constexpr const char* kDataFiles[] = {"data.noun", "data.verb", "data.adj", "data.adv"};
constexpr int64_t kKeyStride = 100000000;  // offsets are 8 decimal digits
constexpr int kLexFiles = 45;              // lexicographer files 00..44 (wndb)

int pos_file_of(char pos) {
  switch (pos) {
    case 'n': return 0;
    case 'v': return 1;
    case 'a':
    case 's': return 2;
    case 'r': return 3;
    default: return -1;
  }
}

int64_t parse_int(const std::string& tok, int base, const std::string& where, const char* what) {
  TORCH_CHECK(!tok.empty(), where, ": missing ", what);
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(tok, &used, base);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == tok.size() && v >= 0, where, ": ", what, " must be a ", base == 16 ? "hexadecimal" : "decimal",
              " number, but got '", tok, "'");
  return v;
}

// Adjective lemmas may carry a syntactic marker: "galore(ip)", "big(a)".
std::string clean_lemma(std::string w) {
  const auto paren = w.find('(');
  if (paren != std::string::npos && !w.empty() && w.back() == ')') w.erase(paren);
  std::replace(w.begin(), w.end(), '_', ' ');
  return w;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string definition_of(const std::string& gloss) {
  const std::string g = trim(gloss);
  const auto q = g.find("; \"");
  std::string d = trim(q == std::string::npos ? g : g.substr(0, q));
  if (g.rfind("\"", 0) == 0) d.clear();  // the gloss is only examples
  return d.empty() ? g : d;
}

uint64_t fnv1a(const std::string& s, uint64_t salt) {
  uint64_t h = 1469598103934665603ULL ^ splitmix64(salt);
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

int64_t bucket(const std::string& s, uint64_t salt, int64_t buckets) {
  // Bucket 0 is the padding row.
  return 1 + static_cast<int64_t>(splitmix64(fnv1a(s, salt)) % static_cast<uint64_t>(buckets - 1));
}

void push_row(Ragged& r, const std::vector<int64_t>& row) {
  r.values.insert(r.values.end(), row.begin(), row.end());
  r.offsets.push_back(static_cast<int64_t>(r.values.size()));
}

void check_ngram_args(const char* fn, int64_t buckets, int64_t min_n, int64_t max_n) {
  TORCH_CHECK(buckets >= 2, fn, "(): argument 'buckets' must be >= 2, but got ", buckets);
  TORCH_CHECK(min_n >= 1 && max_n >= min_n, fn, "(): n-gram lengths must satisfy 1 <= min_n <= max_n, but got ",
              min_n, "..", max_n);
}

// The marked word "<word>" and its character n-grams (lengths min_n..max_n).
void add_word_chargrams(const std::string& word, int64_t buckets, int64_t min_n, int64_t max_n,
                        std::vector<int64_t>& f) {
  const std::string m = "<" + word + ">";
  f.push_back(bucket(m, 3, buckets));
  for (int64_t n = min_n; n <= max_n; ++n) {
    for (int64_t i = 0; i + n <= static_cast<int64_t>(m.size()); ++i) {
      if (n == static_cast<int64_t>(m.size())) continue;  // the whole marked word is already in
      f.push_back(bucket(m.substr(i, n), 4, buckets));
    }
  }
}

void push_tokens(TokenBags& t, const std::vector<std::vector<int64_t>>& tokens) {
  for (const auto& f : tokens) push_row(t.features, f);
  t.offsets.push_back(t.features.rows());
}

// The longest of `rows` of a Ragged or TokenBags (at least 1), each row checked.
template <typename Rows>
int64_t longest_of(const Rows& lists, const std::vector<int64_t>& rows, const char* fn) {
  int64_t longest = 1;
  for (auto r : rows) {
    TORCH_CHECK(r >= 0 && r < lists.rows(), fn, "(): row ", r, " out of range [0, ", lists.rows(), ")");
    longest = std::max(longest, lists.size(r));
  }
  return longest;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

std::vector<Synset> parse_wordnet_data(const std::string& text, int pos_file, const std::string& source) {
  TORCH_CHECK(pos_file >= 0 && pos_file < 4, "parse_wordnet_data(): argument 'pos_file' must be in [0, 4), but got ",
              pos_file);
  std::vector<Synset> out;
  std::istringstream lines(text);
  std::string line;
  int64_t lineno = 0;
  while (std::getline(lines, line)) {
    ++lineno;
    if (line.empty() || line.rfind("  ", 0) == 0) continue;  // licence header
    const std::string where = source + " line " + std::to_string(lineno);
    const auto bar = line.find(" | ");
    const bool has_bar = bar != std::string::npos || (line.size() >= 2 && line.compare(line.size() - 2, 2, " |") == 0);
    TORCH_CHECK(has_bar, where, ": no ' | ' before the gloss (not a WordNet data file?)");
    const std::string head = line.substr(0, bar == std::string::npos ? line.size() - 2 : bar);
    const std::string gloss = bar == std::string::npos ? "" : line.substr(bar + 3);
    std::istringstream in(head);
    auto next = [&](const char* what) {
      std::string t;
      TORCH_CHECK(static_cast<bool>(in >> t), where, ": line ends before its ", what);
      return t;
    };
    Synset s;
    s.offset = parse_int(next("offset"), 10, where, "offset");
    s.lex_filenum = static_cast<int>(parse_int(next("lex_filenum"), 10, where, "lex_filenum"));
    TORCH_CHECK(s.lex_filenum < kLexFiles, where, ": lex_filenum must be < ", kLexFiles, ", but got ",
                s.lex_filenum);
    const std::string ss_type = next("ss_type");
    TORCH_CHECK(ss_type.size() == 1 && pos_file_of(ss_type[0]) == pos_file, where, ": ss_type '", ss_type,
                "' does not belong in ", kDataFiles[pos_file]);
    s.pos = ss_type[0];
    s.key = pos_file * kKeyStride + s.offset;
    const int64_t w_cnt = parse_int(next("w_cnt"), 16, where, "w_cnt");
    TORCH_CHECK(w_cnt >= 1, where, ": w_cnt must be >= 1, but got 0");
    for (int64_t i = 0; i < w_cnt; ++i) {
      s.lemmas.push_back(clean_lemma(next("words")));
      next("lex_id");
    }
    const int64_t p_cnt = parse_int(next("p_cnt"), 10, where, "p_cnt");
    for (int64_t i = 0; i < p_cnt; ++i) {
      const std::string sym = next("pointers");
      const int64_t off = parse_int(next("pointer offset"), 10, where, "pointer offset");
      const std::string pos = next("pointer pos");
      next("pointer source/target");
      const int pf = pos.size() == 1 ? pos_file_of(pos[0]) : -1;
      TORCH_CHECK(pf >= 0, where, ": pointer part of speech must be n, v, a, s or r, but got '", pos, "'");
      if (sym == "@" || sym == "@i") s.hypernyms.push_back(pf * kKeyStride + off);
      if (sym == "&") s.similar.push_back(pf * kKeyStride + off);
    }
    // Verb frames (after the pointers) are not needed.
    s.definition = definition_of(gloss);
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Synset> load_wordnet(const std::string& dir) {
  std::vector<Synset> all;
  for (int f = 0; f < 4; ++f) {
    const std::string path = dir + "/" + kDataFiles[f];
    std::ifstream in(path, std::ios::binary);
    if (!in.good()) {
      // Typed (kDataUnreadable), so that a caller can say how it points the
      // recipe at another directory.
      throw TrainError(TrainErrorKind::kDataUnreadable, "cannot read WordNet file " + path,
                       " (install Debian's 'wordnet-base' package: apt-get install wordnet-base; or use the "
                       "directory of WordNet's data files)");
    }
    std::stringstream ss;
    ss << in.rdbuf();
    auto part = parse_wordnet_data(ss.str(), f, path);
    all.insert(all.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
  }
  return all;
}

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  for (unsigned char c : text) {
    if (std::isalnum(c)) {
      cur.push_back(static_cast<char>(std::tolower(c)));
    } else if (!cur.empty()) {
      out.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

std::vector<int64_t> query_features(const std::string& text, int64_t buckets, int64_t max_features, bool chargrams,
                                    int64_t min_n, int64_t max_n) {
  TORCH_CHECK(buckets >= 2, "query_features(): argument 'buckets' must be >= 2, but got ", buckets);
  const auto w = words_of(text);
  std::vector<int64_t> f;
  for (size_t i = 0; i < w.size(); ++i) f.push_back(bucket(w[i], 1, buckets));
  for (size_t i = 0; i + 1 < w.size(); ++i) f.push_back(bucket(w[i] + " " + w[i + 1], 2, buckets));
  if (chargrams) {
    const auto c = passage_features(text, buckets, min_n, max_n, max_features);
    f.insert(f.end(), c.begin(), c.end());
  }
  if (static_cast<int64_t>(f.size()) > max_features) f.resize(max_features);
  return f;
}

std::vector<int64_t> passage_features(const std::string& text, int64_t buckets, int64_t min_n, int64_t max_n,
                                      int64_t max_features) {
  check_ngram_args("passage_features", buckets, min_n, max_n);
  std::vector<int64_t> f;
  for (const auto& word : words_of(text)) add_word_chargrams(word, buckets, min_n, max_n, f);
  if (static_cast<int64_t>(f.size()) > max_features) f.resize(max_features);
  return f;
}

std::vector<std::vector<int64_t>> query_token_features(const std::string& text, int64_t buckets,
                                                       int64_t max_features, bool chargrams, int64_t min_n,
                                                       int64_t max_n, int64_t max_tokens) {
  check_ngram_args("query_token_features", buckets, min_n, max_n);
  auto w = words_of(text);
  if (static_cast<int64_t>(w.size()) > max_tokens) w.resize(max_tokens);
  std::vector<std::vector<int64_t>> tokens;
  for (size_t i = 0; i < w.size(); ++i) {
    // The word, the bigrams it is part of (the pooled bag's hashes), then
    // its character n-grams.
    std::vector<int64_t> f{bucket(w[i], 1, buckets)};
    if (i > 0) f.push_back(bucket(w[i - 1] + " " + w[i], 2, buckets));
    if (i + 1 < w.size()) f.push_back(bucket(w[i] + " " + w[i + 1], 2, buckets));
    if (chargrams) add_word_chargrams(w[i], buckets, min_n, max_n, f);
    if (static_cast<int64_t>(f.size()) > max_features) f.resize(max_features);
    tokens.push_back(std::move(f));
  }
  if (tokens.empty()) tokens.emplace_back();  // one featureless token: MaxSim needs a valid one
  return tokens;
}

std::vector<std::vector<int64_t>> passage_token_features(const std::string& text, int64_t buckets, int64_t min_n,
                                                         int64_t max_n, int64_t max_features, int64_t max_tokens) {
  check_ngram_args("passage_token_features", buckets, min_n, max_n);
  auto w = words_of(text);
  if (static_cast<int64_t>(w.size()) > max_tokens) w.resize(max_tokens);
  std::vector<std::vector<int64_t>> tokens;
  for (const auto& word : w) {
    std::vector<int64_t> f;
    add_word_chargrams(word, buckets, min_n, max_n, f);
    if (static_cast<int64_t>(f.size()) > max_features) f.resize(max_features);
    tokens.push_back(std::move(f));
  }
  if (tokens.empty()) tokens.emplace_back();
  return tokens;
}

RetrievalCorpus make_retrieval_corpus(std::vector<Synset> synsets, const RetrievalCorpusOptions& o) {
  TORCH_CHECK(o.heldout_per_10000() >= 0 && o.heldout_per_10000() <= 10000,
              "make_retrieval_corpus(): heldout_per_10000 must be in [0, 10000], but got ", o.heldout_per_10000());
  TORCH_CHECK(o.max_features() >= 1, "make_retrieval_corpus(): max_features must be >= 1, but got ",
              o.max_features());
  RetrievalCorpus c;
  c.options = o;
  c.synsets = std::move(synsets);
  const int64_t S = static_cast<int64_t>(c.synsets.size());
  std::unordered_map<std::string, int64_t> ids;
  std::unordered_map<int64_t, int64_t> index_of_key;
  for (int64_t i = 0; i < S; ++i) {
    const auto& s = c.synsets[i];
    std::string p;
    for (size_t j = 0; j < s.lemmas.size(); ++j) p += (j > 0 ? ", " : "") + s.lemmas[j];
    c.queries.push_back(s.definition);
    c.passages.push_back(p);
    const auto it = ids.emplace(lower(p), static_cast<int64_t>(ids.size())).first;
    c.passage_id.push_back(it->second);
    TORCH_CHECK(index_of_key.emplace(s.key, i).second, "make_retrieval_corpus(): synset key ", s.key,
                " appears twice");
    const bool held = static_cast<int64_t>(splitmix64(static_cast<uint64_t>(s.key)) % 10000) < o.heldout_per_10000();
    (held ? c.heldout : c.train).push_back(i);
    push_row(c.query_features, query_features(c.queries[i], o.query_buckets(), o.max_features(), o.query_chargrams(),
                                                   o.min_ngram(), o.max_ngram()));
    push_row(c.passage_features,
             passage_features(p, o.passage_buckets(), o.min_ngram(), o.max_ngram(), o.max_features()));
    if (o.token_features()) {
      push_tokens(c.query_tokens, query_token_features(c.queries[i], o.query_buckets(), o.max_features(),
                                                       o.query_chargrams(), o.min_ngram(), o.max_ngram(),
                                                       o.max_query_tokens()));
      push_tokens(c.passage_tokens, passage_token_features(p, o.passage_buckets(), o.min_ngram(), o.max_ngram(),
                                                           o.max_features(), o.max_passage_tokens()));
    }
  }
  c.num_passage_ids = static_cast<int64_t>(ids.size());
  if (o.train_limit() > 0 && static_cast<int64_t>(c.train.size()) > o.train_limit()) c.train.resize(o.train_limit());

  // Pools over the training split only: a held-out passage never appears in
  // training, not even as a negative.
  std::vector<int64_t> train_pos(S, -1);
  for (size_t t = 0; t < c.train.size(); ++t) train_pos[c.train[t]] = static_cast<int64_t>(t);
  std::unordered_map<int64_t, std::vector<int64_t>> children;  // hypernym key -> train positions
  std::unordered_map<int64_t, std::vector<int64_t>> cluster;   // adjective head key -> train positions
  c.train_by_lexfile.assign(kLexFiles, {});
  for (size_t t = 0; t < c.train.size(); ++t) {
    const auto& s = c.synsets[c.train[t]];
    for (auto h : s.hypernyms) children[h].push_back(static_cast<int64_t>(t));
    // A head adjective and its satellites point at each other with `&`; key
    // the cluster by its head (the satellite's target, or the head itself).
    if (s.pos == 'a') cluster[s.key].push_back(static_cast<int64_t>(t));
    if (s.pos == 's') {
      for (auto h : s.similar) cluster[h].push_back(static_cast<int64_t>(t));
    }
    c.train_by_lexfile[s.lex_filenum].push_back(static_cast<int64_t>(t));
  }
  for (size_t t = 0; t < c.train.size(); ++t) {
    const int64_t i = c.train[t];
    const auto& s = c.synsets[i];
    std::vector<int64_t> pool;
    auto add = [&](const std::vector<int64_t>& members) {
      for (auto m : members) {
        if (c.passage_id[c.train[m]] != c.passage_id[i]) pool.push_back(m);
      }
    };
    for (auto h : s.hypernyms) {
      if (auto it = children.find(h); it != children.end()) add(it->second);
    }
    if (s.pos == 'a') add(cluster[s.key]);
    if (s.pos == 's') {
      for (auto h : s.similar) add(cluster[h]);
    }
    std::sort(pool.begin(), pool.end());
    pool.erase(std::unique(pool.begin(), pool.end()), pool.end());
    push_row(c.hard_negative_pool, pool);
  }
  return c;
}

std::vector<torch::Tensor> feature_batch(const Ragged& features, const std::vector<int64_t>& rows,
                                         torch::Dtype dtype) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t L = longest_of(features, rows, "feature_batch");
  auto ids = torch::zeros({n, L}, torch::kLong);
  auto w = torch::zeros({n, L}, torch::kDouble);
  auto ia = ids.accessor<int64_t, 2>();
  auto wa = w.accessor<double, 2>();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t len = features.size(rows[k]);
    for (int64_t j = 0; j < len; ++j) {
      ia[k][j] = features.values[features.offsets[rows[k]] + j];
      wa[k][j] = 1.0 / static_cast<double>(len);
    }
  }
  return {ids, w.to(dtype)};
}

std::vector<torch::Tensor> token_feature_batch(const TokenBags& bags, const std::vector<int64_t>& rows,
                                               torch::Dtype dtype) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t T = longest_of(bags, rows, "token_feature_batch");
  std::vector<int64_t> token_rows, slots;  // each token's row in bags.features, and its slot k * T + t
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t t = 0; t < bags.size(rows[k]); ++t) {
      token_rows.push_back(bags.offsets[rows[k]] + t);
      slots.push_back(k * T + t);
    }
  }
  // Only the tokens that exist are bags (padding tokens cost nothing);
  // feature_batch pads their features.
  auto bag = feature_batch(bags.features, token_rows, dtype);
  const auto at = torch::tensor(slots, torch::kLong).reshape({-1});
  auto mask = torch::zeros({n * T}, torch::kBool).index_fill_(0, at, true).view({n, T});
  return {bag[0], bag[1], at, mask};
}

std::vector<int64_t> sample_hard_negatives(const RetrievalCorpus& c, const std::vector<int64_t>& rows, int64_t n,
                                           uint64_t seed, int64_t epoch) {
  TORCH_CHECK(n >= 0, "sample_hard_negatives(): argument 'n' must be >= 0, but got ", n);
  std::vector<int64_t> out;
  out.reserve(rows.size() * static_cast<size_t>(n));
  const int64_t T = static_cast<int64_t>(c.train.size());
  for (auto t : rows) {
    TORCH_CHECK(t >= 0 && t < T, "sample_hard_negatives(): row ", t, " out of range [0, ", T, ")");
    const int64_t own = c.passage_id[c.train[t]];
    const int64_t pool_n = c.hard_negative_pool.size(t);
    const auto& lex = c.train_by_lexfile[c.synsets[c.train[t]].lex_filenum];
    for (int64_t j = 0; j < n; ++j) {
      uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(epoch) * 0x100000001B3ULL +
                                                splitmix64(static_cast<uint64_t>(t) * 64 + static_cast<uint64_t>(j))));
      int64_t pick = -1;
      if (pool_n > 0) {
        pick = c.hard_negative_pool.values[c.hard_negative_pool.offsets[t] + static_cast<int64_t>(h % pool_n)];
      } else {
        // Fallback: a synset of the same lexicographer file with another
        // passage (a few tries; the duplicate mask covers a rare miss).
        for (int tries = 0; tries < 8 && pick < 0; ++tries) {
          h = splitmix64(h);
          const int64_t m = lex[static_cast<int64_t>(h % lex.size())];
          if (c.passage_id[c.train[m]] != own) pick = m;
        }
        // Then the first synset with another passage from a random start
        // (the query's own when there is none: the duplicate mask drops it).
        const int64_t from = static_cast<int64_t>(h % static_cast<uint64_t>(T));
        for (int64_t k = 0; k < T && pick < 0; ++k) {
          const int64_t m = (from + k) % T;
          if (c.passage_id[c.train[m]] != own) pick = m;
        }
        if (pick < 0) pick = t;
      }
      out.push_back(pick);
    }
  }
  return out;
}

}  // namespace contrax::train
