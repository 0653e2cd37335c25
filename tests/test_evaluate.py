"""evaluate.py: pass^k and pass@k by hand, evaluation of generated tasks with the scripted user, and of tau2 tasks
with an LLM user behind a fake OpenAI-compatible endpoint (including one that fails)."""

import functools
import json
from pathlib import Path

import pytest

import env
import evaluate
import rollout
import util
from util import read_jsonl, run_main, run_py

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def test_pass_hat_k_hand_made():
    table = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_hat_k(table, 1) == pytest.approx((0.5 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 4) == pytest.approx(1 / 3)
    assert evaluate.pass_hat_k({"a": [1, 0]}, 3) is None  # fewer trials than k
    assert evaluate.pass_hat_k({"a": [1, 1, 1], "b": [0, 1, 1]}, 2) == pytest.approx((1 + 1 / 3) / 2)


def test_pass_at_k_hand_made():
    """At least one success in k trials drawn without replacement: 1 - C(n-c, k) / C(n, k), a mean over tasks."""
    table = {"a": [1, 0, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_at_k(table, 1) == pytest.approx(evaluate.pass_hat_k(table, 1))  # both are the mean reward
    assert evaluate.pass_at_k(table, 2) == pytest.approx((0.5 + 1 + 0) / 3)  # a: 1 - C(3,2)/C(4,2) = 1/2
    assert evaluate.pass_at_k(table, 4) == pytest.approx(2 / 3)
    assert evaluate.pass_at_k({"a": [1, 0]}, 3) is None
    assert evaluate.pass_at_k(table, 2) >= evaluate.pass_hat_k(table, 2)


def test_evaluate_cli(world):
    out = world.root / "eval"
    r = run_py("evaluate.py", "--models", f"base={world.sft / 'init'}", f"sft={world.sft}", "--data-dir", world.data,
               "--k", "2", "--max-turns", "3", "--max-new-tokens", "24", "--out", out)
    tasks = env.load_tasks(world.data / "test_tasks.jsonl")
    kinds = sorted({t["kind"] for t in tasks})
    lines = r.stdout.splitlines()
    assert "| model | tasks | pass^1 | pass^2 |" in lines
    for name in ("base", "sft"):
        assert any(line.startswith(f"| {name} | {len(tasks)} | ") for line in lines), r.stdout
        for kind in kinds:
            assert any(line.startswith(f"| {name} / {kind} | ") for line in lines), (kind, r.stdout)
    res = json.loads((out / "results.json").read_text())
    assert set(res) == {"base", "sft"}
    for name, s in res.items():
        a = s["all"]
        assert a["n"] == len(tasks) and a["errored"] == 0
        assert 0.0 <= a["pass^2"] <= a["pass^1"] <= a["pass@2"] <= 1.0 and a["pass^1"] == pytest.approx(a["reward"])
        assert set(s) == {"all", *kinds}
        rows = read_jsonl(out / f"{name}.jsonl")
        assert len(rows) == 2 * len(tasks)
        assert sorted(x["task_id"] for x in rows) == sorted(t["id"] for t in tasks for _ in range(2))
        assert all("ids" not in x and "messages" in x for x in rows)
    assert (out / "results.md").read_text().strip() in r.stdout
    assert f"sft: pass^1 {res['sft']['all']['pass^1']:.3f} over {len(tasks)} tasks, pass@2 " in r.stdout


class FakeOpenAI(util.FakeOpenAIServer):
    """/chat/completions on 127.0.0.1; reply(body) -> (HTTP status, message text). Records every request body."""

    def __init__(self, reply):
        self.reply, self.bodies = reply, []
        super().__init__()

    def answer(self, path, body):
        self.bodies.append(body)
        status, text = self.reply(body)
        return status, ({"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
            if status == 200 else {"error": text})


@pytest.fixture
def fake_server():
    servers = []

    def start(reply):
        servers.append(FakeOpenAI(reply))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def tau2_args(world, tmp_path, **over):
    if not (TAU2 / "tasks.json").is_file():
        pytest.skip(f"tau2 retail data absent ({TAU2})")
    return dict(tasks=str(TAU2 / "tasks.json"), db=str(TAU2 / "db.json"), n_tasks=2, k=2, max_turns=3,
              max_new_tokens=24, models=[f"sft={world.sft}"], out=str(tmp_path / "eval"), **over)


def test_evaluate_tau2_llm_user(world, tmp_path, fake_server):
    srv = fake_server(lambda body: (200, "I want to return my order. ###STOP###"))
    res = run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4
    assert all(not x["errored"] and x["end_reason"] == "user_stop" for x in rows)
    assert all(x["messages"][1] == {"role": "user", "content": "I want to return my order. ###STOP###"} for x in rows)
    a = res["sft"]["all"]
    assert a["n"] == 2 and a["errored"] == 0 and a["pass^1"] is not None and a["pass^2"] is not None
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["sft"]["all"]["n"] == 2
    tasks = env.load_tasks(TAU2 / "tasks.json")[:2]
    assert len(srv.bodies) == 4  # one opening line per episode, then the user stopped
    # tau2's own user guidelines (found beside its tasks.json), then each task's own scenario
    guidelines = env.load_guidelines(env.guidelines_beside(TAU2 / "tasks.json"))
    assert "User Simulation Guidelines" in guidelines
    for t in tasks:  # each user model sees its own task's scenario (the two tasks differ only near the end)
        want = {"role": "system", "content": env.system_prompt(t, guidelines)}
        assert sum(b["messages"][0] == want for b in srv.bodies) == 2


def test_evaluate_tau2_without_user_fails_clearly(world, tmp_path):
    """tau2 tasks have no script: the scripted user cannot play them; say so (not a KeyError)."""
    with pytest.raises((ValueError, SystemExit), match="script"):
        run_main(evaluate, **tau2_args(world, tmp_path, user=None))


def fast_backoff(monkeypatch):
    monkeypatch.setattr(rollout, "OpenAIChatBackend", functools.partial(rollout.OpenAIChatBackend, backoff=0.001))


def test_evaluate_failing_user_endpoint_mixed(world, tmp_path, fake_server, monkeypatch):
    """The user model fails for one task only: its episodes are errored and left out of pass^k."""
    fast_backoff(monkeypatch)
    bad = env.load_tasks(TAU2 / "tasks.json")[0]["user_scenario"]["instructions"]["reason_for_call"] \
        if (TAU2 / "tasks.json").is_file() else None
    srv = fake_server(lambda body: (500, "boom") if bad in body["messages"][0]["content"]
                      else (200, "Thanks, bye. ###STOP###"))
    res = run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4
    errored = [x for x in rows if x["errored"]]
    assert len(errored) == 2 and all(x["end_reason"] == "user_error" for x in errored)
    a = res["sft"]["all"]
    assert a["errored"] == 2 and a["n"] == 1  # the failing task has no trials left


def test_evaluate_failing_user_endpoint_all(world, tmp_path, fake_server, monkeypatch, capsys):
    """An endpoint that always answers 500: every episode errored, none scored, and evaluate still reports."""
    fast_backoff(monkeypatch)
    srv = fake_server(lambda body: (500, "boom"))
    res = run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4 and all(x["errored"] and x["end_reason"] == "user_error" for x in rows)
    assert all(x["reward"] == 0.0 and x["reward_info"] == {} for x in rows)  # not scored
    a = res["sft"]["all"]
    assert a["errored"] == 4 and a["n"] == 0
    assert a["pass^1"] is None and a["pass^2"] is None  # no trials: nothing to average, not 0
    # how many errored, and why (the user simulator's message, numbers blanked so one cause counts once)
    (reason, n), = a["errored_reasons"].items()
    assert n == 4 and "HTTP N" in reason and "boom" in reason
    assert f"sft: 4 of 4 episodes errored (not scored): 4x {reason}" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, allowed", [("k", 0, ">= 1"), ("temperature", -0.5, ">= 0"),
                                                  ("n_tasks", 0, ">= 1"), ("max_turns", 0, ">= 1")])
def test_bad_arguments_name_the_flag_and_range(flag, value, allowed, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(evaluate, out=tmp_path / "eval", **{flag: value})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--" + flag.replace("_", "-") in err and allowed in err, err


def test_empty_test_tasks_are_refused(world, tmp_path):
    empty = tmp_path / "tasks.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=f"no tasks in {empty}"):
        run_main(evaluate, models=[f"sft={world.sft}"], tasks=empty, db=world.data / "shop.json",
                 out=tmp_path / "eval")
