"""One torchvision classification builder of each family in recipes/finetune.py: its classifier replaced for your
classes and a training step taken, in this process at its smallest input (a launch per model would cost minutes);
googlenet and inception_v3 refused by their flag."""

from __future__ import annotations

import pytest
import torch
import torchvision

from recipes import finetune

BUILDERS = finetune.MODELS  # every torchvision classification builder but googlenet and inception_v3
# One builder of each family (each torchvision module of builders): the recipe's part, classifier_name, finds each
# family's last layer the same way for all its sizes; every size of every family was torchvision's own test to run
FAMILIES = ("alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "maxvit_t", "mnasnet0_5", "mobilenet_v2",
            "mobilenet_v3_small", "regnet_x_400mf", "resnet18", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t",
            "vgg11", "vit_b_32")


def test_every_family_of_builders_has_one_here():
    """A torchvision release with a new family of classifiers fails here until one of them is in FAMILIES."""
    family = {name: torchvision.models.get_model_builder(name).__module__ for name in BUILDERS}
    assert set(family.values()) == {family[name] for name in FAMILIES}


@pytest.mark.parametrize("model", FAMILIES)
def test_a_classifier_of_every_family_trains_a_step(model):
    """Its classifier (a Linear, or SqueezeNet's 1x1 convolution) replaced for 3 classes, at its smallest input."""
    cfg = finetune.Config(model=model, weights="none")
    net = finetune.make_model(3, cfg)
    size = max(32, finetune.chosen_weights(model, "none").meta["min_size"][0])  # its smallest input
    head = net.get_submodule(finetune.classifier_name(net))
    before = head.weight.detach().clone()
    optimizer = finetune.make_optimizer(net, cfg)
    logits = net(torch.randn(2, 3, size, size))
    finetune.loss_fn(logits, torch.tensor([0, 2])).backward()
    assert logits.shape == (2, 3) and head.weight.grad is not None
    optimizer.step()
    assert not torch.equal(head.weight, before)


@pytest.mark.parametrize("model", ["googlenet", "inception_v3"])
def test_a_classifier_with_several_training_outputs_is_refused_by_its_flag(capsys, model):
    with pytest.raises(SystemExit) as stopped:
        finetune.Config.parse(["--model", model])
    assert stopped.value.code == 2 and "return several outputs in training" in capsys.readouterr().err
    assert set(torchvision.models.list_models(module=torchvision.models)) - set(BUILDERS) == {"googlenet",
                                                                                            "inception_v3"}
