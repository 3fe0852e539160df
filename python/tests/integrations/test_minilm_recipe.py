"""python/examples/minilm_retrieval.py reads WordNet as the C++ recipe does:
the same split and evaluation set sizes as `contrax train --recipe retrieval`
(112977 training synsets, 4682 held out against 4631 distinct lemma lists;
--eval-limit 1000: 1000 against 997), and its hard negatives are other lemma
lists."""
import os
import sys

import pytest

WORDNET = "/usr/share/wordnet"
if not os.path.exists(os.path.join(WORDNET, "data.noun")):
    pytest.skip(f"no WordNet in {WORDNET} (Debian's wordnet-base)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import minilm_retrieval as recipe  # noqa: E402


def test_split_and_eval_set_match_the_cpp_recipe():
    # Slow (seconds): each make_data() reads all of WordNet's data files, as the recipe does.
    rows, queries, passages, target = recipe.make_data(WORDNET, 0, 0)
    assert (len(rows["anchor"]), len(queries), len(passages)) == (112977, 4682, 4631)
    assert sorted(set(target)) == list(range(4631))
    _, q1000, p1000, _ = recipe.make_data(WORDNET, 1000, 0)
    assert (len(q1000), len(p1000)) == (1000, 997)
    assert all(n.lower() != p.lower() for p, n in zip(rows["positive"], rows["negative"]))
    # the C++ conventions: examples cut from the gloss, adjective markers dropped
    assert recipe.definition_of('able to swim; "she is able to swim"') == "able to swim"
    assert recipe.definition_of('"only an example"') == '"only an example"'
    assert recipe.clean_lemma("galore(ip)") == "galore" and recipe.clean_lemma("abstract_entity") == "abstract entity"
