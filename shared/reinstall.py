"""The command that installs the torchvision built for this torch, in the line errors.check_torchvision gives when the
installed torchvision's compiled operators do not load (an opt-in module: only a broken install needs it)."""

import re
from pathlib import Path

import torch


def torchvision_for_this_torch(folder: Path, library: Path) -> str:
    """What is installed (torchvision's `folder`, whose compiled `library` did not load) and the pip command that
    replaces it by the torchvision built for this torch: from PyTorch's own index where this torch came from it."""
    text = (folder / "version.py").read_text() if (folder / "version.py").is_file() else ""
    found = re.search(r"^__version__ = '([^']+)'", text, re.MULTILINE)
    version = found.group(1) if found else "(of an unknown version)"
    release, _, build = torch.__version__.partition("+")
    index = ""
    if build.startswith(("cpu", "cu", "rocm")):  # a build from PyTorch's own index: the same index's
        index = f" --index-url https://download.pytorch.org/whl/{build}"
    fix = f"pip uninstall -y torchvision && pip install torch=={release} torchvision{index}"
    return (f"torchvision {version} was not built for torch {torch.__version__}: its compiled operators "
            f"({library.name}) do not load; install the torchvision built for it: {fix}")
