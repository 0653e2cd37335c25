import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import env` works from anywhere

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module (use with `pytestmark = pytest.mark.usefixtures("one_thread")`).

    The models in these tests are tiny: with 2 cores shared with other jobs, OpenMP threads mostly wait on each
    other (a 10x slowdown measured). One thread per process is faster and steadier."""
    import torch  # here, not at the top: test files that never use torch do not pay for importing it

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
