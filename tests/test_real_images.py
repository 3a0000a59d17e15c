"""The recipes on small sets of real photographs and handwritten digits (built by
benchmarks/real_images.py from images that ship inside pip packages), and the conversions that let a
copied recipe read the user's own images: other sizes, grayscale into colour and colour into grayscale."""

from __future__ import annotations

import io
import math

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import ok, read_json, read_jsonl, run_here
from tiny_data import real_digits, real_images, real_photos

QUICK = ("--max_steps", "3", "--batch_size", "16", "--tracker", "none")


@pytest.fixture(scope="module")
def photos10(tmp_path_factory):
    """CIFAR-10's format: 1,500 training and 300 test crops of 10 photographs."""
    return real_photos(tmp_path_factory.mktemp("real") / "photos10", train_per_class=150, test_per_class=30)


def test_cifar_cnn_defaults_train_through_the_learning_rate_peak(env, photos10, tmp_path):
    # With the earlier defaults (no clipping, no BatchNorm) this run fell to 0.08 at step 33, after
    # the one-cycle peak at step 22, and ended at 0.54; on 5,000 photos it stayed at chance.
    out = tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", photos10, "--epochs", "10", "--tracker", "none", "--output_dir", out))
    rows = read_jsonl(out / "metrics.jsonl")
    train = [row for row in rows if "train_loss" in row]
    accuracies = [row["eval_acc"] for row in rows if "eval_acc" in row]
    peak = max(train, key=lambda row: row["lr"])["step"]
    assert train[-1]["step"] == 110 and peak < 30  # 11 steps an epoch, the peak at 20% of the run
    assert all(math.isfinite(row["train_loss"]) and math.isfinite(row["grad_norm"]) for row in train)
    assert max(row["grad_norm"] for row in train) > 1.0  # the clip at 1.0 was needed at some step
    assert len(train) == 110  # default --log_every: about 100 points a run (here every step)
    assert min(accuracies[1:]) >= 0.3 and accuracies[-1] >= 0.7, accuracies  # chance is 0.1


def test_grayscale_digits_into_the_colour_recipe(env, tmp_path):
    digits = real_digits(tmp_path / "digits", limit=200)
    out = tmp_path / "run"
    result = ok(run_here("cifar_cnn", "--data", digits, *QUICK, "--output_dir", out))
    line = "converted the images to 3x32x32, this recipe's decoded size: grayscale -> colour; 28x28 -> 32x32"
    assert line in result.stdout
    assert read_json(out / "summary.json")["steps"] == 3


def test_colour_photos_into_the_grayscale_recipe(env, photos10, tmp_path):
    out = tmp_path / "run"
    result = ok(run_here("resnet18_fmnist", "--data", photos10, "--max_steps", "2", "--batch_size", "8",
                         "--tracker", "none", "--output_dir", out))
    line = "converted the images to 1x28x28, this recipe's decoded size: colour -> grayscale; 32x32 -> 28x28"
    assert line in result.stdout
    assert read_json(out / "summary.json")["steps"] == 2


def test_the_conversion_line_gives_the_sizes_found():
    """It named the first image's size when the images ranged from 60 to 140 px."""
    from shared.images import conversion

    seen = {"channels": {1, 3}, "sizes": {(60, 60), (140, 94), (100, 140)}}
    assert conversion((3, 224, 224), seen) == ("grayscale -> colour; 3 sizes, 60-140 px wide and 60-140 px high -> "
                                               "224x224 (shorter side resized with antialiasing, then centre-cropped)")
    assert conversion((3, 32, 32), {"channels": {3}, "sizes": {(40, 40)}}).startswith("40x40 -> 32x32")
    assert conversion((3, 32, 32), {"channels": {3}, "sizes": {(32, 32)}}) == ""


def test_seven_classes_of_40px_photos_in_an_imagefolder(env, tmp_path):
    from recipes.cifar_cnn import make_model

    folder = real_photos(tmp_path / "mine", train_per_class=8, test_per_class=2, size=40, classes=7,
                         layout="imagefolder")
    assert len(list((folder / "train").iterdir())) == 7
    out = tmp_path / "run"
    result = ok(run_here("cifar_cnn", "--data", folder, *QUICK, "--output_dir", out))
    assert "converted the images to 3x32x32, this recipe's decoded size: 40x40 -> 32x32" in result.stdout
    make_model(7).load_state_dict(load_file(out / "model.safetensors"))  # 7 outputs: the class count of the data


def test_conversion_keeps_the_content(tmp_path, monkeypatch):
    """Decoded pixels, checked against what PIL and torchvision compute: colour -> gray uses ITU-R 601
    luma, sizes are resized on the shorter side with antialiasing and centre-cropped, sizes may mix."""
    import torchvision.transforms.v2.functional as TF

    from shared import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((40, 40, 3), (30, 50, 3), (32, 32, 3))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    images = [Image.fromarray(a) for a in arrays]
    split = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 0]}, features=features)
    datasets.DatasetDict(train=split, test=split).save_to_disk(str(tmp_path / "d"))

    colour, _ = data.load_image_data(str(tmp_path / "d"), (3, 32, 32))
    gray, _ = data.load_image_data(str(tmp_path / "d"), (1, 28, 28))
    assert colour.images.shape == (3, 3, 32, 32) and gray.images.shape == (3, 1, 28, 28)
    for i, array in enumerate(arrays):
        pixels = torch.from_numpy(array).permute(2, 0, 1)
        expected = TF.center_crop(TF.resize(pixels, [32], antialias=True), [32, 32])
        assert torch.equal(colour.images[i], expected)
        luma = torch.from_numpy(np.array(Image.fromarray(array).convert("L")))[None]
        assert torch.equal(gray.images[i], TF.center_crop(TF.resize(luma, [28], antialias=True), [28, 28]))
    assert torch.equal(colour.images[2], torch.from_numpy(arrays[2]).permute(2, 0, 1))  # the right size: untouched



SHOWN = {  # EXIF orientation -> the stored pixels as they are shown
    6: lambda pixels: np.rot90(pixels, -1),  # a quarter turn clockwise
    8: lambda pixels: np.rot90(pixels, 1),
    3: lambda pixels: np.rot90(pixels, 2),
    2: lambda pixels: pixels[:, ::-1],  # mirrored
}


@pytest.mark.parametrize("orientation", SHOWN)
def test_a_photo_is_turned_as_its_exif_orientation_says(orientation):
    """A phone stores a photo as its sensor read it, and says in EXIF how to show it (6: a quarter turn clockwise,
    the portrait photo a phone held upright takes). datasets' Image feature turns it, and so does decode, for
    training and predict.py alike: what is learned and predicted is the photo as its owner sees it."""
    from shared.images import decode

    pixels = np.random.default_rng(0).integers(0, 256, (4, 8, 3), dtype=np.uint8)  # 4 high, 8 wide
    exif = Image.Exif()
    exif[0x0112] = orientation  # the Orientation tag
    file = io.BytesIO()
    Image.fromarray(pixels).save(file, "PNG", exif=exif)
    decoded, _ = decode(file.getvalue(), 3, "photo.png")
    assert torch.equal(decoded.permute(1, 2, 0), torch.from_numpy(SHOWN[orientation](pixels).copy()))


def two_photos(folder) -> str:
    """A save_to_disk dataset of two random 40x40 photos, both splits the same, made once in `folder`."""
    if not folder.exists():
        rng = np.random.default_rng(0)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
        photos = [Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)) for _ in range(2)]
        split = datasets.Dataset.from_dict({"image": photos, "label": [0, 1]}, features=features)
        datasets.DatasetDict(train=split, test=split).save_to_disk(str(folder))
    return str(folder)


def test_the_first_decode_says_what_it_decodes_before_it_starts_and_a_cached_read_says_nothing(tmp_path, monkeypatch,
                                                                                              capsys):
    """Many large photos take minutes to decode (a 12-megapixel JPEG: 0.1 s on a 2-core AMD EPYC): a run that said
    nothing until then looked hung."""
    from shared import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    photos = two_photos(tmp_path / "d")
    data.load_image_data(photos, (3, 32, 32))
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{photos}: decoding 4 images, once: later runs read them from the cache")
    data.load_image_data(photos, (3, 32, 32))
    assert "decoding" not in capsys.readouterr().out


def test_a_change_to_the_conversion_code_is_not_served_from_the_old_cache(tmp_path, monkeypatch):
    from shared import data, images

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    before, _ = data.load_image_data(two_photos(tmp_path / "d"), (3, 32, 32))
    assert before.images.any()

    def fit(image, height, width, where="images", interpolation="bilinear"):  # an edited conversion: black images
        return torch.zeros(image.shape[0], height, width, dtype=torch.uint8)

    monkeypatch.setattr(images, "fit", fit)  # as an edit of shared/images.py would change it
    after, _ = data.load_image_data(two_photos(tmp_path / "d"), (3, 32, 32))
    assert not after.images.any()  # decoded anew, not the first run's cached tensors
    assert len(list((tmp_path / "cache").glob("*-3x32x32-*.safetensors"))) == 2


@pytest.mark.parametrize("damage", ["empty", "zeros", "cut", "no_classes"])
def test_a_damaged_cache_is_said_and_made_again(tmp_path, monkeypatch, capsys, damage):
    """A cache file that cannot be read (a machine's crash before flush_to_disk could leave one empty or zero-filled;
    a copy cut short) ended in SafetensorError's traceback: now one line, and the images are decoded again into it."""
    from safetensors.torch import save_file

    from shared import data

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    photos = two_photos(tmp_path / "d")
    before, _ = data.load_image_data(photos, (3, 32, 32))
    pixels = before.images.clone()  # not the cache file's memory map, which the damage below cuts short
    [cache] = (tmp_path / "cache").glob("*.safetensors")
    size = cache.stat().st_size
    if damage == "no_classes":  # readable, but not what write_cache writes
        save_file({"train.images": pixels}, cache)
    else:
        cache.write_bytes({"empty": b"", "zeros": bytes(size), "cut": cache.read_bytes()[:size // 2]}[damage])
    capsys.readouterr()

    after, _ = data.load_image_data(photos, (3, 32, 32))
    assert torch.equal(after.images, pixels) and after.classes == ["a", "b"]
    assert f"the cache {cache} cannot be read (" in capsys.readouterr().out
    again, _ = data.load_image_data(photos, (3, 32, 32))  # whole again: read back, nothing said
    assert torch.equal(again.images, pixels) and "cannot be read" not in capsys.readouterr().out


def test_a_cache_that_cannot_be_read_back_after_writing_is_one_line(tmp_path, monkeypatch):
    """Made again, the cache must then read back; a filesystem that cannot map it gets one line, not a run that
    decodes again at every start and then ends in a TypeError."""
    from safetensors import SafetensorError

    from shared import data
    from shared.errors import RecipeError

    def cannot_map(path, framework):
        raise SafetensorError("Error while deserializing header: MetadataIncompleteBuffer")

    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(data, "safe_open", cannot_map)
    with pytest.raises(RecipeError, match=r"cannot be read back: set HF_HOME \(or HF_DATASETS_CACHE\) to a local"):
        data.load_image_data(two_photos(tmp_path / "d"), (3, 32, 32))


def test_fit_gives_torchvisions_pixels_for_any_size():
    """fit's own part is the shorter side's new length, which it passes to torchvision's resize as both sides (the
    longer one kept in proportion, rounded down), then the centre crop: the same pixels, bit for bit, as torchvision's
    resize of the shorter side to one length, what the pretrained weights' own transforms() do."""
    import torchvision.transforms.v2.functional as TF

    from shared.images import fit

    generator = torch.Generator().manual_seed(0)
    for channels, h, w, height, width in [(3, 40, 40, 32, 32), (3, 30, 50, 32, 32), (1, 90, 17, 28, 28),
                                          (3, 7, 5, 32, 32), (1, 33, 31, 28, 28), (3, 64, 48, 24, 32)]:
        image = torch.randint(0, 256, (channels, h, w), dtype=torch.uint8, generator=generator)
        for how in (TF.InterpolationMode.BILINEAR, TF.InterpolationMode.BICUBIC):  # resnet18's, efficientnet_b0's
            expected = TF.center_crop(TF.resize(image, [max(height, width)], how, antialias=True), [height, width])
            assert torch.equal(fit(image, height, width, "x", how.value), expected), (channels, h, w, height, width)


@pytest.mark.parametrize("recipe, shape", [("cifar_cnn", (3, 40, 40)), ("cifar_cnn", (1, 64, 48)),
                                           ("resnet18_fmnist", (3, 32, 32)), ("deep_mlp_ckpt", (1, 28, 28))])
def test_changing_image_shape_alone_changes_the_model_input(monkeypatch, recipe, shape):
    # A copied recipe adapts to another input size or channel count by editing IMAGE_SHAPE (and MEAN, STD).
    import importlib

    module = importlib.import_module(f"recipes.{recipe}")
    monkeypatch.setattr(module, "IMAGE_SHAPE", shape)
    monkeypatch.setattr(module, "MEAN", (0.5,) * shape[0])
    monkeypatch.setattr(module, "STD", (0.25,) * shape[0])
    if recipe == "deep_mlp_ckpt":
        module.projection.cache_clear()
    model = module.make_model(7).eval()
    images = torch.randint(0, 256, (2, *shape), dtype=torch.uint8)
    inputs = module.preprocess(images) if recipe == "deep_mlp_ckpt" else module.preprocess(images, training=True)
    with torch.no_grad():
        assert model(inputs).shape == (2, 7)
    if recipe == "deep_mlp_ckpt":
        module.projection.cache_clear()


def test_normalize_refuses_statistics_for_another_channel_count():
    from shared.augment import normalize

    with pytest.raises(ValueError, match="3 means and stds for images of 1 channel"):
        normalize(torch.zeros(2, 1, 8, 8, dtype=torch.uint8), (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))


def test_benchmark_sets_are_reproducible_and_split_by_tile(tmp_path):
    """Same seed, same pixels; one test tile per row and column of each photograph; the CIFAR formats."""
    a, b = real_images.photos(10, 3, 1), real_images.photos(10, 3, 1)
    assert [np.asarray(x).tobytes() for x in a["train"]["img"]] == [np.asarray(x).tobytes() for x in b["train"]["img"]]
    assert a["train"].features["label"].names[0] == "astronaut" and len(a["test"]) == 10
    tiles = [(r, c) for r in range(real_images.GRID) for c in range(real_images.GRID)]
    test_tiles = {tile for tile in tiles if real_images.is_test_tile(*tile)}
    assert len({r for r, _ in test_tiles}) == len({c for _, c in test_tiles}) == len(test_tiles) == real_images.GRID
    hundred = real_images.photos(100, 1, 1)
    assert hundred["train"].features["fine_label"].num_classes == 100
    assert hundred["train"].features["coarse_label"].num_classes == 20
    digits = real_images.digits(test_size=10, limit=30)
    assert np.asarray(digits["train"][0]["image"]).shape == (28, 28) and len(digits["test"]) == 10
