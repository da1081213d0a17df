"""The model zoo: reference shapes, tiny variants, seeded weights, argument checks."""

import pytest
import torch

from batchsim.real import InputSpec, make_model


@pytest.mark.parametrize("name, in_shape, out_shape", [
    ("mlp", (2048,), (2048,)),
    ("cnn", (3, 64, 64), (1000,)),
    ("encoder", (128, 512), (128, 512)),
])
def test_default_sizes_are_the_reference_shapes(name, in_shape, out_shape):
    model = make_model(name)
    assert model.input_spec == InputSpec(in_shape, torch.float32)
    assert model.zoo_name == name and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    y = model(model.input_spec.random(2))
    assert y.shape == (2, *out_shape) and y.dtype == torch.float32


def test_reference_layer_sizes():
    mlp = make_model("mlp")
    assert [m.weight.shape for m in mlp if isinstance(m, torch.nn.Linear)] == \
        [(2048, 2048)] * 4
    enc = make_model("encoder")
    assert len(enc.layers) == 4
    layer = enc.layers[0]
    assert layer.self_attn.num_heads == 8 and layer.linear1.weight.shape == (2048, 512)
    cnn = make_model("cnn")
    convs = [m for m in cnn if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride) for c in convs] == \
        [(3, 64, (1, 1)), (64, 128, (2, 2)), (128, 256, (2, 2))]


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder"])
def test_tiny_models_are_small_and_seeded(name):
    a = make_model(name, size="tiny", seed=3)
    b = make_model(name, size="tiny", seed=3)
    c = make_model(name, size="tiny", seed=4)
    assert a.zoo_name == f"tiny-{name}"
    assert sum(p.numel() for p in a.parameters()) < 100_000
    x = a.input_spec.random(3)
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), c(x))


def test_weights_do_not_touch_the_global_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("mlp", size="tiny")
    assert torch.equal(torch.rand(3), expected)


def test_dtype_is_applied_to_weights_and_spec():
    model = make_model("cnn", dtype="bfloat16", size="tiny")
    assert model.input_spec.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model(model.input_spec.random(2)).dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "resnet"}, "name must be one of"),
    ({"name": "mlp", "size": "huge"}, "size must be one of"),
    ({"name": "mlp", "dtype": "int64"}, "dtype must be a floating torch dtype"),
    ({"name": "mlp", "device": "gpu0"}, "device must name a torch device"),
])
def test_bad_arguments_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_model(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="not available"):
        make_model("mlp", device="cuda", size="tiny")


def test_input_spec_random_is_seeded_and_shaped():
    spec = InputSpec((2, 3), torch.float16)
    x = spec.random(4, seed=1)
    assert x.shape == (4, 2, 3) and x.dtype == torch.float16
    assert torch.equal(x, spec.random(4, seed=1))


def test_input_spec_takes_a_dtype_by_name_and_refuses_bad_ones():
    assert InputSpec([16], "int64") == InputSpec((16,), torch.int64)
    with pytest.raises(ValueError, match=r"shape must be a tuple of sizes >= 0, got \(-1,\)"):
        InputSpec((-1,), torch.float32)
    with pytest.raises(ValueError, match="shape must be a tuple of sizes >= 0, got '4'"):
        InputSpec("4", torch.float32)
    with pytest.raises(ValueError, match="dtype must be a torch dtype or its name, such as "
                                         "'float32', got 'floaty'"):
        InputSpec((4,), "floaty")
