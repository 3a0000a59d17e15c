"""Every torchvision classification builder in recipes/finetune.py: its classifier replaced for your classes and a
training step taken, in this process at its smallest input (a launch per model would cost minutes); googlenet and
inception_v3 refused by their flag."""

from __future__ import annotations

import pytest
import torch
import torchvision

from recipes import finetune

BUILDERS = finetune.MODELS  # every torchvision classification builder but googlenet and inception_v3
# Too large for a real step in a test: their forward and backward run on the meta device
HUGE = ("vit_h_14", "regnet_y_128gf", "vit_l_16", "vit_l_32", "vit_b_16", "swin_v2_b", "swin_b", "convnext_large")
# One of each kind in the quick tier (a step in 0.1-1 s); the other 62 in the full suite
QUICK_BUILDERS = ("alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "maxvit_t",
                  "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf", "resnet18",
                  "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t", "vgg11", "vit_b_32")


@pytest.mark.parametrize("model", [name if name in QUICK_BUILDERS else pytest.param(name, marks=pytest.mark.slow)
                                   for name in BUILDERS])
def test_every_torchvision_classifier_trains_a_step(model):
    """Its classifier (a Linear, or SqueezeNet's 1x1 convolution) replaced for 3 classes, at its smallest input. The
    largest (HUGE: a step of 2.5 s to 130 s here, vit_h_14 at 518 px) run their forward and backward on the meta
    device, shapes and no numbers, where the fused optimizer has no kernel; a smaller one of each of their kinds
    trains a real step."""
    cfg = finetune.Config(model=model, weights="none")
    net = finetune.make_model(3, cfg).to("meta" if model in HUGE else "cpu")
    size = max(32, finetune.chosen_weights(model, "none").meta["min_size"][0])  # its smallest input
    head = net.get_submodule(finetune.classifier_name(net))
    before = head.weight.detach().clone()
    optimizer = finetune.make_optimizer(net, cfg)
    logits = net(torch.randn(2, 3, size, size, device=head.weight.device))
    finetune.loss_fn(logits, torch.tensor([0, 2], device=logits.device)).backward()
    assert logits.shape == (2, 3) and head.weight.grad is not None
    if model not in HUGE:
        optimizer.step()
        assert not torch.equal(head.weight, before)


@pytest.mark.parametrize("model", ["googlenet", "inception_v3"])
def test_a_classifier_with_several_training_outputs_is_refused_by_its_flag(capsys, model):
    with pytest.raises(SystemExit) as stopped:
        finetune.Config.parse(["--model", model])
    assert stopped.value.code == 2 and "return several outputs in training" in capsys.readouterr().err
    assert set(torchvision.models.list_models(module=torchvision.models)) - set(BUILDERS) == {"googlenet",
                                                                                            "inception_v3"}
