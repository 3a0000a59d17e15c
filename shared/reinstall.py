"""A torchvision built for another torch (another release, or a CUDA build beside a CPU one): its compiled operators
do not load, and `import torchvision` ends in a traceback ("operator torchvision::nms does not exist"). Said in one
line with the pip command that installs the torchvision built for this torch: by shared/launch.py's check_launch
before anything imports it, and by shared/failures.py where an import of it failed. An opt-in module, imported by
those two."""

import importlib.util
import re
from pathlib import Path

import torch


def torchvision_mismatch() -> str | None:
    """The line that says what is installed and the command that fixes it, or None: torchvision's compiled operators
    load with this torch (or it is not installed: the import that needs it says so). Loaded as torchvision's
    extension.py loads them, through torch."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    for library in sorted(folder.glob("_C*")):  # _C.so; _C_stable.so in the newer releases
        if library.suffix not in (".so", ".pyd", ".dylib"):
            continue
        try:
            torch.ops.load_library(library)
        except OSError:
            return torchvision_for_this_torch(folder, library)
    return None


def torchvision_for_this_torch(folder: Path, library: Path) -> str:
    """What is installed (torchvision's `folder`, whose compiled `library` did not load) and the pip command that
    replaces it by the torchvision built for this torch: from PyTorch's own index where this torch came from it."""
    text = (folder / "version.py").read_text() if (folder / "version.py").is_file() else ""
    found = re.search(r"^__version__ = '([^']+)'", text, re.MULTILINE)
    version = found.group(1) if found else "(of an unknown version)"
    release, _, build = torch.__version__.partition("+")
    # A build from PyTorch's own index: the same index's
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build.startswith(("cpu", "cu", "rocm")) else ""
    fix = f"pip uninstall -y torchvision && pip install torch=={release} torchvision{index}"
    return (f"torchvision {version} was not built for torch {torch.__version__}: its compiled operators "
            f"({library.name}) do not load; install the torchvision built for it: {fix}")
