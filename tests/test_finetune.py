"""recipes/finetune.py: a torchvision model fine-tuned on a folder of photos, its pretrained weights read from
torchvision's cache ($TORCH_HOME/hub/checkpoints/), where the test puts a file of torchvision's layout (ImageNet
weights cannot be downloaded here). Frozen first (no backward through the pretrained layers), then the whole network;
exact resume at the boundary, on 1 and 2 processes; 2 processes' frozen epoch as 1's; the weights' own preprocessing;
predict.py on the result; offline without the file: one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from test_errors import one_line

from recipes import finetune, predict
from shared import bounds
from shared.errors import RecipeError

from conftest import ROOT, assert_bitwise_equal, hooked, launch, ok, run_here, weights
from tiny_data import idx_folder, imagefolder_dataset, random_splits

# 24 training photos in batches of 8: 3 steps an epoch, the first epoch frozen
RUN = ("--image_size", "32", "--batch_size", "8", "--max_steps", "6", "--freeze_epochs", "1", "--log_every", "1",
       "--tracker", "none", "--checkpoint_every", "3")
CACHED = "resnet18-f37072fd.pth"  # the name torchvision's ResNet18_Weights.IMAGENET1K_V1 downloads to
@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    return imagefolder_dataset(tmp_path_factory.mktemp("photos") / "shoes", sizes={"train": 24, "test": 9},
                               num_classes=3)


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory) -> Path:
    """A torchvision hub cache holding resnet18's weights file, in torchvision's layout (random weights here)."""
    home = tmp_path_factory.mktemp("torch_home")
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), home / "hub" / "checkpoints" / CACHED)
    return home


@pytest.fixture(scope="module")
def reference(photos, torch_home, tmp_path_factory) -> tuple[Path, Counter]:
    """A run of 6 steps, the first 3 frozen, and how many gradients each parameter received."""
    gradients = Counter()

    def counting(make_model):
        def make(*args, **kwargs):
            model = make_model(*args, **kwargs)
            for name, param in model.named_parameters():
                param.register_post_accumulate_grad_hook(lambda _, name=name: gradients.update([name]))
            return model
        return make

    out = tmp_path_factory.mktemp("ft") / "run"
    with hooked(finetune, "make_model", counting):
        ok(run_here("finetune", "--data", photos, *RUN, "--output_dir", out, "--keep_checkpoints", "5",
                    env={"TORCH_HOME": str(torch_home)}))
    return out, gradients


def test_the_frozen_backbone_keeps_the_pretrained_weights_then_trains(reference, torch_home):
    pretrained = torch.load(torch_home / "hub" / "checkpoints" / CACHED, weights_only=True)
    after_freeze = weights(reference[0] / "checkpoints" / "step_3")
    backbone = [k for k in pretrained if not k.startswith("fc.")]
    for name in backbone:  # weights and BatchNorm's running statistics, as in the file
        assert torch.equal(after_freeze[name], pretrained[name]), name
    assert after_freeze["fc.weight"].shape == (3, 512)  # the new classifier, trained
    final = weights(reference[0])
    assert not torch.equal(final["layer4.1.conv2.weight"], pretrained["layer4.1.conv2.weight"])  # then unfrozen


def test_a_frozen_step_computes_no_gradient_for_the_pretrained_layers(reference):
    """Setting their gradients to None after the backward kept the weights, but paid for the whole backward pass
    (and, on several processes, its all-reduce): here they receive none at all."""
    gradients = reference[1]
    assert gradients["fc.weight"] == gradients["fc.bias"] == 6  # the new classifier: every step
    assert {gradients[name] for name in gradients if not name.startswith("fc.")} == {3}  # the unfrozen steps only


def test_a_resume_at_the_end_of_the_frozen_epoch_is_exact(photos, torch_home, reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    shutil.rmtree(out / "checkpoints" / "step_6")
    (out / "model.safetensors").unlink()
    ok(run_here("finetune", "--data", photos, *RUN, "--output_dir", out, "--keep_checkpoints", "5", "--resume",
                "latest", env={"TORCH_HOME": str(torch_home)}))
    assert_bitwise_equal(weights(out), weights(reference[0]))


@pytest.mark.slow
def test_two_processes_cross_the_boundary_and_resume_exactly_at_it(env, photos, torch_home, tmp_path):
    """DDP all-reduces no gradient of a frozen layer (no_sync, the classifier's averaged by hand), then all of them:
    2 processes over gloo, each accumulating 2 batches of 2, train through the boundary, and a run resumed at it ends
    on the same weights. The frozen epoch is the arithmetic of 1 process at batch 8 (BatchNorm frozen too, no
    augmentation, no clip): a classifier gradient summed over the processes instead of averaged, or one process's
    alone, fails here and nowhere else."""
    env = dict(env, TORCH_HOME=str(torch_home))
    flags = ("--data", str(photos), *RUN, "--no-augment", "--max_grad_norm", "inf", "--keep_checkpoints", "5")
    two = (*flags, "--batch_size", "2", "--grad_accum", "2")  # global batch 8: 3 steps an epoch
    one, full, resumed = tmp_path / "one", tmp_path / "full", tmp_path / "resumed"
    ok(launch(env, "finetune", *two, "--output_dir", str(full), config="2gpu", use_cpu=True))
    ok(run_here("finetune", *flags, "--output_dir", one, env={"TORCH_HOME": str(torch_home)}))  # batch 8 (RUN)
    pretrained = torch.load(torch_home / "hub" / "checkpoints" / CACHED, weights_only=True)
    frozen, reference = weights(full / "checkpoints" / "step_3"), weights(one / "checkpoints" / "step_3")
    assert torch.equal(frozen["layer1.0.conv1.weight"], pretrained["layer1.0.conv1.weight"])
    for name in ("fc.weight", "fc.bias"):
        assert (frozen[name] - reference[name]).abs().max() <= 1e-6, name
    assert not torch.equal(weights(full)["layer1.0.conv1.weight"], pretrained["layer1.0.conv1.weight"])
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_6")
    (resumed / "model.safetensors").unlink()
    ok(launch(env, "finetune", *two, "--output_dir", str(resumed), "--resume", "latest", config="2gpu",
              use_cpu=True))
    assert_bitwise_equal(weights(resumed), weights(full))


@pytest.mark.parametrize("model, decoded_side", [("resnet18", 256), ("efficientnet_b0", 256), ("swin_t", 232)])
def test_evaluation_sees_the_images_as_the_weights_were_evaluated(tmp_path, model, decoded_side):
    """Decoded at the weights' resize size with their filter, centre-cropped on the device: torchvision's
    weights.transforms() (resize 256 bilinear, centre crop 224 for resnet18's; bicubic for efficientnet_b0's, 232 and
    bicubic for swin_t's), not a straight resize to 224, nor bilinear for all."""
    photo = tmp_path / "photo.png"
    pixels = torch.randint(0, 256, (300, 420, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    Image.fromarray(pixels.numpy()).save(photo)
    cfg = finetune.Config(model=model)
    shape, _, resize_filter = finetune.input_sizes(cfg)
    decoded = predict.read_image(photo, shape, resize_filter)  # as predict.py reads a photo
    assert decoded.shape == (3, decoded_side, decoded_side)
    ours = finetune.preprocess(decoded[None], training=False, cfg=cfg)
    theirs = finetune.chosen_weights(model, "DEFAULT").transforms()(Image.open(photo))
    # The same pixels, but for rounding: transforms() resizes a PIL image through PIL, 1 level of 255 apart from
    # torch's resize of a tensor (which shared/images.py's fit uses) in a few of them here.
    one_level = 1 / 255 / min(finetune.chosen_weights(model, "DEFAULT").transforms().std) + 1e-6
    torch.testing.assert_close(ours[0], theirs, atol=one_level, rtol=0)
    assert (ours[0] - theirs).abs().gt(1e-6).float().mean() < 0.01
    assert finetune.preprocess(decoded[None], training=True, cfg=cfg).shape == (1, 3, 224, 224)  # the crop too


def test_an_image_size_scales_the_decoded_size_as_the_weights_resize_their_crop():
    """docs/finetuning.md: resnet18's weights resize to 256 and crop 224, so --image_size 64 decodes at 73 (the size
    the line about converted photos names), then crops 64."""
    assert finetune.input_sizes(finetune.Config(image_size=64))[:2] == ((3, 73, 73), 64)


def test_without_pretrained_weights_nothing_is_frozen(capsys):
    cfg = finetune.Config.parse(["--weights", "none"])
    assert cfg.freeze_epochs == 0 and cfg.backbone_lr_scale == 1
    pretrained = finetune.Config.parse([])
    assert pretrained.freeze_epochs == 1 and pretrained.backbone_lr_scale == 0.1
    for flag in (["--freeze_epochs", "1"], ["--backbone_lr_scale", "0.5"]):
        with pytest.raises(SystemExit):
            finetune.Config.parse(["--weights", "none", *flag])
        assert "--weights none has none (every layer starts random)" in capsys.readouterr().err
    for scale in ("0", "1.5"):  # a share of --lr, not a rate
        with pytest.raises(SystemExit):
            finetune.Config.parse(["--backbone_lr_scale", scale])
        assert f"--backbone_lr_scale is a fraction of --lr: in (0, 1], got {float(scale)}" in capsys.readouterr().err


@pytest.mark.parametrize("flags, refused", [
    (["--model", "vit_b_16", "--image_size", "256"], "must be 224 for vit_b_16 (DEFAULT weights), got 256"),
    (["--model", "vit_b_16", "--image_size", "224"], None),
    (["--model", "vit_b_16", "--image_size", "256", "--weights", "none"], None),  # new position embeddings
    (["--model", "vit_b_16", "--image_size", "250", "--weights", "none"], "a multiple of vit_b_16's 16-px patches"),
    (["--model", "vit_b_16", "--image_size", "64", "--weights", "none"], None),  # was: "must be 224 to 4,096"
    (["--model", "vit_b_16", "--image_size", "16", "--weights", "none"], "must be 32 to 4,096 for vit_b_16"),
    (["--model", "maxvit_t", "--image_size", "256", "--weights", "none"], "--image_size must be 224 for maxvit_t"),
    (["--model", "swin_t", "--image_size", "256"], None),  # windows of 7 patches, padded at any size
    (["--model", "alexnet", "--image_size", "62"], "--image_size must be 63 to 4,096 for alexnet"),
    (["--model", "resnet18", "--image_size", "31"], "--image_size must be 32 to 4,096 for resnet18"),
    (["--image_size", "1000000000"], "--image_size must be 32 to 4,096 for resnet18"),  # was torch's RuntimeError
    (["--model", "resnet18", "--image_size", "500"], None)])
def test_an_image_size_the_weights_cannot_take_is_one_line(capsys, flags, refused):
    """A ViT's pretrained position embeddings fit one input size: another one read 'holds another model's weights
    (...): delete it to download vit_b_16's again', and deleting the file changed nothing. MaxViT at another size, and
    a new ViT's side that is not a whole number of its patches, ended in a traceback."""
    if refused is None:
        assert finetune.Config.parse(flags).image_size == int(flags[3])
        return
    with pytest.raises(SystemExit):
        finetune.Config.parse(flags)
    assert refused in capsys.readouterr().err


def test_a_new_vit_takes_a_side_below_its_weights_own():
    """--weights none: the ViT's position embeddings are made for --image_size, any whole number of its patches."""
    cfg = finetune.Config.parse(["--model", "vit_b_16", "--weights", "none", "--image_size", "32"])
    shape, side, _ = finetune.input_sizes(cfg)
    images = torch.randint(0, 256, (2, *shape), dtype=torch.uint8)
    assert side == 32 and finetune.make_model(3, cfg)(finetune.preprocess(images, False, cfg)).shape == (2, 3)


def test_synthetic_data_has_the_default_datas_sizes_and_classes(tmp_path, monkeypatch):
    """--synthetic stands in for beans (1,034 training and 128 test photos, 3 classes), as every recipe's stands in
    for its own data: it was CIFAR-10's 60,000 images and 10 classes, 11.8 GB at the weights' 256 px, which a 16 GB
    machine's kernel killed without a word."""
    from shared import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path)
    train, test = finetune.load_data(finetune.Config.parse(["--synthetic", "--weights", "none", "--image_size", "32"]))
    assert (len(train), len(test), len(train.classes)) == (1_034, 128, 3)
    assert train.images.shape[1:] == (3, 37, 37)  # resnet18's weights' resize before its crop, scaled to 32 px


def test_predict_uses_the_fine_tuned_model(env, photos, reference, tmp_path):
    result = ok(subprocess.run([sys.executable, "recipes/predict.py", "--weights",
                                str(reference[0] / "model.safetensors"), "--recipe", "finetune", "--images",
                                str(photos / "test"), "--output", str(tmp_path / "predictions.csv")],
                               cwd=ROOT, env=env, capture_output=True, text=True))
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + 9 and "finetune" in result.stdout


def test_offline_without_the_weights_file_is_one_line(env, photos, tmp_path):
    offline = dict(env, TORCH_HOME=str(tmp_path / "empty"), HTTPS_PROXY="http://127.0.0.1:9",
                   https_proxy="http://127.0.0.1:9")  # no download, wherever the test runs
    line = one_line(launch(offline, "finetune", "--data", str(photos), *RUN, "--output_dir", str(tmp_path / "out")),
                    f"{tmp_path / 'empty' / 'hub' / 'checkpoints' / CACHED} is not there and could not be downloaded "
                    "from https://download.pytorch.org/models/resnet18-f37072fd.pth",
                    "or pass --weights none")
    assert "ResNet18_Weights.IMAGENET1K_V1" in line


@pytest.mark.parametrize("zipped", [True, False], ids=["torch.save's zip", "torch's format before 1.6"])
def test_a_cached_weights_file_in_either_format_torch_load_reads_is_loaded(torch_home, tmp_path, monkeypatch, zipped):
    """torchvision's older downloads are in torch's format before 1.6, five pickles then the tensors' bytes: checked
    as torch.load reads them (check_archive), and loaded."""
    home = tmp_path / "home"
    (home / "hub" / "checkpoints").mkdir(parents=True)
    state = torch.load(torch_home / "hub" / "checkpoints" / CACHED, weights_only=True)
    torch.save(state, home / "hub" / "checkpoints" / CACHED, _use_new_zipfile_serialization=zipped)
    monkeypatch.setenv("TORCH_HOME", str(home))
    model = finetune.make_model(3, cfg := finetune.Config())
    finetune.load_pretrained(model, finetune.pretrained_state(cfg), cfg)
    assert torch.equal(model.state_dict()["layer1.0.conv1.weight"], state["layer1.0.conv1.weight"])


def test_a_cached_weights_file_with_compressed_entries_is_not_inflated(torch_home, tmp_path, monkeypatch):
    """The cache may hold a file from anywhere: deflated entries could inflate to any size in torch.load."""
    from test_hostile import zip_bomb

    home = tmp_path / "home"
    shutil.copytree(torch_home, home)
    monkeypatch.setenv("TORCH_HOME", str(home))
    cfg = finetune.Config()
    zip_bomb(home / "hub" / "checkpoints" / CACHED)
    with pytest.raises(RecipeError, match=f"{CACHED}' holds entries of .* which torch.save never writes"):
        finetune.load_pretrained(finetune.make_model(3, cfg), finetune.pretrained_state(cfg), cfg)
    (home / "hub" / "checkpoints" / CACHED).unlink()
    os.mkfifo(home / "hub" / "checkpoints" / CACHED)  # would block the read forever
    with pytest.raises(RecipeError, match=rf"{CACHED}' is not a regular file \(a FIFO, socket, device or folder\)"):
        finetune.load_pretrained(finetune.make_model(3, cfg), finetune.pretrained_state(cfg), cfg)


def test_photos_that_would_not_fit_in_memory_decoded_are_refused_first(photos, monkeypatch):
    """33 photos decoded at 4,681 px (--image_size 4,096, the largest, at resnet18's resize) take 2.0 GiB, here with
    1 GiB free: one line, before any photo is decoded."""
    monkeypatch.setattr(bounds, "free_memory", lambda: 2**30)
    cfg = finetune.Config.parse(["--data", str(photos), "--weights", "none", "--image_size", "4096"])
    with pytest.raises(RecipeError, match=r"33 images of 3x4681x4681 take 2.0 GiB decoded, more than the 1.0 "
                                          r"GiB of free memory: use smaller images \(finetune.py: --image_size\)"):
        finetune.load_data(cfg)


def test_published_files_that_would_not_fit_in_memory_converted_are_refused_first(tmp_path, monkeypatch):
    """IDX files are read, then converted to --image_size all at once: the same bound, before the conversion."""
    monkeypatch.setattr(bounds, "free_memory", lambda: 2**30)
    digits = idx_folder(tmp_path / "digits", random_splits((28, 28), sizes=(24, 9), classes=3))
    cfg = finetune.Config.parse(["--data", str(digits), "--weights", "none", "--image_size", "4096"])
    with pytest.raises(RecipeError, match="33 images of 3x4681x4681 take 2.0 GiB decoded, more than the 1.0 GiB"):
        finetune.load_data(cfg)


def test_a_damaged_weights_file_is_said_before_the_photos_are_decoded(photos, torch_home, tmp_path, monkeypatch):
    """The pretrained file is read first: damaged, the line came after every photo was decoded (10 s and more)."""
    from shared import data

    home = tmp_path / "home"
    shutil.copytree(torch_home, home)
    (home / "hub" / "checkpoints" / CACHED).write_bytes(b"not a torch file")
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "decoded")  # empty: the photos would be decoded into it
    line = one_line(run_here("finetune", "--data", photos, "--max_steps", "1", "--tracker", "none", "--output_dir",
                             tmp_path / "out", env={"TORCH_HOME": str(home)}))
    assert f"{CACHED}' is damaged or holds a pickle that is refused" in line
    assert not (tmp_path / "decoded").exists()  # no photo decoded


def test_a_cached_weights_file_of_another_architecture_is_one_line(tmp_path, monkeypatch):
    """ResNet-50's weights where torchvision caches resnet18's: torch's size-mismatch traceback before."""
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(torchvision.models.resnet50().state_dict(), tmp_path / "hub" / "checkpoints" / CACHED)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cfg = finetune.Config()
    with pytest.raises(RecipeError, match=r"holds another model's weights \('layer1.0.conv1.weight' is "
                                          r"\(64, 64, 1, 1\) in the file, \(64, 64, 3, 3\) in the model, and \d+ more "
                                          r"tensors differ\): delete it to download resnet18's again"):
        finetune.load_pretrained(finetune.make_model(3, cfg), finetune.pretrained_state(cfg), cfg)
