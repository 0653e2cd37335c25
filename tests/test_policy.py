"""tau2 as tau2 runs it: on tau2's tasks the agent's system prompt holds tau2's domain policy (policy.md beside
tasks.json, or --policy), in evaluate.py and in grpo.py; the generated shop keeps rollout.SYSTEM_PROMPT."""

from pathlib import Path

import pytest

import env
import evaluate
import grpo
import rollout
import sft
import util

TAU2 = Path(__file__).resolve().parent.parent.parent / "shared" / "tau2" / "retail"
needs_tau2 = pytest.mark.skipif(not (TAU2 / "tasks.json").is_file() or not (TAU2 / "policy.md").is_file(),
                                reason=f"tau2 retail data absent ({TAU2})")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def test_system_prompt_without_a_policy_is_the_shops(tmp_path):
    assert rollout.agent_system_prompt() == rollout.SYSTEM_PROMPT
    assert rollout.agent_system_prompt(None, str(tmp_path / "tasks.jsonl")) == rollout.SYSTEM_PROMPT  # none beside
    (tmp_path / "rules.md").write_text("Never refund gift cards.\n")
    prompt = rollout.agent_system_prompt(str(tmp_path / "rules.md"))
    assert "<policy>\nNever refund gift cards.\n</policy>" in prompt
    assert rollout.agent_system_prompt("none", str(tmp_path / "tasks.jsonl")) == rollout.SYSTEM_PROMPT
    with pytest.raises(FileNotFoundError, match="policy file"):
        rollout.agent_system_prompt(str(tmp_path / "missing.md"))


@needs_tau2
def test_policy_beside_tau2_tasks():
    assert env.policy_beside(str(TAU2 / "tasks.json")) == str((TAU2 / "policy.md").resolve())
    prompt = rollout.agent_system_prompt(None, str(TAU2 / "tasks.json"))
    assert (TAU2 / "policy.md").read_text().strip() in prompt
    assert rollout.agent_system_prompt("none", str(TAU2 / "tasks.json")) == rollout.SYSTEM_PROMPT


class FakeUser(util.FakeOpenAIServer):
    """An OpenAI-compatible user model: asks for help once, then stops."""

    def answer(self, path, body):
        said = sum(m["role"] == "assistant" for m in body["messages"])  # its own earlier lines
        text = "Hi, I want to return an order." if said == 0 else "Thanks. ###STOP###"
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny random model whose tokenizer has seen the policy prompt (so it is a few thousand tokens, not bytes)."""
    system = rollout.agent_system_prompt(None, str(TAU2 / "tasks.json")) if (TAU2 / "policy.md").is_file() else ""
    convs = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i}"}]} for i in range(4)]
    tok, model = sft.make_tiny(convs, 400, 32, 2, 2, seed=0)
    return rollout.save_checkpoint(str(tmp_path_factory.mktemp("policy_tiny")), 0, model, tok)


@pytest.fixture
def user_server():
    srv = FakeUser()
    yield srv
    srv.close()


@needs_tau2
def test_evaluate_tau2_gives_the_agent_the_policy(tiny_ckpt, user_server, tmp_path):
    evaluate.main(["--models", f"tiny={tiny_ckpt}", "--tasks", str(TAU2 / "tasks.json"), "--db", str(TAU2 / "db.json"),
                   "--n-tasks", "1", "--k", "1", "--max-turns", "1", "--max-new-tokens", "4", "--max-len", "8192",
                   "--user", user_server.url, "--out", str(tmp_path)])
    ep = util.read_jsonl(tmp_path / "tiny.jsonl")[0]
    policy = (TAU2 / "policy.md").read_text().strip()
    prompt = rollout.agent_system_prompt(None, str(TAU2 / "tasks.json"))
    assert ep["messages"][0] == {"role": "system", "content": prompt}
    assert policy in ep["messages"][0]["content"] and ep["turns"] == 1  # the agent played with it


@needs_tau2
def test_grpo_tau2_gives_the_agent_the_policy(tiny_ckpt, user_server, tmp_path, monkeypatch):
    played = []

    def spy(*a, **kw):
        played.extend(rollout.run_episodes(*a, **kw))
        return played[-2:]
    monkeypatch.setattr(grpo, "run_episodes", spy)
    grpo.main(["--model", tiny_ckpt, "--tasks", str(TAU2 / "tasks.json"), "--db", str(TAU2 / "db.json"),
               "--user", user_server.url, "--steps", "1", "--batch-tasks", "1", "--group", "2", "--max-turns", "1",
               "--max-new-tokens", "4", "--max-len", "8192", "--out", str(tmp_path / "grpo")])
    policy = (TAU2 / "policy.md").read_text().strip()
    assert len(played) == 2 and all(policy in ep.messages[0]["content"] for ep in played)
    assert all(ep.messages[0]["role"] == "system" and ep.turns == 1 for ep in played)
