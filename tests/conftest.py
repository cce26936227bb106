import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
logging.getLogger("torchao").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
