"""C++ argument errors surface as ValueError with the library's message;
other failures as RuntimeError."""
import pytest
import torch

import contrax
from distributed import run


def test_value_error_single_process():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"clip_loss\(\): argument 'logit_scale' must be a 0-dim tensor, "
                                         r"but got shape \[3\]"):
        contrax.clip_loss(a, b, torch.zeros(3))
    with pytest.raises(ValueError, match=r"nt_xent_loss\(\): argument 'temperature'"):
        contrax.nt_xent_loss(a, b, temperature=-1.0)
    with pytest.raises(ValueError, match="argument 'z2'|arguments 'z1' and 'z2'"):
        contrax.nt_xent_loss(a, torch.randn(2, 4))
    with pytest.raises(ValueError) as info:
        contrax.clip_loss(a, b, torch.zeros(3))
    assert "Exception raised from" not in str(info.value)  # no C++ backtrace


def test_zero_width_features_are_value_errors():
    # Issue 29, item 7: these reached ATen's amax() error before.
    e = torch.randn(4, 0)
    for name, call in [("nt_xent_loss", lambda: contrax.nt_xent_loss(e, e)),
                       ("nt_xent_loss", lambda: contrax.nt_xent_loss(e, e, path="tiled")),
                       ("moco_v3_loss", lambda: contrax.moco_v3_loss(e, e, e, e)),
                       ("clip_loss", lambda: contrax.clip_loss(e, e, torch.tensor(1.0)))]:
        with pytest.raises(ValueError, match=name + r"\(\): argument '(z1|q1|a)' must have a width of at least 1"):
            call()


def test_reduced_precision_logit_scale_is_computed_in_fp32():
    # Issue 29, item 7: an fp16 scale raised "clamp_max_scalar_cpu not
    # implemented for 'Half'"; it now gives the fp32 scale's loss.
    torch.manual_seed(3)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    for dt in (torch.float16, torch.bfloat16):
        s = torch.tensor(2.5, dtype=dt)
        assert contrax.clip_loss(a, b, s).item() == contrax.clip_loss(a, b, s.float()).item()


def test_nan_logit_scale_gives_nan():
    # Issue 29, item 1: a NaN scale was replaced by the maximum scale.
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    for path in ("materialised", "tiled"):
        s = torch.tensor(float("nan"), requires_grad=True)
        loss = contrax.clip_loss(a, b, s, path=path, tile_size=2)
        loss.backward()
        assert torch.isnan(loss) and torch.isnan(s.grad), path
    assert torch.isnan(contrax.siglip_loss(a, b, torch.tensor(float("nan")), torch.tensor(0.0)))


def test_bad_group_is_type_error():
    with pytest.raises(TypeError, match="argument 'group' must be a torch.distributed ProcessGroup"):
        contrax.clip_loss(torch.randn(2, 3), torch.randn(2, 3), torch.tensor(0.0), group="world")


def _errors_worker(rank, world):
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    # Rank 1 passes a bad scale: it gets the ValueError naming the argument,
    # rank 0 an error naming rank 1 -- nobody hangs.
    scale = torch.zeros(3) if rank == 1 else torch.tensor(0.0)
    with pytest.raises((ValueError, RuntimeError)) as info:
        contrax.clip_loss(a, b, scale)
    if rank == 1:
        assert info.type is ValueError
        assert "clip_loss(): argument 'logit_scale' must be a 0-dim tensor, but got shape [3]" in str(info.value)
    else:
        assert "rank 1" in str(info.value), str(info.value)
    # Widths that differ between ranks: the same ValueError on every rank.
    z = torch.randn(2, 4 if rank == 0 else 6)
    with pytest.raises(ValueError, match="must have the same trailing shape on every rank"):
        contrax.nt_xent_loss(z, z.clone())
    # Afterwards the group still works.
    loss = contrax.clip_loss(a, b, torch.tensor(0.0))
    assert torch.isfinite(loss)


def test_errors_on_every_rank():
    run(2, _errors_worker)


def test_an_argument_of_the_wrong_kind_is_named():
    # Round five, item 6: pybind11's "incompatible function arguments" list
    # named no argument; the table's types now check each one by name.
    a, b, s = torch.randn(4, 3), torch.randn(4, 3), torch.tensor(1.0)
    cases = [
        (lambda: contrax.clip_loss(a, "b", s), "clip_loss(): argument 'b' must be a Tensor, but got str"),
        (lambda: contrax.clip_loss(a, b, 2.0), "clip_loss(): argument 'logit_scale' must be a Tensor, but got float"),
        (lambda: contrax.clip_loss(a, b, s, logit_bias=1.0),
         "clip_loss(): argument 'logit_bias' must be a Tensor or None, but got float"),
        (lambda: contrax.nt_xent_loss(a, b, temperature="0.1"),
         "nt_xent_loss(): argument 'temperature' must be a number, but got str"),
        (lambda: contrax.nt_xent_loss(a, b, temperature=None),
         "nt_xent_loss(): argument 'temperature' must be a number, but got NoneType"),
        (lambda: contrax.clip_loss(a, b, s, tile_size=2.5), "clip_loss(): argument 'tile_size' must be an integer, "
         "but got float"),
        (lambda: contrax.clip_loss(a, b, s, symmetric="no"), "clip_loss(): argument 'symmetric' must be True or "
         "False, but got str"),
        (lambda: contrax.clip_loss(a, b, s, path=1), "clip_loss(): argument 'path' must be a string, but got int"),
        (lambda: contrax.ClipLoss(max_logit_scale="big"), "ClipLoss(): argument 'max_logit_scale' must be a "
         "number, but got str"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == message


def test_features_on_two_devices_are_named():
    # Round five, item 6: clip_loss and siglip_loss did not check (nt_xent_loss did).
    a, b = torch.randn(4, 3), torch.randn(4, 3, device="meta")
    with pytest.raises(ValueError, match=r"clip_loss\(\): arguments 'a' and 'b' must be on the same device, but got "
                                         r"cpu and meta"):
        contrax.clip_loss(a, b, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"siglip_loss\(\): arguments 'a' and 'b' must be on the same device"):
        contrax.siglip_loss(a, b, torch.tensor(1.0), torch.tensor(0.0))


def test_gather_names_its_own_argument():
    # Round five, item 6: the message said 'local', the C++ name.
    with pytest.raises(ValueError, match=r"gather_with_grad\(\): argument 'x' must"):
        contrax.gather_with_grad(torch.tensor(1.0))
