"""The seed posts' own training loops, on the same data as the recipes: the floor each recipe must beat.

  cifar_cnn        seed 004: the CNN as the post wrote it (no nonlinearity; --relu adds the recipe's
                   ReLUs), ToTensor only, SGD lr 0.01, batch 64, cross-entropy, no augmentation, no schedule
  resnet18_fmnist  d2l's train_ch6 on the recipe's ResNet-18: Xavier-uniform init of every Linear and
                   Conv2d, ToTensor only, SGD lr 0.1, batch 256, no augmentation, no schedule
  deep_mlp_ckpt    the seed's 72 plain Linear layers (no nonlinearity, no normalization), Adam lr 0.002
                   betas (0.5, 0.999), batch 16, on the recipe's projected inputs

Images go one at a time through PIL and torchvision's ToTensor in a DataLoader with 2 worker
processes, then to the GPU if there is one; test accuracy after every epoch, as the posts printed it.
Prints one JSON line: final test accuracy, and seconds per epoch (training plus that epoch's test pass,
as a recipe's wall time counts it).

    python benchmarks/seed_loops.py cifar_cnn --data DIR --epochs 20 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from shared.data import load_image_data  # (the recipes' decoded images: the same pixels)

from throughput import SeedStyleImages


def seed_cnn(num_classes: int, relu: bool) -> nn.Sequential:
    act = nn.ReLU if relu else nn.Identity
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), act(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 5, padding=2), act(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), act(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1024, 64), act(), nn.Linear(64, num_classes))


def d2l_resnet(num_classes: int) -> nn.Module:
    from recipes.resnet18_fmnist import make_model

    model = make_model(num_classes)
    for module in model.modules():  # d2l's init_weights
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(module.weight)
    return model


class SeedMLP(nn.Module):
    """72 Linear layers, 1000 -> 1000 ... -> classes, on the recipe's fixed projection of the pixels."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1000, 1000) for _ in range(71)], nn.Linear(1000, num_classes))

    def forward(self, x):
        from recipes.deep_mlp_ckpt import projection

        return self.layers(x.flatten(1) @ projection(x.device))


LOOPS = {  # recipe -> (data shape, model, optimizer, batch size)
    "cifar_cnn": ((3, 32, 32), lambda n, a: seed_cnn(n, a.relu), lambda p: torch.optim.SGD(p, lr=0.01), 64),
    "resnet18_fmnist": ((1, 28, 28), lambda n, a: d2l_resnet(n), lambda p: torch.optim.SGD(p, lr=0.1), 256),
    "deep_mlp_ckpt": ((3, 32, 32), lambda n, a: SeedMLP(n),
                      lambda p: torch.optim.Adam(p, lr=0.002, betas=(0.5, 0.999)), 16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=list(LOOPS))
    parser.add_argument("--data", required=True, help="a local dataset folder, as the recipes' --data")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--relu", action="store_true", help="cifar_cnn: a ReLU after each conv and the hidden Linear")
    args = parser.parse_args()

    shape, make_model, make_optimizer, batch_size = LOOPS[args.recipe]
    torch.manual_seed(args.seed)
    train_set, test_set = load_image_data(args.data, shape)
    to_tensor = transforms.ToTensor()
    train_loader = DataLoader(SeedStyleImages(train_set.images, train_set.labels, to_tensor), batch_size,
                              shuffle=True, num_workers=2, persistent_workers=True)
    test_loader = DataLoader(SeedStyleImages(test_set.images, test_set.labels, to_tensor), 256, num_workers=2,
                             persistent_workers=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the posts trained on one GPU
    model = make_model(len(train_set.classes), args).to(device)
    optimizer = make_optimizer(model.parameters())
    loss_fn = nn.CrossEntropyLoss()

    accuracies, start = [], time.perf_counter()
    for _ in range(args.epochs):
        model.train()
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = loss_fn(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in test_loader:
                correct += (model(images.to(device)).argmax(1).cpu() == labels).sum().item()
        accuracies.append(correct / len(test_set))
    seconds = time.perf_counter() - start
    print(json.dumps({"recipe": args.recipe, "loop": "seed" + (" + ReLU" if args.relu else ""), "seed": args.seed,
                      "eval_acc": accuracies[-1], "best_eval_acc": max(accuracies), "eval_acc_per_epoch": accuracies,
                      "s_per_epoch": seconds / args.epochs, "final_loss": loss.item()}))


if __name__ == "__main__":
    main()
