// WordNet as a paired corpus for dense retrieval ("reverse dictionary"):
// each synset's gloss is a query, its lemma names are the passage.
//
// The data files are the Princeton WordNet 3.0 database files as Debian's
// `wordnet-base` installs them (/usr/share/wordnet/data.{noun,verb,adj,adv};
// format: `man 5 wndb`). A synset line is
//
//   offset lex_filenum ss_type w_cnt (word lex_id){w_cnt} p_cnt (ptr offset pos src/tgt){p_cnt} [frames] | gloss
//
// with w_cnt in hexadecimal (two digits) and p_cnt in decimal (three digits);
// lines starting with two spaces are the licence header.
//
// Text conventions (the same for every system that is evaluated):
//  * query   = the gloss's definition: the text after `|` up to the first
//              `; "` (where the usage examples begin), trimmed; the whole gloss
//              when that is empty. Examples usually contain the lemma itself
//              ("able to swim"), which would make the task string matching.
//  * passage = the synset's lemma names in file order, underscores as spaces,
//              adjective position markers such as `(p)` removed, joined by
//              ", " (e.g. "abstraction, abstract entity").
//  * passage id = the index of the passage's lowercased string among all
//              distinct ones: synsets with the same lemmas ("bank" is a whole
//              passage of ten noun synsets) share it. Used for duplicate
//              masking in the loss and for the deduplicated evaluation.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "contrax/train/common/sampler.h"  // splitmix64

namespace contrax::train {

/// Debian's location of the WordNet database files.
constexpr const char* kDefaultWordNetDir = "/usr/share/wordnet";

/// One synset of the database.
struct Synset {
  /// Unique over all four files: part-of-speech file index * 10^8 + byte offset
  /// (offsets are unique within one data file only). File index: noun 0, verb
  /// 1, adj 2 (satellites `s` included), adv 3.
  int64_t key = 0;
  int64_t offset = 0;                ///< byte offset of the synset in its data file
  char pos = 'n';                    ///< part of speech (ss_type): n, v, a, s (adjective satellite) or r
  int lex_filenum = 0;               ///< lexicographer file number (noun.animal, verb.motion, ...)
  std::vector<std::string> lemmas;   ///< the synset's words, underscores as spaces and markers removed
  std::string definition;            ///< the gloss: the query text of the retrieval corpus
  std::vector<int64_t> hypernyms;    ///< keys of the hypernyms (the `@` and `@i` pointers)
  std::vector<int64_t> similar;      ///< keys of the similar-to synsets (`&` pointers, adjective clusters)
};

/// Parses the text of one data file (`pos_file` 0..3 as in `Synset::key`).
/// `source` names it in errors: "data.noun line 31: ...".
std::vector<Synset> parse_wordnet_data(const std::string& text, int pos_file, const std::string& source);

/// Reads data.noun, data.verb, data.adj and data.adv from `dir` (in that
/// order). Throws naming the missing file and the package that provides it.
std::vector<Synset> load_wordnet(const std::string& dir);

/// Options of `make_retrieval_corpus`. Defaults: 4% of the synsets held out,
/// hashed features in 2^16 buckets.
struct RetrievalCorpusOptions {
  /// A synset is held out when splitmix64(key) mod 10000 < this (400 = 4%):
  /// fixed by the key alone, so the split never depends on file order, the
  /// seed or the world size.
  TORCH_ARG(int64_t, heldout_per_10000) = 400;
  /// Hash buckets of the query (word uni/bigram) features.
  TORCH_ARG(int64_t, query_buckets) = int64_t{1} << 16;
  /// Hash buckets of the passage (character n-gram) features.
  TORCH_ARG(int64_t, passage_buckets) = int64_t{1} << 16;
  /// Shortest character n-gram of the passage features.
  TORCH_ARG(int64_t, min_ngram) = 3;
  /// Longest character n-gram of the passage features.
  TORCH_ARG(int64_t, max_ngram) = 5;
  /// At most this many features per query / passage (the rest dropped).
  TORCH_ARG(int64_t, max_features) = 256;
  /// Queries also get the character n-grams of their words (as passages do),
  /// so that the towers can learn the morphological overlap BM25 uses.
  TORCH_ARG(bool, query_chargrams) = true;
  /// > 0: keep only the first N training synsets (short runs, tests).
  TORCH_ARG(int64_t, train_limit) = -1;
  /// Also make the per-token features (`query_tokens`, `passage_tokens`) of
  /// the MaxSim scorer.
  TORCH_ARG(bool, token_features) = false;
  /// At most this many tokens (words) per query (ColBERT's query length; 99%
  /// of WordNet's glosses have at most 32 words), and `max_passage_tokens`
  /// per passage (99.9% of its lemma lists have at most 16): maxsim_loss
  /// pads every query and passage of the global batch to the longest, so its
  /// work grows as their product.
  TORCH_ARG(int64_t, max_query_tokens) = 32;
  /// At most this many tokens (words) per passage.
  TORCH_ARG(int64_t, max_passage_tokens) = 16;
};

/// Ragged integer lists (one per synset) in one flat buffer.
struct Ragged {
  std::vector<int64_t> values;      ///< the lists one after another
  std::vector<int64_t> offsets{0};  ///< row i is values[offsets[i], offsets[i+1]); starts with 0
  /// Number of lists.
  int64_t rows() const { return static_cast<int64_t>(offsets.size()) - 1; }
  /// Length of list `i`.
  int64_t size(int64_t i) const { return offsets[i + 1] - offsets[i]; }
};

/// Per-token feature bags of every synset (the MaxSim scorer's input): one
/// row of `features` per token, synset i's tokens being rows offsets[i] ..
/// offsets[i+1] - 1. Every synset has at least one token.
struct TokenBags {
  Ragged features;                  ///< one row per token: its hashed features
  std::vector<int64_t> offsets{0};  ///< synset i's first token row; starts with 0
  /// Number of synsets.
  int64_t rows() const { return static_cast<int64_t>(offsets.size()) - 1; }
  /// Tokens of synset `i`.
  int64_t size(int64_t i) const { return offsets[i + 1] - offsets[i]; }
};

/// The corpus as the retrieval recipe uses it.
struct RetrievalCorpus {
  std::vector<Synset> synsets;        ///< the synsets, in file order
  std::vector<std::string> queries;   ///< [S] query of each synset: its definition
  std::vector<std::string> passages;  ///< [S] passage of each synset: its lemma list
  std::vector<int64_t> passage_id;    ///< [S] id of its lowercased passage string (equal strings, equal ids)
  int64_t num_passage_ids = 0;        ///< number of distinct passage strings
  std::vector<int64_t> train;         ///< synset indices of the training split, in file order
  std::vector<int64_t> heldout;       ///< synset indices of the held-out split, in file order
  Ragged query_features;              ///< [S] hashed word unigrams and bigrams
  Ragged passage_features;            ///< [S] hashed character n-grams and whole words
  TokenBags query_tokens;             ///< [S] per gloss word (with `token_features`): query_token_features
  TokenBags passage_tokens;           ///< [S] per lemma word (with `token_features`): passage_token_features
  /// Per training synset (same order as `train`): indices INTO `train` of its
  /// hard-negative pool: co-hyponyms (synsets sharing a hypernym) and, for
  /// adjectives, the members of its similar-to cluster; passages equal to its
  /// own are excluded. May be empty (then the sampler falls back to a synset
  /// of the same lexicographer file).
  Ragged hard_negative_pool;
  /// Per lexicographer file (0..44): indices into `train` (fallback pool).
  std::vector<std::vector<int64_t>> train_by_lexfile;
  RetrievalCorpusOptions options;  ///< the options the corpus was made with
};

/// Splits, ids, features and the hard-negative pools of `synsets`.
RetrievalCorpus make_retrieval_corpus(std::vector<Synset> synsets, const RetrievalCorpusOptions& options = {});

/// Lowercased alphanumeric words of `text` (every other character separates).
std::vector<std::string> words_of(const std::string& text);

/// Hashed word unigram and bigram features of a query, each in [1, buckets)
/// (0 is the padding row), then, with `chargrams`, the passage features of
/// the text (n-grams min_n..max_n). Deterministic (FNV-1a).
std::vector<int64_t> query_features(const std::string& text, int64_t buckets, int64_t max_features,
                                    bool chargrams = false, int64_t min_n = 3, int64_t max_n = 5);

/// Hashed character n-grams (lengths min_n..max_n) of every word of a passage,
/// each word marked as "<word>", plus the marked word itself; in [1, buckets).
std::vector<int64_t> passage_features(const std::string& text, int64_t buckets, int64_t min_n, int64_t max_n,
                                      int64_t max_features);

/// The token-level features of a query (the MaxSim scorer's): per word (the
/// first `max_tokens`), its unigram, the bigrams it is part of and, with
/// `chargrams`, its marked form and character n-grams, hashed as
/// query_features hashes them; at most `max_features` per token. A text
/// without words gives one token without features.
std::vector<std::vector<int64_t>> query_token_features(const std::string& text, int64_t buckets,
                                                       int64_t max_features, bool chargrams = false,
                                                       int64_t min_n = 3, int64_t max_n = 5, int64_t max_tokens = 32);

/// The token-level features of a passage: per word (the first `max_tokens`),
/// the features passage_features gives that word.
std::vector<std::vector<int64_t>> passage_token_features(const std::string& text, int64_t buckets, int64_t min_n,
                                                         int64_t max_n, int64_t max_features,
                                                         int64_t max_tokens = 16);

/// Rows `rows` of a ragged feature list as the towers' input: ids int64 [n, L]
/// (L the longest row, at least 1; padding id 0) and weights [n, L] of dtype
/// `dtype` (1/len on the row's features, 0 on padding: a mean bag).
std::vector<torch::Tensor> feature_batch(const Ragged& features, const std::vector<int64_t>& rows,
                                         torch::Dtype dtype = torch::kFloat);

/// Rows `rows` of per-token bags as the token towers' input: the N tokens
/// that exist as feature_batch makes their bags (ids int64 [N, F], weights
/// [N, F]), each token's slot k T + t in the padded [n, T] layout (int64
/// [N]; T the most tokens of a row, at least 1), and the valid slots, bool
/// [n, T]. Padding tokens are never embedded.
std::vector<torch::Tensor> token_feature_batch(const TokenBags& bags, const std::vector<int64_t>& rows,
                                               torch::Dtype dtype = torch::kFloat);

/// Hard negatives of training examples: for example t (an index into
/// `corpus.train`) and slot j < n, a deterministic draw from its pool keyed
/// by (seed, epoch, t, j), falling back to its lexicographer file. Returns
/// indices into `corpus.train`, [rows.size() * n], grouped per example.
std::vector<int64_t> sample_hard_negatives(const RetrievalCorpus& corpus, const std::vector<int64_t>& rows, int64_t n,
                                           uint64_t seed, int64_t epoch);

}  // namespace contrax::train
