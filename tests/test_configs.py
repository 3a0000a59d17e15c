"""Every shipped accelerate config loads through accelerate's own loader and says what it should."""

from __future__ import annotations

import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from conftest import ROOT

CONFIGS = ROOT / "accelerate_configs"
EXPECTED = {  # name: (distributed_type, processes, mixed_precision, use_cpu)
    "cpu": (DistributedType.NO, 1, "no", True),
    "cpu_bf16": (DistributedType.NO, 1, "bf16", True),
    "1gpu": (DistributedType.NO, 1, "no", False),
    "2gpu": (DistributedType.MULTI_GPU, 2, "no", False),
    "fp16": (DistributedType.NO, 1, "fp16", False),
    "bf16": (DistributedType.NO, 1, "bf16", False),
    "multigpu_bf16": (DistributedType.MULTI_GPU, 8, "bf16", False),
    "multinode": (DistributedType.MULTI_GPU, 16, "bf16", False),
}


def test_every_yaml_is_listed():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert (config.distributed_type, config.num_processes, config.mixed_precision, config.use_cpu) == EXPECTED[name]


def test_one_machine_of_several_processes_takes_a_free_port_at_each_launch():
    """Without a port, accelerate takes 29500 where it looks free: two launches started together both see it free and
    the second dies in EADDRINUSE (it happened to two of this suite's launches at once). 0 asks for a free one."""
    several = [name for name, (_, processes, *_) in EXPECTED.items() if processes > 1 and name != "multinode"]
    assert several == ["2gpu", "multigpu_bf16"]
    for name in several:
        assert load_config_from_file(str(CONFIGS / f"{name}.yaml")).main_process_port == 0, name


def test_multinode_template_names_its_rendezvous():
    config = load_config_from_file(str(CONFIGS / "multinode.yaml"))
    assert config.num_machines == 2 and config.machine_rank == 0
    assert config.main_process_ip and config.main_process_port


def test_slurm_example_is_valid_bash_using_the_multinode_config():
    script = CONFIGS / "slurm_multinode.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "accelerate_configs/multinode.yaml" in text and "--machine_rank" in text and "--main_process_ip" in text
