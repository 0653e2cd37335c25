"""grpo.py and evaluate.py as the README runs them: GRPO end to end from a tiny SFT checkpoint (metrics,
checkpoints, resume, the reference model only when beta > 0, --drop-zero-spread, torchrun on CPU) and pass^k
evaluation (generated tasks with the scripted user; tau2 tasks with an LLM user behind a fake OpenAI-compatible
endpoint, including one that always fails)."""

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import env
import evaluate
import grpo
import rollout
import sft
import util
from util import free_port, read_jsonl, sub_env

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
METRIC_KEYS = ("reward_mean", "zero_spread_frac", "turns", "tool_calls", "tool_errors", "tokens_generated",
               "rollout_s", "update_s", "update_skipped")
UPDATE_KEYS = ("loss", "kl", "clip_frac", "entropy", "grad_norm")  # only on steps that updated
# small enough that a GRPO step on 2 cores takes a second or two
TINY_RL = ["--batch-tasks", "2", "--group", "2", "--max-turns", "3", "--max-new-tokens", "24", "--micro-batch", "4"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def run_py(*argv, timeout=90):
    r = subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=sub_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{argv[:1]} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r


def parser_defaults(module):
    """module.main's argparse defaults, read by running main() with no flags and catching the Namespace."""
    seen = {}
    entry = "run" if module is evaluate else "train"
    with mock.patch.object(sys, "argv", [module.__name__ + ".py"]), \
            mock.patch.object(module, entry, lambda args: seen.update(vars(args))):
        module.main()
    return seen


def ns(module, **over):
    """A Namespace with every option of module.main's parser, then the overrides (which must be real options)."""
    a = parser_defaults(module)
    assert set(over) <= set(a), set(over) - set(a)
    a.update(over)
    return argparse.Namespace(**a)


# ----------------------------------------------------------------------------------------------------
# a generated shop and a tiny "SFT checkpoint" (3 steps: it calls tools badly, which is all GRPO needs to run)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_cli")
    data, out = root / "data", root / "out"
    run_py("synth.py", "--data-dir", data, "--n-users", "30", "--n-train", "40", "--n-test", "9")
    # sft.main's own defaults (so a new sft.py option cannot break the fixture), tiny sizes
    sft.train(ns(sft, data=str(data / "sft.jsonl"), out=str(out / "sft"), d_model=32, n_layer=2, n_head=2,
                 vocab_size=512, steps=3, batch_size=2, max_len=1024, eval_every=100, warmup=1, copy_warmup=0,
                 copy_mix=0))
    assert (out / "sft" / "latest").is_file() and (out / "sft" / "init" / "latest").is_file()
    return SimpleNamespace(root=root, data=data, sft=out / "sft")


def weights(ckpt_dir):
    from safetensors.torch import load_file
    return load_file(Path(sft.resolve_checkpoint(str(ckpt_dir))) / "model.safetensors")


def grpo_cli(world, out, *extra):
    return run_py("grpo.py", "--model", world.sft, "--data-dir", world.data, "--out", out, *TINY_RL, *extra)


# ----------------------------------------------------------------------------------------------------
# 1. grpo.py end to end


def test_grpo_cli_metrics_and_checkpoints(world):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = world.root / "grpo"
    grpo_cli(world, out, "--steps", "2", "--save-every", "1")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in METRIC_KEYS if k not in r]
        assert not missing, (missing, r)
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["zero_spread_frac"] in (0.0, 0.5, 1.0)  # 2 groups per step
        if r["update_skipped"]:  # every group had equal rewards (the 3-step model mostly solves nothing)
            assert r["zero_spread_frac"] == 1.0 and not any(k in r for k in UPDATE_KEYS)
        else:
            assert r["kl"] == 0.0  # beta 0: no reference, no KL term
            assert 0.0 <= r["clip_frac"] <= 1.0 and r["entropy"] > 0
        assert r["tokens_generated"] > 0
        assert 1 <= r["turns"] <= 3 and r["tool_errors"] <= r["tool_calls"]
        assert r["rollout_s"] >= 0 and r["update_s"] >= 0 and r["errored"] == 0
    # --save-every 1: both steps saved (the newest two are kept), `latest` names the last
    assert (out / "latest").read_text().strip() == "step_000002"
    assert (out / "step_000001").is_dir() and (out / "step_000002").is_dir()
    ck = out / "step_000002"
    assert torch.load(ck / "train_state.pt", weights_only=False)["step"] == 2
    AutoModelForCausalLM.from_pretrained(ck)
    AutoTokenizer.from_pretrained(ck)
    # all groups with equal rewards -> every advantage 0 -> exactly zero gradients; AdamW (no weight decay) then
    # leaves the weights bit-identical. Any group with a spread gives a non-zero gradient that moves them.
    w0, w2 = weights(world.sft), weights(out)
    assert w0.keys() == w2.keys()
    moved = any(not torch.equal(w0[k], w2[k]) for k in w0)
    assert moved == any(r["zero_spread_frac"] < 1.0 for r in rows), rows


def test_grpo_cli_resume(world):
    full = world.root / "grpo"  # the uninterrupted 2-step run of the test above, if it ran
    out = world.root / "grpo_resume"
    grpo_cli(world, out, "--steps", "1")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    # a line from a step that was never checkpointed (a run killed after logging it): resume must drop it
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": -1.0}) + "\n")
    r = grpo_cli(world, out, "--steps", "2", "--resume")
    assert " 1/2 " in r.stderr and " 0/2 " not in r.stderr, r.stderr[-1000:]  # tqdm: starts after step 1
    rows = read_jsonl(out / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2] and rows[1]["reward_mean"] >= 0
    assert (out / "latest").read_text().strip() == "step_000002"
    assert torch.load(out / "step_000002" / "train_state.pt", weights_only=False)["step"] == 2
    if (full / "metrics.jsonl").is_file():
        # rollouts are seeded by (seed, step, rank) and the weights and AdamW state come back exactly, so step 2
        # of the resumed run replays step 2 of the uninterrupted one
        ref = read_jsonl(full / "metrics.jsonl")
        for k in ("reward_mean", "zero_spread_frac", "turns", "tool_calls", "tool_errors", "tokens_generated"):
            assert rows[1][k] == ref[1][k], (k, rows[1], ref[1])
        wa, wb = weights(full), weights(out)
        assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)


# ----------------------------------------------------------------------------------------------------
# 2. the reference model exists only when beta > 0


def tiny_grpo(world, out, **over):
    return ns(grpo, model=str(world.sft), data_dir=str(world.data), out=str(out), batch_tasks=2, group=2,
              max_turns=3, max_new_tokens=24, micro_batch=4, **over)


@pytest.mark.parametrize("beta", [0.0, 0.001])
def test_reference_model_only_with_beta(world, tmp_path, monkeypatch, beta):
    copies, models = [], set()
    real_copy, real_fwd = copy.deepcopy, grpo.forward_logprobs

    def counting_deepcopy(x, *a, **kw):
        copies.append(type(x).__name__)
        return real_copy(x, *a, **kw)

    def recording_fwd(model, ids, attn, temperature):
        models.add(id(model))
        return real_fwd(model, ids, attn, temperature)

    monkeypatch.setattr(grpo, "copy", SimpleNamespace(deepcopy=counting_deepcopy))  # grpo's namespace only
    monkeypatch.setattr(grpo, "forward_logprobs", recording_fwd)
    monkeypatch.setattr(grpo, "run_episodes", spread_rewards(rollout.run_episodes))  # so that the update runs
    grpo.train(tiny_grpo(world, tmp_path / "g", steps=1, beta=beta))
    rec = read_jsonl(tmp_path / "g" / "metrics.jsonl")[0]
    assert "kl" in rec and rec["kl"] >= 0.0
    if beta > 0:
        assert len(copies) == 1, copies  # the frozen starting policy
        assert len(models) == 2  # policy and reference both scored the batch
    else:
        assert copies == [] and len(models) == 1 and rec["kl"] == 0.0


def spread_rewards(real):
    """run_episodes with rewards overwritten to 1, 0, 1, 0, ...: every group of 2 has a spread, so every step has
    a gradient (the 3-step SFT model itself solves nothing)."""

    def run(*a, **kw):
        eps = real(*a, **kw)
        for i, e in enumerate(eps):
            e.reward = float(i % 2 == 0)
        return eps
    return run


def test_reward_spread_moves_the_weights(world, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "run_episodes", spread_rewards(rollout.run_episodes))
    grpo.train(tiny_grpo(world, tmp_path / "g", steps=1))
    rec = read_jsonl(tmp_path / "g" / "metrics.jsonl")[0]
    assert rec["zero_spread_frac"] == 0.0 and rec["reward_mean"] == 0.5 and rec["grad_norm"] > 0
    assert rec["update_skipped"] == 0 and rec["kl"] == 0.0 and 0.0 <= rec["clip_frac"] <= 1.0 and rec["entropy"] > 0
    w0, w1 = weights(world.sft), weights(tmp_path / "g")
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)


def test_resume_keeps_the_starting_policy_as_reference(world, tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "run_episodes", spread_rewards(rollout.run_episodes))
    out = tmp_path / "g"
    grpo.train(tiny_grpo(world, out, steps=1, beta=0.001))
    w0, w1 = weights(world.sft), weights(out / "step_000001")
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # step 1 did move the policy
    refs, real_update = [], grpo.update

    def recording_update(model, ref, *a, **kw):  # however the reference is built, update() receives it
        refs.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
        return real_update(model, ref, *a, **kw)

    monkeypatch.setattr(grpo, "update", recording_update)
    grpo.train(tiny_grpo(world, out, steps=2, beta=0.001, resume=True))
    assert len(refs) == 1
    assert all(torch.equal(refs[0][k], w0[k]) for k in w0), "the reference is not the starting policy"


def test_parser_defaults_cover_the_namespaces():
    a = parser_defaults(grpo)
    assert a["beta"] == 0.0 and a["drop_zero_spread"] is False and a["resume"] is False
    e = parser_defaults(evaluate)
    assert e["user"] is None and e["k"] == 4
    assert e["temperature"] == 0.0  # greedy agent, as tau-bench's run.py: trials differ through the user


# ----------------------------------------------------------------------------------------------------
# 3. --drop-zero-spread: groups with equal rewards are dropped and replaced (a bounded number of rounds)


def fake_run_episodes(calls, errored_in=()):
    """Stands in for run_episodes: task "spread" alternates rewards 1, 0; every other task scores 0. Tasks in
    errored_in get an errored (unscored) first rollout."""

    def run(gen, tok, tasks, db, make_user, **kw):
        calls.append([t["id"] for t in tasks])
        eps = []
        for i, t in enumerate(tasks):
            e = rollout.Episode(task_id=t["id"], messages=[])
            e.reward = float(t["id"] == "spread" and i % 2 == 0)
            e.errored = t["id"] in errored_in and i % 2 == 0
            if e.errored:
                e.reward = 0.0
            eps.append(e)
        return eps
    return run


def collect_args(**kw):
    base = dict(seed=0, batch_tasks=4, group=2, drop_zero_spread=False, max_turns=3, max_len=512,
                max_new_tokens=8, temperature=1.0)
    return SimpleNamespace(**{**base, **kw})


def groups(eps, g):
    return [eps[i:i + g] for i in range(0, len(eps), g)]


def test_collect_without_drop_keeps_every_group(monkeypatch):
    calls = []
    monkeypatch.setattr(grpo, "run_episodes", fake_run_episodes(calls))
    tasks = [{"id": n} for n in ("spread", "a", "b", "c")]
    kept, zero, played = grpo.collect(None, None, tasks, {}, None, collect_args(), step=0, rank=0, world=1)
    assert len(calls) == 1 and played == 4 and len(kept) == 8
    gs = groups(kept, 2)
    assert all(len({e.task_id for e in g}) == 1 for g in gs)  # group order: G rollouts of one task together
    assert zero == sum(g[0].task_id != "spread" for g in gs)


def test_collect_drop_zero_spread(monkeypatch):
    calls = []
    monkeypatch.setattr(grpo, "run_episodes", fake_run_episodes(calls))
    tasks = [{"id": n} for n in ("spread", "a", "b", "c")]
    kept, zero, played = grpo.collect(None, None, tasks, {}, None, collect_args(drop_zero_spread=True),
                                      step=0, rank=0, world=1)
    assert 1 <= len(calls) <= 4  # the first round and at most 3 extra ones
    assert played == sum(len(c) for c in calls) // 2
    assert all(e.task_id == "spread" for e in kept) and len(kept) <= 8 and len(kept) % 2 == 0
    assert zero == played - len(kept) // 2  # every dropped group is counted
    # each extra round asks only for the groups still missing
    for prev, cur in zip(calls, calls[1:]):
        got = sum(1 for i in range(0, len(prev), 2) if prev[i] == "spread")
        assert len(cur) == len(prev) - 2 * got
    # with spread everywhere the first round fills the batch
    calls.clear()
    kept, zero, played = grpo.collect(None, None, [{"id": "spread"}], {}, None, collect_args(drop_zero_spread=True),
                                      step=3, rank=0, world=1)
    assert len(calls) == 1 and len(kept) == 8 and zero == 0 and played == 4
    # nothing ever has a spread: 4 rounds, nothing kept, every group counted
    calls.clear()
    kept, zero, played = grpo.collect(None, None, [{"id": "a"}], {}, None, collect_args(drop_zero_spread=True),
                                      step=0, rank=0, world=1)
    assert len(calls) == 4 and kept == [] and zero == played == 16


def test_errored_rollout_does_not_make_a_spread(monkeypatch):
    """A group [1, errored] has one real outcome: no spread, so it is dropped."""
    calls = []
    monkeypatch.setattr(grpo, "run_episodes", fake_run_episodes(calls, errored_in={"spread"}))
    kept, zero, played = grpo.collect(None, None, [{"id": "spread"}], {}, None,
                                      collect_args(drop_zero_spread=True, batch_tasks=1), step=0, rank=0, world=1)
    assert kept == [] and zero == played == 4


# ----------------------------------------------------------------------------------------------------
# 4. torchrun on CPU (gloo): 2 ranks, one task each; rank 0 logs the global numbers


def descendants(pid):
    """Pids of every process below pid (torchrun starts its ranks in sessions of their own)."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def test_grpo_torchrun(world, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "grpo.py", "--model", str(world.sft),
           "--data-dir", str(world.data), "--out", str(out), *TINY_RL, "--steps", "1"]
    e = dict(sub_env(), GLOO_SOCKET_IFNAME="lo")  # loopback only: the machine may have no routable interface
    log = tmp_path / "torchrun.log"  # a file, not a pipe: a stuck rank cannot keep the test waiting on it
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=f, stderr=subprocess.STDOUT)
    done_at = None  # when rank 0 had logged its step and saved the checkpoint
    for _ in range(900):  # ~10 s normally
        if proc.poll() is not None:
            break
        if done_at is None and (out / "latest").is_file() and (out / "metrics.jsonl").is_file():
            done_at = time.time()
        if time.time() - (done_at or time.time()) > 30 or _ == 899:
            for pid in [*descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            proc.wait()
            tail = log.read_text()[-1500:]
            if done_at:  # seen here: a rank stuck in ~ProcessGroupGloo (joining a gloo thread that needs the GIL)
                pytest.fail("BUG grpo.train: training finished but a rank hung at exit (process group teardown) "
                            f"for 30 s:\n{tail}")
            pytest.fail(f"torchrun did not finish in 90 s:\n{tail}")
        time.sleep(0.1)
    r = SimpleNamespace(returncode=proc.returncode, stderr=log.read_text())
    util.check_torchrun(r)
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 1  # rank 0 alone writes
    rec = rows[0]
    assert 0.0 <= rec["reward_mean"] <= 1.0 and rec["tokens_generated"] > 0
    # 2 groups in the global batch, one per rank: a per-rank fraction could only be 0 or 1
    assert rec["zero_spread_frac"] in (0.0, 0.5, 1.0)
    assert (out / "latest").read_text().strip() == "step_000001"


# ----------------------------------------------------------------------------------------------------
# 5. evaluate.py on generated tasks (scripted user)


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


# ----------------------------------------------------------------------------------------------------
# 6. evaluate.py on tau2 tasks with an LLM user behind an OpenAI-compatible endpoint


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
    return ns(evaluate, tasks=str(TAU2 / "tasks.json"), db=str(TAU2 / "db.json"), n_tasks=2, k=2, max_turns=3,
              max_new_tokens=24, models=[f"sft={world.sft}"], out=str(tmp_path / "eval"), **over)


def test_evaluate_tau2_llm_user(world, tmp_path, fake_server):
    srv = fake_server(lambda body: (200, "I want to return my order. ###STOP###"))
    res = evaluate.run(tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4
    assert all(not x["errored"] and x["end_reason"] == "user_stop" for x in rows)
    assert all(x["messages"][1] == {"role": "user", "content": "I want to return my order. ###STOP###"} for x in rows)
    a = res["sft"]["all"]
    assert a["n"] == 2 and a["errored"] == 0 and a["pass^1"] is not None and a["pass^2"] is not None
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["sft"]["all"]["n"] == 2
    tasks = env.load_tasks(TAU2 / "tasks.json")[:2]
    assert len(srv.bodies) == 4  # one opening line per episode, then the user stopped
    for t in tasks:  # each user model sees its own task's scenario (the two tasks differ only near the end)
        assert sum(b["messages"][0] == {"role": "system", "content": env.system_prompt(t)} for b in srv.bodies) == 2


def test_evaluate_tau2_without_user_fails_clearly(world, tmp_path):
    """tau2 tasks have no script: the scripted user cannot play them; say so (not a KeyError)."""
    with pytest.raises((ValueError, SystemExit), match="script"):
        evaluate.run(tau2_args(world, tmp_path, user=None))


def fast_backoff(monkeypatch):
    monkeypatch.setattr(env, "OpenAIChatBackend", functools.partial(env.OpenAIChatBackend, backoff=0.001))


def test_evaluate_failing_user_endpoint_mixed(world, tmp_path, fake_server, monkeypatch):
    """The user model fails for one task only: its episodes are errored and left out of pass^k."""
    fast_backoff(monkeypatch)
    bad = env.load_tasks(TAU2 / "tasks.json")[0]["user_scenario"]["instructions"]["reason_for_call"] \
        if (TAU2 / "tasks.json").is_file() else None
    srv = fake_server(lambda body: (500, "boom") if bad in body["messages"][0]["content"]
                      else (200, "Thanks, bye. ###STOP###"))
    res = evaluate.run(tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4
    errored = [x for x in rows if x["errored"]]
    assert len(errored) == 2 and all(x["end_reason"] == "user_error" for x in errored)
    a = res["sft"]["all"]
    assert a["errored"] == 2 and a["n"] == 1  # the failing task has no trials left


def test_evaluate_failing_user_endpoint_all(world, tmp_path, fake_server, monkeypatch):
    """An endpoint that always answers 500: every episode errored, none scored, and evaluate still reports."""
    fast_backoff(monkeypatch)
    srv = fake_server(lambda body: (500, "boom"))
    res = evaluate.run(tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft.jsonl")
    assert len(rows) == 4 and all(x["errored"] and x["end_reason"] == "user_error" for x in rows)
    assert all(x["reward"] == 0.0 and x["reward_info"] == {} for x in rows)  # not scored
    a = res["sft"]["all"]
    assert a["errored"] == 4 and a["n"] == 0
    assert a["pass^1"] is None and a["pass^2"] is None  # no trials: nothing to average, not 0
