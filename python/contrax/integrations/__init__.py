"""Drop-in losses for the training libraries people use, computed by Contrax.

One module per library; each keeps that library's constructor arguments and
call convention, so that its training loop runs unchanged, and replaces the
loss underneath with Contrax's exact ``[local x global]`` one (gradients equal
to one device's on the concatenated global batch, uneven per-rank batches, the
memory-bounded paths for large batches):

* ``contrax.integrations.open_clip``: ``ClipLoss``, ``SigLipLoss``, ``create_loss``;
* ``contrax.integrations.lightly``: ``NTXentLoss``;
* ``contrax.integrations.sentence_transformers``:
  ``MultipleNegativesRankingLoss``, ``CachedMultipleNegativesRankingLoss``,
  ``MatryoshkaLoss`` (around either);
* ``contrax.integrations.pylate``: ``Contrastive`` (ColBERT, late interaction);
* ``contrax.integrations.colpali_engine``: ``ColbertLoss``, ``ColbertNegativeCELoss``,
  ``ColbertPairwiseCELoss``, ``ColbertPairwiseNegativeCELoss``, ``ColbertSigmoidLoss``
  (ColPali, late interaction).

None of them imports its peer library to compute a loss; the versions each is
tested against are listed in docs/integrations.md.
"""
