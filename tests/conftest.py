import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch="llama", **config) -> directory of a tiny real checkpoint, written once per session."""
    from harness import write_checkpoint

    made = {}

    def get(arch: str = "llama", **config_kwargs) -> str:
        key = (arch, tuple(sorted(config_kwargs.items())))
        if key not in made:
            made[key] = write_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, **config_kwargs)
        return made[key]

    return get


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs CUDA (run by scripts/gpu_check.sh)")
